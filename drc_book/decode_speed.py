"""Realized speed-up of per-token halting in generation: the KV-cached decoder at fixed depth (``generate_fixed``)
against the halting decoders, beside the FLOP proxy and the honest FLOPs, with the timing protocol of
:mod:`drc_book.speed`. Time per decode step = (time of n new tokens - time of 1) / (n - 1), so the prompt pass
drops out; :func:`decode_loop_cost` and :func:`decode_prediction` model what one loop of a step costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from drc_book.cost import Log, honest_flops, interleaved, matmul_flops_per_token, median, spread
from drc_book.speed import SpeedConfig, on_device, prepare_memory, rule_specs, skip_path, speed_columns
from drc_core import (
    ContinuousResult,
    DepthRecurrentLM,
    DrcError,
    GenerationResult,
    HaltingRule,
    RuleSpec,
    Uniform,
    generate_continuous,
    generate_fixed,
)
from drc_core import generate_ids as generate

__all__ = ["DecodeTimes", "decode_loop_cost", "decode_prediction", "time_decoder_sets", "time_decoding",
           "time_generation"]


def _first_divergence(tokens: Tensor, reference: Tensor) -> float:
    """Mean over rows of the index of the first new token that differs from ``reference`` (n if none does)."""
    differ = tokens != reference
    first = torch.where(differ.any(dim=1), differ.int().argmax(dim=1), tokens.shape[1])
    return float(first.double().mean())


def _loops_run(exit_loop: Tensor) -> float:
    """Mean over positions (columns of ``exit_loop``, (B, n)) of the deepest exit among the B rows: the loops a
    decode step runs while any of its rows is active."""
    return float(exit_loop.max(dim=0).values.double().mean())


def _step_seconds(full: Sequence[float], first: Sequence[float], n: int) -> float:
    """Seconds per decode step from the round times of n new tokens and of 1: (median(full) - median(first)) /
    (n - 1), the prompt pass dropped out; should timer noise make that <= 0, median(full) / n (amortized)."""
    decode = (median(full) - median(first)) / (n - 1)
    return decode if decode > 0 else median(full) / n


def decode_setup(model: DepthRecurrentLM, prompt: object, cfg: SpeedConfig) -> tuple[Tensor, Tensor]:
    """The prompt (B, T0) on the model's device, checked against ``max_seq_len`` with ``new_tokens`` more, and
    the initial states (B, T0 + n, d) every generation comparison starts from (seeded by ``cfg.seed``)."""
    prompt = on_device(model, prompt, "prompt", targets=False)
    B, t0 = prompt.shape
    n = cfg.new_tokens
    if t0 + n > model.cfg.max_seq_len:
        raise DrcError(f"prompt length {t0} + new_tokens {n} exceeds max_seq_len={model.cfg.max_seq_len}: "
                       "shorten the prompt or generate fewer tokens")
    with torch.inference_mode():
        gen = torch.Generator(device=prompt.device).manual_seed(cfg.seed)
        s0 = model.initial_state(torch.zeros(B, t0 + n, model.cfg.d_model, device=prompt.device), gen)
    return prompt, s0


@dataclass
class DecodeTimes:
    """The tables of one interleaved timing of the decoders (:func:`time_decoding`): ``generation`` (the
    :func:`time_generation` table of every batch size, column ``rows``) and ``decoders`` (the
    :func:`~drc_book.continuous_speed.time_decoders` table of the rules timed on both decoders)."""

    generation: pd.DataFrame
    decoders: pd.DataFrame


def time_generation(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                    cfg: SpeedConfig | None = None, *, log: Log = None) -> pd.DataFrame:
    """Time per new token of greedy ``generate`` with each rule against the dense decoder at depth r
    (``generate_fixed``, ``path`` "dense decode") and ``generate`` with ``Uniform(r)``: same prompt (B, T0), same
    ``new_tokens``, same initial states. One row per variant, columns as in :func:`~drc_book.speed.time_batched` plus
    ``rows``, ``ms_per_token``, ``prompt_ms``, ``same_tokens`` and ``first_divergence`` (against the dense decoder's
    tokens) and ``loops_run`` (the mean deepest exit among the rows per step); no CE. :func:`time_decoding` with one
    batch size and no continuous decoder."""
    prompt = on_device(model, prompt, "prompt", targets=False)
    return time_decoding(model, prompt, rules, cfg, batches=[prompt.shape[0]], continuous=(), log=log).generation


def time_decoding(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                  cfg: SpeedConfig | None = None, *, batches: Sequence[int] = (1, 8, 32),
                  continuous: Sequence[str] | None = None, log: Log = None) -> DecodeTimes:
    """One interleaved timing, per batch size B of ``batches`` (the first B prompts of ``prompt``), of greedy
    decoding of ``cfg.new_tokens`` tokens by the dense decoder (``generate_fixed`` at ``cfg.reference_loops`` r),
    by ``generate`` with ``Uniform(r)`` and each rule, and by ``generate_continuous`` with ``Uniform(r)`` and the
    rules whose family is in ``continuous`` (None: every rule; empty: no continuous decoder). Each decoder's time
    per step is (time of n new tokens - time of 1) / (n - 1), medians over ``cfg.rounds`` interleaved rounds
    after a warm-up of one decode step; tokens, exit loops and work come from the first timed round. Returns
    both tables (:class:`DecodeTimes`), so a book that shows both times every decoder once."""
    cfg = cfg or SpeedConfig()
    prepare_memory(cfg)
    prompt, s0 = decode_setup(model, prompt, cfg)
    if not batches or min(batches) < 1 or max(batches) > prompt.shape[0]:
        raise DrcError(f"batches {list(batches)} must lie in 1..{prompt.shape[0]} (the prompts given); pass more "
                       "prompts or smaller batches")
    n, r = cfg.new_tokens, cfg.reference_loops
    t0 = prompt.shape[1]
    uniform = RuleSpec("uniform", float(r), Uniform(r))
    specs = [uniform, *rule_specs(rules, r)]

    def timed_continuously(sp: RuleSpec) -> bool:
        return continuous is None or sp.family in continuous or (sp is uniform and len(continuous) > 0)

    both = [sp for sp in specs if timed_continuously(sp)]
    generation, decoders = [], []
    with torch.inference_mode():
        model.eval()
        for b in batches:
            p, s = prompt[:b], s0[:b]
            # one call per decoder and rule, generating `new` tokens (from the first t0 + new initial states)
            calls: dict[str, Callable[[int], object]] = {
                "dense": lambda new, p=p, s=s: generate_fixed(model, p, new, r, state=s[:, : t0 + new])}
            for spec in specs:
                calls[f"gen {spec.rule}"] = lambda new, p=p, s=s, rule=spec.rule: generate(
                    model, p, new, rule, state=s[:, : t0 + new], fused=cfg.fused)
                if timed_continuously(spec):  # (not `spec in both`: that compares rules by value)
                    calls[f"cont {spec.rule}"] = lambda new, p=p, s=s, rule=spec.rule: generate_continuous(
                        model, p, new, rule, states=s[:, : t0 + new], fused=cfg.fused, keep_logits=False)
            for call in calls.values():  # warm-up: the prompt pass and one decode step
                call(min(n, 2))
            variants = {f"{key} [{tag}]": (lambda call=call, new=new: call(new))
                        for key, call in calls.items() for tag, new in (("n", n), ("1", 1))}
            kept: dict[str, dict[str, Any]] = {}
            times = interleaved(variants, cfg.rounds, log, f"decoders, batch {b}", cfg.clock,
                                keep=lambda name, out, kept=kept: kept.update({name: _summary(out)}))
            step = {key: _step_seconds(times[f"{key} [n]"], times[f"{key} [1]"], n) for key in calls}
            generation += _generation_rows(model, specs, kept, times, step, b, t0, n, r)
            decoders += _decoder_rows(model, both, kept, times, step, b, t0, n, r)
    return DecodeTimes(pd.DataFrame(generation), pd.DataFrame(decoders))


def time_decoder_sets(model: DepthRecurrentLM, prompts: Tensor, rules: Sequence[RuleSpec], cfg: SpeedConfig, *,
                      gen_batches: Sequence[int], decoder_batches: Sequence[int],
                      continuous: Sequence[str]) -> DecodeTimes:
    """Notebook 05's decoder timings, each decoder timed once: at the batch sizes of ``gen_batches`` every rule with
    ``generate`` and the ``continuous`` families with both decoders (:func:`time_decoding`); at the other batch
    sizes of ``decoder_batches`` those families only. Batch sizes beyond the prompts are left out. Returns the
    generation table of ``gen_batches`` and the decoder table of ``decoder_batches``, ordered by batch."""
    gen = [b for b in gen_batches if b <= len(prompts)]
    dec = [b for b in decoder_batches if b <= len(prompts)]
    decoding = [time_decoding(model, prompts, rules, cfg, batches=gen, continuous=continuous)]
    more = [b for b in dec if b not in gen]
    if more:
        decoding.append(time_decoding(model, prompts, [sp for sp in rules if sp.family in continuous], cfg,
                                      batches=more))
    decoders = pd.concat([d.decoders for d in decoding], ignore_index=True)
    decoders = decoders[decoders.batch.isin(dec)].sort_values("batch", kind="stable")
    return DecodeTimes(decoding[0].generation, decoders)


def _summary(out: object) -> dict[str, Any]:
    """What the tables read of a decoder's output: the tokens and exit loops (one tensor, or one per request of a
    continuous decoder), the work done, the mean exit loop of the new tokens and the core steps (continuous)."""
    if isinstance(out, ContinuousResult):
        return {"tokens": [c.tokens for c in out.completions], "exit_loop": [c.exit_loop for c in out.completions],
                "work": out.work, "avg_loops": out.new_avg_depth, "steps": out.steps}
    if isinstance(out, GenerationResult):
        return {"tokens": out.tokens, "exit_loop": out.exit_loop, "work": out.work, "avg_loops": out.new_avg_depth}
    return {"tokens": out}  # generate_fixed: the tokens


def _work_per_token(model: DepthRecurrentLM, kept: dict[str, dict[str, Any]], key: str, b: int, t_len: int,
                    n: int) -> float:
    """Honest FLOPs per new token: the work of n new tokens minus that of 1, over b (n - 1)."""
    work = honest_flops(model, kept[f"{key} [n]"]["work"], t_len) - honest_flops(model, kept[f"{key} [1]"]["work"],
                                                                                 t_len)
    return work / (b * (n - 1))


def _generation_rows(model: DepthRecurrentLM, specs: list[RuleSpec], kept: dict[str, dict[str, Any]],
                     times: dict[str, list[float]], step: dict[str, float], b: int, t0: int, n: int,
                     r: int) -> list[dict]:
    """The :func:`time_generation` rows of one batch size."""
    dense_tokens = kept["dense [n]"]["tokens"][:, t0:]
    rows = [{"setting": "generation", "family": "uniform", "param": float(r), "rule": f"uniform={r} dense decode",
             "path": "dense decode", "baseline": True, "needs_log_probs": False, "avg_loops": float(r),
             "same_tokens": 1.0, "first_divergence": float(n), "loops_run": float(r),
             "honest_flops": float(model.flops_per_token(r, t0 + n)), "key": "dense"}]
    for spec in specs:
        key = f"gen {spec.rule}"
        out = kept[f"{key} [n]"]
        new_tokens = out["tokens"][:, t0:]
        rows.append({"setting": "generation", "family": spec.family, "param": float(spec.param),
                     "rule": str(spec.rule), "path": "generate", "baseline": False,
                     "needs_log_probs": spec.rule.needs_log_probs, "avg_loops": out["avg_loops"],
                     "same_tokens": float((new_tokens == dense_tokens).double().mean()),
                     "first_divergence": _first_divergence(new_tokens, dense_tokens),
                     "loops_run": _loops_run(out["exit_loop"][:, t0 - 1 :]),
                     "honest_flops": _work_per_token(model, kept, key, b, t0 + n, n), "key": key})
    base_flops = matmul_flops_per_token(model, r, t0 + n, "forward")
    for row, spec in zip(rows, [None, *specs], strict=True):
        key = row.pop("key")
        row["seconds"] = step[key]
        row["ms_per_token"] = 1e3 * row["seconds"]
        row["tokens_per_s"] = b / row["seconds"]
        row["rows"] = b
        row["prompt_ms"] = 1e3 * median(times[f"{key} [1]"])
        row["spread"] = spread(times[f"{key} [n]"])
        path = "forward" if spec is None else skip_path(spec.rule)
        speed_columns(row, step["dense"], r, base_flops,
                       matmul_flops_per_token(model, row["avg_loops"], t0 + n, path))
    return rows


def _decoder_rows(model: DepthRecurrentLM, specs: list[RuleSpec], kept: dict[str, dict[str, Any]],
                  times: dict[str, list[float]], step: dict[str, float], b: int, t0: int, n: int,
                  r: int) -> list[dict]:
    """The :func:`~drc_book.continuous_speed.time_decoders` rows of one batch size (none without a
    continuous decoder)."""
    if not specs:
        return []
    dense_flops = float(model.flops_per_token(r, t0 + n))
    rows = [{"batch": b, "rule": f"uniform={r}", "family": "uniform", "path": "dense decode", "avg_loops": float(r),
             "honest_flops": dense_flops, "key": "dense"}]
    for spec in specs:
        name = str(spec.rule)
        full, cont = kept[f"gen {name} [n]"], kept[f"cont {name} [n]"]
        same = all(torch.equal(tok, full["tokens"][i]) and torch.equal(ex, full["exit_loop"][i])
                   for i, (tok, ex) in enumerate(zip(cont["tokens"], cont["exit_loop"], strict=True)))
        for path, key in (("generate", f"gen {name}"), ("continuous", f"cont {name}")):
            extra = {"same_as_generate": same, "steps": cont["steps"]} if path == "continuous" else {}
            rows.append({"batch": b, "rule": name, "family": spec.family, "path": path, "avg_loops": full["avg_loops"],
                         "honest_flops": _work_per_token(model, kept, key, b, t0 + n, n), "key": key, **extra})
    for row in rows:
        key = row.pop("key")
        sec = step[key]
        row.update(ms_per_step=1e3 * sec, tokens_per_s=b / sec, x_dense=step["dense"] / sec,
                   flop_speedup=dense_flops / row["honest_flops"], spread=spread(times[f"{key} [n]"]))
        row["realization"] = row["x_dense"] / row["flop_speedup"]
    return rows


def decode_loop_cost(model: DepthRecurrentLM, prompt: Tensor, cfg: SpeedConfig | None = None, *,
                     rows: Sequence[int] = (1, 2, 4, 8, 16), log: Log = None) -> pd.DataFrame:
    """What one core loop of a decode step costs with B rows active, for each B of ``rows``: the
    ``generate_fixed`` step at depth r and at depth 1, ``loop_ms`` = their difference / (r - 1), and the
    least-squares line loop_ms = ``fixed_ms`` + ``per_row_ms`` x B with ``fixed_share`` (the part that does not shrink
    when rows exit). One row per B."""
    cfg = cfg or SpeedConfig()
    prepare_memory(cfg)
    n, r = cfg.new_tokens, cfg.reference_loops
    if r < 2 or n < 2:
        raise DrcError(f"decode_loop_cost needs reference_loops >= 2 and new_tokens >= 2 (got {r}, {n}): raise them")
    if max(rows) > len(prompt) or min(rows) < 1:
        raise DrcError(f"rows {list(rows)} must lie in 1..{len(prompt)} (the prompts given): pass more prompts")
    prompt, s0 = decode_setup(model, prompt[: max(rows)], cfg)
    variants: dict[str, Callable[[], object]] = {}
    with torch.inference_mode():
        model.eval()
        for b, depth, new in itertools.product(rows, (1, r), (1, n)):
            def call(b: int = b, depth: int = depth, new: int = new) -> Tensor:
                return generate_fixed(model, prompt[:b], new, depth, state=s0[:b, : prompt.shape[1] + new])
            if new == 1:  # warm-up: the prompt pass and one decode step
                call(new=min(n, 2))
            variants[f"B={b} r={depth} n={new}"] = call
        times = interleaved(variants, cfg.rounds, log, "decode loop cost", cfg.clock)

    def step(b: int, depth: int) -> float:
        return _step_seconds(times[f"B={b} r={depth} n={n}"], times[f"B={b} r={depth} n=1"], n)

    out = pd.DataFrame([{"rows": b, "step_ms": 1e3 * step(b, r), "loop_ms": 1e3 * (step(b, r) - step(b, 1)) / (r - 1)}
                        for b in rows])
    out["loop_ms_per_row"] = out.loop_ms / out.rows
    if len(out) > 1:
        per_row, fixed = (float(v) for v in np.polyfit(out.rows.to_numpy(float), out.loop_ms.to_numpy(float), 1))
    else:
        per_row, fixed = 0.0, float(out.loop_ms.iloc[0])
    out["fixed_ms"], out["per_row_ms"] = fixed, per_row
    out["fixed_share"] = fixed / out.loop_ms
    return out


def decode_prediction(generation: pd.DataFrame, cost: pd.DataFrame) -> pd.DataFrame:
    """The core-loop speed-up each rule of a generation frame can expect at the measured decode loop cost
    (loop = f + p x active rows): a step costs f x its deepest exit + p x the sum of its rows' exits, so
    ``loop_cost_speedup`` = r (f + p B) / (f loops_run + p B avg_loops); an upper bound for rules that also read out
    every loop. One row per (rows, rule), baselines and ``Uniform(r)`` left out."""
    fixed, per_row = float(cost.fixed_ms.iloc[0]), float(cost.per_row_ms.iloc[0])
    rows = []
    for g in generation[generation.family != "uniform"].itertuples():
        base = generation[generation.baseline & (generation.rows == g.rows)].iloc[0]
        r, b = base.avg_loops, g.rows
        rows.append({"rows": int(b), "rule": g.rule, "avg_loops": g.avg_loops, "loops_run": g.loops_run,
                     "proxy_speedup": g.proxy_speedup, "honest_speedup": g.honest_speedup,
                     "loop_cost_speedup": r * (fixed + per_row * b) / (fixed * g.loops_run + per_row * b * g.avg_loops),
                     "wallclock_speedup": g.wallclock_speedup})
    return pd.DataFrame(rows)

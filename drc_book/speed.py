"""Realized speed-up of per-token halting at matched quality: the FLOP proxy ``r / a``, the honest FLOPs (the work a
run really did) and the clock, in batched evaluation and generation. Every variant runs once untimed (warm-up, and the
quality of exactly what is timed), then ``rounds`` interleaved rounds (medians, :func:`drc_book.cost.interleaved`); a
decode step takes (time of n new tokens - time of 1) / (n - 1), so that the prompt pass drops out.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from drc_book.cost import (
    CLOCKS,
    Autorange,
    Log,
    Timings,
    honest_flops,
    interleaved,
    keep_freed_memory,
    matmul_flops_per_token,
    median,
    median_interval,
    page_faults,
    spread,
)
from drc_core import (
    EVAL_STATE_SEED,
    ContinuousResult,
    DepthRecurrentLM,
    DrcError,
    GenerationResult,
    HaltingRule,
    KLThreshold,
    RuleSpec,
    StateDelta,
    Uniform,
    check_token_ids,
    default_families,
    default_rules,
    eval_batches,
    generate_continuous,
    generate_fixed,
    huginn_presets,
    matching_depth,
    need_float,
    need_int,
    skip_forward,
    summarize,
    sweep,
)
from drc_core import generate_ids as generate

__all__ = ["TARGET_DECODER", "TARGET_HONEST", "TARGET_KL_BATCHED", "TARGET_MEASURE", "TARGET_OVERHEAD", "TARGET_RATIO",
           "TARGET_REALIZATION", "DecodeTimes", "Matched", "SpeedConfig", "batched_variants", "decode_loop_cost",
           "decode_prediction", "decode_setup", "decoder_calls", "decoder_targets", "matched_rules", "preset_specs",
           "paired_speedup", "serving_latency", "skip_overhead", "speed_targets", "speedup_table",
           "target_row", "timing_checks", "time_batched", "time_decoder_sets", "time_decoders",
           "time_decoding", "time_generation", "with_timings"]

TARGET_RATIO = 0.9  # wall-clock speedup >= 0.9 x the FLOP proxy at matched quality
TARGET_MEASURE = 1.2  # the measurement pass <= 1.2 x one depth-32 forward (the target as worded)
TARGET_OVERHEAD = 1.05  # the skipping path / continuous batching at equal depth <= 1.05 x the dense forward / decoder
TARGET_HONEST = 0.9  # wall-clock speedup >= 0.9 x the honest-FLOP speedup, every rule
TARGET_KL_BATCHED = 1.5  # the KL rule >= 1.5 x faster than uniform depth r in batched evaluation
TARGET_REALIZATION = 0.7  # the continuous decoder realizes >= 0.7 of its honest-FLOP speed-up at batch 8 and 32
TARGET_DECODER = {8: 1.0, 32: 1.2}  # the continuous decoder's tokens/s over the dense decoder's, by batch size

Batch = tuple[Tensor, Tensor, Tensor]  # inputs, targets, initial state


@dataclass(frozen=True)
class SpeedConfig:
    """What to measure and how (a bad value is a one-line :class:`DrcError`): uniform depth ``reference_loops`` r is
    the quality to match (CE within ``ce_tolerance``) and the time to beat; ``clock`` is "wall" or "cpu";
    ``presets`` / ``profile`` add Huginn's presets / a profile to :func:`~drc_book.speed_checks.run_speed`."""

    reference_loops: int = 8
    rule_max_loops: int = 16
    families: tuple[str, ...] = (KLThreshold.family, StateDelta.family)
    ce_tolerance: float = 0.005
    batch_size: int = 16
    rounds: int = 3  # timed rounds, or the least of them when max_rounds is larger (Autorange)
    max_rounds: int = 0  # 0: exactly `rounds`; else more rounds until the interval is within `rel` or `budget_s`
    rel: float = 0.03
    budget_s: float = 30.0
    seed: int = EVAL_STATE_SEED
    new_tokens: int = 64
    prompt_len: int = 32
    gen_rows: int = 1
    measure_loops: int = 32
    measure_windows: int = 8
    max_online_tries: int = 3
    fused: bool = False
    clock: str = "wall"
    more_gen_rows: tuple[int, ...] = ()
    presets: bool = False
    profile: bool = False
    keep_freed: bool = True

    def __post_init__(self) -> None:
        minimum = {"reference_loops": 1, "rule_max_loops": 1, "batch_size": 1, "rounds": 1, "new_tokens": 2,
                   "prompt_len": 1, "gen_rows": 1, "measure_loops": 2, "measure_windows": 1, "max_online_tries": 1}
        for name, lo in minimum.items():
            need_int(name, getattr(self, name), lo)
        for rows in self.more_gen_rows:
            need_int("more_gen_rows", rows, 1)
        need_float("ce_tolerance", self.ce_tolerance, 0.0)
        self.autorange()  # checks max_rounds, rel, budget_s
        if self.clock not in CLOCKS:
            raise DrcError(f"clock={self.clock!r} is invalid: use one of {', '.join(CLOCKS)}")
        known = default_families()
        if not self.families or any(f not in known for f in self.families):
            raise DrcError(f"families={list(self.families)!r} is invalid: choose from {', '.join(known)}")

    def autorange(self) -> Autorange:
        """When each interleaved timing stops (:class:`drc_book.cost.Autorange`)."""
        return Autorange(self.rounds, max(self.rounds, self.max_rounds), self.rel, self.budget_s)

    def start(self) -> None:
        """Before timing: the allocator setting ``keep_freed`` asks for."""
        if self.keep_freed:
            keep_freed_memory()


def on_device(model: DepthRecurrentLM, ids: object, what: str = "windows", targets: bool = True) -> Tensor:
    """Token ids checked by :func:`drc_core.check_token_ids`, on the model's device."""
    return check_token_ids(model, ids, what, targets=targets).to(next(model.parameters()).device)


def timing_batches(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig) -> list[Batch]:
    """(inputs, targets, s_0) per batch, s_0 drawn as :func:`drc_core.sweep` draws it for the same seed and batch."""
    return [(b.x, b.y, b.initial_state(model)) for b in eval_batches(model, windows, cfg.batch_size, cfg.seed)]


def ce_sum(logits: Tensor, y: Tensor) -> float:
    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"))


def skip_path(rule: HaltingRule) -> str:
    return "skip_log_probs" if rule.needs_log_probs else "skip_states"


def rule_specs(rules: Sequence[RuleSpec | HaltingRule], r: int) -> list[RuleSpec]:
    """Rules as :class:`RuleSpec` (a bare rule: its class name, param NaN), distinct and none the baseline."""
    specs = [s if isinstance(s, RuleSpec) else RuleSpec(type(s).__name__, math.nan, s) for s in rules]
    for spec in specs:
        if not isinstance(spec.rule, HaltingRule):
            raise DrcError(f"rules must be HaltingRule or RuleSpec instances; got {spec.rule!r}")
    names = [str(spec.rule) for spec in specs]
    if len(set(names)) != len(names) or f"uniform={r}" in names:
        raise DrcError(f"rules {names} repeat a rule or the baseline uniform={r}: pass each rule once")
    return specs


def batched_variants(model: DepthRecurrentLM, rules: Sequence[RuleSpec | HaltingRule], cfg: SpeedConfig, *,
                     skip_uniform: bool = True) -> list[tuple[dict, Callable[[Tensor, Tensor], Any]]]:
    """``(info, fn(x, s0))``: the dense forward at depth r (the baseline), then ``skip_forward`` with ``Uniform(r)``
    (if ``skip_uniform``) and each rule; ``info`` has ``family, param, rule, path, baseline, needs_log_probs``."""
    r = cfg.reference_loops
    uniform = RuleSpec("uniform", float(r), Uniform(r))
    out: list[tuple[dict, Callable[[Tensor, Tensor], Any]]] = [
        ({"family": "uniform", "param": float(r), "rule": f"uniform={r}", "path": "forward", "baseline": True,
          "needs_log_probs": False}, lambda x, s: model(x, r, state=s))]
    specs = rule_specs(rules, r)
    for spec in [uniform, *specs] if skip_uniform else specs:
        out.append(({"family": spec.family, "param": float(spec.param),
                     "rule": f"{spec.rule} via skip_forward" if spec is uniform else str(spec.rule),
                     "path": skip_path(spec.rule), "baseline": False, "needs_log_probs": spec.rule.needs_log_probs},
                    lambda x, s, rule=spec.rule: skip_forward(model, x, rule, state=s, fused=cfg.fused)))
    return out


def _untimed(model: DepthRecurrentLM, fn: Callable[[Tensor, Tensor], Any], batches: list[Batch], r: int,
             t_len: int) -> tuple[float, float, float]:
    """(average exit loop, mean CE, honest FLOPs per token) of one pass of ``fn`` (dense at depth r or skipping)."""
    loops = ce = flops = 0.0
    for x, y, s0 in batches:
        out = fn(x, s0)
        dense = isinstance(out, Tensor)
        loops += r * x.numel() if dense else float(out.exit_loop.double().sum())
        flops += model.flops_per_token(r, t_len) * x.numel() if dense else honest_flops(model, out.work, t_len)
        ce += ce_sum(out if dense else out.logits, y)
        del out
    n = sum(x.numel() for x, _, _ in batches)
    return loops / n, ce / n, flops / n


def speed_columns(row: dict, base_seconds: float, model: DepthRecurrentLM, r: int, seq_len: int, path: str) -> None:
    """Adds the speed-ups of ``row`` (run on ``path``) over the dense forward at depth r taking ``base_seconds``."""
    base_flops = matmul_flops_per_token(model, r, seq_len, "forward")
    row["proxy_speedup"] = r / row["avg_loops"]
    row["flop_speedup"] = base_flops / matmul_flops_per_token(model, row["avg_loops"], seq_len, path)
    row["wallclock_speedup"] = base_seconds / row["seconds"]
    row["wall_over_proxy"] = row["wallclock_speedup"] / row["proxy_speedup"]
    row["honest_speedup"] = base_flops / row["honest_flops"]
    row["wall_over_honest"] = row["wallclock_speedup"] / row["honest_speedup"]


@dataclass
class Matched:
    """:func:`matched_rules`: the chosen :class:`RuleSpec` per family, one row per family (the chosen point offline
    and online, or why none) and the offline ``grid`` (``chosen`` marks the picks)."""

    specs: list[RuleSpec]
    table: pd.DataFrame
    grid: pd.DataFrame


def matched_rules(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
                  log: Log = None) -> Matched:
    """Each family's lowest-average-depth grid point with CE <= CE(uniform r) + ``ce_tolerance`` offline, checked
    online (up to ``max_online_tries`` stricter points if it misses); no point offline: the lowest-CE one."""
    cfg = cfg or SpeedConfig()
    windows = on_device(model, windows)
    r = cfg.reference_loops
    specs = [s for s in default_rules(cfg.rule_max_loops) if s.family in cfg.families]
    with torch.inference_mode():
        frame = sweep(model, windows, specs, reference_loops=r, uniform_loops=[r], oracle_eps=(),
                      batch_size=cfg.batch_size, seed=cfg.seed, mode="offline")
        grid = summarize(frame, n_boot=200, seed=0)
        ce_uniform = float(grid[(grid.family == "uniform") & (grid.param == r)].ce.iloc[0])
        target = ce_uniform + cfg.ce_tolerance
        if log:
            log(f"matching: offline sweep of {len(specs)} grid points; target CE <= {ce_uniform:.4f} + "
                f"{cfg.ce_tolerance:g} = {target:.4f}")
        batches = timing_batches(model, windows, cfg)
        by_param = {(s.family, float(s.param)): s for s in specs}
        grid["chosen"] = False
        chosen: list[RuleSpec] = []
        rows = []
        for fam in cfg.families:
            m = matching_depth(grid, fam, target)
            points = grid[grid.family == fam]
            matched_offline = not math.isnan(m["param"])
            if matched_offline:
                points = points[(points.avg_depth >= m["grid"]) & (points.ce <= target)].sort_values("avg_depth")
            else:
                points = points.sort_values(["ce", "avg_depth"]).head(1)
            tries = 0
            for _, point in points.head(cfg.max_online_tries).iterrows():
                spec = by_param[(fam, float(point.param))]
                loops, ce, _ = _untimed(model, lambda x, s, rule=spec.rule: skip_forward(
                    model, x, rule, state=s, fused=cfg.fused), batches, r, windows.shape[1] - 1)
                tries += 1
                ok = ce <= target
                if log:
                    log(f"matching: {spec.rule} offline {point.avg_depth:.3f} loops CE {point.ce:.4f}; "
                        f"online {loops:.3f} loops CE {ce:.4f} ({'within' if ok else 'misses'} the target)")
                if ok:
                    break
            grid.loc[(grid.family == fam) & (grid.param == spec.param), "chosen"] = True
            chosen.append(spec)
            note = ("" if ok else "no grid point within the target offline: lowest-CE point" if not matched_offline
                    else f"online CE misses the target at {tries} grid point(s)")
            rows.append({"family": fam, "param": float(spec.param), "rule": str(spec.rule),
                         "needs_log_probs": spec.rule.needs_log_probs, "ce_uniform": ce_uniform, "ce_target": target,
                         "matched_offline": matched_offline, "avg_loops_offline": float(point.avg_depth),
                         "ce_offline": float(point.ce), "avg_loops": loops, "ce": ce, "within_tolerance": ok,
                         "online_tries": tries, "note": note})
    return Matched(specs=chosen, table=pd.DataFrame(rows), grid=grid)


def preset_specs(cfg: SpeedConfig, taken: Sequence[RuleSpec] = ()) -> list[RuleSpec]:
    """Huginn's exit criteria at ``rule_max_loops`` (family "huginn", param NaN), less those among ``taken``."""
    names = {str(t.rule) for t in taken}
    return [RuleSpec("huginn", math.nan, rule) for rule in huginn_presets(cfg.rule_max_loops).values()
            if str(rule) not in names]


def with_timings(frame: pd.DataFrame, *timings: Timings) -> pd.DataFrame:
    """``frame`` with ``attrs["timings"]``: how each of its interleaved timings ended (:meth:`Timings.warmup`)."""
    frame.attrs["timings"] = [t.warmup() for t in timings]
    return frame


def timing_checks(*frames: pd.DataFrame | None) -> pd.DataFrame:
    """One row per interleaved timing behind ``frames`` (their ``attrs["timings"]``): its variants and rounds, why
    it stopped (``interval``: every median within the asked precision; ``budget``: the time budget spent;
    ``rounds``: the most rounds allowed), its seconds, and the warm-up check (``warmup_p``, ``warmup_ok``)."""
    rows = [t for f in frames if f is not None for t in f.attrs.get("timings", [])]
    return pd.DataFrame(rows).drop_duplicates(subset=["timing"], keep="first").reset_index(drop=True)


def time_batched(model: DepthRecurrentLM, windows: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                 cfg: SpeedConfig | None = None, *, log: Log = None) -> pd.DataFrame:
    """One row per variant of :func:`batched_variants` on the same windows and states: ``setting``, its ``info``,
    ``avg_loops``, ``ce``, ``ce_gap``, ``within_tolerance``, ``seconds``, ``spread``, ``page_faults_per_batch``,
    ``tokens_per_s``, ``honest_flops`` and the speed-ups over the baseline (:func:`speed_columns`)."""
    cfg = cfg or SpeedConfig()
    cfg.start()
    windows = on_device(model, windows)
    r = cfg.reference_loops
    variants = batched_variants(model, rules, cfg)
    t_len = windows.shape[1] - 1
    with torch.inference_mode():
        model.eval()
        batches = timing_batches(model, windows, cfg)
        n_tok = sum(x.numel() for x, _, _ in batches)
        rows = []
        for info, fn in variants:  # untimed pass: warm-up and the quality of exactly what is timed
            loops, ce, flops = _untimed(model, fn, batches, r, t_len)
            rows.append({"setting": "batched eval", **info, "avg_loops": loops, "ce": ce, "honest_flops": flops})
        faults: dict[str, list[int]] = {info["rule"]: [] for info, _ in variants}

        def run(name: str, fn: Callable[[Tensor, Tensor], Any]) -> None:
            before = page_faults()
            for x, _, s0 in batches:
                fn(x, s0)
            faults[name].append(page_faults() - before)

        times = interleaved({info["rule"]: (lambda name=info["rule"], fn=fn: run(name, fn)) for info, fn in variants},
                            cfg.autorange(), log, "batched eval", cfg.clock)
    base = rows[0]
    base_rounds = times[base["rule"]]
    for row in rows:
        row["ce_uniform"] = base["ce"]
        row["ce_gap"] = row["ce"] - base["ce"]
        row["within_tolerance"] = row["ce_gap"] <= cfg.ce_tolerance
        row.update(times.row(row["rule"]))
        row["page_faults_per_batch"] = median(faults[row["rule"]]) / len(batches)
        row["tokens_per_s"] = n_tok / row["seconds"]
        speed_columns(row, median(base_rounds), model, r, t_len, row["path"])
        row.update(paired_speedup(base_rounds, times[row["rule"]]))
    return with_timings(pd.DataFrame(rows), times)


def paired_speedup(base: Sequence[float], timed: Sequence[float]) -> dict[str, float]:
    """``speedup_lo``, ``speedup_hi``, ``speedup_coverage``: the interval of the median over rounds of the paired
    ratio ``base`` / ``timed`` (the interleaved rounds pair them, so drift of the machine between rounds cancels)."""
    lo, hi, coverage = median_interval([b / t for b, t in zip(base, timed, strict=True)])
    return {"speedup_lo": lo, "speedup_hi": hi, "speedup_coverage": coverage}


def decode_setup(model: DepthRecurrentLM, prompt: object, cfg: SpeedConfig) -> tuple[Tensor, Tensor]:
    """The prompt (B, T0) on the model's device, checked to fit ``new_tokens`` more, and the seeded initial states
    (B, T0 + n, d) every generation comparison starts from."""
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


def check_batches(batches: Sequence[int], n: int, empty_ok: bool = False) -> None:
    if (not batches and not empty_ok) or (batches and (min(batches) < 1 or max(batches) > n)):
        raise DrcError(f"batches {list(batches)} must lie in 1..{n} (the prompts given); pass more prompts or "
                       "smaller batches")


def decoder_calls(model: DepthRecurrentLM, prompt: Tensor, s0: Tensor, specs: Sequence[RuleSpec], cfg: SpeedConfig,
                  continuous: Callable[[RuleSpec], bool]) -> dict[str, Callable[[int], Any]]:
    """``call(new)`` decoding ``new`` greedy tokens after ``prompt`` by name: the dense decoder at depth r
    (``"uniform=r dense decode"``), ``generate`` with each spec, ``"continuous <rule>"`` for the specs selected."""
    r, t0 = cfg.reference_loops, prompt.shape[1]
    calls: dict[str, Callable[[int], Any]] = {
        f"uniform={r} dense decode": lambda new: generate_fixed(model, prompt, new, r, state=s0[:, : t0 + new])}
    for spec in specs:
        calls[str(spec.rule)] = lambda new, rule=spec.rule: generate(model, prompt, new, rule,
                                                                     state=s0[:, : t0 + new], fused=cfg.fused)
    for spec in filter(continuous, specs):
        calls[f"continuous {spec.rule}"] = lambda new, rule=spec.rule: generate_continuous(
            model, prompt, new, rule, states=s0[:, : t0 + new], fused=cfg.fused, keep_logits=False)
    return calls


def _step_seconds(full: Sequence[float], first: Sequence[float], n: int) -> float:
    """Seconds per decode step, or median(full) / n should timer noise make the difference <= 0."""
    decode = (median(full) - median(first)) / (n - 1)
    return decode if decode > 0 else median(full) / n


def _summary(out: object) -> dict[str, Any]:
    """What the tables read of a decoder's output (a continuous decoder's per request)."""
    if isinstance(out, ContinuousResult):
        return {"tokens": [c.tokens for c in out.completions], "exit_loop": [c.exit_loop for c in out.completions],
                "work": out.work, "avg_loops": out.new_avg_depth, "steps": out.steps}
    if isinstance(out, GenerationResult):
        return {"tokens": out.tokens, "exit_loop": out.exit_loop, "work": out.work, "avg_loops": out.new_avg_depth}
    return {"tokens": out}  # generate_fixed: the tokens


@dataclass
class DecodeTimes:
    """:func:`time_decoding`: the :func:`time_generation` table of every batch size and the :func:`time_decoders`
    table."""

    generation: pd.DataFrame
    decoders: pd.DataFrame


@dataclass
class _Timed:
    """One batch size ``b``'s timing: each call's kept output and round times, ``n`` new of ``seq_len`` tokens."""

    model: DepthRecurrentLM
    kept: dict[str, dict[str, Any]]
    times: Timings
    n: int
    b: int
    seq_len: int

    def step(self, key: str) -> float:
        return _step_seconds(self.times[f"{key} [n]"], self.times[f"{key} [1]"], self.n)

    def step_interval(self, key: str) -> dict[str, float]:
        """``ms_lo``, ``ms_hi``: a decode step's interval from the two calls' median intervals (the widest
        difference of the two, so at least their coverages' product), and ``rounds``."""
        full, first = self.times.row(f"{key} [n]"), self.times.row(f"{key} [1]")
        return {"ms_lo": 1e3 * (full["seconds_lo"] - first["seconds_hi"]) / (self.n - 1),
                "ms_hi": 1e3 * (full["seconds_hi"] - first["seconds_lo"]) / (self.n - 1), "rounds": full["rounds"]}

    def step_rounds(self, key: str) -> list[float]:
        """``key``'s decode step in each round, from that round's two calls."""
        return [_step_seconds([full], [first], self.n)
                for full, first in zip(self.times[f"{key} [n]"], self.times[f"{key} [1]"], strict=True)]

    def work_per_token(self, key: str) -> float:
        """Honest FLOPs per new token: the work of n new tokens minus that of 1, over b (n - 1)."""
        work = [honest_flops(self.model, self.kept[f"{key} [{tag}]"]["work"], self.seq_len) for tag in ("n", "1")]
        return (work[0] - work[1]) / (self.b * (self.n - 1))


def _generation_rows(t: _Timed, specs: list[RuleSpec], r: int, t0: int) -> list[dict]:
    dense = f"uniform={r} dense decode"
    dense_tokens = t.kept[f"{dense} [n]"]["tokens"][:, t0:]
    rows = [{"setting": "generation", "family": "uniform", "param": float(r), "rule": dense, "path": "dense decode",
             "baseline": True, "needs_log_probs": False, "avg_loops": float(r), "same_tokens": 1.0,
             "first_divergence": float(t.n), "loops_run": float(r),
             "honest_flops": float(t.model.flops_per_token(r, t.seq_len))}]
    for spec in specs:
        out = t.kept[f"{spec.rule} [n]"]
        differ = out["tokens"][:, t0:] != dense_tokens
        first = torch.where(differ.any(dim=1), differ.int().argmax(dim=1), differ.shape[1])  # n where none differs
        rows.append({"setting": "generation", "family": spec.family, "param": float(spec.param),
                     "rule": str(spec.rule), "path": "generate", "baseline": False,
                     "needs_log_probs": spec.rule.needs_log_probs, "avg_loops": out["avg_loops"],
                     "same_tokens": float((~differ).double().mean()), "first_divergence": float(first.double().mean()),
                     # the loops a step runs while any row is active: the deepest exit among the rows
                     "loops_run": float(out["exit_loop"][:, t0 - 1 :].max(dim=0).values.double().mean()),
                     "honest_flops": t.work_per_token(str(spec.rule))})
    for row, spec in zip(rows, [None, *specs], strict=True):
        key = row["rule"]
        sec = t.step(key)
        row.update(seconds=sec, ms_per_token=1e3 * sec, tokens_per_s=t.b / sec, rows=t.b,
                   prompt_ms=1e3 * median(t.times[f"{key} [1]"]), spread=spread(t.times[f"{key} [n]"]),
                   **t.step_interval(key), **paired_speedup(t.step_rounds(dense), t.step_rounds(key)))
        speed_columns(row, t.step(dense), t.model, r, t.seq_len, "forward" if spec is None else skip_path(spec.rule))
    return rows


def _decoder_rows(t: _Timed, specs: list[RuleSpec], r: int) -> list[dict]:
    if not specs:
        return []
    dense = f"uniform={r} dense decode"
    dense_flops = float(t.model.flops_per_token(r, t.seq_len))
    rows = [{"batch": t.b, "rule": f"uniform={r}", "family": "uniform", "path": "dense decode", "avg_loops": float(r),
             "honest_flops": dense_flops, "key": dense}]
    for spec in specs:
        name = str(spec.rule)
        full, cont = t.kept[f"{name} [n]"], t.kept[f"continuous {name} [n]"]
        same = all(torch.equal(tok, full["tokens"][i]) and torch.equal(ex, full["exit_loop"][i])
                   for i, (tok, ex) in enumerate(zip(cont["tokens"], cont["exit_loop"], strict=True)))
        for path, key in (("generate", name), ("continuous", f"continuous {name}")):
            extra = {"same_as_generate": same, "steps": cont["steps"]} if path == "continuous" else {}
            rows.append({"batch": t.b, "rule": name, "family": spec.family, "path": path,
                         "avg_loops": full["avg_loops"], "honest_flops": t.work_per_token(key), "key": key, **extra})
    for row in rows:
        key = row.pop("key")
        sec = t.step(key)
        paired = paired_speedup(t.step_rounds(dense), t.step_rounds(key))  # its keys as x_dense_lo, _hi, _coverage
        row.update(ms_per_step=1e3 * sec, tokens_per_s=t.b / sec, x_dense=t.step(dense) / sec,
                   flop_speedup=dense_flops / row["honest_flops"], spread=spread(t.times[f"{key} [n]"]),
                   **t.step_interval(key), **{k.replace("speedup", "x_dense"): v for k, v in paired.items()})
        row["realization"] = row["x_dense"] / row["flop_speedup"]
    return rows


def time_decoding(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                  cfg: SpeedConfig | None = None, *, batches: Sequence[int] = (1, 8, 32),
                  continuous: Sequence[str] | None = None, log: Log = None) -> DecodeTimes:
    """One interleaved timing per batch size B (the first B prompts) of the :func:`decoder_calls` with
    ``Uniform(r)`` and each rule, continuously for the families of ``continuous`` (None: all): both tables at once,
    each decoder timed once. Tokens, exits and work come from the first round."""
    cfg = cfg or SpeedConfig()
    cfg.start()
    prompt, s0 = decode_setup(model, prompt, cfg)
    check_batches(batches, prompt.shape[0])
    n, r = cfg.new_tokens, cfg.reference_loops
    t0 = prompt.shape[1]
    uniform = RuleSpec("uniform", float(r), Uniform(r))
    specs = [uniform, *rule_specs(rules, r)]

    def timed_continuously(sp: RuleSpec) -> bool:  # (not `sp in both`: that compares rules by value)
        return continuous is None or sp.family in continuous or (sp is uniform and len(continuous) > 0)

    both = [sp for sp in specs if timed_continuously(sp)]
    generation, decoders, timings = [], [], []
    with torch.inference_mode():
        model.eval()
        for b in batches:
            calls = decoder_calls(model, prompt[:b], s0[:b], specs, cfg, timed_continuously)
            for call in calls.values():  # warm-up: the prompt pass and one decode step
                call(min(n, 2))
            variants = {f"{key} [{tag}]": (lambda call=call, new=new: call(new))
                        for key, call in calls.items() for tag, new in (("n", n), ("1", 1))}
            kept: dict[str, dict[str, Any]] = {}
            times = interleaved(variants, cfg.autorange(), log, f"decoders, batch {b}", cfg.clock,
                                keep=lambda name, out, kept=kept: kept.update({name: _summary(out)}))
            timings.append(times)
            timed = _Timed(model, kept, times, n, b, t0 + n)
            generation += _generation_rows(timed, specs, r, t0)
            decoders += _decoder_rows(timed, both, r)
    return DecodeTimes(with_timings(pd.DataFrame(generation), *timings), with_timings(pd.DataFrame(decoders), *timings))


def time_generation(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                    cfg: SpeedConfig | None = None, *, log: Log = None) -> pd.DataFrame:
    """``generate`` with ``Uniform(r)`` and each rule against the dense decoder at depth r (the baseline) after the
    whole ``prompt``: :func:`time_batched`'s columns (no CE), ``rows``, ``ms_per_token``, ``prompt_ms``,
    ``same_tokens``, ``first_divergence`` (against the dense tokens) and ``loops_run`` (deepest exit per step)."""
    prompt = on_device(model, prompt, "prompt", targets=False)
    return time_decoding(model, prompt, rules, cfg, batches=[prompt.shape[0]], continuous=(), log=log).generation


def time_decoders(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                  cfg: SpeedConfig | None = None, *, batches: Sequence[int] = (1, 8, 32), log: Log = None
                  ) -> pd.DataFrame:
    """One row per (batch, rule, path) of the dense, ``generate`` and continuous decoders (:func:`time_decoding`):
    ``avg_loops``, ``ms_per_step``, ``tokens_per_s``, ``x_dense``, ``honest_flops``, ``flop_speedup``,
    ``realization`` (x_dense / flop_speedup), ``same_as_generate``, ``spread`` and ``steps``."""
    return time_decoding(model, prompt, rules, cfg, batches=batches, log=log).decoders


def time_decoder_sets(model: DepthRecurrentLM, prompts: Tensor, rules: Sequence[RuleSpec], cfg: SpeedConfig, *,
                      gen_batches: Sequence[int], decoder_batches: Sequence[int],
                      continuous: Sequence[str]) -> DecodeTimes:
    """Notebook 05's decoder timings, each decoder timed once: every rule at ``gen_batches``, the ``continuous``
    families also at the other ``decoder_batches`` (batch sizes beyond the prompts left out)."""
    gen = [b for b in gen_batches if b <= len(prompts)]
    dec = [b for b in decoder_batches if b <= len(prompts)]
    decoding = [time_decoding(model, prompts, rules, cfg, batches=gen, continuous=continuous)]
    more = [b for b in dec if b not in gen]
    if more:
        decoding.append(time_decoding(model, prompts, [sp for sp in rules if sp.family in continuous], cfg,
                                      batches=more))
    decoders = pd.concat([d.decoders for d in decoding], ignore_index=True)
    decoders = decoders[decoders.batch.isin(dec)].sort_values("batch", kind="stable").reset_index(drop=True)
    decoders.attrs["timings"] = [t for d in decoding for t in d.decoders.attrs["timings"]]
    return DecodeTimes(decoding[0].generation, decoders)


def decode_loop_cost(model: DepthRecurrentLM, prompt: Tensor, cfg: SpeedConfig | None = None, *,
                     rows: Sequence[int] = (1, 2, 4, 8, 16), log: Log = None) -> pd.DataFrame:
    """What one core loop of a decode step costs with B of ``rows`` active: ``loop_ms`` = (step at depth r - step at
    depth 1) / (r - 1), and its least-squares line ``fixed_ms`` + ``per_row_ms`` x B with ``fixed_share``."""
    cfg = cfg or SpeedConfig()
    cfg.start()
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
        times = interleaved(variants, cfg.autorange(), log, "decode loop cost", cfg.clock)

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
    return with_timings(out, times)


def decode_prediction(generation: pd.DataFrame, cost: pd.DataFrame) -> pd.DataFrame:
    """Per (rows, rule) of a generation frame, the core-loop speed-up at the decode loop cost (a step costs f x its
    deepest exit + p x its rows' exits): ``loop_cost_speedup`` = r (f + p B) / (f loops_run + p B avg_loops)."""
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


def serving_latency(model: DepthRecurrentLM, prompt: Tensor, rule: HaltingRule, *, slots: int,
                    new_tokens: Sequence[int], cfg: SpeedConfig | None = None, log: Log = None) -> pd.DataFrame:
    """Requests (request i asks for ``new_tokens[i % len]`` tokens) arriving at once, served ``slots`` at a time by
    continuous depth batching and by ``generate`` (batches as long as their longest): per path the latency
    percentiles ``p50, p90, p99``, ``seconds`` and ``tokens_per_s``."""
    cfg = cfg or SpeedConfig()
    n_max = max(new_tokens)
    prompt, s0 = decode_setup(model, prompt, replace(cfg, new_tokens=n_max))
    n_req, t0 = prompt.shape
    asks = [new_tokens[i % len(new_tokens)] for i in range(n_req)]
    states = [s0[i, : t0 + asks[i]] for i in range(n_req)]
    latencies: dict[str, list[list[float]]] = {"continuous": [], "generate": []}

    def continuous() -> None:
        res = generate_continuous(model, list(prompt), asks, rule, slots=slots, states=states, keep_logits=False)
        latencies["continuous"].append([c.finished for c in res.completions])

    def batched() -> None:
        done: list[float] = []
        t_start = time.perf_counter()
        for i in range(0, n_req, slots):
            n = max(asks[i : i + slots])
            generate(model, prompt[i : i + slots], n, rule, state=s0[i : i + slots, : t0 + n], fused=cfg.fused)
            done += [time.perf_counter() - t_start] * len(asks[i : i + slots])
        latencies["generate"].append(done)

    with torch.inference_mode():
        model.eval()
        continuous()
        batched()  # warm-up
        for v in latencies.values():
            v.clear()
        times = interleaved({"continuous": continuous, "generate": batched}, cfg.autorange(), log, "serving",
                            cfg.clock)
    rows = []
    for path, lat in latencies.items():
        arr = np.median(np.array(lat), axis=0)  # per request, median over rounds
        sec = median(times[path])
        rows.append({"path": path, "rule": str(rule), "slots": slots, "requests": n_req, "seconds": sec,
                     "tokens_per_s": sum(asks) / sec, **{f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)},
                     "rounds": len(times[path])})
    return with_timings(pd.DataFrame(rows), times)


def skip_overhead(batched: pd.DataFrame) -> float:
    """The wall-clock speed-up of ``skip_forward`` with ``Uniform(r)`` over the dense forward (< 1: a slowdown)."""
    row = batched[(batched.family == "uniform") & ~batched.baseline]
    if row.empty:
        raise DrcError("the batched frame has no skip_forward Uniform(r) row: pass the frame of time_batched")
    return float(row.wallclock_speedup.iloc[0])


def target_row(value: float, lo: float, hi: float, ok: Callable[[float], bool], ceiling: float = 1.0
               ) -> dict[str, Any]:
    """A target's judgement: ``met`` on the median ``value``; ``verdict`` "met" or "missed" only when the whole
    interval ``[lo, hi]`` is on one side of the target (the median alone without one), else "unresolved";
    ``reachable``: whether the ``ceiling`` (the value were the clock to follow the honest FLOPs) meets it (True
    where there is no ceiling, NaN)."""
    inside = [ok(v) for v in (lo, hi) if not math.isnan(v)] or [ok(value)]
    verdict = "met" if all(inside) else "missed" if not any(inside) else "unresolved"
    return {"value": float(value), "lo": float(lo), "hi": float(hi), "met": bool(ok(value)), "verdict": verdict,
            "ceiling": float(ceiling), "reachable": math.isnan(ceiling) or bool(ok(ceiling))}


def speed_targets(*frames: pd.DataFrame) -> pd.DataFrame:
    """One row per (setting, rule, target) of :func:`time_batched` / :func:`time_generation` frames, judged by
    :func:`target_row` on the interval of the paired per-round speed-up (``speedup_lo``/``speedup_hi``, NaN in
    frames without it)."""
    rows = []

    def add(setting: str, rule: str, target: str, value: float, lo: float, hi: float, threshold: float,
            ok: Callable[[float, float], bool], ceiling: float = 1.0) -> None:
        rows.append({"setting": setting, "rule": rule, "target": target, "threshold": threshold,
                     **target_row(value, lo, hi, lambda v: ok(v, threshold), ceiling)})

    for frame in frames:
        for r in frame[~frame.baseline].itertuples():
            setting = r.setting if r.setting != "generation" else f"generation, batch {int(r.rows)}"
            lo, hi = getattr(r, "speedup_lo", math.nan), getattr(r, "speedup_hi", math.nan)
            if r.family == "uniform":
                add(setting, r.rule, "time / dense time at equal depth <= 1.05", 1 / r.wallclock_speedup, 1 / hi,
                    1 / lo, TARGET_OVERHEAD, operator.le)
                continue
            add(setting, r.rule, "faster than uniform depth (wall-clock speedup > 1)", r.wallclock_speedup, lo, hi,
                1.0, operator.gt, r.honest_speedup)
            h = r.honest_speedup
            add(setting, r.rule, "wall / honest FLOPs >= 0.9", r.wall_over_honest, lo / h, hi / h, TARGET_HONEST,
                operator.ge)
            if r.family == "state_delta":
                p = r.proxy_speedup
                add(setting, r.rule, "wall / proxy >= 0.9", r.wall_over_proxy, lo / p, hi / p, TARGET_RATIO,
                    operator.ge, h / p)
            if r.family == "kl" and r.setting == "batched eval":
                add(setting, r.rule, "wall-clock speedup >= 1.5", r.wallclock_speedup, lo, hi, TARGET_KL_BATCHED,
                    operator.ge, h)
    return pd.DataFrame(rows, columns=["setting", "rule", "target", "threshold", "value", "lo", "hi", "met",
                                       "verdict", "ceiling", "reachable"])


def decoder_targets(table: pd.DataFrame, families: Sequence[str] | None = None, batches: Sequence[int] = (8, 32),
                    serving: pd.DataFrame | None = None) -> pd.DataFrame:
    """The targets on a :func:`time_decoders` table at each of ``batches``: with the KL rule and the state-change
    rule (``families``), the continuous decoder reaches :data:`TARGET_DECODER` x the dense decoder's tokens/s (the
    target of the largest listed batch size not above ``b``; batch 8's below 8) and realizes
    >= :data:`TARGET_REALIZATION` of its honest-FLOP speed-up; at equal depth it costs <= 1.05 x; with a
    :func:`serving_latency` table, its p50 latency is below ``generate``'s. Each judged by :func:`target_row` on the
    interval of the paired per-round ratio (``x_dense_lo``/``x_dense_hi``); a speed-up's ``ceiling`` is the
    ``flop_speedup`` (the work the rule asks for, readouts included); serving has no interval and no ceiling."""
    families = SpeedConfig.families if families is None else families
    out = []

    def check(b: int, name: str, value: float, lo: float, hi: float, target: str, ok: Callable[[float], bool],
              ceiling: float = 1.0) -> None:
        out.append({"batch": b, "check": name, "target": target, **target_row(value, lo, hi, ok, ceiling)})

    cont = table[table.path == "continuous"]
    for b in batches:
        at = cont[cont.batch == b]
        goal = TARGET_DECODER[max([k for k in TARGET_DECODER if k <= b], default=min(TARGET_DECODER))]
        for fam in families:
            for _, row in at[at.family == fam].iterrows():
                lo, hi = row.get("x_dense_lo", math.nan), row.get("x_dense_hi", math.nan)
                f = row.flop_speedup
                check(b, f"{row.rule}: tokens/s over the dense decoder", row.x_dense, lo, hi, f">= {goal:g}",
                      lambda v, g=goal: v >= g, ceiling=f)
                check(b, f"{row.rule}: realization", row.realization, lo / f, hi / f, f">= {TARGET_REALIZATION}",
                      lambda v: v >= TARGET_REALIZATION)
        for _, row in at[at.family == "uniform"].iterrows():
            lo, hi = row.get("x_dense_lo", math.nan), row.get("x_dense_hi", math.nan)
            check(b, "continuous at equal depth: time / dense decoder", 1 / row.x_dense, 1 / hi, 1 / lo,
                  f"<= {TARGET_OVERHEAD}", lambda v: v <= TARGET_OVERHEAD)
    if serving is not None and {"continuous", "generate"} <= set(serving.path):
        p50 = serving.set_index("path").p50
        check(int(serving.slots.iloc[0]), f"serving {serving.rule.iloc[0]}: p50 continuous / generate",
              p50["continuous"] / p50["generate"], math.nan, math.nan, "< 1", lambda v: v < 1, ceiling=math.nan)
    return pd.DataFrame(out, columns=["batch", "check", "value", "lo", "hi", "target", "met", "verdict", "ceiling",
                                      "reachable"])


def speedup_table(*frames: pd.DataFrame) -> pd.DataFrame:
    """The non-baseline rows of :func:`time_batched` / :func:`time_generation` frames, as
    :func:`drc_book.viz.speedup_bars` draws them."""
    cols = ["setting", "rule", "avg_loops", "proxy_speedup", "flop_speedup", "wallclock_speedup", "wall_over_proxy"]
    rows = pd.concat([f[~f.baseline] for f in frames], ignore_index=True)
    return rows[cols].assign(rule=rows.rule.astype(str)).reset_index(drop=True)

"""Realized speedup of per-token halting: the FLOP proxy beside measured wall-clock, and what the
32-loop measurement pass costs.

The FLOP proxy of a halting rule is ``r / a``: uniform depth r against the rule's average exit loop a,
counting only the core (prelude and coda run once). This module measures, on the same windows and in the
same process, what that becomes on the clock:

- :func:`matched_rules`: for each rule family (default :class:`~drc_core.halting.rules.KLThreshold` and
  :class:`~drc_core.halting.rules.StateDelta`), the lowest-average-depth point of its threshold grid
  (:func:`drc_core.halting.sweep.default_rules`) whose cross-entropy is within ``ce_tolerance`` of uniform depth r.
  The grid is swept offline (:func:`drc_core.halting.sweep.sweep`, one uniform pass for all thresholds,
  :func:`~drc_core.halting.sweep.summarize`, :func:`~drc_core.halting.sweep.matching_depth`); the chosen point is
  then run online with :func:`~drc_core.halting.skipping.skip_forward` (the path that is timed) and, should its
  CE miss the target there, the next stricter grid point is tried.
- :func:`time_batched`: ``model(x, r)`` (uniform depth r, one readout) against ``skip_forward`` with each
  matched rule, and against ``skip_forward`` with ``Uniform(r)`` (the skipping machinery's own overhead at
  equal depth), over the same windows with the same initial states.
- :func:`time_generation`: :func:`~drc_core.halting.generate.generate_fixed` (the KV-cached decoder at fixed depth
  r with no halting machinery) against :func:`~drc_core.halting.generate.generate` with ``Uniform(r)`` and with
  each matched rule: same prompts, same number of new tokens, greedy. Time per step = (time of n new tokens -
  time of 1) / (n - 1), so the prompt pass drops out; tokens/s = rows / time per step.
- honest FLOPs: every skipping run counts the work it did (:class:`~drc_core.halting.work.Work`),
  priced by :func:`drc_core.experiments.cost.honest_flops`; ``wall_over_honest`` beside ``wall_over_proxy``;
  :func:`speed_targets` checks the speed targets at matched quality, :func:`profile_batched` shows where the time goes,
  :func:`bf16_check` compares bf16 autocast with fp32, :func:`anderson_table` measures Anderson acceleration.
- :func:`measurement_cost`: :func:`drc_core.analysis.measure.measure_windows` at ``max_loops`` = 32 against one
  depth-32 forward and against a bare pass that reads out (log-softmax) at every loop.

Timing: every comparison runs its variants once untimed first (warm-up, and the quality numbers), then
``rounds`` interleaved rounds (the order rotates from round to round, as in ``bench/train_throughput.py``);
reported times are medians over rounds, so load on a shared machine slows all variants alike. Everything
runs under ``torch.inference_mode()`` in eval mode.

Why the clock falls short of the proxy (the cost model of :mod:`drc_core.halting.skipping`; ``block`` one transformer
block, ``core = R * block + adapter``, ``head = 2 d V``; :func:`drc_core.experiments.cost.matmul_flops_per_token`)::

    uniform depth r (forward)             (P + C) * block + r * core + head
    skip_forward, rule with log-probs     P * block + a * (core + C * block + head)   (+ a V-sized softmax per loop)
    skip_forward, rule without            P * block + a * core + C * block + head     (coda context ignored)

A rule that reads the output (KL, entropy, confidence) pays the coda and the vocabulary head at every loop
of every active token: with d = 128 and V = 4096 the head (2 d V) is about one whole core loop, so on a small
model such a rule's honest FLOPs stay close to uniform depth's even at a large proxy (at 3.4 loops ~9.6 M
against ~11.1 M per token on the reference model: at most ~1.15x). A rule on the states only (StateDelta)
pays the core per active token and one readout, so its FLOPs follow the proxy; what remains between them is
the fixed cost of the skipping machinery (the ``Uniform(r)`` row of :func:`time_batched` shows it at equal
depth).

Why "measurement pass <= 1.2 x one depth-32 forward" cannot hold: per-token, per-loop statistics need
every loop's output distribution, i.e. the coda, the head and a log-softmax at each of the 32 loops, while a
forward reads out once. The bare every-loop readout pass is the floor of any such measurement; the
measurement's own overhead is its time over that floor (:func:`measurement_cost` prints both ratios).
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import iterate_stats
from drc_core.analysis.measure import measure_windows
from drc_core.errors import DrcError, need_float, need_int
from drc_core.experiments.cost import (
    CLOCKS,
    Log,
    honest_flops,
    interleaved,
    keep_freed_memory,
    matmul_flops_per_token,
    median,
    page_faults,
    spread,
)
from drc_core.experiments.fixed_point import fixed_point_costs, seconds_per_eval
from drc_core.halting.anderson import PLAIN, AndersonConfig
from drc_core.halting.generate import generate, generate_fixed
from drc_core.halting.rules import HaltingRule, Uniform, huginn_presets
from drc_core.halting.skipping import skip_forward
from drc_core.halting.sweep import RuleSpec, default_families, default_rules, matching_depth, summarize, sweep
from drc_core.model.lm import DepthRecurrentLM, check_token_ids, iterate
from drc_core.model.passes import EVAL_STATE_SEED, eval_batches

__all__ = [
    "TARGET_HONEST",
    "TARGET_KL_BATCHED",
    "TARGET_OVERHEAD",
    "TARGET_RATIO",
    "Matched",
    "anderson_configs",
    "bf16_check",
    "anderson_table",
    "decode_loop_cost",
    "decode_prediction",
    "SpeedConfig",
    "SpeedReport",
    "matched_rules",
    "measurement_cost",
    "measurement_pass",
    "measurement_summary",
    "preset_specs",
    "profile_batched",
    "profile_generation",
    "run_speed",
    "skip_overhead",
    "speed_targets",
    "speedup_table",
    "targets_met",
    "time_batched",
    "time_generation",
]

TARGET_RATIO = 0.9  # wall-clock speedup >= 0.9 x the FLOP proxy at matched quality
TARGET_MEASURE = 1.2  # the measurement pass <= 1.2 x one depth-32 forward (the target as worded)


@dataclass(frozen=True)
class SpeedConfig:
    """What to measure and how (every field validated; a bad value is a one-line :class:`DrcError`).

    ``reference_loops`` r: the uniform depth to match and to beat. ``rule_max_loops``: every rule's
    ``max_loops``. ``families``: rule families of :func:`drc_core.halting.sweep.default_rules` to match.
    ``ce_tolerance``: "matched quality" is CE <= CE(uniform r) + this (nats). ``batch_size``: windows per
    batch (also fixes the initial states, as in :func:`drc_core.training.evaluate.loss_by_depth`). ``rounds``: timed,
    interleaved rounds. ``new_tokens``/``prompt_len``/``gen_rows``: generation of ``new_tokens`` greedy
    tokens after the first ``prompt_len`` tokens of ``gen_rows`` windows. ``measure_loops`` and
    ``measure_windows``: the measurement pass compared (on the first ``measure_windows`` windows).
    ``max_online_tries``: stricter grid points tried when the offline-matched one misses the target online.
    ``fused``: rules with log-probs compute their readout statistics with the compiled kernel
    (:func:`drc_core.halting.loopstats.fused_stats_kernel`; needs a C++ compiler). ``clock``: "wall" or "cpu"
    (:func:`drc_core.experiments.cost.interleaved`). ``more_gen_rows``: further batch sizes for generation
    (e.g. (8,)). ``presets``: also time Huginn's presets in batched evaluation. ``profile``: also profile one
    batch (:func:`profile_batched`). ``keep_freed``: before timing, make glibc keep freed memory for reuse
    (:func:`drc_core.experiments.cost.keep_freed_memory`, for the whole process), so that no variant pays page
    faults on fresh buffers by the luck of its allocation order.
    """

    reference_loops: int = 8
    rule_max_loops: int = 16
    families: tuple[str, ...] = ("kl", "state_delta")
    ce_tolerance: float = 0.005
    batch_size: int = 16
    rounds: int = 3
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
        if self.clock not in CLOCKS:
            raise DrcError(f"clock={self.clock!r} is invalid: use one of {', '.join(CLOCKS)}")
        known = default_families()
        if not self.families or any(f not in known for f in self.families):
            raise DrcError(f"families={list(self.families)!r} is invalid: choose from {', '.join(known)}")


# ----------------------------------------------------------------------------------------------------------
# Cost model and timing helpers


def _memory(cfg: SpeedConfig) -> None:
    """Before timing: the allocator setting ``cfg.keep_freed`` asks for."""
    if cfg.keep_freed:
        keep_freed_memory()


def _skip_path(rule: HaltingRule) -> str:
    return "skip_log_probs" if rule.needs_log_probs else "skip_states"


def _on_device(model: DepthRecurrentLM, ids: object, what: str = "windows", targets: bool = True) -> Tensor:
    """:func:`drc_core.model.lm.check_token_ids`, then moved to the model's device."""
    return check_token_ids(model, ids, what, targets=targets).to(next(model.parameters()).device)


def _batches(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(inputs, targets, s_0) per batch; s_0 drawn exactly as :func:`drc_core.halting.sweep.sweep` and
    :func:`drc_core.training.evaluate.loss_by_depth` draw it for the same ``seed`` and ``batch_size``."""
    return [(b.x, b.y, b.initial_state(model)) for b in eval_batches(model, windows, cfg.batch_size, cfg.seed)]


def _ce_sum(logits: Tensor, y: Tensor) -> float:
    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"))


# ----------------------------------------------------------------------------------------------------------
# Matched quality


@dataclass
class Matched:
    """What :func:`matched_rules` returns: ``specs`` (the chosen :class:`~drc_core.halting.sweep.RuleSpec` per matched
    family), ``table`` (one row per family: the chosen point offline and online, or why none) and ``grid``
    (the offline summary of every grid point, ``chosen`` marks the picks)."""

    specs: list[RuleSpec]
    table: pd.DataFrame
    grid: pd.DataFrame


def _online(model: DepthRecurrentLM, batches: list[tuple[Tensor, Tensor, Tensor]], rule: HaltingRule,
            fused: bool = False) -> tuple[float, float]:
    """(average exit loop, mean CE) of ``skip_forward`` with ``rule`` over the batches."""
    loops = ce = 0.0
    n = 0
    for x, y, s0 in batches:
        res = skip_forward(model, x, rule, state=s0, fused=fused)
        loops += float(res.exit_loop.double().sum())
        ce += _ce_sum(res.logits, y)
        n += x.numel()
    return loops / n, ce / n


def matched_rules(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
                  log: Log = None) -> Matched:
    """Each family's lowest-average-depth grid point with CE <= CE(uniform r) + ``ce_tolerance`` on ``windows``.

    Offline sweep of the family grids of :func:`drc_core.halting.sweep.default_rules` (``rule_max_loops``), then
    :func:`~drc_core.halting.sweep.matching_depth` on its :func:`~drc_core.halting.sweep.summarize`; the pick is checked
    online with :func:`~drc_core.halting.skipping.skip_forward` (same initial states) and, if its CE misses the
    target there, up to ``max_online_tries - 1`` stricter grid points are tried. A family whose grid has no point
    within the target offline (``matched_offline`` False) falls back to its lowest-CE point, so that it is still timed;
    ``within_tolerance`` says whether the chosen point meets the target online, ``note`` why not.
    """
    cfg = cfg or SpeedConfig()
    windows = _on_device(model, windows)
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
        batches = _batches(model, windows, cfg)
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
                loops, ce = _online(model, batches, spec.rule, cfg.fused)
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


# ----------------------------------------------------------------------------------------------------------
# Batched evaluation


def _specs(rules: Sequence[RuleSpec | HaltingRule], r: int) -> list[RuleSpec]:
    """Rules as :class:`RuleSpec` (a bare rule: family = its class name, param NaN), distinct by name and
    distinct from the baselines."""
    specs = [s if isinstance(s, RuleSpec) else RuleSpec(type(s).__name__, math.nan, s) for s in rules]
    for spec in specs:
        if not isinstance(spec.rule, HaltingRule):
            raise DrcError(f"rules must be HaltingRule or RuleSpec instances; got {spec.rule!r}")
    names = [str(spec.rule) for spec in specs]
    if len(set(names)) != len(names) or f"uniform={r}" in names:
        raise DrcError(f"rules {names} repeat a rule or the baseline uniform={r}: pass each rule once")
    return specs


def _speed_columns(row: dict, base_seconds: float, r: int, base_flops: float, flops: float) -> dict:
    row["proxy_speedup"] = r / row["avg_loops"]
    row["flop_speedup"] = base_flops / flops
    row["wallclock_speedup"] = base_seconds / row["seconds"]
    row["wall_over_proxy"] = row["wallclock_speedup"] / row["proxy_speedup"]
    if "honest_flops" in row:
        row["honest_speedup"] = base_flops / row["honest_flops"]
        row["wall_over_honest"] = row["wallclock_speedup"] / row["honest_speedup"]
    return row


def time_batched(model: DepthRecurrentLM, windows: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                 cfg: SpeedConfig | None = None, *, log: Log = None) -> pd.DataFrame:
    """Wall-clock of uniform depth r (``model(x, r)``) against ``skip_forward`` with each rule, same windows.

    One row per variant: the baseline (``path`` "forward"), ``Uniform(r)`` through ``skip_forward`` (the
    skipping machinery at equal depth) and every rule. Columns: ``setting`` ("batched eval"), ``family``,
    ``param``, ``rule``, ``path``, ``baseline``, ``needs_log_probs``, ``avg_loops`` (mean exit loop), ``ce``
    (mean next-token CE of exactly the timed outputs), ``ce_uniform``, ``ce_gap``, ``within_tolerance``,
    ``seconds`` (median over rounds for all windows), ``spread``, ``page_faults_per_batch`` (minor page faults,
    median over rounds), ``tokens_per_s``, ``proxy_speedup`` (r /
    avg_loops), ``flop_speedup`` (:func:`~drc_core.experiments.cost.matmul_flops_per_token` ratio),
    ``wallclock_speedup`` and ``wall_over_proxy`` (target: >= 0.9), ``honest_flops`` (per token:
    :func:`~drc_core.experiments.cost.honest_flops` of the work the run really did; the forward's
    ``flops_per_token(r, T)``), ``honest_speedup`` and ``wall_over_honest`` (target: >= 0.9).
    """
    cfg = cfg or SpeedConfig()
    _memory(cfg)
    windows = _on_device(model, windows)
    r = cfg.reference_loops
    specs = _specs(rules, r)
    t_len = windows.shape[1] - 1
    variants: list[tuple[dict, Callable[[Tensor, Tensor], Tensor]]] = [
        ({"family": "uniform", "param": float(r), "rule": f"uniform={r}", "path": "forward", "baseline": True,
          "needs_log_probs": False}, lambda x, s: model(x, r, state=s)),
        ({"family": "uniform", "param": float(r), "rule": f"uniform={r} via skip_forward", "path": "skip_states",
          "baseline": False, "needs_log_probs": False},
         lambda x, s: skip_forward(model, x, Uniform(r), state=s, fused=cfg.fused)),
    ]
    for spec in specs:
        variants.append(({"family": spec.family, "param": float(spec.param), "rule": str(spec.rule),
                          "path": _skip_path(spec.rule), "baseline": False,
                          "needs_log_probs": spec.rule.needs_log_probs},
                         lambda x, s, rule=spec.rule: skip_forward(model, x, rule, state=s, fused=cfg.fused)))
    with torch.inference_mode():
        model.eval()
        batches = _batches(model, windows, cfg)
        n_tok = sum(x.numel() for x, _, _ in batches)
        rows = []
        for info, fn in variants:  # untimed pass: warm-up and the quality of exactly what is timed
            loops = ce = flops = 0.0
            for x, y, s0 in batches:
                out = fn(x, s0)
                logits = out if isinstance(out, Tensor) else out.logits
                loops += r * x.numel() if isinstance(out, Tensor) else float(out.exit_loop.double().sum())
                flops += (model.flops_per_token(r, t_len) * x.numel() if isinstance(out, Tensor)
                          else honest_flops(model, out.work, t_len))
                ce += _ce_sum(logits, y)
                del out, logits
            rows.append({"setting": "batched eval", **info, "avg_loops": loops / n_tok, "ce": ce / n_tok,
                         "honest_flops": flops / n_tok})

        faults: dict[str, list[int]] = {info["rule"]: [] for info, _ in variants}

        def run(name: str, fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[], None]:
            def go() -> None:
                before = page_faults()
                for x, _, s0 in batches:
                    fn(x, s0)
                faults[name].append(page_faults() - before)
            return go

        times = interleaved({info["rule"]: run(info["rule"], fn) for info, fn in variants}, cfg.rounds, log,
                            "batched eval", cfg.clock)
    base = rows[0]
    base_s = median(times[base["rule"]])
    base_flops = matmul_flops_per_token(model, r, t_len, "forward")
    for row in rows:
        row["ce_uniform"] = base["ce"]
        row["ce_gap"] = row["ce"] - base["ce"]
        row["within_tolerance"] = row["ce_gap"] <= cfg.ce_tolerance
        row["seconds"] = median(times[row["rule"]])
        row["spread"] = spread(times[row["rule"]])
        row["page_faults_per_batch"] = median(faults[row["rule"]]) / len(batches)
        row["tokens_per_s"] = n_tok / row["seconds"]
        _speed_columns(row, base_s, r, base_flops, matmul_flops_per_token(model, row["avg_loops"], t_len, row["path"]))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# Generation


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


def _decode_setup(model: DepthRecurrentLM, prompt: object, cfg: SpeedConfig) -> tuple[Tensor, Tensor]:
    """The prompt (B, T0) on the model's device, checked against ``max_seq_len`` with ``new_tokens`` more, and
    the initial states (B, T0 + n, d) every generation comparison starts from (seeded by ``cfg.seed``)."""
    prompt = _on_device(model, prompt, "prompt", targets=False)
    B, t0 = prompt.shape
    n = cfg.new_tokens
    if t0 + n > model.cfg.max_seq_len:
        raise DrcError(f"prompt length {t0} + new_tokens {n} exceeds max_seq_len={model.cfg.max_seq_len}: "
                       "shorten the prompt or generate fewer tokens")
    with torch.inference_mode():
        gen = torch.Generator(device=prompt.device).manual_seed(cfg.seed)
        s0 = model.initial_state(torch.zeros(B, t0 + n, model.cfg.d_model, device=prompt.device), gen)
    return prompt, s0


def time_generation(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                    cfg: SpeedConfig | None = None, *, log: Log = None) -> pd.DataFrame:
    """Time per new token of greedy :func:`~drc_core.halting.generate.generate` with ``Uniform(r)`` against each rule.

    Same prompt (B, T0), same ``new_tokens`` n, same initial states. The baseline (``path`` "dense decode") is
    :func:`~drc_core.halting.generate.generate_fixed` at depth r, the KV-cached decoder with no halting machinery;
    then ``generate`` with ``Uniform(r)`` (the machinery's own overhead at equal depth) and with each rule. Time
    per new token = (median time of n new tokens - median time of 1) / (n - 1): the decode steps alone (should
    noise make that <= 0, the median time of n tokens / n). One row per variant; columns as in
    :func:`time_batched` (``setting`` "generation", ``path`` "generate"), with ``avg_loops`` the mean exit loop
    of the n positions whose outputs chose the new tokens, ``ms_per_token``, ``tokens_per_s`` (B new tokens per
    step), ``rows`` (B), ``prompt_ms`` (the prompt pass plus the first token), ``same_tokens`` (fraction of new
    tokens equal to the dense decoder's, position by position), ``first_divergence`` (index of the first new
    token that differs; n if none; mean over rows), ``loops_run`` (loops a decode step runs: the mean over the n
    positions of the deepest exit among the B rows; ``avg_loops`` when B = 1) and no CE. ``honest_flops`` is
    per new token (the work of n new tokens minus that of 1, over n - 1, per row); ``flop_speedup`` uses a
    context of T0 + n tokens.
    """
    cfg = cfg or SpeedConfig()
    _memory(cfg)
    prompt, s0 = _decode_setup(model, prompt, cfg)
    B, t0 = prompt.shape
    n, r = cfg.new_tokens, cfg.reference_loops
    specs = [RuleSpec("uniform", float(r), Uniform(r)), *_specs(rules, r)]
    dense = f"uniform={r} dense decode"
    with torch.inference_mode():
        model.eval()
        dense_tokens = generate_fixed(model, prompt, n, r, state=s0)[:, t0:]
        generate_fixed(model, prompt, 1, r, state=s0[:, : t0 + 1])
        rows = [{"setting": "generation", "family": "uniform", "param": float(r), "rule": dense,
                 "path": "dense decode", "baseline": True, "needs_log_probs": False, "avg_loops": float(r),
                 "same_tokens": 1.0, "first_divergence": float(n), "loops_run": float(r),
                 "honest_flops": float(model.flops_per_token(r, t0 + n))}]
        variants = {f"{dense} [n]": lambda: generate_fixed(model, prompt, n, r, state=s0),
                    f"{dense} [1]": lambda: generate_fixed(model, prompt, 1, r, state=s0[:, : t0 + 1])}
        for spec in specs:  # untimed: warm-up, exit loops and tokens
            res = generate(model, prompt, n, spec.rule, state=s0, fused=cfg.fused)
            one = generate(model, prompt, 1, spec.rule, state=s0[:, : t0 + 1], fused=cfg.fused)
            work = honest_flops(model, res.work, t0 + n) - honest_flops(model, one.work, t0 + n)
            rows.append({"setting": "generation", "family": spec.family, "param": float(spec.param),
                         "rule": str(spec.rule), "path": "generate", "baseline": False,
                         "needs_log_probs": spec.rule.needs_log_probs, "avg_loops": res.new_avg_depth,
                         "same_tokens": float((res.new_tokens == dense_tokens).double().mean()),
                         "first_divergence": _first_divergence(res.new_tokens, dense_tokens),
                         "loops_run": _loops_run(res.exit_loop[:, t0 - 1 :]),
                         "honest_flops": work / (B * (n - 1))})
            name = str(spec.rule)
            variants[f"{name} [n]"] = lambda rule=spec.rule: generate(model, prompt, n, rule, state=s0,
                                                                      fused=cfg.fused)
            variants[f"{name} [1]"] = lambda rule=spec.rule: generate(model, prompt, 1, rule, state=s0[:, : t0 + 1],
                                                                      fused=cfg.fused)
        times = interleaved(variants, cfg.rounds, log, "generation", cfg.clock)
    for row in rows:
        full, first = times[f"{row['rule']} [n]"], times[f"{row['rule']} [1]"]
        row["seconds"] = _step_seconds(full, first, n)
        row["ms_per_token"] = 1e3 * row["seconds"]
        row["tokens_per_s"] = B / row["seconds"]
        row["rows"] = B
        row["prompt_ms"] = 1e3 * median(first)
        row["spread"] = spread(full)
    base = rows[0]
    base_flops = matmul_flops_per_token(model, r, t0 + n, "forward")
    for row, spec in zip(rows, [None, *specs], strict=True):
        path = "forward" if spec is None else _skip_path(spec.rule)
        _speed_columns(row, base["seconds"], r, base_flops, matmul_flops_per_token(model, row["avg_loops"], t0 + n,
                                                                                    path))
    return pd.DataFrame(rows)


def decode_loop_cost(model: DepthRecurrentLM, prompt: Tensor, cfg: SpeedConfig | None = None, *,
                     rows: Sequence[int] = (1, 2, 4, 8, 16), log: Log = None) -> pd.DataFrame:
    """What one core loop of a decode step costs with B rows active, for each B of ``rows`` (the first B
    prompts of ``prompt``): the decode step of :func:`~drc_core.halting.generate.generate_fixed` at depth r and
    at depth 1 (each as in :func:`time_generation`: time of n new tokens - time of 1, over n - 1), and per loop
    ``loop_ms`` = (step at r - step at 1) / (r - 1), all in one interleaved timing.

    One row per B: ``rows``, ``step_ms`` (depth r), ``loop_ms``, ``loop_ms_per_row``, ``fixed_ms`` and
    ``per_row_ms`` (the least-squares line loop_ms = fixed + per_row * B over all B, same on every row) and
    ``fixed_share`` (fixed_ms / loop_ms: the part of a loop that does not shrink when rows exit). A loop over a
    few rows is latency-bound (one pass over the weights, ~40 small ops), not FLOP-bound: see
    :func:`decode_prediction`."""
    cfg = cfg or SpeedConfig()
    _memory(cfg)
    n, r = cfg.new_tokens, cfg.reference_loops
    if r < 2 or n < 2:
        raise DrcError(f"decode_loop_cost needs reference_loops >= 2 and new_tokens >= 2 (got {r}, {n}): raise them")
    if max(rows) > len(prompt) or min(rows) < 1:
        raise DrcError(f"rows {list(rows)} must lie in 1..{len(prompt)} (the prompts given): pass more prompts")
    prompt, s0 = _decode_setup(model, prompt[: max(rows)], cfg)
    variants: dict[str, Callable[[], object]] = {}
    with torch.inference_mode():
        model.eval()
        for b, depth, new in itertools.product(rows, (1, r), (1, n)):
            def call(b: int = b, depth: int = depth, new: int = new) -> Tensor:
                return generate_fixed(model, prompt[:b], new, depth, state=s0[:b, : prompt.shape[1] + new])
            call()  # warm-up
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
    """The core-loop speed-up each rule of a :func:`time_generation` frame can expect at the decode loop cost
    measured by :func:`decode_loop_cost` (loop = ``fixed_ms`` + ``per_row_ms`` x active rows), beside its
    honest-FLOP and measured speed-ups.

    A decode step of B rows with uniform depth r costs r (f + p B); with a rule, loop l costs f + p (rows still
    active at l), so a step costs f x (deepest exit among its rows) + p x (sum of the rows' exits): on average
    f ``loops_run`` + p B ``avg_loops``. ``loop_cost_speedup`` = r (f + p B) / (f loops_run + p B avg_loops):
    r / avg_loops (the proxy) when p dominates, r / loops_run when f does. It counts core loops only: the
    readouts a rule performs per loop (KL, entropy, ...) come on top, so for those rules it is an upper bound.
    One row per (rows, rule) of the frame's rules (baselines and ``Uniform(r)`` left out)."""
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


# ----------------------------------------------------------------------------------------------------------
# The measurement pass


def measurement_cost(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
                     log: Log = None) -> pd.DataFrame:
    """Wall-clock of the per-token, per-loop measurement pass against one forward at the same depth.

    On the first ``measure_windows`` windows, L = ``measure_loops``: ``forward`` (``model(x, L)``, one
    readout), ``readout every loop`` (``iterate(model, x, L, readout="log_probs")``: coda, head and
    log-softmax at each loop, the floor of any per-loop statistic), and
    :func:`drc_core.analysis.measure.measure_windows` with ``kl_to_final`` False and True (the latter is what
    notebook 2 runs). Columns: ``pass``, ``seconds``
    (median), ``spread``, ``x_forward`` (time / forward's), ``x_readout_pass`` (time / the readout pass's),
    ``target_as_worded`` (``x_forward`` <= 1.2).
    """
    cfg = cfg or SpeedConfig()
    _memory(cfg)
    windows = _on_device(model, windows)[: cfg.measure_windows]
    L, bs = cfg.measure_loops, cfg.batch_size

    batches, one = _batches(model, windows, cfg), _batches(model, windows[:1], cfg)

    def forward(w: Tensor, b: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        for x, _, s0 in b:
            model(x, L, state=s0)

    def readout(w: Tensor, b: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        for x, _, s0 in b:
            for _ in iterate(model, x, L, state=s0, readout="log_probs"):
                pass

    def measure(kl_to_final: bool) -> Callable[[Tensor, list], object]:
        return lambda w, b: measure_windows(model, w, L, batch_size=bs, seed=cfg.seed, kl_to_final=kl_to_final)

    names = _pass_names(L)
    passes: dict[str, Callable[[Tensor, list], object]] = {
        names["forward"]: forward,
        names["readout"]: readout,
        names["measure"]: measure(False),
        names["measure_kl_final"]: measure(True),
    }
    with torch.inference_mode():
        model.eval()
        for fn in passes.values():  # warm-up on one window
            fn(windows[:1], one)
        times = interleaved({k: (lambda fn=fn: fn(windows, batches)) for k, fn in passes.items()}, cfg.rounds,
                             log, "measurement")
    med = {k: median(v) for k, v in times.items()}
    fwd, ro = med[names["forward"]], med[names["readout"]]
    rows = [{"pass": k, "loops": L, "windows": len(windows), "seconds": med[k], "spread": spread(times[k]),
             "x_forward": med[k] / fwd, "x_readout_pass": med[k] / ro,
             "target_as_worded": med[k] / fwd <= TARGET_MEASURE} for k in passes]
    return pd.DataFrame(rows)


def _pass_names(loops: int) -> dict[str, str]:
    """The ``pass`` labels of :func:`measurement_cost`'s rows at ``loops`` loops."""
    return {"forward": f"forward, depth {loops}", "readout": f"readout every loop, {loops} loops",
            "measure": "measure_windows (kl_to_final=False)", "measure_kl_final": "measure_windows (kl_to_final=True)"}


def measurement_pass(measurement: pd.DataFrame, kind: str) -> pd.Series:
    """The row of one pass of a :func:`measurement_cost` frame: ``kind`` is "forward", "readout" (every loop),
    "measure" or "measure_kl_final" (:func:`~drc_core.analysis.measure.measure_windows` without / with the
    deepest-output KL, what notebook 2 runs)."""
    names = _pass_names(int(measurement.loops.iloc[0]))
    if kind not in names:
        raise DrcError(f"kind={kind!r} is not a measurement pass; use one of {', '.join(names)}")
    return measurement[measurement["pass"] == names[kind]].iloc[0]


def measurement_summary(measurement: pd.DataFrame) -> dict[str, float]:
    """The measurement pass (with the deepest-output KL) against one forward and against the bare every-loop
    readout pass, and that readout pass against one forward."""
    full, floor = measurement_pass(measurement, "measure_kl_final"), measurement_pass(measurement, "readout")
    return {"measurement_x_forward": float(full.x_forward), "measurement_x_readout_pass": float(full.x_readout_pass),
            "readout_pass_x_forward": float(floor.x_forward)}


def skip_overhead(batched: pd.DataFrame) -> float:
    """The wall-clock speedup of ``skip_forward`` with ``Uniform(r)`` over the dense forward (:func:`time_batched`):
    the fixed cost of the skipping machinery at equal depth (< 1 is a slowdown)."""
    row = batched[(batched.family == "uniform") & ~batched.baseline]
    if row.empty:
        raise DrcError("the batched frame has no skip_forward Uniform(r) row: pass the frame of time_batched")
    return float(row.wallclock_speedup.iloc[0])


def targets_met(*frames: pd.DataFrame) -> dict[str, bool]:
    """Per matched rule of :func:`time_batched` / :func:`time_generation` frames (``"<setting>: <rule>"``):
    whether its wall-clock speedup reaches ``TARGET_RATIO`` x its FLOP proxy."""
    rules = pd.concat(frames)
    rules = rules[rules.family != "uniform"]
    return {f"{r.setting}: {r.rule}": bool(r.wall_over_proxy >= TARGET_RATIO) for r in rules.itertuples()}


TARGET_OVERHEAD = 1.05  # the skipping path at equal depth <= 1.05 x the dense forward / decoder
TARGET_HONEST = 0.9  # wall-clock speedup >= 0.9 x the honest-FLOP speedup, every rule
TARGET_KL_BATCHED = 1.5  # the KL rule >= 1.5 x faster than uniform depth r in batched evaluation


def speed_targets(*frames: pd.DataFrame) -> pd.DataFrame:
    """The speed targets at matched quality, one row per (frame, rule, target) of :func:`time_batched` /
    :func:`time_generation` frames: ``setting`` (generation labelled with its batch size), ``rule``, ``target``,
    ``value``, ``threshold``, ``met``, ``ceiling`` and ``reachable``. Targets: the skipping path at equal depth
    (``Uniform(r)`` row) takes <= 1.05 x the dense time; every rule is faster than uniform depth r (wall-clock
    speedup > 1) and reaches >= 0.9 x its honest-FLOP speedup; the state-change rule >= 0.9 x its FLOP proxy; the
    KL rule >= 1.5 x in batched evaluation.

    ``ceiling`` is the value the target's quantity would take if the wall clock followed the rule's honest FLOPs
    exactly (wall / honest = 1, the best any implementation of the same work can do): the honest-FLOP speedup for
    the speed-up targets, honest / proxy for wall / proxy, 1.0 for the overhead and wall / honest targets.
    ``reachable`` says whether the ceiling meets the threshold: a target that is not ``met`` but ``reachable`` is
    bound by the implementation, one that is not ``reachable`` by the work the rule itself asks for (its readout,
    the prelude / coda / head that do not shrink with depth)."""
    rows = []

    def add(setting: str, rule: str, target: str, value: float, threshold: float,
            ok: Callable[[float, float], bool], ceiling: float = 1.0) -> None:
        """``ok(x, threshold)`` is the target's comparison, applied to the measured value and to the ceiling."""
        rows.append({"setting": setting, "rule": rule, "target": target, "value": float(value),
                     "threshold": threshold, "met": bool(ok(value, threshold)), "ceiling": float(ceiling),
                     "reachable": bool(ok(ceiling, threshold))})

    for frame in frames:
        for r in frame[~frame.baseline].itertuples():
            setting = r.setting if r.setting != "generation" else f"generation, batch {int(r.rows)}"
            if r.family == "uniform":
                add(setting, r.rule, "time / dense time at equal depth <= 1.05", 1 / r.wallclock_speedup,
                    TARGET_OVERHEAD, operator.le)
                continue
            add(setting, r.rule, "faster than uniform depth (wall-clock speedup > 1)", r.wallclock_speedup, 1.0,
                operator.gt, r.honest_speedup)
            add(setting, r.rule, "wall / honest FLOPs >= 0.9", r.wall_over_honest, TARGET_HONEST, operator.ge)
            if r.family == "state_delta":
                add(setting, r.rule, "wall / proxy >= 0.9", r.wall_over_proxy, TARGET_RATIO, operator.ge,
                    r.honest_speedup / r.proxy_speedup)
            if r.family == "kl" and r.setting == "batched eval":
                add(setting, r.rule, "wall-clock speedup >= 1.5", r.wallclock_speedup, TARGET_KL_BATCHED,
                    operator.ge, r.honest_speedup)
    return pd.DataFrame(rows)


def preset_specs(cfg: SpeedConfig, taken: Sequence[RuleSpec] = ()) -> list[RuleSpec]:
    """Huginn's exit criteria at its default thresholds (:func:`drc_core.halting.rules.huginn_presets`, at
    ``rule_max_loops``) as :class:`RuleSpec` (family "huginn", param NaN), leaving out any that is already one of
    ``taken`` (same rule name)."""
    names = {str(t.rule) for t in taken}
    return [RuleSpec("huginn", math.nan, rule) for rule in huginn_presets(cfg.rule_max_loops).values()
            if str(rule) not in names]


_OP_KINDS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),
             ("attention", ("aten::_scaled_dot_product",)),
             ("readout statistics", ("aten::_softmax", "aten::_log_softmax", "aten::amax", "aten::argmax",
                                     "aten::linalg_vecdot", "CompiledFxGraph", "aten::exp", "aten::log")),
             ("gather / scatter", ("aten::index", "aten::_index_put", "aten::index_copy", "aten::index_select",
                                   "aten::nonzero", "aten::scatter", "aten::masked_fill", "aten::bincount")))


def _op_kind(name: str) -> str:
    for kind, prefixes in _OP_KINDS:
        if any(p in name for p in prefixes):
            return kind
    return "other (norms, RoPE, MLP activation, adds, copies)"


@contextmanager
def _quiet_fd2() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block: torch's C++ profiler writes a ``USDT: ... profiler_start`` /
    ``profiler_stop`` line there around every profile, which would land in a notebook's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _profile(variants: dict[str, Callable[[], object]], top: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``torch.profiler`` over one call of each variant (after an untimed warm-up call): ``(kinds, ops)`` as
    described in :func:`profile_batched`."""
    from torch.profiler import ProfilerActivity, profile

    kinds, ops = [], []
    for name, fn in variants.items():
        fn()
        with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events) / 1e3
        by_kind: dict[str, list[float]] = {}
        for e in events:
            acc = by_kind.setdefault(_op_kind(e.key), [0.0, 0.0])
            acc[0] += e.self_cpu_time_total / 1e3
            acc[1] += e.count
        for kind, (ms, calls) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
            kinds.append({"variant": name, "kind": kind, "ms": ms, "calls": int(calls), "share": ms / total})
        kinds.append({"variant": name, "kind": "total", "ms": total,
                      "calls": int(sum(e.count for e in events)), "share": 1.0})
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
            ops.append({"variant": name, "op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count,
                        "share": e.self_cpu_time_total / 1e3 / total})
    return pd.DataFrame(kinds), pd.DataFrame(ops)


def profile_batched(model: DepthRecurrentLM, windows: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                    cfg: SpeedConfig | None = None, *, top: int = 8) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Where the time goes: ``torch.profiler`` over one batch (the first ``batch_size`` windows) of the dense
    forward at depth r, ``skip_forward`` with ``Uniform(r)`` and with each rule (one untimed warm-up call each).

    Returns ``(kinds, ops)``: ``kinds`` one row per (variant, kind of op: matmul, attention, readout statistics,
    gather/scatter, other) with ``ms`` (self CPU time), ``calls`` and ``share``, plus a ``total`` row; ``ops`` the
    ``top`` ops of each variant by self CPU time (``op``, ``ms``, ``calls``, ``share``)."""
    cfg = cfg or SpeedConfig()
    _memory(cfg)
    windows = _on_device(model, windows)
    r = cfg.reference_loops
    x, _, s0 = _batches(model, windows[: cfg.batch_size], cfg)[0]
    variants: dict[str, Callable[[], object]] = {
        f"uniform={r}": lambda: model(x, r, state=s0),
        f"uniform={r} via skip_forward": lambda: skip_forward(model, x, Uniform(r), state=s0, fused=cfg.fused)}
    for spec in _specs(rules, r):
        variants[str(spec.rule)] = lambda rule=spec.rule: skip_forward(model, x, rule, state=s0, fused=cfg.fused)
    with torch.inference_mode():
        model.eval()
        return _profile(variants, top)


def profile_generation(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                       cfg: SpeedConfig | None = None, *, top: int = 8) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Where the time of generation goes: ``torch.profiler`` over ``new_tokens`` greedy tokens after ``prompt``
    (B, T0) with :func:`~drc_core.halting.generate.generate_fixed` at depth r (variant "uniform=r dense
    decode"), ``generate`` with ``Uniform(r)`` and with each rule; same initial states as
    :func:`time_generation`. Returns ``(kinds, ops)`` as :func:`profile_batched` does."""
    cfg = cfg or SpeedConfig()
    _memory(cfg)
    prompt, s0 = _decode_setup(model, prompt, cfg)
    n, r = cfg.new_tokens, cfg.reference_loops
    with torch.inference_mode():
        model.eval()
        variants: dict[str, Callable[[], object]] = {
            f"uniform={r} dense decode": lambda: generate_fixed(model, prompt, n, r, state=s0)}
        for spec in [RuleSpec("uniform", float(r), Uniform(r)), *_specs(rules, r)]:
            variants[str(spec.rule)] = lambda rule=spec.rule: generate(model, prompt, n, rule, state=s0,
                                                                       fused=cfg.fused)
        return _profile(variants, top)


def bf16_check(model: DepthRecurrentLM, windows: Tensor, rules: Sequence[RuleSpec | HaltingRule],
               cfg: SpeedConfig | None = None, *, log: Log = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The dense forward at depth r and ``skip_forward`` with each rule, in fp32 and under bf16 autocast
    (``torch.autocast(device, bfloat16)``; fast where :func:`drc_core.model.precision.bf16_support` says so), same
    windows and initial states.

    Returns ``(variants, kl)``. ``variants``: one row per (rule, precision) with ``avg_loops``, ``ce``,
    ``same_exit`` (share of tokens whose exit loop equals fp32's), ``seconds`` (median of interleaved rounds)
    and ``x_fp32_time``. ``kl``: per loop 2..r the median and 90th percentile over tokens of
    |KL_bf16 - KL_fp32| / KL_fp32 of the successive KL (:func:`drc_core.analysis.loops.iterate_stats` on the
    first batch), and the fp32 median KL: the precision check that the rule's statistic stays within noise."""
    cfg = cfg or SpeedConfig()
    _memory(cfg)
    windows = _on_device(model, windows)
    r = cfg.reference_loops
    device = windows.device
    specs = _specs(rules, r)

    def under(bf16: bool, fn: Callable[[], object]) -> Callable[[], object]:
        def go() -> object:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                return fn()
        return go

    rows, variants = [], {}
    with torch.inference_mode():
        model.eval()
        batches = _batches(model, windows, cfg)
        n_tok = sum(x.numel() for x, _, _ in batches)
        base_exits: dict[str, list[Tensor]] = {}
        for name, make in [(f"uniform={r}", None), *((str(sp.rule), sp.rule) for sp in specs)]:
            for bf16 in (False, True):
                def run(rule: HaltingRule | None = make) -> list:
                    return [model(x, r, state=s0) if rule is None else skip_forward(model, x, rule, state=s0,
                                                                                       fused=cfg.fused)
                            for x, _, s0 in batches]
                outs = under(bf16, run)()
                ce = sum(_ce_sum(o if isinstance(o, Tensor) else o.logits, y)
                         for o, (_, y, _) in zip(outs, batches, strict=True)) / n_tok
                exits = [torch.full(x.shape, r) if isinstance(o, Tensor) else o.exit_loop
                         for o, (x, _, _) in zip(outs, batches, strict=True)]
                if not bf16:
                    base_exits[name] = exits
                same = sum(float((a == b).double().sum()) for a, b in zip(exits, base_exits[name], strict=True))
                label = f"{name} [{'bf16' if bf16 else 'fp32'}]"
                rows.append({"rule": name, "precision": "bf16" if bf16 else "fp32",
                             "avg_loops": sum(float(e.double().sum()) for e in exits) / n_tok, "ce": ce,
                             "same_exit": same / n_tok, "label": label})
                variants[label] = under(bf16, run)
                del outs
        times = interleaved(variants, cfg.rounds, log, "bf16 check", cfg.clock)
        x, _, s0 = batches[0]
        fp32 = [st.kl for st in iterate_stats(model, x, r, state=s0)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            low = [st.kl for st in iterate_stats(model, x, r, state=s0)]
    frame = pd.DataFrame(rows)
    frame["seconds"] = [median(times[label]) for label in frame.label]
    frame["x_fp32_time"] = frame.seconds / frame.groupby("rule").seconds.transform("first")
    kl_rows = []
    for loop in range(2, r + 1):
        a, b = fp32[loop - 1].flatten().double(), low[loop - 1].flatten().double()
        rel = ((b - a).abs() / a.clamp_min(1e-12))
        kl_rows.append({"loop": loop, "kl_fp32_median": float(a.median()), "rel_diff_median": float(rel.median()),
                        "rel_diff_p90": float(rel.quantile(0.9))})
    return frame.drop(columns="label"), pd.DataFrame(kl_rows)


def anderson_configs(ms: Sequence[int] = (2, 3, 5), beta: float = 0.7, scope: str = "sequence",
                     damped: Sequence[float] = (0.85,)) -> dict[str, AndersonConfig]:
    """Plain iteration, damped plain iteration ``x' = b f(x) + (1 - b) x`` for each ``b`` in ``damped`` (same
    fixed points as f, one evaluation per step and no mixing; it turns a period-2 oscillation into a contraction)
    and Anderson acceleration with each window ``m`` (damping ``beta``, ``scope``), by label; plain first."""
    configs = [PLAIN, *(AndersonConfig(m=0, beta=b) for b in damped),
               *(AndersonConfig(m=m, beta=beta, scope=scope) for m in ms)]
    return {c.label: c for c in configs}


def anderson_table(model: DepthRecurrentLM, windows: Tensor, configs: dict[str, AndersonConfig], *,
                   max_evals: int = 16, ref_loops: int = 32, at_evals: int = 8, batch_size: int = 16,
                   time_rounds: int = 3) -> pd.DataFrame:
    """One row per config: mean core evaluations per token until the successive KL stays below 1e-3 and 1e-5
    (:func:`drc_core.experiments.fixed_point.fixed_point_costs`, ``max_evals`` evaluations, reference: plain
    iteration at ``ref_loops``), CE and KL to the reference after ``at_evals`` evaluations, the mean successive KL
    at the last evaluation (``kl_prev_at_<max_evals>``: the KL floor, e.g. for the reference model's fixed-point
    target at 2R), and seconds per core evaluation on the first batch
    (:func:`~drc_core.experiments.fixed_point.seconds_per_eval`, no readout).
    ``at_evals`` must not exceed ``max_evals``."""
    if not 1 <= at_evals <= max_evals:
        raise DrcError(f"at_evals={at_evals} must lie in 1..max_evals={max_evals}: compare the methods at an "
                       "evaluation count the pass reaches")
    windows = _on_device(model, windows)
    with torch.inference_mode():
        model.eval()
        costs = fixed_point_costs(model, windows, configs, max_evals=max_evals, ref_loops=ref_loops,
                                  eps=(1e-3, 1e-5), batch_size=batch_size)
        x = windows[:batch_size, :-1]
        secs = {name: seconds_per_eval(model, x, cfg, evals=min(8, max_evals - 1), rounds=time_rounds)
                for name, cfg in configs.items()}
    rows = []
    for name in configs:
        d = costs.depths[costs.depths.method == name].set_index("eps")
        c = costs.curves[(costs.curves.method == name) & (costs.curves.evals == at_evals)].iloc[0]
        last = costs.curves[(costs.curves.method == name) & (costs.curves.evals == max_evals)].iloc[0]
        rows.append({"method": name, "evals_kl_1e-3": float(d.loc[1e-3, "mean_evals"]),
                     "evals_kl_1e-5": float(d.loc[1e-5, "mean_evals"]),
                     "converged_1e-5": float(d.loc[1e-5, "converged"]), f"ce_at_{at_evals}": float(c.ce),
                     f"kl_ref_at_{at_evals}": float(c.kl_ref), f"kl_prev_at_{max_evals}": float(last.kl_prev),
                     "seconds_per_eval": secs[name]})
    out = pd.DataFrame(rows)
    out["x_plain_time_per_eval"] = out.seconds_per_eval / out.seconds_per_eval.iloc[0]
    return out


# ----------------------------------------------------------------------------------------------------------
# Everything, and the table for the figure


def speedup_table(*frames: pd.DataFrame) -> pd.DataFrame:
    """The non-baseline rows of :func:`time_batched` / :func:`time_generation` frames: ``setting``, ``rule``,
    ``avg_loops``, ``proxy_speedup``, ``flop_speedup``, ``wallclock_speedup``, ``wall_over_proxy`` (what
    ``drc_core.book.viz.speedup_bars`` draws)."""
    cols = ["setting", "rule", "avg_loops", "proxy_speedup", "flop_speedup", "wallclock_speedup", "wall_over_proxy"]
    rows = pd.concat([f[~f.baseline] for f in frames], ignore_index=True)
    return rows[cols].assign(rule=rows.rule.astype(str)).reset_index(drop=True)


@dataclass
class SpeedReport:
    """What :func:`run_speed` returns: the config, the matching (:class:`Matched`), the batched frame (matched
    rules, then Huginn's presets if asked), the generation frame (one block of rows per batch size), the
    measurement pass, the speed targets (:func:`speed_targets`) and, if asked, the profile
    (:func:`profile_batched`: ``profile_kinds``, ``profile_ops``)."""

    config: SpeedConfig
    matched: Matched
    batched: pd.DataFrame
    generation: pd.DataFrame
    measurement: pd.DataFrame
    targets: pd.DataFrame | None = None
    profile_kinds: pd.DataFrame | None = None
    profile_ops: pd.DataFrame | None = None

    def table(self) -> pd.DataFrame:
        """:func:`speedup_table` of the batched and generation frames."""
        return speedup_table(self.batched, self.generation)

    def to_dict(self) -> dict:
        """JSON-ready content (frames as lists of records)."""
        out = {"config": asdict(self.config), "matched": self.matched.table.to_dict("records"),
               "batched": self.batched.to_dict("records"), "generation": self.generation.to_dict("records"),
               "measurement": self.measurement.to_dict("records"), "table": self.table().to_dict("records")}
        for name in ("targets", "profile_kinds", "profile_ops"):
            frame = getattr(self, name)
            if frame is not None:
                out[name] = frame.to_dict("records")
        return out


def run_speed(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
              log: Log = None) -> SpeedReport:
    """:func:`matched_rules`, then :func:`time_batched` with the matched rules (and Huginn's presets,
    :func:`preset_specs`, with ``presets``), :func:`time_generation` with the matched rules for ``gen_rows`` and
    each of ``more_gen_rows`` prompts (the first ``prompt_len`` tokens of the first windows), then
    :func:`measurement_cost`, :func:`speed_targets` and, with ``profile``, :func:`profile_batched`."""
    cfg = cfg or SpeedConfig()
    windows = _on_device(model, windows)
    most = max((cfg.gen_rows, *cfg.more_gen_rows))
    if cfg.prompt_len > windows.shape[1] or most > len(windows):
        raise DrcError(f"prompt_len={cfg.prompt_len} / gen_rows={most} exceed the windows "
                       f"({len(windows)} of {windows.shape[1]} tokens): lower them")
    matched = matched_rules(model, windows, cfg, log=log)
    extra = preset_specs(cfg, matched.specs) if cfg.presets else []
    batched = time_batched(model, windows, [*matched.specs, *extra], cfg, log=log)
    generation = pd.concat([time_generation(model, windows[:rows, : cfg.prompt_len], matched.specs, cfg, log=log)
                            for rows in dict.fromkeys((cfg.gen_rows, *cfg.more_gen_rows))], ignore_index=True)
    measurement = measurement_cost(model, windows, cfg, log=log)
    targets = speed_targets(batched[batched.family != "huginn"], generation)
    kinds = ops = None
    if cfg.profile:
        kinds, ops = profile_batched(model, windows, matched.specs, cfg)
    return SpeedReport(cfg, matched, batched, generation, measurement, targets, kinds, ops)

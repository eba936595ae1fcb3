"""Realized speed-up of per-token halting: the FLOP proxy ``r / a`` (uniform depth r against a rule's average exit
loop a) beside the clock, in batched evaluation.

:func:`matched_rules` picks each family's cheapest threshold whose CE is within ``ce_tolerance`` of uniform depth r
(swept offline, checked online with ``skip_forward``); :func:`time_batched` times ``model(x, r)`` against
``skip_forward`` with ``Uniform(r)`` and each rule; :func:`speed_targets` checks the targets. Generation is in
:mod:`drc_book.decode_speed`, the other checks in :mod:`drc_book.speed_checks`, the cost model in
:mod:`drc_book.cost`. Every comparison runs its variants once untimed (warm-up and quality), then ``rounds``
interleaved rounds (:func:`drc_book.cost.interleaved`), reported as medians, under ``torch.inference_mode()``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from drc_book.cost import (
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
from drc_core import (
    EVAL_STATE_SEED,
    DepthRecurrentLM,
    DrcError,
    HaltingRule,
    KLThreshold,
    RuleSpec,
    StateDelta,
    Uniform,
    check_token_ids,
    default_families,
    default_rules,
    eval_batches,
    huginn_presets,
    matching_depth,
    need_float,
    need_int,
    skip_forward,
    summarize,
    sweep,
)

__all__ = [
    "TARGET_MEASURE",
    "TARGET_HONEST",
    "TARGET_KL_BATCHED",
    "TARGET_OVERHEAD",
    "TARGET_RATIO",
    "Matched",
    "SpeedConfig",
    "matched_rules",
    "preset_specs",
    "skip_overhead",
    "speed_summary",
    "speed_targets",
    "speedup_table",
    "targets_met",
    "time_batched",
]

TARGET_RATIO = 0.9  # wall-clock speedup >= 0.9 x the FLOP proxy at matched quality
TARGET_MEASURE = 1.2  # the measurement pass <= 1.2 x one depth-32 forward (the target as worded)


@dataclass(frozen=True)
class SpeedConfig:
    """What to measure and how (validated: a bad value is a one-line :class:`DrcError`). ``reference_loops``
    r is the uniform depth to match and beat; "matched quality" is CE <= CE(uniform r) + ``ce_tolerance``;
    ``new_tokens`` greedy tokens after ``prompt_len`` prompt tokens of ``gen_rows`` windows (and ``more_gen_rows``);
    the measurement pass at ``measure_loops`` on ``measure_windows`` windows; ``max_online_tries`` stricter grid
    points when the offline match misses online; ``fused`` readout statistics through the compiled kernel; ``clock``
    "wall" or "cpu"; ``presets``/``profile`` also time Huginn's presets / profile one batch; ``keep_freed``:
    :func:`drc_book.cost.keep_freed_memory` before timing."""

    reference_loops: int = 8
    rule_max_loops: int = 16
    families: tuple[str, ...] = (KLThreshold.family, StateDelta.family)
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


def prepare_memory(cfg: SpeedConfig) -> None:
    """Before timing: the allocator setting ``cfg.keep_freed`` asks for."""
    if cfg.keep_freed:
        keep_freed_memory()


def skip_path(rule: HaltingRule) -> str:
    return "skip_log_probs" if rule.needs_log_probs else "skip_states"


def on_device(model: DepthRecurrentLM, ids: object, what: str = "windows", targets: bool = True) -> Tensor:
    """:func:`drc_core.model.lm.check_token_ids`, then moved to the model's device."""
    return check_token_ids(model, ids, what, targets=targets).to(next(model.parameters()).device)


def timing_batches(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(inputs, targets, s_0) per batch; s_0 drawn exactly as :func:`drc_core.halting.sweep.sweep` and
    :func:`drc_core.training.evaluate.loss_by_depth` draw it for the same ``seed`` and ``batch_size``."""
    return [(b.x, b.y, b.initial_state(model)) for b in eval_batches(model, windows, cfg.batch_size, cfg.seed)]


def ce_sum(logits: Tensor, y: Tensor) -> float:
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
        ce += ce_sum(res.logits, y)
        n += x.numel()
    return loops / n, ce / n


def matched_rules(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
                  log: Log = None) -> Matched:
    """Each family's lowest-average-depth grid point with CE <= CE(uniform r) + ``ce_tolerance``: swept
    offline, then checked online with ``skip_forward`` (up to ``max_online_tries`` stricter points if it misses). A
    family with no point within the target offline falls back to its lowest-CE point; ``within_tolerance`` and
    ``note`` say whether and why not."""
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


def rule_specs(rules: Sequence[RuleSpec | HaltingRule], r: int) -> list[RuleSpec]:
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


def speed_columns(row: dict, base_seconds: float, r: int, base_flops: float, flops: float) -> dict:
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
    """Wall-clock of uniform depth r (``model(x, r)``, the baseline) against ``skip_forward`` with
    ``Uniform(r)`` (the skipping machinery at equal depth) and with each rule, same windows and initial states.
    One row per variant: what it is (``setting``, ``family``, ``param``, ``rule``, ``path``, ``baseline``), its
    quality (``avg_loops``, ``ce`` of exactly the timed outputs, ``ce_gap``, ``within_tolerance``), its time
    (``seconds`` median over rounds, ``spread``, ``page_faults_per_batch``, ``tokens_per_s``) and its speed-ups:
    ``proxy_speedup`` r / avg_loops, ``flop_speedup`` (matmul model), ``honest_flops`` (the work it really did),
    ``honest_speedup``, ``wallclock_speedup``, ``wall_over_proxy`` and ``wall_over_honest``."""
    cfg = cfg or SpeedConfig()
    prepare_memory(cfg)
    windows = on_device(model, windows)
    r = cfg.reference_loops
    specs = rule_specs(rules, r)
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
                          "path": skip_path(spec.rule), "baseline": False,
                          "needs_log_probs": spec.rule.needs_log_probs},
                         lambda x, s, rule=spec.rule: skip_forward(model, x, rule, state=s, fused=cfg.fused)))
    with torch.inference_mode():
        model.eval()
        batches = timing_batches(model, windows, cfg)
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
                ce += ce_sum(logits, y)
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
        speed_columns(row, base_s, r, base_flops, matmul_flops_per_token(model, row["avg_loops"], t_len, row["path"]))
    return pd.DataFrame(rows)


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


def speed_summary(batched: pd.DataFrame, generation: pd.DataFrame) -> dict[str, Any]:
    """The skipping path's speed-up at equal depth (:func:`skip_overhead`), whether each matched rule reaches
    ``TARGET_RATIO`` x its proxy (:func:`targets_met`, Huginn's presets left out) and that target."""
    return {"skip_overhead_at_equal_depth": skip_overhead(batched),
            "target_met": targets_met(batched[batched.family != "huginn"], generation),
            "target_wall_over_proxy": TARGET_RATIO}


TARGET_OVERHEAD = 1.05  # the skipping path at equal depth <= 1.05 x the dense forward / decoder
TARGET_HONEST = 0.9  # wall-clock speedup >= 0.9 x the honest-FLOP speedup, every rule
TARGET_KL_BATCHED = 1.5  # the KL rule >= 1.5 x faster than uniform depth r in batched evaluation


def speed_targets(*frames: pd.DataFrame) -> pd.DataFrame:
    """The speed targets at matched quality, one row per (frame, rule, target) of :func:`time_batched` /
    generation frames: the skipping path at equal depth takes <= 1.05 x the dense time; every rule beats uniform depth
    r and reaches >= 0.9 x its honest-FLOP speed-up; the state-change rule >= 0.9 x its proxy; the KL rule >= 1.5 x in
    batched evaluation. ``ceiling`` is the value if the clock followed the honest FLOPs exactly; ``reachable`` whether
    that meets the threshold (a missed, reachable target is bound by the implementation, else by the work)."""
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


# ----------------------------------------------------------------------------------------------------------
# Everything, and the table for the figure


def speedup_table(*frames: pd.DataFrame) -> pd.DataFrame:
    """The non-baseline rows of :func:`time_batched` / :func:`time_generation` frames: ``setting``, ``rule``,
    ``avg_loops``, ``proxy_speedup``, ``flop_speedup``, ``wallclock_speedup``, ``wall_over_proxy`` (what
    ``drc_book.viz.speedup_bars`` draws)."""
    cols = ["setting", "rule", "avg_loops", "proxy_speedup", "flop_speedup", "wallclock_speedup", "wall_over_proxy"]
    rows = pd.concat([f[~f.baseline] for f in frames], ignore_index=True)
    return rows[cols].assign(rule=rows.rule.astype(str)).reset_index(drop=True)

"""Notebook 05's other checks beside :mod:`drc_book.speed`: the measurement pass's cost, where the time goes
(``torch.profiler``), bf16 against fp32, Anderson acceleration, and the whole benchmark in one call (:func:`run_speed`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import pandas as pd
import torch
from torch import Tensor

from drc_book.cost import Log, interleaved, median
from drc_book.fixed_point import fixed_point_costs, seconds_per_eval
from drc_book.speed import (
    TARGET_MEASURE,
    Matched,
    SpeedConfig,
    batched_variants,
    ce_sum,
    check_batches,
    decode_setup,
    decoder_calls,
    matched_rules,
    on_device,
    preset_specs,
    rule_specs,
    speed_targets,
    speedup_table,
    time_batched,
    time_generation,
    timing_batches,
    with_timings,
)
from drc_core import PLAIN_ITERATION as PLAIN
from drc_core import (
    AndersonConfig,
    DepthRecurrentLM,
    DrcError,
    HaltingRule,
    RuleSpec,
    Uniform,
    iterate,
    iterate_stats,
    measure_windows,
)

__all__ = ["SpeedReport", "anderson_configs", "anderson_summary", "anderson_table", "aten_calls", "bf16_check",
           "by_kind", "decode_op_calls", "measurement_cost", "measurement_pass", "measurement_summary",
           "profile_batched", "profile_generation", "run_speed", "self_cpu_ms"]


def _pass_names(loops: int) -> dict[str, str]:
    """The ``pass`` labels of :func:`measurement_cost`'s rows at ``loops`` loops, by kind."""
    return {"forward": f"forward, depth {loops}", "readout": f"readout every loop, {loops} loops",
            "measure": "measure_windows (kl_to_final=False)", "measure_kl_final": "measure_windows (kl_to_final=True)"}


def measurement_cost(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
                     log: Log = None) -> pd.DataFrame:
    """``measure_windows`` (without and with ``kl_to_final``) against one forward at the same depth and a bare
    every-loop readout pass, on the first ``measure_windows`` windows: ``seconds``, ``spread``, ``x_forward``,
    ``x_readout_pass`` and ``target_as_worded`` (<= 1.2 x the forward)."""
    cfg = cfg or SpeedConfig()
    cfg.start()
    windows = on_device(model, windows)[: cfg.measure_windows]
    L, bs = cfg.measure_loops, cfg.batch_size
    batches, one = timing_batches(model, windows, cfg), timing_batches(model, windows[:1], cfg)

    def forward(w: Tensor, b: list) -> None:
        for x, _, s0 in b:
            model(x, L, state=s0)

    def readout(w: Tensor, b: list) -> None:
        for x, _, s0 in b:
            for _ in iterate(model, x, L, state=s0, readout="log_probs"):
                pass

    def measure(kl_to_final: bool) -> Callable[[Tensor, list], object]:
        return lambda w, b: measure_windows(model, w, L, batch_size=bs, seed=cfg.seed, kl_to_final=kl_to_final)

    names = _pass_names(L)  # in the order of these passes
    passes = dict(zip(names.values(), (forward, readout, measure(False), measure(True)), strict=True))
    with torch.inference_mode():
        model.eval()
        for fn in passes.values():  # warm-up on one window
            fn(windows[:1], one)
        times = interleaved({k: (lambda fn=fn: fn(windows, batches)) for k, fn in passes.items()},
                            cfg.autorange(), log, "measurement")
    med = {k: median(v) for k, v in times.items()}
    fwd, ro = med[names["forward"]], med[names["readout"]]
    return with_timings(pd.DataFrame([{"pass": k, "loops": L, "windows": len(windows), **times.row(k),
                                       "x_forward": med[k] / fwd, "x_readout_pass": med[k] / ro,
                                       "target_as_worded": med[k] / fwd <= TARGET_MEASURE} for k in passes]), times)


def measurement_pass(measurement: pd.DataFrame, kind: str) -> pd.Series:
    """The row of ``kind`` ("forward", "readout", "measure" or "measure_kl_final") of a :func:`measurement_cost`
    frame."""
    names = _pass_names(int(measurement.loops.iloc[0]))
    if kind not in names:
        raise DrcError(f"kind={kind!r} is not a measurement pass; use one of {', '.join(names)}")
    return measurement[measurement["pass"] == names[kind]].iloc[0]


def measurement_summary(measurement: pd.DataFrame) -> dict[str, float]:
    """The measurement pass (``kl_to_final``) and the readout pass against one forward, and the one against the
    other."""
    full, floor = measurement_pass(measurement, "measure_kl_final"), measurement_pass(measurement, "readout")
    return {"measurement_x_forward": float(full.x_forward), "measurement_x_readout_pass": float(full.x_readout_pass),
            "readout_pass_x_forward": float(floor.x_forward)}


_OP_KINDS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),
             ("attention", ("aten::_scaled_dot_product",)),
             ("readout statistics", ("aten::_softmax", "aten::_log_softmax", "aten::amax", "aten::argmax",
                                     "aten::linalg_vecdot", "CompiledFxGraph", "aten::exp", "aten::log")),
             ("gather / scatter", ("aten::index", "aten::_index_put", "aten::index_copy", "aten::index_select",
                                   "aten::nonzero", "aten::scatter", "aten::masked_fill", "aten::bincount")))


def _profiled(fn: Callable[[], object]) -> dict[str, tuple[float, int]]:
    """:func:`self_cpu_ms` of one call of ``fn`` under ``torch.profiler``, file descriptor 2 on /dev/null meanwhile:
    torch's C++ profiler writes a ``USDT`` line there, into a notebook's output."""
    from torch.profiler import ProfilerActivity, profile

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return self_cpu_ms(prof)


def self_cpu_ms(prof: object) -> dict[str, tuple[float, int]]:
    """``{op name: (self CPU ms, calls)}`` of a finished CPU profile, as ``prof.key_averages()`` counts them, read
    from the raw events without building the Python event tree."""
    from torch.autograd import DeviceType

    threads: dict[int, list[tuple[int, int, str]]] = {}
    for e in prof.profiler.kineto_results.events():  # type: ignore[attr-defined]
        if e.device_type() == DeviceType.CPU:
            threads.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.end_ns(), e.name()))
    out: dict[str, list[float]] = {}

    def close(ev: list) -> None:
        acc = out.setdefault(ev[2], [0.0, 0])
        acc[0] += (ev[1] - ev[0] - ev[3]) / 1e6
        # an op whose only direct child is an op of its own name (a redispatch) is one call, as key_averages counts
        acc[1] += 0 if ev[4] == 1 and ev[5] == ev[2] else 1

    for events in threads.values():
        events.sort(key=lambda ev: (ev[0], -ev[1]))  # an enclosing op before the ops it starts with
        stack: list[list] = []  # [start, end, name, ns of direct children, their number, the last one's name]
        for start, end, name in events:
            while stack and stack[-1][1] <= start:
                close(stack.pop())
            if stack:
                stack[-1][3] += end - start
                stack[-1][4] += 1
                stack[-1][5] = name
            stack.append([start, end, name, 0, 0, None])
        while stack:
            close(stack.pop())
    return {name: (ms, int(calls)) for name, (ms, calls) in out.items()}


def _profile(variants: dict[str, Callable[[], object]], top: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``torch.profiler`` over one call of each variant after an untimed one: :func:`profile_batched`'s result."""
    kinds, ops = [], []
    for name, fn in variants.items():
        fn()
        events = {op: v for op, v in _profiled(fn).items() if v[0] > 0}
        total = sum(ms for ms, _ in events.values())
        by_op_kind: dict[str, tuple[float, int]] = {}
        for op, (ms, calls) in events.items():
            kind = next((k for k, prefixes in _OP_KINDS if any(p in op for p in prefixes)),
                        "other (norms, RoPE, MLP activation, adds, copies)")
            kind_ms, kind_calls = by_op_kind.get(kind, (0.0, 0))
            by_op_kind[kind] = (kind_ms + ms, kind_calls + calls)
        for kind, (ms, calls) in sorted(by_op_kind.items(), key=lambda kv: -kv[1][0]):
            kinds.append({"variant": name, "kind": kind, "ms": ms, "calls": calls, "share": ms / total})
        kinds.append({"variant": name, "kind": "total", "ms": total,
                      "calls": int(sum(calls for _, calls in events.values())), "share": 1.0})
        for op, (ms, calls) in sorted(events.items(), key=lambda kv: -kv[1][0])[:top]:
            ops.append({"variant": name, "op": op, "ms": ms, "calls": calls, "share": ms / total})
    return pd.DataFrame(kinds), pd.DataFrame(ops)


def profile_batched(model: DepthRecurrentLM, windows: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                    cfg: SpeedConfig | None = None, *, top: int = 8) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``torch.profiler`` over one batch of each :func:`~drc_book.speed.batched_variants`: ``(kinds, ops)``, self CPU
    ``ms``, ``calls`` and ``share`` per variant and kind of op (and a ``total`` row), and per op of the ``top``."""
    cfg = cfg or SpeedConfig()
    cfg.start()
    windows = on_device(model, windows)
    x, _, s0 = timing_batches(model, windows[: cfg.batch_size], cfg)[0]
    with torch.inference_mode():
        model.eval()
        return _profile({info["rule"]: (lambda fn=fn: fn(x, s0)) for info, fn in batched_variants(model, rules, cfg)},
                        top)


def profile_generation(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                       cfg: SpeedConfig | None = None, *, top: int = 8,
                       continuous: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """As :func:`profile_batched`, over ``new_tokens`` tokens by each :func:`~drc_book.speed.decoder_calls` (the
    continuous decoders with ``continuous``)."""
    cfg = cfg or SpeedConfig()
    cfg.start()
    prompt, s0 = decode_setup(model, prompt, cfg)
    r = cfg.reference_loops
    specs = [RuleSpec("uniform", float(r), Uniform(r)), *rule_specs(rules, r)]
    with torch.inference_mode():
        model.eval()
        calls = decoder_calls(model, prompt, s0, specs, cfg, lambda sp: continuous and sp is not specs[0])
        return _profile({name: (lambda call=call: call(cfg.new_tokens)) for name, call in calls.items()}, top)


def by_kind(kinds: pd.DataFrame) -> pd.DataFrame:
    """A profile's ``kinds``, one row per variant: self CPU ms by kind of op, ``matmul_calls`` and ``ops``."""
    ms = kinds.pivot_table(index="variant", columns="kind", values="ms", sort=False)
    calls = kinds.pivot_table(index="variant", columns="kind", values="calls", sort=False)
    return ms.round(0).assign(matmul_calls=calls["matmul"], ops=calls["total"])


def aten_calls(fn: Callable[[], object]) -> int:
    """The aten operator calls of one call of ``fn``, counted as :func:`self_cpu_ms` counts them."""
    return sum(calls for op, (_, calls) in _profiled(fn).items() if op.startswith("aten::"))


def decode_op_calls(model: DepthRecurrentLM, prompt: Tensor, rules: Sequence[RuleSpec | HaltingRule],
                    cfg: SpeedConfig | None = None, *, batches: Sequence[int] = (8, 32)) -> pd.DataFrame:
    """Aten operator calls per new token of ``generate`` and ``generate_continuous`` with each rule at each batch
    size B (the first B prompts): (calls for n tokens - calls for 1) / (B (n - 1)), after a warm-up. A count, not a
    time: the per-step overhead, whatever the machine's load. One row per (batch, rule) with their ``ratio``."""
    cfg = cfg or SpeedConfig()
    prompt, s0 = decode_setup(model, prompt, cfg)
    n, r = cfg.new_tokens, cfg.reference_loops  # (SpeedConfig holds new_tokens >= 2)
    check_batches(batches, len(prompt), empty_ok=True)
    rows = []
    with torch.inference_mode():
        model.eval()
        for b in batches:
            for spec in rule_specs(rules, r):
                calls = decoder_calls(model, prompt[:b], s0[:b], [spec], cfg, lambda _: True)
                row = {"batch": b, "rule": str(spec.rule), "family": spec.family}
                for path, name in (("generate", str(spec.rule)), ("continuous", f"continuous {spec.rule}")):
                    call = calls[name]
                    call(n)  # warm-up (compiles the fused kernels, if any, outside the count)
                    full, one = aten_calls(lambda call=call: call(n)), aten_calls(lambda call=call: call(1))
                    row[path] = (full - one) / (b * (n - 1))
                row["ratio"] = row["continuous"] / row["generate"]
                rows.append(row)
    return pd.DataFrame(rows, columns=["batch", "rule", "family", "generate", "continuous", "ratio"])


def bf16_check(model: DepthRecurrentLM, windows: Tensor, rules: Sequence[RuleSpec | HaltingRule],
               cfg: SpeedConfig | None = None, *, log: Log = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The dense forward and ``skip_forward`` with each rule in fp32 and under bf16 autocast: ``(variants, kl)``, per
    (rule, precision) ``avg_loops``, ``ce``, ``same_exit`` (share of fp32's exits), ``seconds``, ``x_fp32_time``;
    per loop 2..r the relative error of the successive KL under bf16 beside the fp32 median KL."""
    cfg = cfg or SpeedConfig()
    cfg.start()
    windows = on_device(model, windows)
    r = cfg.reference_loops
    device = windows.device

    rows, variants = [], {}
    with torch.inference_mode():
        model.eval()
        batches = timing_batches(model, windows, cfg)
        n_tok = sum(x.numel() for x, _, _ in batches)
        base_exits: dict[str, list[Tensor]] = {}
        for info, fn in batched_variants(model, rules, cfg, skip_uniform=False):
            name = info["rule"]
            for precision in ("fp32", "bf16"):
                def run(fn: Callable[[Tensor, Tensor], object] = fn, bf16: bool = precision == "bf16") -> list:
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        return [fn(x, s0) for x, _, s0 in batches]
                outs = run()
                ce = sum(ce_sum(o if isinstance(o, Tensor) else o.logits, y)
                         for o, (_, y, _) in zip(outs, batches, strict=True)) / n_tok
                exits = [torch.full(x.shape, r) if isinstance(o, Tensor) else o.exit_loop
                         for o, (x, _, _) in zip(outs, batches, strict=True)]
                base_exits.setdefault(name, exits)  # fp32's, run first
                same = sum(float((a == b).double().sum()) for a, b in zip(exits, base_exits[name], strict=True))
                label = f"{name} [{precision}]"
                rows.append({"rule": name, "precision": precision,
                             "avg_loops": sum(float(e.double().sum()) for e in exits) / n_tok, "ce": ce,
                             "same_exit": same / n_tok, "label": label})
                variants[label] = run
                del outs
        times = interleaved(variants, cfg.autorange(), log, "bf16 check", cfg.clock)
        x, _, s0 = batches[0]
        fp32 = [st.kl for st in iterate_stats(model, x, r, state=s0)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            low = [st.kl for st in iterate_stats(model, x, r, state=s0)]
    frame = pd.DataFrame(rows)
    frame["seconds"] = [median(times[label]) for label in frame.label]
    frame["rounds"] = [len(times[label]) for label in frame.label]
    frame["x_fp32_time"] = frame.seconds / frame.groupby("rule").seconds.transform("first")
    kl_rows = []
    for loop in range(2, r + 1):
        a, b = fp32[loop - 1].flatten().double(), low[loop - 1].flatten().double()
        rel = ((b - a).abs() / a.clamp_min(1e-12))
        kl_rows.append({"loop": loop, "kl_fp32_median": float(a.median()), "rel_diff_median": float(rel.median()),
                        "rel_diff_p90": float(rel.quantile(0.9))})
    return with_timings(frame.drop(columns="label"), times), pd.DataFrame(kl_rows)


def anderson_configs(ms: Sequence[int] = (2, 3, 5), beta: float = 0.7, scope: str = "sequence",
                     damped: Sequence[float] = (0.85,)) -> dict[str, AndersonConfig]:
    """By label: plain iteration, damped ``x' = b f(x) + (1 - b) x`` for each ``b`` of ``damped`` (it turns a
    period-2 oscillation into a contraction) and Anderson acceleration with each window of ``ms``."""
    configs = [PLAIN, *(AndersonConfig(m=0, beta=b) for b in damped),
               *(AndersonConfig(m=m, beta=beta, scope=scope) for m in ms)]
    return {c.label: c for c in configs}


def anderson_table(model: DepthRecurrentLM, windows: Tensor, configs: dict[str, AndersonConfig], *,
                   max_evals: int = 16, ref_loops: int = 32, at_evals: int = 8, batch_size: int = 16,
                   time_rounds: int = 3) -> pd.DataFrame:
    """One row per config (:func:`drc_book.fixed_point.fixed_point_costs`): mean core evaluations until the
    successive KL stays below 1e-3 and 1e-5, CE and KL to the reference after ``at_evals``, the successive KL at
    ``max_evals`` (the floor) and seconds per core evaluation (no readout)."""
    if not 1 <= at_evals <= max_evals:
        raise DrcError(f"at_evals={at_evals} must lie in 1..max_evals={max_evals}: compare the methods at an "
                       "evaluation count the pass reaches")
    windows = on_device(model, windows)
    with torch.inference_mode():
        model.eval()
        costs = fixed_point_costs(model, windows, configs, max_evals=max_evals, ref_loops=ref_loops,
                                  eps=(1e-3, 1e-5), batch_size=batch_size)
        secs = {name: seconds_per_eval(model, windows[:batch_size, :-1], cfg, evals=min(8, max_evals - 1),
                                       rounds=time_rounds) for name, cfg in configs.items()}
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


def anderson_summary(anderson: pd.DataFrame) -> str:
    """An :func:`anderson_table` in lines: each damped iteration against plain, then the Anderson windows' range and
    the best one's time to 1e-5 against plain iteration's."""
    plain = anderson.iloc[0]
    acc = anderson[anderson.method.str.startswith("anderson")]
    lines = [f"{row.method}: evaluations to 1e-5 {row['evals_kl_1e-5']:.2f} (plain {plain['evals_kl_1e-5']:.2f}), "
             f"to 1e-3 {row['evals_kl_1e-3']:.2f} (plain {plain['evals_kl_1e-3']:.2f}); tokens reaching 1e-5: "
             f"{row['converged_1e-5']:.1%} (plain {plain['converged_1e-5']:.1%}); "
             f"time per evaluation {row.x_plain_time_per_eval:.2f}x plain"
             for _, row in anderson[anderson.method.str.startswith("plain (")].iterrows()]
    best = acc.loc[(acc["evals_kl_1e-5"] * acc.x_plain_time_per_eval).idxmin()]
    e5, e3, cost = acc["evals_kl_1e-5"], acc["evals_kl_1e-3"], acc.x_plain_time_per_eval
    ratio = best["evals_kl_1e-5"] * best.x_plain_time_per_eval / plain["evals_kl_1e-5"]
    lines.append(f"Anderson: evaluations to 1e-5 {e5.min():.2f}-{e5.max():.2f}, to 1e-3 {e3.min():.2f}-{e3.max():.2f}; "
                 f"each evaluation costs {cost.min():.2f}-{cost.max():.2f}x a plain one; "
                 f"time to 1e-5, best ({best.method}): {ratio:.2f}x plain")
    return "\n".join(lines)


@dataclass
class SpeedReport:
    """:func:`run_speed`'s result: the config, the matching, the batched, generation (by ``rows``) and measurement
    frames, the speed targets and, if asked, the profile of one batch."""

    config: SpeedConfig
    matched: Matched
    batched: pd.DataFrame
    generation: pd.DataFrame
    measurement: pd.DataFrame
    targets: pd.DataFrame | None = None
    profile_kinds: pd.DataFrame | None = None
    profile_ops: pd.DataFrame | None = None

    def table(self) -> pd.DataFrame:
        """:func:`drc_book.speed.speedup_table` of the batched and generation frames."""
        return speedup_table(self.batched, self.generation)

    def to_dict(self) -> dict:
        """JSON-ready content, frames as lists of records."""
        out = {"config": asdict(self.config), "matched": self.matched.table.to_dict("records"),
               "table": self.table().to_dict("records")}
        for f in fields(self)[2:]:
            frame = getattr(self, f.name)
            if frame is not None:
                out[f.name] = frame.to_dict("records")
        return out


def run_speed(model: DepthRecurrentLM, windows: Tensor, cfg: SpeedConfig | None = None, *,
              log: Log = None) -> SpeedReport:
    """Matching, then :func:`~drc_book.speed.time_batched` (Huginn's presets too with ``presets``) and
    :func:`~drc_book.speed.time_generation` for ``gen_rows`` and each of ``more_gen_rows`` prompts,
    :func:`measurement_cost`, the speed targets and, with ``profile``, :func:`profile_batched`."""
    cfg = cfg or SpeedConfig()
    windows = on_device(model, windows)
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
    kinds, ops = profile_batched(model, windows, matched.specs, cfg) if cfg.profile else (None, None)
    return SpeedReport(cfg, matched, batched, generation, measurement, targets, kinds, ops)

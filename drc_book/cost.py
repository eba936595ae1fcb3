"""What a forward costs (the matmul-FLOP model of each path, from ``DepthRecurrentLM.flops_per_token``) and the
interleaved timer the speed measurements and ``bench/`` share (medians over rounds that rotate the variants)."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd
from scipy import stats as sps

from drc_core import KEEP_FREED_BYTES, DepthRecurrentLM, DrcError, keep_freed_memory, need_float, need_int

__all__ = ["CLOCKS", "KEEP_FREED_BYTES", "VOCAB_STAT_FLOPS", "Autorange", "Log", "Timings", "flop_parts",
           "flop_summary", "honest_flops", "interleaved", "keep_freed_memory", "matmul_flops_per_token", "median",
           "median_interval", "page_faults", "rotations", "speedup_model", "spread", "train_flops_per_token"]

Log = Callable[[str], None] | None
T = TypeVar("T")


def matmul_flops_per_token(model: DepthRecurrentLM, loops: float, seq_len: int, path: str) -> float:
    """Matmul FLOPs per token at (average) depth ``loops`` of ``path``: "forward" (one readout), "skip_log_probs" (a
    readout every active loop) or "skip_states" (one readout; the coda context's k/v projections ignored)."""
    parts = flop_parts(model, seq_len)
    prelude, core, coda, head = parts["prelude"], parts["core"], parts["coda"], parts["head"]
    if path == "forward":
        return prelude + coda + head + loops * core
    if path == "skip_log_probs":
        return prelude + loops * (core + coda + head)
    if path == "skip_states":
        return prelude + loops * core + coda + head
    raise DrcError(f"path={path!r} is not supported; use 'forward', 'skip_log_probs' or 'skip_states'")


def flop_parts(model: DepthRecurrentLM, seq_len: int) -> dict[str, float]:
    """Matmul FLOPs per token of ``prelude``, ``core`` (one loop), ``coda``, ``head``, ``vocab_stats`` (one readout
    statistic) and ``readout`` (coda + head + vocab_stats: what a rule on the output pays per token and loop)."""
    c = model.cfg
    base = model.flops_per_token(0, seq_len)  # (P + C) * block + head
    core = model.flops_per_token(1, seq_len) - base
    head = 2 * c.d_model * c.vocab_size
    n_blocks = c.n_prelude + c.n_coda
    block = (base - head) / n_blocks if n_blocks else 0.0
    coda = c.n_coda * block
    stats = VOCAB_STAT_FLOPS * c.vocab_size
    return {"prelude": c.n_prelude * block, "core": core, "coda": coda, "head": float(head),
            "vocab_stats": float(stats), "readout": coda + head + stats}


def flop_summary(model: DepthRecurrentLM, seq_len: int) -> str:
    """One line: the MFLOP per token of each part (:func:`flop_parts`) and what one readout costs in core loops."""
    parts = flop_parts(model, seq_len)
    return (", ".join(f"{k} {v / 1e6:.2f} MFLOP" for k, v in parts.items())
            + f"; one readout (coda + head + statistic) = {parts['readout'] / parts['core']:.2f} core loops")


def speedup_model(model: DepthRecurrentLM, reference: int, seq_len: int) -> pd.DataFrame:
    """The matmul speed-up over uniform depth r of each skipping path at average depths 1, r/4, r/2, r."""
    base = matmul_flops_per_token(model, reference, seq_len, "forward")
    return pd.DataFrame([
        {"avg loops a": a, "FLOP proxy r/a": reference / a,
         "matmul speed-up, rule on states": base / matmul_flops_per_token(model, a, seq_len, "skip_states"),
         "matmul speed-up, rule on log-probs": base / matmul_flops_per_token(model, a, seq_len, "skip_log_probs")}
        for a in sorted({1.0, reference / 4, reference / 2, float(reference)})])


VOCAB_STAT_FLOPS = 8  # per vocabulary entry and token-loop of a per-loop readout: softmax (max, subtract, exp, sum)
# and the statistic's dot product (subtract, multiply, add), counted so that a readout's elementwise work is not free


def honest_flops(model: DepthRecurrentLM, work: object, seq_len: int) -> float:
    """Total FLOPs of the work a skipping run really did (its ``work``: core token-loops, blocks, ``qkv``-only
    projections, head readouts, vocabulary statistics); for ``Uniform(r)`` exactly ``flops_per_token(r)`` a token."""
    c = model.cfg
    d = c.d_model
    block = 2 * (4 * d * d + 3 * d * c.hidden_dim) + 4 * seq_len * d
    adapter = 2 * 2 * d * d if c.injection == "concat" else 0
    w = work
    return float(w.core * (c.n_core * block + adapter) + w.blocks * block + w.qkv * 6 * d * d  # type: ignore
                 + w.head * 2 * d * c.vocab_size + w.vocab_stats * VOCAB_STAT_FLOPS * c.vocab_size)  # type: ignore


def train_flops_per_token(model: DepthRecurrentLM, n: int, k: int | None, seq_len: int) -> int:
    """Matmul FLOPs per token of a training step at ``n`` loops, backprop (2x the forward) through the last ``k``."""
    k_eff = n if k is None else min(k, n)
    return model.flops_per_token(n, seq_len) + 2 * model.flops_per_token(k_eff, seq_len)


def rotations(items: Sequence[T], rounds: int) -> Iterator[tuple[int, list[T]]]:
    """``(round, order)`` for each of ``rounds`` rounds: the items, round r starting at item r mod n."""
    items = list(items)
    for rnd in range(rounds):
        shift = rnd % len(items) if items else 0
        yield rnd, items[shift:] + items[:shift]


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Autorange:
    """When :func:`interleaved` stops (the way ``timeit``'s autorange and ``pyperf`` decide, here on interleaved
    rounds): after ``min_rounds``, as soon as every variant's median is known to within ``rel`` of itself (the
    half-width of its 95% interval, :func:`median_interval`), or once the rounds have taken ``budget_s`` seconds;
    at ``max_rounds`` at the latest. Where the warm-up check fails (:meth:`Timings.warmup`) when the rounds could
    stop, the first round counts as warm-up: it is dropped once and the rounds go on. ``Autorange(n, n)`` is a
    fixed number of rounds."""

    min_rounds: int = 3
    max_rounds: int = 12
    rel: float = 0.03
    budget_s: float = 30.0

    def __post_init__(self) -> None:
        need_int("min_rounds", self.min_rounds, 1)
        need_int("max_rounds", self.max_rounds, self.min_rounds)
        need_float("rel", self.rel, 0.0)
        need_float("budget_s", self.budget_s, 0.0)


def median_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """``(lo, hi, coverage)``: the distribution-free interval of the median from the order statistics of ``xs``, the
    narrowest whose coverage is at least ``level``; with too few values for that, ``[min, max]`` and its coverage
    (1 - 2^(1-n): 0.75 for three rounds)."""
    s, n = sorted(xs), len(xs)
    if n == 0:
        return math.nan, math.nan, 0.0
    j = 1  # the interval [s_(j), s_(n+1-j)] covers the median with probability 1 - 2 P(Binom(n, 1/2) <= j - 1)
    while j < (n + 1) // 2 and 2 * sps.binom.cdf(j, n, 0.5) <= 1 - level:
        j += 1
    return s[j - 1], s[n - j], float(1 - 2 * sps.binom.cdf(j - 1, n, 0.5))


class Timings(dict[str, list[float]]):
    """:func:`interleaved`'s seconds per call of each variant (a dict of lists), with how the rounds ended:
    ``what``, ``stopped`` ("interval", "budget" or "rounds"), ``seconds`` spent in the rounds and ``dropped``, the
    rounds dropped as warm-up (0 or 1)."""

    what: str = ""
    stopped: str = "rounds"
    seconds: float = 0.0
    dropped: int = 0

    def row(self, name: str) -> dict[str, float]:
        """``seconds`` (median over rounds), ``seconds_lo``/``seconds_hi`` (its interval), ``coverage``, ``rounds``,
        ``spread`` and ``first_over_rest`` (the first timed round over the median of the later ones) of ``name``."""
        xs = self[name]
        lo, hi, cover = median_interval(xs)
        rest = xs[1:]
        return {"seconds": median(xs), "seconds_lo": lo, "seconds_hi": hi, "coverage": cover, "rounds": len(xs),
                "spread": spread(xs), "first_over_rest": xs[0] / median(rest) if rest else math.nan}

    def warmup(self) -> dict[str, object]:
        """Is the warm-up enough? Without a warm-up effect the first timed round is the slowest of a variant's
        ``n`` rounds with probability 1/n; ``p`` tests whether it is so more often across the variants (one-sided
        binomial test), ``ok`` when ``p >= 0.05`` (None with one round). Also how the rounds ended."""
        n = min(len(v) for v in self.values()) if self else 0
        first_slowest = sum(v[0] >= max(v) for v in self.values())
        p = float(sps.binomtest(first_slowest, len(self), 1 / n, alternative="greater").pvalue) if n > 1 else math.nan
        return {"timing": self.what, "variants": len(self), "rounds": n, "stopped": self.stopped,
                "seconds": self.seconds, "dropped": self.dropped, "first_round_slowest": first_slowest, "warmup_p": p,
                "warmup_ok": bool(p >= 0.05) if n > 1 else None}


def interleaved(variants: dict[str, Callable[[], object]], rounds: int | Autorange, log: Log, what: str,
                clock: str = "wall", *, keep: Callable[[str, object], None] | None = None) -> Timings:
    """Seconds per call of each variant, one call per round in :func:`rotations`, for ``rounds`` rounds (a number,
    or an :class:`Autorange` that decides when to stop); ``keep(name, output)`` gets the first round's outputs;
    ``clock`` "wall" (``perf_counter``) or "cpu" (``process_time``)."""
    if clock not in CLOCKS:
        raise DrcError(f"clock={clock!r} is not supported; use one of {', '.join(CLOCKS)}")
    plan = rounds if isinstance(rounds, Autorange) else Autorange(rounds, rounds)
    tick = CLOCKS[clock]
    names = list(variants)
    times = Timings({n: [] for n in names})
    times.what = what
    gc.collect()
    own_freeze = gc.get_freeze_count() == 0  # a caller's own gc.freeze() is left as it was
    if own_freeze:
        gc.freeze()  # what lives now is left alone by the collections below: each scans only what the rounds made
    start = time.perf_counter()
    try:
        for rnd, order in rotations(names, plan.max_rounds):
            for name in order:
                gc.collect()  # no garbage of an earlier call collected inside this one's clock
                t0 = tick()
                out = variants[name]()
                times[name].append(tick() - t0)
                if keep is not None and rnd == 0:
                    keep(name, out)
                del out
            times.seconds = time.perf_counter() - start
            if log:
                log(f"{what} round {rnd + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names))
            if rnd + 1 - times.dropped >= plan.min_rounds and rnd + 1 < plan.max_rounds:
                if not times.dropped and plan.min_rounds > 1 and times.warmup()["warmup_ok"] is False:
                    for xs in times.values():  # the warm-up was too short: its first timed round was part of it
                        del xs[0]
                    times.dropped = 1
                    continue
                # settled: every variant's median interval at 95% coverage and within ``rel`` of the median
                if all(cover >= 0.95 and (hi - lo) / 2 <= plan.rel * median(xs)
                       for xs in times.values() for lo, hi, cover in [median_interval(xs)]):
                    times.stopped = "interval"
                    break
                if times.seconds >= plan.budget_s:
                    times.stopped = "budget"
                    break
    finally:
        if own_freeze:
            gc.unfreeze()
    return times


median = statistics.median  # over rounds


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median over rounds; 0 for a single round."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def page_faults() -> int:
    """Minor page faults of this process so far (0 where ``getrusage`` is not available)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)



"""The rule's statistics on the skipping paths: computed for the active tokens only (a compact (N,) layout), only
the fields the rule reads (:func:`stat_fields`), against the previous loop kept per token (:class:`Tracker`);
the readout's vocabulary-sized statistics in L2-sized row chunks or one compiled kernel
(:func:`fused_stats_kernel`). The definitions of the statistics are :class:`~drc_core.analysis.loops.LoopStats`'s;
:mod:`drc_core.halting.skipping` explains the cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from drc_core.analysis.loops import (
    BUILTIN_STATISTICS,
    MIN_P,
    STATISTICS,
    LoopStats,
    extra_statistics,
    extra_values,
    minp_log_probs,
    state_change,
    trajectory_step,
    with_needs,
    with_placeholders,
)
from drc_core.errors import DrcError
from drc_core.halting.rules import HaltingRule
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["CHUNK", "FullLayout", "Tracker", "Trajectory", "compact_stats", "fused_stats_kernel", "stat_fields"]

CHUNK = 128  # rows of the fused head + statistics pass (128 x 4096 floats = 2 MB: stays in L2)


def _needs(name: str) -> set[str]:
    """What statistic ``name`` needs computed on the compact layout: its ``needs`` (the previous loop's values,
    so this loop's too), without the state (always there); a built-in's log-probs are not materialised (the
    kernels read the logits), a registered statistic that reads the output gets this loop's log-probs."""
    stat = STATISTICS.get(name)
    if stat is None:
        return set()
    need = set(stat.needs) - {"state", name}
    if name in BUILTIN_STATISTICS:
        return need - {"log_probs"}
    return need | ({"log_probs"} if stat.reads == "output" else set())


def stat_fields(rule: HaltingRule) -> frozenset[str]:
    """The statistics the skipping paths compute for ``rule``: what it reads (:attr:`HaltingRule.reads`) and,
    transitively, what those need on the compact layout (:func:`_needs`); every statistic where it reads None."""
    if rule.reads is None:
        return frozenset(STATISTICS)
    unknown = sorted(set(rule.reads) - set(STATISTICS))
    if unknown:
        raise DrcError(f"rule {type(rule).__name__} reads {unknown[0]!r}, which is no statistic: use one of "
                       f"{', '.join(STATISTICS)} (or register_statistic it)")
    return with_needs(rule.reads, _needs)


def _vecdot(a: Tensor, b: Tensor) -> Tensor:
    return torch.linalg.vecdot(a, b, dim=-1)


def _stats_first(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(lse, top_prob, entropy) of logits z (N, V): one expression, which ``torch.compile`` fuses into one loop
    over each row."""
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1, keepdim=True)
    lse = m + s.log()
    return lse.squeeze(-1), (1.0 / s).squeeze(-1), (lse - (e * z).sum(-1, keepdim=True) / s).squeeze(-1)


def _stats_kl(z: Tensor, zp: Tensor, index: Tensor, lse_prev: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, top_prob, entropy, KL(p || p_prev)) of logits z (N, V) against the previous loop's logits
    ``zp[index]`` and normaliser ``lse_prev`` (N,): read z and the previous rows once, no (N, V) temporary."""
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1, keepdim=True)
    lse = m + s.log()
    kl = ((e * (z - zp[index])).sum(-1, keepdim=True) / s - lse).squeeze(-1) + lse_prev
    return lse.squeeze(-1), (1.0 / s).squeeze(-1), (lse - (e * z).sum(-1, keepdim=True) / s).squeeze(-1), kl


def _minp_log(z: Tensor) -> Tensor:
    """Huginn's min-p filtered log-distribution (:func:`~drc_core.analysis.loops.minp_log_probs`) from logits."""
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    q = torch.where(z < m + math.log(MIN_P), 1.0 / z.shape[-1], e / e.sum(-1, keepdim=True))
    return q.log() - q.sum(-1, keepdim=True).log()


def _stats_minp(z: Tensor, zp: Tensor, index: Tensor) -> Tensor:
    """KL(q_prev || q) of the min-p filtered outputs of logits z (N, V) and the previous loop's ``zp[index]``."""
    lq_prev, lq = _minp_log(zp[index]), _minp_log(z)
    return (lq_prev.exp() * (lq_prev - lq)).sum(-1)


_COMPILED: dict[str, object] = {}
FUSED_MIN_ROWS = 16  # fewer active tokens take the eager path


def fused_stats_kernel(kind: str = "kl") -> object:
    """:func:`_stats_kl` (``kind`` "kl"), :func:`_stats_first` ("first") or :func:`_stats_minp` ("minp", Huginn's
    min-p KL from the logits) compiled with dynamic shapes, built
    once per process (the first call compiles, ~20 s on a CPU; inductor caches the kernel on disk). Every
    argument is always a tensor and the callers use the kernels only from 16 rows on (no size-1
    specialisation), so each compiles once per grad / autocast mode."""
    if kind not in _COMPILED:
        fn = {"kl": _stats_kl, "first": _stats_first, "minp": _stats_minp}[kind]
        _COMPILED[kind] = torch.compile(fn, dynamic=True)
    return _COMPILED[kind]


class Tracker:
    """Compact (active tokens only) statistics of one loop against the previous, only the fields in ``need``.

    The output statistics come from the logits z (N, V) of :meth:`logits_buffer` (two preallocated buffers that
    alternate: this loop's and the previous loop's), computed chunk by chunk (:meth:`readout`); per-token
    values of the previous loop (normaliser, entropy, argmax and its run, state, step) are kept compact and
    shrunk with :meth:`keep`; the previous loop's logits are read through an index (no copy)."""

    def __init__(self, need: frozenset[str], n: int, vocab: int, like: Tensor, readout: bool,
                 fused: bool = False) -> None:
        self.need, self.fused = need, fused
        self.readout_each_loop = readout
        # vocabulary-sized passes per token-loop: the softmax and the statistic read from it; min-p KL adds two
        # filtered distributions (this loop's and the previous loop's, recomputed) and their KL
        self.vocab_passes = 1 + (2 if "minp_kl" in need else 0)
        self.bufs = [like.new_empty(n, vocab, dtype=torch.float32) for _ in range(2 if readout else 0)]
        self.cur = 0
        self.prev: dict[str, Tensor] = {}
        self.prev_index: Tensor | None = None  # rows of the previous logits buffer for the current tokens
        self.loop = 0
        extras = [st for st in extra_statistics() if st.name in need]  # registered statistics: their own compute
        self.extra_state = frozenset(st.name for st in extras if st.reads == "state")
        self.extra_output = frozenset(st.name for st in extras if st.reads == "output")
        self.keeps_state = bool(need & {"state_delta", "cosine", "state_step"} or extras)
        self.x: Tensor | None = None

    def logits_buffer(self, n: int) -> Tensor:
        return self.bufs[self.cur][:n]

    def readout(self, model: DepthRecurrentLM, y: Tensor, loop: int) -> dict[str, Tensor]:
        """Head + statistics of the coda outputs ``y`` (N, d): fills :meth:`logits_buffer` and returns the
        output fields in ``need`` (N,) (``log_probs`` (N, V)). Long because the built-in statistics are computed
        together in one chunked pass over the logits (one read of the (N, V) buffer, no intermediate of that
        size)."""
        n, need = y.shape[0], self.need
        z = self.logits_buffer(n)
        first = self.loop == 0
        idx = self.prev_index
        zp = None if first else self.bufs[1 - self.cur] if idx is not None else self.bufs[1 - self.cur][:n]
        want_p = bool(need & {"kl", "entropy", "entropy_delta", "top_prob"})
        out = {k: y.new_empty(n, dtype=torch.float32) for k in ("lse", "kl", "entropy", "top_prob") if want_p}
        arg = y.new_empty(n, dtype=torch.long) if "argmax" in need else None
        hn = model.norm(y)
        if not torch.is_autocast_enabled(y.device.type) and model.lm_head.bias is None and hn.dtype == z.dtype:
            torch.mm(hn, model.lm_head.weight.t(), out=z)  # into the preallocated buffer: no (N, V) allocation
        else:
            z.copy_(model.lm_head(hn))
        scratch = None
        fused = self.fused and n >= FUSED_MIN_ROWS  # a few rows: eager is as fast, and no recompiles for N = 1
        if want_p and fused:
            if zp is None or "kl" not in need:
                lse, top, ent = fused_stats_kernel("first")(z)  # type: ignore[operator]
            else:
                index = idx if idx is not None else torch.arange(n, device=z.device)
                lse, top, ent, kl = fused_stats_kernel("kl")(z, zp, index, self.prev["lse"])  # type: ignore[operator]
                out["kl"] = kl.reshape(n)
            out.update(lse=lse.reshape(n), top_prob=top.reshape(n), entropy=ent.reshape(n))  # (N,) also at N = 1
            want_p = False  # done; the chunk loop below only computes the argmax, if read
            computed = True
        else:
            computed = False
        for i in range(0, n, CHUNK):
            j = min(i + CHUNK, n)
            zc = z[i:j]
            if arg is not None:
                arg[i:j] = zc.argmax(dim=-1)
            if not want_p:
                continue
            p = torch.softmax(zc, dim=-1)
            p_max = p.amax(dim=-1)
            lse = zc.amax(dim=-1) - p_max.log()
            out["lse"][i:j], out["top_prob"][i:j] = lse, p_max
            if "entropy" in need:
                out["entropy"][i:j] = lse - _vecdot(p, zc)
            if "kl" in need and zp is not None:
                zpc = zp[i:j] if idx is None else zp.index_select(0, idx[i:j])
                scratch = torch.sub(zc, zpc, out=scratch[: j - i] if scratch is not None else None)
                out["kl"][i:j] = _vecdot(p, scratch) - (lse - self.prev["lse"][i:j])
        res: dict[str, Tensor] = {}
        inf = torch.full((n,), math.inf, device=y.device)
        if want_p or computed:
            res["lse"] = out["lse"]
            if "kl" in need:
                res["kl"] = inf if first else out["kl"]
            if "top_prob" in need:
                res["top_prob"] = out["top_prob"]
            if "entropy" in need:
                res["entropy"] = out["entropy"]
                if "entropy_delta" in need:
                    res["entropy_delta"] = inf if first else (out["entropy"] - self.prev["entropy"]).abs()
        if arg is not None:
            res["argmax"] = arg
            if "argmax_run" in need:
                res["argmax_run"] = (torch.ones_like(arg) if first else
                                     torch.where(arg == self.prev["argmax"], self.prev["argmax_run"] + 1, 1))
        fused_minp = "minp_kl" in need and fused
        if fused_minp:
            if first:
                res["minp_kl"] = inf
            else:
                assert zp is not None
                index = idx if idx is not None else torch.arange(n, device=z.device)
                res["minp_kl"] = fused_stats_kernel("minp")(z, zp, index).reshape(n)  # type: ignore[operator]
        if "log_probs" in need or ("minp_kl" in need and not fused_minp):
            lp = torch.log_softmax(z, dim=-1)
            res["log_probs"] = lp
            if "minp_kl" in need and not fused_minp:
                if first:
                    res["minp_kl"] = inf
                else:
                    prev = self.prev.get("log_probs")
                    if prev is None:  # the previous loop ran the fused kernel: its log-probs from its logits
                        assert zp is not None
                        prev = torch.log_softmax(zp if idx is None else zp.index_select(0, idx), dim=-1)
                    q_prev, q = minp_log_probs(prev), minp_log_probs(lp)
                    res["minp_kl"] = _vecdot(q_prev.exp(), q_prev - q)
        if self.extra_output:
            assert self.x is not None, "states() runs before readout()"
            res.update(extra_values(res["log_probs"], self.x, None if first else self.prev, self.extra_output))
        return res

    def states(self, x: Tensor, loop: int) -> dict[str, Tensor]:
        """The state fields in ``need`` of the active tokens' new states ``x`` (N, d)."""
        need, res = self.need, {}
        first = self.loop == 0
        self.x = x
        if self.extra_state:
            res.update(extra_values(None, x, None if first else self.prev, self.extra_state))
        if need & {"state_delta", "cosine"}:
            if first:
                inf = torch.full((x.shape[0],), math.inf, device=x.device)
                res["state_delta"], res["cosine"] = inf, -inf
            else:
                res["state_delta"], res["cosine"] = state_change(x, self.prev["state"])
        if "state_step" in need:
            prev = None if first else Trajectory(loop - 1, self.prev["state"], self.prev["state_step"],
                                                  self.prev["accel"])
            res["state_step"], res["accel"], res["accel_prev"] = trajectory_step(x, prev)  # type: ignore[arg-type]
        return res

    def done(self, loop: int, x: Tensor, res: dict[str, Tensor]) -> None:
        """Remember this loop's values for the next loop."""
        kept = ("lse", "entropy", "argmax", "argmax_run", "log_probs", "state_step", "accel")
        self.prev = {k: v for k, v in res.items() if k in kept or k in self.extra_state or k in self.extra_output}
        if self.keeps_state:
            self.prev["state"] = x
        if self.readout_each_loop:
            self.cur = 1 - self.cur
        self.prev_index = None
        self.loop = loop

    def keep(self, keep: Tensor) -> None:
        """Keep only the tokens ``keep`` (an index into the current tokens) for the next loop."""
        self.prev = {k: v.index_select(0, keep) for k, v in self.prev.items()}
        self.prev_index = keep


@dataclass
class Trajectory:
    """What :func:`~drc_core.analysis.loops.trajectory_step` reads of the previous loop."""

    loop: int
    state: Tensor
    state_step: Tensor
    accel: Tensor


def compact_stats(loop: int, x: Tensor, res: dict[str, Tensor]) -> LoopStats:
    """The (1, N) :class:`LoopStats` of the computed fields ``res``; the others are placeholders
    (:func:`~drc_core.analysis.loops.with_placeholders`: NaN, argmax -1, run 0, empty log-probs and steps) that a
    rule declaring its ``reads`` never looks at."""
    return LoopStats.of(loop, x[None], with_placeholders({k: v[None] for k, v in res.items()}, (1, x.shape[0]),
                                                        x.device))


class FullLayout:
    """For a rule with ``reads=None``: every statistic scattered into (B, W) buffers, so a halted token keeps its
    exit-loop values (its decisions are ignored anyway); ``state`` is the (B, W, d) state, halted tokens frozen."""

    def __init__(self, shape: tuple[int, int], vocab: int, like: Tensor) -> None:
        dev = like.device
        self.full: dict[str, Tensor] = {}
        for name, stat in STATISTICS.items():
            if stat.kind == "distribution":
                self.full[name] = torch.zeros(*shape, vocab, device=dev)
            elif stat.kind == "vector":
                self.full[name] = torch.zeros(*shape, like.shape[-1], device=dev)
            else:
                self.full[name] = stat.placeholder(shape, dev)

    def stats(self, loop: int, lin: Tensor, res: dict[str, Tensor], state: Tensor) -> LoopStats:
        for name, buf in self.full.items():
            if name in res:
                buf.view(-1, *buf.shape[2:])[lin] = res[name].to(buf.dtype)
        return LoopStats.of(loop, state, self.full)

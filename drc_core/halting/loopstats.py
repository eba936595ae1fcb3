"""The rule's statistics (:class:`~drc_core.analysis.loops.LoopStats`) on the skipping paths: for the active
tokens only, only the fields the rule reads (:func:`stat_fields`), against the previous loop (:class:`Tracker`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

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

__all__ = ["CHUNK", "FullLayout", "Tracker", "compact_stats", "fused_stats_kernel", "stat_fields"]

CHUNK = 128  # rows of the fused head + statistics pass (128 x 4096 floats = 2 MB: stays in L2)


def _needs(name: str) -> set[str]:
    """What statistic ``name`` needs computed on the compact layout (a built-in reads the logits, no log-probs)."""
    stat = STATISTICS.get(name)
    if stat is None:
        return set()
    need = set(stat.needs) - {"state", name}
    if name in BUILTIN_STATISTICS:
        return need - {"log_probs"}
    return need | ({"log_probs"} if stat.reads == "output" else set())


def stat_fields(rule: HaltingRule) -> frozenset[str]:
    """The statistics the skipping paths compute for ``rule``: what it reads and, transitively, what those need."""
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
    """(lse, top_prob, entropy) of logits z (N, V), one expression for ``torch.compile`` to fuse."""
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    s = e.sum(-1, keepdim=True)
    lse = m + s.log()
    return lse.squeeze(-1), (1.0 / s).squeeze(-1), (lse - (e * z).sum(-1, keepdim=True) / s).squeeze(-1)


def _stats_kl(z: Tensor, zp: Tensor, index: Tensor, lse_prev: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_stats_first` and KL(p || p_prev) against the previous loop's logits ``zp[index]`` and ``lse_prev``."""
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


_COMPILED: dict[str, Callable[..., Any]] = {}
FUSED_MIN_ROWS = 16  # fewer active tokens take the eager path


def fused_stats_kernel(kind: str = "kl") -> Callable[..., Any]:
    """:func:`_stats_kl` ("kl"), :func:`_stats_first` ("first") or :func:`_stats_minp` ("minp") compiled with
    dynamic shapes, once per process (~20 s on a CPU); used from :data:`FUSED_MIN_ROWS` rows on."""
    if kind not in _COMPILED:
        fn = {"kl": _stats_kl, "first": _stats_first, "minp": _stats_minp}[kind]
        _COMPILED[kind] = torch.compile(fn, dynamic=True)
    return _COMPILED[kind]


class Tracker:
    """Compact statistics (active tokens only) of one loop against the previous, only the fields in ``need``; the
    logits (N, V) alternate between two preallocated buffers, the previous loop's read through an index."""

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
        """Head + statistics of the coda outputs ``y`` (N, d): fills :meth:`logits_buffer` and returns the output
        fields in ``need``, the softmax-based ones from one pass over L2-sized row chunks (``KL(p_l || p_{l-1}) =
        sum p (z_l - z_{l-1}) - lse_l + lse_{l-1}``, no (N, V) temporary) or one compiled kernel (``fused``)."""
        n, need, first = y.shape[0], self.need, self.loop == 0
        z, idx = self.logits_buffer(n), self.prev_index
        zp = None if first else self.bufs[1 - self.cur] if idx is not None else self.bufs[1 - self.cur][:n]
        want_p = bool(need & {"kl", "entropy", "entropy_delta", "top_prob"})
        arg = y.new_empty(n, dtype=torch.long) if "argmax" in need else None
        hn = model.norm(y)
        if not torch.is_autocast_enabled(y.device.type) and model.lm_head.bias is None and hn.dtype == z.dtype:
            torch.mm(hn, model.lm_head.weight.t(), out=z)  # into the preallocated buffer: no (N, V) allocation
        else:
            z.copy_(model.lm_head(hn))
        fused = self.fused and n >= FUSED_MIN_ROWS  # a few rows: eager is as fast, and no recompiles for N = 1
        index = (idx if idx is not None else torch.arange(n, device=z.device)) if fused and zp is not None else None
        out: dict[str, Tensor] = {}
        if want_p and fused:
            if zp is None or "kl" not in need:
                out["lse"], out["top_prob"], out["entropy"] = fused_stats_kernel("first")(z)
            else:
                out["lse"], out["top_prob"], out["entropy"], out["kl"] = fused_stats_kernel("kl")(
                    z, zp, index, self.prev["lse"])
            out = {k: v.reshape(n) for k, v in out.items()}  # (N,) also at N = 1
        elif want_p:
            out = {k: y.new_empty(n, dtype=torch.float32) for k in ("lse", "kl", "entropy", "top_prob")}
        scratch = None
        for i in range(0, n, CHUNK):
            j = min(i + CHUNK, n)
            zc = z[i:j]
            if arg is not None:
                arg[i:j] = zc.argmax(dim=-1)
            if not want_p or fused:
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
        res = {k: v for k, v in out.items() if k == "lse" or k in need}  # the softmax-based fields
        inf = torch.full((n,), math.inf, device=y.device)
        if "kl" in need:
            res["kl"] = inf if first else out["kl"]
        if {"entropy", "entropy_delta"} <= need:
            res["entropy_delta"] = inf if first else (out["entropy"] - self.prev["entropy"]).abs()
        if arg is not None:
            res["argmax"] = arg
            if "argmax_run" in need:
                res["argmax_run"] = (torch.ones_like(arg) if first else
                                     torch.where(arg == self.prev["argmax"], self.prev["argmax_run"] + 1, 1))
        eager_minp = "minp_kl" in need and not fused
        if "minp_kl" in need and fused:
            res["minp_kl"] = inf if first else fused_stats_kernel("minp")(z, zp, index).reshape(n)
        if "log_probs" in need or eager_minp:
            lp = res["log_probs"] = torch.log_softmax(z, dim=-1)
            if eager_minp and first:
                res["minp_kl"] = inf
            elif eager_minp:
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
        if "state_step" in need:  # what trajectory_step reads of the previous loop
            prev = None if first else SimpleNamespace(loop=loop - 1, state=self.prev["state"],
                                                      state_step=self.prev["state_step"], accel=self.prev["accel"])
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


def compact_stats(loop: int, x: Tensor, res: dict[str, Tensor]) -> LoopStats:
    """The (1, N) :class:`LoopStats` of the computed fields ``res``, the others placeholders."""
    return LoopStats.of(loop, x[None], with_placeholders({k: v[None] for k, v in res.items()}, (1, x.shape[0]),
                                                        x.device))


class FullLayout:
    """For a rule with ``reads=None``: every statistic scattered into (B, W) buffers (a halted token keeps its
    exit-loop values)."""

    def __init__(self, shape: tuple[int, int], vocab: int, like: Tensor) -> None:
        width = {"distribution": vocab, "vector": like.shape[-1]}  # the last axis of the non-scalar kinds
        self.full = {name: torch.zeros(*shape, width[st.kind], device=like.device) if st.kind in width
                     else st.placeholder(shape, like.device) for name, st in STATISTICS.items()}

    def stats(self, loop: int, lin: Tensor, res: dict[str, Tensor], state: Tensor) -> LoopStats:
        for name, buf in self.full.items():
            if name in res:
                buf.view(-1, *buf.shape[2:])[lin] = res[name].to(buf.dtype)
        return LoopStats.of(loop, state, self.full)

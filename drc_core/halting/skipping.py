"""Per-token halting that really skips the halted tokens' compute (the "realized speedup": wall-clock against the
FLOP proxy and the honest FLOPs).

:func:`skip_forward` computes exactly what the masked reference :func:`drc_core.halting.rules.masked_forward`
computes (to float tolerance, with the same exit loops), but at loop l it runs the core only on the tokens
still active at loop l. The semantics (see :func:`drc_core.model.lm.iterate`): a token that
halts at loop e keeps s_e, and at every later loop offers, in every core and coda block, the keys/values it
computed at loop e; an active token at loop l therefore attends to each earlier token's loop-min(l, e)
keys/values, and a token's logits are its readout at its exit loop.

How. The active tokens are kept *compacted* across loops: a flat list (N,) of (row, position) pairs in
row-major order with their states x (N, d) and injections (N, d), gathered once and shrunk (one index per
tensor) only at a loop where some token halts; a halting token's state, exit loop and logits are written out
once, when it halts. Per block there is a key/value cache (B, H, T, hd) that always holds every token's last
computed keys/values: a loop computes q/k/v, attention output and MLP only for the N active tokens (matmuls on
(N, d)), writes their k/v into the cache (``index_copy_`` at precomputed offsets) and lets their queries
attend over the cache. The attention layout (:class:`Attn`) is computed once per active set: while every
position of the window is active (every loop of ``Uniform``, and the loops before the first halt) the queries
are the plain (B, H, W, hd) view and attention is the dense causal kernel (no padding, no mask, no index);
after the first halt the queries are padded per row to the largest active count M of any row that has one,
with an explicit boolean mask (key position <= query position; padding queries see key 0 only and are
dropped), over the cached keys cropped to the last active position + 1. Host syncs: one per loop (which
tokens halted), plus the index of the new active set at a loop where some halted.

While every position of every row is active (``skip_forward``'s dense loops), a block runs exactly as in
``Block.forward`` (q, k, v (B, H, T, hd), the causal kernel on the fresh keys/values) and its keys/values are
not copied into the cache at all: the layout keeps the last ones of each block and writes them into the cache
only when the active set first shrinks (:meth:`Attn.flush`), so ``Uniform(r)`` copies no key/value. (Measured
on the reference model: with the copies, 1.04x the dense forward at equal depth; without, 0.99-1.01x.)

Readout: only what the rule reads. A rule declares the :class:`~drc_core.analysis.loops.LoopStats` fields
its criterion reads (:attr:`HaltingRule.reads <drc_core.halting.rules.HaltingRule.reads>`); only those are
computed, only for the active tokens, and the rule decides on them in the compact (1, N) layout (no (B, T)
buffers). A rule with ``needs_log_probs`` (KL, entropy, argmax, confidence, min-p KL) needs every active
token's output at every loop, so the coda runs on the N active tokens and the head writes their logits into
a preallocated (N, V) buffer (the loop's one vocabulary-sized buffer; two alternate, this loop's and the
previous one's). The statistics then read that buffer in row chunks of :data:`CHUNK` tokens (L2-resident):
softmax, the log-normaliser ``lse = max - log(p_max)`` and, only if read, KL(p_l || p_{l-1}) =
sum p (z_l - z_{l-1}) - lse_l + lse_{l-1} (the previous loop's logits z and normaliser reused, no log-softmax
materialised), entropy ``lse - sum p z``, top probability ``p_max`` and argmax. With ``fused=True`` the
softmax, normaliser, KL and entropy are one compiled kernel instead (:func:`fused_stats_kernel`: one pass
over z and the previous z per row). Only the min-p KL (and a rule with ``reads=None``) materialises log-probs.
A rule that reads states only (state change, cosine, acceleration, uniform) runs no readout per loop: a token
is read out once, at its exit loop (the coda runs on the tokens of its row that are still active at that loop
and lie at or before the last exiting position, their coda keys/values being what the exiting token sees; the
last coda block's queries, attention and MLP only on the exiting tokens, whose coda outputs (d wide) are kept;
the head runs once at the end on every token, as in the dense forward). A rule with
``reads=None`` (routers, rules of your own) gets every statistic in the (B, T) layout, as before.

Work actually done is counted (:class:`Work`: token passes through the core, full blocks, key/value-only
projections, the head and the vocabulary-sized statistics); :func:`drc_core.experiments.cost.honest_flops`
turns it into the honest FLOP count.

Cost model (matmul FLOPs per token, ``block`` and ``head = 2 d V`` as in
:meth:`~drc_core.model.lm.DepthRecurrentLM.flops_per_token`, ``a`` the average exit loop)::

    uniform depth r (forward)             (P + C) * block + r * core + head              core = R * block + adapter
    skip_forward, rule with log-probs     P * block + a * (core + C * block + head)      + a * (softmax + stats) * V
    skip_forward, rule without            P * block + a * core + C' + head               C' <= coda context

The FLOP proxy ``r / a`` counts only the core, so it is what a rule without log-probs can realise; a rule
with log-probs pays the coda, a head (2 d V: with V = 4096, d = 128 about one core loop) and a V-sized softmax
per token per loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import MIN_P, LoopStats, minp_log_probs, state_change, trajectory_step
from drc_core.errors import DrcError
from drc_core.halting.rules import AdaptiveResult, HaltingRule
from drc_core.model.lm import Block, DepthRecurrentLM

__all__ = [
    "CHUNK", "Attn", "KVSlab", "LoopCaches", "LoopResult", "SkipResult", "Tokens", "Work", "attend_cached",
    "block_step", "check_state", "coda_readout", "empty_caches", "run_loops", "skip_forward", "stat_fields",
]

KVSlab = tuple[Tensor, Tensor]  # (K, V), each (B, H, T, hd): one block's cached keys/values at one loop
CHUNK = 128  # rows of the fused head + statistics pass (128 x 4096 floats = 2 MB: stays in L2)
_STAT_FIELDS = tuple(f.name for f in fields(LoopStats) if f.name not in ("loop", "state"))
_OUTPUT_FIELDS = frozenset({"log_probs", "kl", "entropy", "entropy_delta", "argmax", "argmax_run", "top_prob",
                            "minp_kl"})
_NEEDS = {"entropy_delta": {"entropy"}, "argmax_run": {"argmax"},
          "accel_prev": {"accel"}, "accel": {"state_step"}}


def stat_fields(rule: HaltingRule) -> frozenset[str]:
    """The :class:`LoopStats` fields the skipping paths compute for ``rule``: what it reads
    (:attr:`HaltingRule.reads`) and what those need from the previous loop (every field where it reads None)."""
    if rule.reads is None:
        return frozenset(_STAT_FIELDS)
    need = set(rule.reads)
    while True:
        more = set().union(*(_NEEDS.get(f, set()) for f in need)) - need
        if not more:
            return frozenset(need)
        need |= more


# ----------------------------------------------------------------------------------------------------------
# Flat tokens, the attention layout and cached attention


@dataclass
class Tokens:
    """A flat list of N tokens at ``(rows[i], pos[i])``, in row-major order (rows, then positions, ascending)."""

    rows: Tensor
    pos: Tensor

    @classmethod
    def of(cls, mask: Tensor) -> Tokens:
        """The True entries of a (B, T) mask."""
        rows, pos = mask.nonzero(as_tuple=True)
        return cls(rows, pos)

    @classmethod
    def window(cls, batch: int, t0: int, t1: int, device: torch.device) -> Tokens:
        """Every row's positions t0..t1-1."""
        rows = torch.arange(batch, device=device).repeat_interleave(t1 - t0)
        return cls(rows, torch.arange(t0, t1, device=device).repeat(batch))

    def __len__(self) -> int:
        return self.rows.numel()

    def select(self, keep: Tensor) -> Tokens:
        return Tokens(self.rows[keep], self.pos[keep])

    def gather(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...)."""
        return x[self.rows, self.pos]


class Attn:
    """How the N flat tokens ``toks`` write keys/values into and attend over caches (B, H, T, hd), computed once
    per active set and reused by every block of every loop until the set changes.

    ``dense`` (``window`` (t0, t1) given and every row's positions t0..t1-1 present): q, k, v in the (B, H, W, hd)
    layout of ``Block.forward``, cache writes a slice copy, attention the dense causal kernel. ``scratch`` (the
    caches are read by this run only, as in ``skip_forward``) with a dense layout over the whole cache: the
    writes are deferred to :meth:`flush` (which :meth:`select` calls), attention reads the fresh keys/values.
    Otherwise the queries are padded per row (see the module docstring) with the padding, the mask and the cache
    offsets precomputed here.
    """

    def __init__(self, toks: Tokens, batch: int, seq_len: int, heads: int, rope: tuple[Tensor, Tensor],
                 window: tuple[int, int] | None = None, *, scratch: bool = False) -> None:
        self.toks, self.batch, self.seq_len, self.heads, self.rope = toks, batch, seq_len, heads, rope
        n = len(toks)
        self.dense = window is not None and n == batch * (window[1] - window[0])
        self.pending: dict[int, tuple[KVSlab, Tensor, Tensor]] = {}
        if self.dense:
            assert window is not None
            self.t0, self.t1 = window
            self.cos_w, self.sin_w = rope[0][self.t0 : self.t1], rope[1][self.t0 : self.t1]
            self.lazy = scratch and self.t0 == 0 and self.t1 == seq_len
            return
        self.cos, self.sin = rope[0][toks.pos], rope[1][toks.pos]
        dev = toks.rows.device
        counts = torch.bincount(toks.rows, minlength=batch)
        present = counts > 0
        compact_row = (torch.cumsum(present, 0) - 1)[toks.rows]
        slot = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[toks.rows]
        self.n_rows, self.width = int(present.sum()), int(counts.max())
        self.t_k = int(toks.pos.max()) + 1
        self.used = present.nonzero().squeeze(1) if self.n_rows < batch else None
        self.q_index = compact_row * self.width + slot  # (N,) into the padded (rows * M) queries
        pos_pad = torch.zeros(self.n_rows * self.width, dtype=torch.long, device=dev)
        pos_pad[self.q_index] = toks.pos
        seen = torch.arange(self.t_k, device=dev) <= pos_pad.view(self.n_rows, self.width, 1)
        self.mask = torch.zeros(seen.shape, device=dev).masked_fill_(~seen, -math.inf)[:, None]  # additive, once
        # offsets of (row, head, pos) in a (B * H * T, hd) view of a cache, (N * H,) in (token, head) order
        h = torch.arange(heads, device=dev)
        self.kv_index = ((toks.rows[:, None] * heads + h) * seq_len + toks.pos[:, None]).reshape(-1)

    def write(self, kv: KVSlab, k: Tensor, v: Tensor) -> None:
        """Write the tokens' keys/values into the cache: k, v (B, H, W, hd) in the dense layout, else (N, H, hd).

        Dense over the whole cache with ``scratch``: only kept (the attention of this loop reads them as they
        are), and written into the cache by :meth:`flush`, when a later layout needs them."""
        if self.dense and self.lazy:
            self.pending[id(kv[0])] = (kv, k, v)
            return
        for cache, new in zip(kv, (k, v), strict=True):
            if self.dense:
                cache[:, :, self.t0 : self.t1].copy_(new)
            else:
                new = new.to(cache.dtype)
                cache.view(-1, cache.shape[-1]).index_copy_(0, self.kv_index, new.reshape(-1, new.shape[-1]))

    def flush(self) -> None:
        """Write the kept keys/values of :meth:`write` into their caches."""
        for (cache_k, cache_v), k, v in self.pending.values():
            cache_k.copy_(k)
            cache_v.copy_(v)
        self.pending.clear()

    def attend(self, q: Tensor, kv: KVSlab) -> Tensor:
        """Causal attention of the tokens' queries over their rows' cached keys/values -> (N, H * hd); q is
        (B, H, W, hd) in the dense layout, else (N, H, hd)."""
        if self.dense:
            t0, t1 = self.t0, self.t1
            qd = q
            batch, heads, _, hd = q.shape
            n = batch * (t1 - t0)
            fresh = self.pending.get(id(kv[0]))
            if fresh is not None:
                k, v = fresh[1], fresh[2]
            else:
                k, v = kv[0][:, :, :t1].to(q.dtype), kv[1][:, :, :t1].to(q.dtype)
            if t0 == 0:
                y = F.scaled_dot_product_attention(qd, k, v, is_causal=True)
            elif t1 - t0 == 1:
                y = F.scaled_dot_product_attention(qd, k, v)
            else:
                mask = torch.arange(t1, device=q.device) <= torch.arange(t0, t1, device=q.device)[:, None]
                y = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask)
            return y.transpose(1, 2).reshape(n, heads * hd)
        heads, hd = q.shape[1:]
        k, v = kv[0][:, :, : self.t_k], kv[1][:, :, : self.t_k]
        if self.used is not None:
            k, v = k.index_select(0, self.used), v.index_select(0, self.used)
        k, v = k.to(q.dtype), v.to(q.dtype)
        q_pad = q.new_zeros(self.n_rows * self.width, heads, hd).index_copy_(0, self.q_index, q)
        y = F.scaled_dot_product_attention(q_pad.view(self.n_rows, self.width, heads, hd).transpose(1, 2), k, v,
                                           attn_mask=self.mask.to(q.dtype))
        return y.transpose(1, 2).reshape(-1, heads * hd).index_select(0, self.q_index)

    def select(self, keep: Tensor) -> Attn:
        """The layout of the kept tokens (``keep`` (N,) bool or an index); the kept keys/values are written first."""
        self.flush()
        return Attn(self.toks.select(keep), self.batch, self.seq_len, self.heads, self.rope)


def _attn(toks: Tokens, kv: KVSlab, rope: tuple[Tensor, Tensor]) -> Attn:
    """The (not dense) :class:`Attn` of ``toks`` over caches shaped like ``kv`` (B, H, T, hd)."""
    B, H, T, _ = kv[0].shape
    return Attn(toks, B, T, H, rope)


def attend_cached(q: Tensor, toks: Tokens, kv: KVSlab) -> Tensor:
    """Causal attention of queries q (N, H, hd) at ``toks`` over their rows' cached k/v: -> (N, H * hd).

    The query at position p sees the keys at positions 0..p of its row in ``kv`` (B, H, T, hd).
    """
    hd = q.shape[-1]
    T = kv[0].shape[2]
    dummy = torch.zeros(T, hd // 2, device=q.device)
    return _attn(toks, kv, (dummy, dummy)).attend(q, kv)


def block_step(block: Block, x: Tensor, toks: Tokens | Attn, kv: KVSlab, cos: Tensor, sin: Tensor,
               query: Tensor | None = None, *, work: Work | None = None) -> Tensor:
    """One transformer block on the flat tokens ``x`` (N, d) at ``toks`` (or their :class:`Attn` layout),
    attending over the cache ``kv``: :meth:`Block.qkv <drc_core.model.lm.Block.qkv>` and
    :meth:`Block.finish <drc_core.model.lm.Block.finish>`, the code of ``Block.forward``, around cached attention
    instead of dense causal attention.

    The tokens' keys/values are written into ``kv`` first (in place), so they see themselves and every other
    token's cached keys/values. ``query`` (N,) bool: only those tokens get the attention output and the MLP
    (all tokens still write their k/v); returns (N', d) for the N' selected tokens. ``cos``/``sin``: the full
    RoPE tables (max_seq_len, hd/2).
    """
    attn = toks if isinstance(toks, Attn) else _attn(toks, kv, (cos, sin))
    n = x.shape[0]
    if attn.dense:  # the layout of Block.forward: q, k, v (B, H, W, hd)
        q, k, v = block.qkv(x.view(attn.batch, -1, x.shape[-1]), attn.cos_w, attn.sin_w)
    else:
        q, k, v = (t[0].transpose(0, 1) for t in block.qkv(x[None], attn.cos, attn.sin))  # (N, H, hd)
    attn.write(kv, k, v)
    if query is not None:
        sel = query.nonzero().squeeze(1)
        if work is not None:
            work.qkv += n - sel.numel()
            work.blocks += sel.numel()
        if sel.numel() == 0:
            return x[:0]
        if sel.numel() < n:
            if attn.dense:
                q = q.transpose(1, 2).reshape(n, *q.shape[1:2], q.shape[-1])
            x, q, attn = x.index_select(0, sel), q.index_select(0, sel), attn.select(sel)
    elif work is not None:
        work.blocks += n
    return block.finish(x, attn.attend(q, kv))


def coda(model: DepthRecurrentLM, x: Tensor, attn: Attn, coda_kv: list[KVSlab], query: Tensor | None = None, *,
         work: Work | None = None) -> Tensor:
    """The coda blocks on the flat states ``x`` (N, d) laid out by ``attn``: every token writes its coda
    keys/values; only the ``query`` tokens (default all) run the last block's attention and MLP -> (N', d)."""
    last = len(model.coda) - 1
    cos, sin = model.rope_cos, model.rope_sin
    for j, (block, kv) in enumerate(zip(model.coda, coda_kv, strict=True)):
        x = block_step(block, x, attn, kv, cos, sin, query=query if j == last else None, work=work)
    if last < 0 and query is not None:
        x = x[query]
    return x


def coda_readout(model: DepthRecurrentLM, x: Tensor, toks: Tokens | Attn, coda_kv: list[KVSlab],
                 query: Tensor | None = None, *, work: Work | None = None) -> Tensor:
    """Coda + norm + head of the flat states ``x`` (N, d) at ``toks`` -> logits (N', V) of the ``query`` tokens.

    Every token in ``toks`` writes its coda keys/values (the context that later tokens see); only the
    ``query`` tokens (default all) run the last coda block's attention and MLP and the head.
    """
    attn = toks
    if isinstance(toks, Tokens) and coda_kv:
        attn = _attn(toks, coda_kv[0], (model.rope_cos, model.rope_sin))
    y = coda(model, x, attn, coda_kv, query, work=work)  # type: ignore[arg-type]
    if work is not None:
        work.head += y.shape[0]
    return model.head(y)


def empty_caches(model: DepthRecurrentLM, n_blocks: int, shape: tuple[int, ...], like: Tensor) -> list[KVSlab]:
    """Zeroed (K, V) caches per block, each ``(*lead, B, H, T, hd)`` for ``shape = (*lead, B, T)`` (zeros, so
    that masked-out keys never hold NaN)."""
    *lead, B, T = shape
    size = (*lead, B, model.cfg.n_heads, T, model.cfg.head_dim)
    return [(like.new_zeros(size), like.new_zeros(size)) for _ in range(n_blocks)]


# ----------------------------------------------------------------------------------------------------------
# Work done (for the honest FLOP count)


@dataclass
class Work:
    """Token passes a skipping run actually computed: ``core`` (token-loops through the whole core, adapter
    included), ``blocks`` (full block applications outside the core: prelude, coda), ``qkv`` (tokens that only
    projected their coda keys/values as context), ``head`` (readouts through the final norm and the head) and
    ``vocab_stats`` (token-loops x vocabulary-sized passes: the softmax and what the rule reads, three passes for
    min-p KL), and
    ``tokens`` (the tokens processed). :func:`drc_core.experiments.cost.honest_flops` prices them."""

    core: int = 0
    blocks: int = 0
    qkv: int = 0
    head: int = 0
    vocab_stats: int = 0
    tokens: int = 0

    def add(self, other: Work) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# ----------------------------------------------------------------------------------------------------------
# Statistics for the rule: active tokens only, only what it reads


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
_FUSED_MIN_ROWS = 16  # fewer active tokens take the eager path


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


class _Tracker:
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

    def logits_buffer(self, n: int) -> Tensor:
        return self.bufs[self.cur][:n]

    def readout(self, model: DepthRecurrentLM, y: Tensor, loop: int) -> dict[str, Tensor]:
        """Head + statistics of the coda outputs ``y`` (N, d): fills :meth:`logits_buffer` and returns the
        output fields in ``need`` (N,) (``log_probs`` (N, V))."""
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
        fused = self.fused and n >= _FUSED_MIN_ROWS  # a few rows: eager is as fast, and no recompiles for N = 1
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
        return res

    def states(self, x: Tensor, loop: int) -> dict[str, Tensor]:
        """The state fields in ``need`` of the active tokens' new states ``x`` (N, d)."""
        need, res = self.need, {}
        first = self.loop == 0
        if need & {"state_delta", "cosine"}:
            if first:
                inf = torch.full((x.shape[0],), math.inf, device=x.device)
                res["state_delta"], res["cosine"] = inf, -inf
            else:
                res["state_delta"], res["cosine"] = state_change(x, self.prev["state"])
        if "state_step" in need:
            prev = None if first else _Trajectory(loop - 1, self.prev["state"], self.prev["state_step"],
                                                  self.prev["accel"])
            res["state_step"], res["accel"], res["accel_prev"] = trajectory_step(x, prev)  # type: ignore[arg-type]
        return res

    def done(self, loop: int, x: Tensor, res: dict[str, Tensor]) -> None:
        """Remember this loop's values for the next loop."""
        self.prev = {k: v for k, v in res.items() if k in ("lse", "entropy", "argmax", "argmax_run", "log_probs",
                                                            "state_step", "accel")}
        if self.need & {"state_delta", "cosine", "state_step"}:
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
class _Trajectory:
    """What :func:`~drc_core.analysis.loops.trajectory_step` reads of the previous loop."""

    loop: int
    state: Tensor
    state_step: Tensor
    accel: Tensor


def _compact_stats(loop: int, x: Tensor, res: dict[str, Tensor]) -> LoopStats:
    """The (1, N) :class:`LoopStats` of the computed fields ``res``; the others are placeholders (NaN, argmax -1,
    run 0, empty log-probs and steps) that a rule declaring its ``reads`` never looks at (one placeholder tensor
    per kind, shared by the fields of that kind)."""
    n = x.shape[0]
    filled: dict[str, Tensor] = {}
    nan = empty = None
    for name in _STAT_FIELDS:
        if name in res:
            filled[name] = res[name][None]
        elif name in ("log_probs", "state_step"):
            empty = x.new_empty(1, n, 0) if empty is None else empty
            filled[name] = empty
        elif name == "argmax":
            filled[name] = torch.full((1, n), -1, dtype=torch.long, device=x.device)
        elif name == "argmax_run":
            filled[name] = torch.zeros((1, n), dtype=torch.long, device=x.device)
        else:
            nan = torch.full((1, n), math.nan, device=x.device) if nan is None else nan
            filled[name] = nan
    return LoopStats(loop=loop, state=x[None], **filled)


class _FullLayout:
    """For a rule with ``reads=None``: every statistic scattered into (B, W) buffers, so a halted token keeps its
    exit-loop values (its decisions are ignored anyway); ``state`` is the (B, W, d) state, halted tokens frozen."""

    def __init__(self, shape: tuple[int, int], vocab: int, like: Tensor) -> None:
        dev = like.device

        def nan() -> Tensor:
            return torch.full(shape, math.nan, device=dev)

        self.full: dict[str, Tensor] = {
            "log_probs": torch.zeros(*shape, vocab, device=dev),
            "kl": nan(), "state_delta": nan(), "entropy": nan(), "entropy_delta": nan(), "cosine": nan(),
            "argmax": torch.full(shape, -1, dtype=torch.long, device=dev),
            "argmax_run": torch.zeros(shape, dtype=torch.long, device=dev), "top_prob": nan(), "minp_kl": nan(),
            "state_step": torch.zeros(*shape, like.shape[-1], device=dev), "accel": nan(), "accel_prev": nan(),
        }

    def stats(self, loop: int, lin: Tensor, res: dict[str, Tensor], state: Tensor) -> LoopStats:
        for name, buf in self.full.items():
            if name in res:
                buf.view(-1, *buf.shape[2:])[lin] = res[name].to(buf.dtype)
        return LoopStats(loop=loop, state=state, **self.full)


# ----------------------------------------------------------------------------------------------------------
# The loop


@dataclass
class LoopCaches:
    """Key/value caches for :func:`run_loops`: ``core[j]``/``coda[j]`` are block j's (K, V), either one slab
    (B, H, T, hd) each that always holds every token's last computed keys/values (``per_loop=False``), or
    one slab per loop (L, B, H, T, hd) where slab l-1 holds every token's loop-min(l, e) keys/values
    (``per_loop=True``, what generation needs to add tokens later). A token still active at loop l writes
    its own loop-l slab; one that exits at loop e copies its loop-e keys/values into slabs e+1..L."""

    core: list[KVSlab]
    coda: list[KVSlab]
    per_loop: bool
    _views: list[tuple[list[KVSlab], list[KVSlab]]] | None = field(default=None, repr=False)

    def slabs(self, loop: int) -> tuple[list[KVSlab], list[KVSlab]]:
        """The core and coda slabs that loop ``loop`` reads and writes (per-loop views made once, not per step)."""
        if not self.per_loop:
            return self.core, self.coda
        if self._views is None:
            loops = self.core[0][0].shape[0] if self.core else 0
            self._views = [([(k[i], v[i]) for k, v in self.core], [(k[i], v[i]) for k, v in self.coda])
                           for i in range(loops)]
        return self._views[loop - 1]

    def exited(self, toks: Tokens, loop: int) -> None:
        """Tokens that exit at ``loop`` offer their loop-``loop`` keys/values at every later loop."""
        if not self.per_loop or len(toks) == 0:
            return
        for k, v in (*self.core, *self.coda):
            if loop < k.shape[0]:
                for t in (k, v):
                    t[loop:, toks.rows, :, toks.pos] = t[loop - 1, toks.rows, :, toks.pos][:, None]


@dataclass
class LoopResult:
    """What :func:`run_loops` returns for the processed positions [t0, t1): ``exit_loop`` (B, W) long and
    ``logits`` (B, W, V) at each token's exit loop; the states are written into the state tensor."""

    exit_loop: Tensor
    logits: Tensor


def run_loops(model: DepthRecurrentLM, rule: HaltingRule, s: Tensor, e: Tensor, window: tuple[int, int],
              caches: LoopCaches, *, work: Work | None = None, fused: bool = False) -> LoopResult:
    """Run loops 1..``rule.max_loops`` with per-token halting on the tokens at positions [t0, t1) of every
    row, computing only the active ones; earlier positions must be complete (their caches filled).

    ``s`` (B, T, d) holds s_0 at the processed positions and is updated in place (a halted token keeps its
    exit state); ``e`` (B, T, d) is the prelude output. Stops as soon as every processed token has halted.
    ``work``, if given, is incremented by the work done (:class:`Work`). ``fused``: the readout statistics
    through the compiled kernel (:func:`fused_stats_kernel`) instead of the eager chunked pass.
    """
    t0, t1 = window
    B, width, d = s.shape[0], t1 - t0, s.shape[-1]
    V = model.cfg.vocab_size
    exit_loop = torch.zeros(B, width, dtype=torch.long, device=s.device)
    # a rule with a per-loop readout: the exiting tokens' logits rows, copied out of the loop's logits buffer;
    # without: their coda outputs (d wide, not V), and the head runs once at the end on every token, as in the
    # dense forward. Allocated at the first exit (or the loop's own tensor, if every token exits at once).
    logits: Tensor | None = None
    hidden: Tensor | None = None
    flat_exit = exit_loop.view(-1)
    need = stat_fields(rule)
    per_loop = rule.needs_log_probs
    toks = Tokens.window(B, t0, t1, s.device)
    lin = torch.arange(B * width, device=s.device)  # the active tokens' index into the (B, W) window
    x = s[:, t0:t1].reshape(-1, d)
    inj = e[:, t0:t1].reshape(-1, d)
    core_kv, coda_kv = caches.slabs(1)
    attn = Attn(toks, B, core_kv[0][0].shape[-2], model.cfg.n_heads, (model.rope_cos, model.rope_sin), window,
                scratch=not caches.per_loop)
    tracker = _Tracker(need, len(toks), V, s, per_loop, fused)
    full = _FullLayout((B, width), V, s) if rule.reads is None else None
    w = work if work is not None else Work()
    for loop in range(1, rule.max_loops + 1):
        core_kv, coda_kv = caches.slabs(loop)
        n = x.shape[0]
        x = model.inject(x, inj)
        for block, kv in zip(model.core, core_kv, strict=True):
            x = block_step(block, x, attn, kv, model.rope_cos, model.rope_sin)
        w.core += n
        res = tracker.states(x, loop)
        if per_loop:
            y = coda(model, x, attn, coda_kv, work=w)
            res.update(tracker.readout(model, y, loop))
            w.head += n
            w.vocab_stats += n * tracker.vocab_passes
        if loop < rule.min_loops:  # no token halts before min_loops (HaltingRule.decide): no decision, no sync
            tracker.done(loop, x, res)
            continue
        if full is not None:
            s.view(-1, d)[_window_to_seq(lin, width, s.shape[1], t0)] = x
            now = rule.decide(full.stats(loop, lin, res, s[:, t0:t1])).view(-1)[lin]
        else:
            now = rule.decide(_compact_stats(loop, x, res)).reshape(n)
        gone = now.nonzero().squeeze(1)
        n_gone = gone.numel()
        if n_gone:
            everyone = n_gone == n
            if per_loop:
                out = tracker.logits_buffer(n) if everyone else tracker.logits_buffer(n).index_select(0, gone)
                logits = _put_rows(logits, (B, width, V), lin, gone, out.to(s.dtype))
            else:
                out = _exit_readout(model, x, attn, now, gone, coda_kv, w, full_context=caches.per_loop)
                hidden = _put_rows(hidden, (B, width, d), lin, gone, out)
            flat_exit.index_fill_(0, lin[gone], loop)
            s.view(-1, d)[_window_to_seq(lin[gone], width, s.shape[1], t0)] = x.index_select(0, gone)
            caches.exited(attn.toks.select(gone), loop)
        elif not per_loop and caches.per_loop and len(model.coda) and loop >= rule.min_loops:
            # generation: later tokens that exit at this loop read these coda keys/values (none exits before
            # min_loops, so those loops' coda slabs are never read and not written)
            _exit_readout(model, x, attn, now, gone, coda_kv, w, full_context=True)
        tracker.done(loop, x, res)
        if n_gone == n:
            break
        if n_gone:
            keep = (~now).nonzero().squeeze(1)
            x, inj, lin = x.index_select(0, keep), inj.index_select(0, keep), lin.index_select(0, keep)
            attn = attn.select(keep)
            tracker.keep(keep)
    w.tokens += B * width
    if hidden is not None:
        logits = model.head(hidden).to(s.dtype)
    if logits is None:
        logits = s.new_empty(B, width, V)
    return LoopResult(exit_loop=exit_loop, logits=logits)


def _put_rows(buf: Tensor | None, shape: tuple[int, int, int], lin: Tensor, gone: Tensor, rows: Tensor) -> Tensor:
    """Write ``rows`` (G, k) of the exiting tokens ``gone`` (an index into the active tokens, whose window
    indices are ``lin``) into ``buf`` (B, W, k), allocated on first use; when every token of the window exits at
    once, ``rows`` (in window order) becomes the buffer without a copy. (``index_put_``: on a CPU 3x faster than
    ``index_copy_`` for rows of V = 4096 floats.)"""
    if buf is None and rows.shape[0] == shape[0] * shape[1]:
        return rows.view(shape)
    if buf is None:
        buf = rows.new_empty(shape)
    buf.view(-1, shape[2])[lin[gone]] = rows
    return buf


def _window_to_seq(lin: Tensor, width: int, seq_len: int, t0: int) -> Tensor:
    """Flat (B, W) window indices -> flat (B, T) sequence indices."""
    if width == seq_len:
        return lin
    return (lin // width) * seq_len + lin % width + t0


def _exit_readout(model: DepthRecurrentLM, x: Tensor, attn: Attn, now: Tensor, gone: Tensor,
                  coda_kv: list[KVSlab], work: Work, *, full_context: bool) -> Tensor:
    """The coda outputs (G, d) of the tokens that exit now (``now`` (N,) bool, ``gone`` their index, G of them)
    for a rule without a per-loop readout (the head runs later, once for every token). The coda context is the
    active tokens of their rows at or before the last exiting position (every active token with
    ``full_context``: generation, whose later tokens read these coda keys/values)."""
    if gone.numel() == now.numel():  # everyone exits: the whole layout, every token a query
        y = coda(model, x, attn, coda_kv, work=work)
    else:
        toks = attn.toks
        if not full_context:
            last = torch.full((attn.batch,), -1, dtype=torch.long, device=x.device)
            last.scatter_reduce_(0, toks.rows[gone], toks.pos[gone], reduce="amax")
            ctx = (toks.pos <= last[toks.rows]).nonzero().squeeze(1)
            if ctx.numel() < now.numel():
                x, now, attn = x.index_select(0, ctx), now.index_select(0, ctx), attn.select(ctx)
        y = coda(model, x, attn, coda_kv, query=now, work=work)
    work.head += y.shape[0]
    return y


# ----------------------------------------------------------------------------------------------------------
# Public entry point


def check_state(state: Tensor | None, shape: tuple[int, int, int], what: str = "(B, T, d_model)") -> None:
    """A one-line DrcError unless ``state`` is None or a tensor of ``shape`` (``what`` names its axes)."""
    if state is not None and (not isinstance(state, Tensor) or tuple(state.shape) != shape):
        shown = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
        raise DrcError(
            f"state has shape {shown} but must be {what} = {shape}; "
            "pass s_0 for every position, or state=None to draw it"
        )


@dataclass
class SkipResult(AdaptiveResult):
    """:class:`~drc_core.halting.rules.AdaptiveResult` plus the :class:`Work` the skipping run did."""

    work: Work | None = None


@torch.no_grad()
def skip_forward(
    model: DepthRecurrentLM,
    idx: Tensor,
    rule: HaltingRule,
    *,
    generator: torch.Generator | None = None,
    state: Tensor | None = None,
    fused: bool = False,
) -> SkipResult:
    """:func:`drc_core.halting.rules.masked_forward`, computing only the active tokens at every loop.

    Same arguments, same :class:`~drc_core.halting.rules.AdaptiveResult` (a :class:`SkipResult`, which also
    carries the :class:`Work` done), same semantics (halted tokens frozen, offering their exit-loop keys/values
    in every core and coda block; logits from the exit loop), equal to it to float tolerance with the same
    exit loops (a decision can only differ where a statistic lies within rounding of the threshold). A rule
    that declares :attr:`~drc_core.halting.rules.HaltingRule.reads` decides on the active tokens' statistics in
    a (1, N) layout, with only the fields it reads computed (the others are placeholders); a rule with
    ``reads=None`` gets :class:`~drc_core.analysis.loops.LoopStats` over (B, T) whose active entries equal the
    reference's (a halted token's are stale; its decisions are ignored). Stops early once every token has
    halted. ``fused=True`` computes the readout statistics of a rule with log-probs with one compiled kernel
    (``torch.compile``, needs a C++ compiler on a CPU; the first call compiles). Runs under
    ``torch.no_grad()`` (and under the caller's autocast, if any); put the model in eval mode first if it has
    dropout. Cost: see the module docstring.
    """
    if not isinstance(rule, HaltingRule):
        raise DrcError(f"rule={rule!r} is not a HaltingRule; pass e.g. KLThreshold(1e-3)")
    if idx.dim() != 2:
        raise DrcError(f"idx must be (B, T) token ids; got shape {tuple(idx.shape)}")
    B, T = idx.shape
    check_state(state, (B, T, model.cfg.d_model))
    e = model.embed(idx)
    s = (model.initial_state(e, generator) if state is None else state).to(e.dtype).clone()
    caches = LoopCaches(core=empty_caches(model, len(model.core), (B, T), e),
                        coda=empty_caches(model, len(model.coda), (B, T), e), per_loop=False)
    work = Work(blocks=B * T * len(model.prelude))
    res = run_loops(model, rule, s, e, (0, T), caches, work=work, fused=fused)
    return SkipResult(exit_loop=res.exit_loop, logits=res.logits, avg_depth=float(res.exit_loop.float().mean()),
                      state=s, rule=str(rule), work=work)

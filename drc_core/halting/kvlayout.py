"""Where the skipping paths' tokens write and read keys/values: flat tokens (:class:`Tokens`), their attention
layout over caches (:class:`Attn`), one block on them (:func:`block_step`), the coda (:func:`coda`), and the
per-block caches with the exit policy of the halting semantics (:class:`LoopCaches`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.halting.work import Work
from drc_core.model.blocks import Block
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["Attn", "KVSlab", "LoopCaches", "Tokens", "block_step", "coda", "empty_caches"]

KVSlab = tuple[Tensor, Tensor]  # (K, V), each (B, H, T, hd): one block's cached keys/values at one loop


@dataclass
class Tokens:
    """A flat list of N tokens at ``(rows[i], pos[i])``, in row-major order (rows, then positions, ascending)."""

    rows: Tensor
    pos: Tensor

    @classmethod
    def window(cls, batch: int, t0: int, t1: int, device: torch.device) -> Tokens:
        """Every row's positions t0..t1-1."""
        if t1 - t0 == 1:  # one position per row (a decode step): two ops instead of four
            return cls(torch.arange(batch, device=device), torch.full((batch,), t0, dtype=torch.long, device=device))
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
    """How the N flat tokens ``toks`` write keys/values into and attend over caches (B, H, T, hd), built once per
    active set. ``dense`` (every row's positions of ``window`` present): the (B, H, W, hd) layout of
    ``Block.forward``, with ``scratch`` over a whole cache read by this run only writing at :meth:`flush`.
    Otherwise queries are padded per row to the largest count, with a causal mask over the keys."""

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
        """Write the tokens' keys/values into the cache (kept until :meth:`flush` in the lazy layout)."""
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
        """Causal attention of the tokens' queries over their rows' cached keys/values -> (N, H * hd)."""
        if self.dense:
            t0, t1 = self.t0, self.t1
            batch, heads, _, hd = q.shape
            fresh = self.pending.get(id(kv[0]))
            if fresh is not None:
                k, v = fresh[1], fresh[2]
            else:
                k, v = kv[0][:, :, :t1].to(q.dtype), kv[1][:, :, :t1].to(q.dtype)
            if t0 == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif t1 - t0 == 1:
                y = F.scaled_dot_product_attention(q, k, v)
            else:
                mask = torch.arange(t1, device=q.device) <= torch.arange(t0, t1, device=q.device)[:, None]
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return y.transpose(1, 2).reshape(batch * (t1 - t0), heads * hd)
        heads, hd = q.shape[1:]
        k, v = kv[0][:, :, : self.t_k], kv[1][:, :, : self.t_k]
        if self.used is not None:
            k, v = k.index_select(0, self.used), v.index_select(0, self.used)
        k, v = k.to(q.dtype), v.to(q.dtype)
        q_pad = q.new_zeros(self.n_rows * self.width, heads, hd).index_copy_(0, self.q_index, q)
        y = F.scaled_dot_product_attention(q_pad.view(self.n_rows, self.width, heads, hd).transpose(1, 2), k, v,
                                           attn_mask=self.mask.to(q.dtype))
        return y.transpose(1, 2).reshape(-1, heads * hd).index_select(0, self.q_index)

    def project(self, block: Block, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (N, H, hd) of the flat tokens ``x`` (N, d) outside the dense layout."""
        q, k, v = (t[0].transpose(0, 1) for t in block.qkv(x[None], self.cos, self.sin))
        return q, k, v

    def select(self, keep: Tensor) -> Attn:
        """The layout of the kept tokens (``keep`` (N,) bool or an index); the kept keys/values are written first."""
        self.flush()
        return Attn(self.toks.select(keep), self.batch, self.seq_len, self.heads, self.rope)


def block_step(block: Block, x: Tensor, toks: Tokens | Attn, kv: KVSlab, cos: Tensor, sin: Tensor,
               query: Tensor | None = None, *, work: Work | None = None) -> Tensor:
    """One block on the flat tokens ``x`` (N, d) at ``toks`` (or their :class:`Attn` layout) over the cache ``kv``,
    into which their keys/values are written first; only the ``query`` (N,) bool tokens get attention and MLP."""
    attn = toks if isinstance(toks, Attn) else Attn(toks, kv[0].shape[0], kv[0].shape[2], kv[0].shape[1], (cos, sin))
    n = x.shape[0]
    if attn.dense:  # the layout of Block.forward: q, k, v (B, H, W, hd)
        q, k, v = block.qkv(x.view(attn.batch, -1, x.shape[-1]), attn.cos_w, attn.sin_w)
    else:
        q, k, v = attn.project(block, x)  # q (N, ...) in the layout's own shape
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
    """The coda blocks on the flat states ``x`` (N, d): every token writes its keys/values, only the ``query`` tokens
    (default all) run the last block's attention and MLP."""
    last = len(model.coda) - 1
    cos, sin = model.rope_cos, model.rope_sin
    for j, (block, kv) in enumerate(zip(model.coda, coda_kv, strict=True)):
        x = block_step(block, x, attn, kv, cos, sin, query=query if j == last else None, work=work)
    if last < 0 and query is not None:
        x = x[query]
    return x


def empty_caches(model: DepthRecurrentLM, n_blocks: int, shape: tuple[int, ...], like: Tensor) -> list[KVSlab]:
    """Zeroed (K, V) caches per block, each ``(*lead, B, H, T, hd)`` for ``shape = (*lead, B, T)``."""
    *lead, B, T = shape
    size = (*lead, B, model.cfg.n_heads, T, model.cfg.head_dim)
    return [(like.new_zeros(size), like.new_zeros(size)) for _ in range(n_blocks)]


@dataclass
class LoopCaches:
    """Key/value caches of :func:`~drc_core.halting.skipping.run_loops` per block: one slab (B, H, T, hd) of every
    token's last keys/values, or (``per_loop``, for generation) (L, B, H, T, hd), slab l-1 holding every token's
    loop-min(l, e) keys/values."""

    core: list[KVSlab]
    coda: list[KVSlab]
    per_loop: bool
    _views: list[tuple[list[KVSlab], list[KVSlab]]] | None = field(default=None, repr=False)

    def slabs(self, loop: int) -> tuple[list[KVSlab], list[KVSlab]]:
        """The core and coda slabs that loop ``loop`` reads and writes."""
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

"""Continuous depth batching (arXiv 2608.09444): generation whose rows advance one loop at a time, each on its own.

:func:`generate_continuous` runs *core steps*: one loop of every active (row, token) item, each at its own loop; an
exiting token runs coda + head and chooses the next token, which joins the next step at loop 1; a finished row frees
its slot for the next waiting request. Every request gets the tokens and exit loops of decoding it alone with
:func:`~drc_core.halting.generate.generate` (logits to float tolerance). Caches per block are ``(2, L, S, H, T, hd)``
(S slots, L = ``rule.max_loops``): an item of slot b at loop l is row (l - 1) * S + b of one flat batch, so one
layout serves every block of a step. Per step one host-to-device copy of its indices and one host sync.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import STATISTICS
from drc_core.errors import DrcError
from drc_core.halting.generate import check_generate_args, choose_next, prelude_step
from drc_core.halting.kvlayout import Attn, KVSlab, LoopCaches, Tokens, block_step, coda
from drc_core.halting.loopstats import Tracker, compact_stats, stat_fields
from drc_core.halting.rules import HaltingRule
from drc_core.halting.skipping import check_state, run_loops
from drc_core.halting.work import Work
from drc_core.model.blocks import Block
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["Completion", "ContinuousResult", "generate_continuous"]


@dataclass
class Completion:
    """One request's output, as a row of :class:`~drc_core.halting.generate.GenerationResult` (``logits`` None
    unless ``keep_logits``), and when (seconds since the call) its prompt began, its first and last token came."""

    tokens: Tensor
    exit_loop: Tensor
    logits: Tensor | None
    initial_state: Tensor
    prompt_len: int
    admitted: float
    first_token: float
    finished: float

    @property
    def new_tokens(self) -> Tensor:
        return self.tokens[self.prompt_len :]

    @property
    def new_avg_depth(self) -> float:
        """The mean exit loop of the positions whose outputs chose the new tokens."""
        return float(self.exit_loop[self.prompt_len - 1 :].float().mean())


@dataclass
class ContinuousResult:
    """What :func:`generate_continuous` returns: the :class:`Completion` of each request, core steps, work, time."""

    completions: list[Completion]
    rule: str
    slots: int
    steps: int
    work: Work
    seconds: float

    @property
    def new_avg_depth(self) -> float:
        """The mean exit loop over every request's new-token positions."""
        loops = torch.cat([c.exit_loop[c.prompt_len - 1 :] for c in self.completions])
        return float(loops.float().mean())

    def latency(self, q: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
        """Percentiles (seconds) of the per-request latency from the call to its last token (``ttft p..``: first)."""
        done = np.array([c.finished for c in self.completions])
        first = np.array([c.first_token for c in self.completions])
        out = {f"p{g:g}": float(np.percentile(done, g)) for g in q}
        out.update({f"ttft p{g:g}": float(np.percentile(first, g)) for g in q})
        return out


class _Items(Attn):
    """The :class:`~drc_core.halting.kvlayout.Attn` of one item per flat cache row, over a block's K and V kept as one
    tensor ``kv`` = ((2, R, H, T, hd), its (2, R * H * T, hd) view): item i at row ``rows[i]`` writes position
    ``pos[i]`` (``kv_index``: its heads' offsets in that view, head-major) and attends to 0..pos[i] (``mask``).
    ``lockstep`` = (first slot, end slot, loop, S): the items are those slots at one loop, read in place. A
    :meth:`select`'s positions, RoPE rows and offsets are made when first read."""

    def __init__(self, rows: Tensor, mask: Tensor, t_k: int, rope: tuple[Tensor, Tensor], heads: int,
                 lockstep: tuple[int, int, int, int] | None = None, *, pos: Tensor | None = None,
                 kv_index: Tensor | None = None, parent: tuple[_Items, Tensor] | None = None) -> None:
        self.rows, self.mask, self.t_k, self.rope, self.heads, self.lockstep = rows, mask, t_k, rope, heads, lockstep
        self.dense, self._parent = False, parent
        if parent is None:
            self.pos, self.kv_index = pos, kv_index  # else cached_property: made from the parent on first read

    @cached_property
    def pos(self) -> Tensor:
        parent, keep = self._parent
        return parent.pos.index_select(0, keep)

    @cached_property
    def cos(self) -> Tensor:
        return self.rope[0].index_select(0, self.pos)

    @cached_property
    def sin(self) -> Tensor:
        return self.rope[1].index_select(0, self.pos)

    @cached_property
    def kv_index(self) -> Tensor:
        parent, keep = self._parent
        return parent.kv_index.view(self.heads, -1).index_select(1, keep).view(-1)

    def project(self, block: Block, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (N, H, 1, hd), the queries of :meth:`attend`; k, v (1, H, N, hd), as ``Block.qkv`` gives them."""
        q, k, v = block.qkv(x[None], self.cos, self.sin)
        return q.permute(2, 1, 0, 3), k, v

    def write(self, kv: KVSlab, k: Tensor, v: Tensor) -> None:
        new = torch.stack((k, v))  # (2, 1, H, N, hd): head-major rows, as kv_index
        if new.dtype != kv[1].dtype:
            new = new.to(kv[1].dtype)
        kv[1].index_copy_(1, self.kv_index, new.view(2, -1, new.shape[-1]))

    def attend(self, q: Tensor, kv: KVSlab) -> Tensor:
        if self.lockstep is not None:
            first, end, loop, n_slots = self.lockstep
            both = kv[0].view(2, -1, n_slots, *kv[0].shape[2:])[:, loop, first:end]
        else:
            both = kv[0].index_select(1, self.rows)  # (2, N, H, T, hd): each item's row
        k, v = both[0, :, :, : self.t_k], both[1, :, :, : self.t_k]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask = self.mask if self.mask.dtype == q.dtype else self.mask.to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.reshape(q.shape[0], -1)

    def select(self, keep: Tensor) -> _Items:
        return _Items(self.rows.index_select(0, keep), self.mask.index_select(0, keep), self.t_k, self.rope,
                      self.heads, parent=(self, keep))


def _is_run(slots: list[int]) -> bool:
    """Whether sorted, distinct ``slots`` are consecutive (read and written through a slice)."""
    return slots[-1] - slots[0] + 1 == len(slots)


def _take(t: Tensor, sel: Tensor | slice) -> Tensor:
    return t[sel] if isinstance(sel, slice) else t.index_select(0, sel)


def _put(t: Tensor, sel: Tensor | slice, value: Tensor) -> None:
    if isinstance(sel, slice):
        t[sel] = value
    else:
        t.index_copy_(0, sel, value)


def _masked(res: dict[str, Tensor], loops: Tensor) -> dict[str, Tensor]:
    """The first loop's values for the items at loop 1 (and 2, for second-order statistics): their slot's previous
    values belong to another token."""
    first = loops == 1
    early = loops <= 2 if "accel" in res or "accel_prev" in res else first
    for name, value in res.items():
        stat = STATISTICS.get(name)
        if name in ("accel", "accel_prev"):  # second order: undefined at loops 1 and 2
            res[name] = value.masked_fill(early, math.inf)
        elif stat is not None and stat.first is not None:
            res[name] = value.masked_fill(first, stat.first)
        elif name == "argmax_run":
            res[name] = value.masked_fill(first, 1)
        elif name == "state_step":
            res[name] = value.masked_fill(first[:, None], 0.0)
    return res


def _request_list(prompts: Tensor | Sequence[Tensor], max_new_tokens: int | Sequence[int],
                  states: Sequence[Tensor | None] | Tensor | None) -> list[tuple[Tensor, int, Tensor | None]]:
    """(prompt (1, T0), n, state (T0 + n, d) or None) per request, with one-line errors."""
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2:
            raise DrcError(f"prompts has shape {tuple(prompts.shape)}; pass (B, T0) token ids or a list of (T0,) "
                           "tensors")
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) or not prompts:
        raise DrcError("prompts is empty; pass at least one prompt ((B, T0) ids or a list of (T0,) tensors)")
    n_req = len(prompts)
    news = [max_new_tokens] * n_req if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(news) != n_req:
        raise DrcError(f"max_new_tokens has {len(news)} entries for {n_req} prompts; pass one int or one per prompt")
    states = [None] * n_req if states is None else list(states)
    if len(states) != n_req:
        raise DrcError(f"states has {len(states)} entries for {n_req} prompts; pass one per prompt or None")
    out = []
    for i, (p, n, s) in enumerate(zip(prompts, news, states, strict=True)):
        if not isinstance(p, Tensor) or p.dim() != 1:
            shown = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise DrcError(f"prompt {i} is {shown}; each prompt must be a 1-D tensor of token ids")
        out.append((p[None], n, s))
    return out


@torch.no_grad()
def generate_continuous(model: DepthRecurrentLM, prompts: Tensor | Sequence[Tensor],
                        max_new_tokens: int | Sequence[int], rule: HaltingRule, *, slots: int | None = None,
                        temperature: float = 0.0, generator: torch.Generator | None = None,
                        states: Sequence[Tensor | None] | Tensor | None = None, fused: bool = False,
                        keep_logits: bool = True) -> ContinuousResult:
    """Generate ``max_new_tokens`` (one int, or one per prompt) after each of ``prompts`` ((B, T0) ids or a list of
    1-D prompts) with continuous depth batching. ``slots``: rows decoded together (default: all requests; fewer is
    serving mode). ``states``: each request's initial states (T0 + n, d), else drawn up front request by request.
    The rest as in :func:`~drc_core.halting.generate.generate`; the rule must declare its ``reads``."""
    t_start = time.perf_counter()
    reqs = _request_list(prompts, max_new_tokens, states)
    for p, n, _ in reqs:
        check_generate_args(model, p, n, rule, temperature)
    if rule.reads is None:
        raise DrcError(f"rule {rule} does not declare the statistics it reads (reads=None: a router or a rule of "
                       "your own); continuous batching decides token by token, so use generate for it")
    n_slots = len(reqs) if slots is None else slots
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
        raise DrcError(f"slots={slots!r} is invalid; it must be an integer >= 1 (or None: one per request)")
    d = model.cfg.d_model
    like = torch.empty(0, dtype=model.tok_emb.weight.dtype, device=model.rope_cos.device)
    init = []
    for i, (p, n, s) in enumerate(reqs):
        check_state(s, (p.shape[1] + n, d), f"(T0 + max_new_tokens, d_model) for prompt {i}")  # type: ignore[arg-type]
        s = model.initial_state(like.new_zeros(1, p.shape[1] + n, d), generator) if s is None else s[None]
        init.append(s.to(like))
    decoder = _Decoder(model, rule, reqs, init, min(n_slots, len(reqs)), t_start, temperature=temperature,
                       generator=generator, fused=fused, keep_logits=keep_logits)
    while decoder.step():
        pass
    return decoder.result()


class _Decoder:
    """The scheduler of :func:`generate_continuous`: slots, caches, queue, records; :meth:`step`, one core step."""

    def __init__(self, model: DepthRecurrentLM, rule: HaltingRule, reqs: list[tuple[Tensor, int, Tensor | None]],
                 init: list[Tensor], n_slots: int, t_start: float, *, temperature: float,
                 generator: torch.Generator | None, fused: bool, keep_logits: bool) -> None:
        self.model, self.rule, self.reqs, self.n_slots, self.t_start = model, rule, reqs, n_slots, t_start
        self.temperature, self.generator, self.fused, self.keep_logits = temperature, generator, fused, keep_logits
        cfg = model.cfg
        d, self.L, self.V, self.heads = cfg.d_model, rule.max_loops, cfg.vocab_size, cfg.n_heads
        self.device, self.dtype = model.rope_cos.device, model.tok_emb.weight.dtype
        like = self.like = torch.empty(0, dtype=self.dtype, device=self.device)
        self.T = T = max(p.shape[1] + n for p, n, _ in reqs)
        # every request's initial states in one tensor (a joining token's state is one row of it); init[r] a view
        self.init_rows = torch.cat([s[0] for s in init])
        self.init_offset = list(itertools.accumulate([s.shape[1] for s in init], initial=0))
        self.init = [self.init_rows[o : o + s.shape[1]][None] for o, s in zip(self.init_offset[:-1], init, strict=True)]
        # K and V of a block in one tensor, prelude (2, 1, S, H, T, hd), core and coda (2, L, S, H, T, hd) all in one
        hd, n_core = cfg.head_dim, len(model.core)
        self.pre_joint = like.new_zeros(len(model.prelude), 2, 1, n_slots, cfg.n_heads, T, hd)
        self.looped_kv = like.new_zeros(n_core + len(model.coda), 2, self.L, n_slots, cfg.n_heads, T, hd)
        pairs = [(p[0], p[1]) for p in self.looped_kv]  # (L, S, H, T, hd)
        self.core_kv, self.coda_kv = pairs[:n_core], pairs[n_core:]
        self.pre_looped = [(p[0], p[1]) for p in self.pre_joint]  # the prelude's caches as one loop's slab
        # per group of blocks: its (K, V) slabs (dense layout) and each block's flat (2, L * S, H, T, hd) rows with
        # their (2, L * S * H * T, hd) view (the items' layout)
        self.groups = {name: (pairs_, [(j.view(2, -1, *j.shape[3:]), j.view(2, -1, hd)) for j in joint])
                       for name, pairs_, joint in (("prelude", self.pre_looped, self.pre_joint),
                                                   ("core", self.core_kv, self.looped_kv[:n_core]),
                                                   ("coda", self.coda_kv, self.looped_kv[n_core:]))}
        self.kv_rows = self.looped_kv.view(-1, self.L * n_slots * cfg.n_heads * T, hd)  # exits copy these rows
        self.rope = (model.rope_cos, model.rope_sin)
        # additive causal masks by position: row p lets a query at p see keys 0..p
        self.causal = like.new_zeros(T, 1, 1, T).masked_fill_(
            torch.ones(T, T, dtype=torch.bool, device=self.device).triu_(1)[:, None, None], -math.inf)
        self.slot_ids = torch.arange(n_slots, device=self.device)
        self.views: dict[tuple[object, ...], list[list[tuple[Tensor, Tensor]]]] = {}  # cache views, made once
        self.per_loop = rule.needs_log_probs
        self.need = stat_fields(rule)
        self.work = Work()
        # per slot: its request (-1: free), the position and loop of its token, its state and injection, and the
        # previous loop's statistics of that token
        self.request, self.pos, self.loop = [-1] * n_slots, [0] * n_slots, [0] * n_slots
        self.state, self.inj = like.new_zeros(n_slots, d), like.new_zeros(n_slots, d)
        self.prev: dict[str, Tensor] = {}
        self.tokens: list[list[int]] = [[] for _ in reqs]  # each request's tokens so far (host side)
        self.prompt_exits: list[Tensor] = [like for _ in reqs]
        self.exits: list[list[int]] = [[] for _ in reqs]  # exit loops of the decode phase
        self.outs: list[list[Tensor]] = [[] for _ in reqs]
        self.times = [[0.0, 0.0, 0.0] for _ in reqs]  # admitted, first token, finished
        self.queue = list(range(len(reqs)))
        self.joiners: list[int] = []
        # exits' key/value copies not yet made (rows of kv_rows: sources, destinations), the step that first reads one
        self.copies: tuple[list[int], list[int]] = ([], [])
        self.copy_by: float = math.inf
        self.z_none = like.new_empty(0, self.V, dtype=torch.float32)
        # this step's logits and each slot's previous ones (rules that read the output distribution)
        self.z_buf = like.new_empty(n_slots, self.V, dtype=torch.float32) if self.per_loop else self.z_none
        self.z_prev = like.new_zeros(n_slots, self.V, dtype=torch.float32) if self.per_loop else self.z_none
        self.steps = 0

    def now_s(self) -> float:
        return time.perf_counter() - self.t_start

    def chosen(self, b: int, token: int) -> None:
        """Slot b's token chose ``token``: finish the request or queue that token for :meth:`join`."""
        r = self.request[b]
        self.tokens[r].append(token)
        if len(self.tokens[r]) == self.reqs[r][0].shape[1] + 1:
            self.times[r][1] = self.now_s()
        t = len(self.tokens[r]) - 1  # the position of the token just chosen
        if t == self.reqs[r][0].shape[1] + self.reqs[r][1] - 1:  # the last new token: it is never processed
            self.times[r][2] = self.now_s()
            self.request[b], self.loop[b] = -1, 0
            return
        self.pos[b], self.loop[b] = t, 1
        self.joiners.append(b)

    def admit(self) -> None:
        """Run queued prompts on the free slots, a run of slots with prompts of one length as one batch."""
        free = [b for b in range(self.n_slots) if self.request[b] < 0]
        if free:
            self.copy_kv()  # a finished request's pending copies, before a new one writes its slot
        while free and self.queue:
            t0 = self.reqs[self.queue[0]][0].shape[1]
            n = 1
            while (n < len(free) and n < len(self.queue) and free[n] == free[0] + n
                   and self.reqs[self.queue[n]][0].shape[1] == t0):
                n += 1
            self._admit_run(free[0], [self.queue.pop(0) for _ in range(n)], t0)
            free = free[n:]

    def _admit_run(self, b0: int, rs: list[int], t0: int) -> None:
        """Prompts ``rs`` (all of length t0) on slots b0..b0+len(rs)-1, one batch."""
        model, n = self.model, len(rs)
        now = self.now_s()
        ids = torch.stack([self.reqs[r][0][0] for r in rs]).to(self.device)
        e = self.like.new_zeros(n, t0, model.cfg.d_model)
        s = torch.cat([self.init[r][:, :t0] for r in rs])
        slots = slice(b0, b0 + n)
        prelude_step(model, ids, (0, t0), [(k[0, slots], v[0, slots]) for k, v in self.pre_looped], e, self.work)
        caches = LoopCaches(core=[(k[:, slots], v[:, slots]) for k, v in self.core_kv],
                            coda=[(k[:, slots], v[:, slots]) for k, v in self.coda_kv], per_loop=True)
        res = run_loops(model, self.rule, s, e, (0, t0), caches, work=self.work, fused=self.fused)
        picks = choose_next(res.logits[:, -1], self.temperature, self.generator).tolist()
        for j, r in enumerate(rs):
            self.times[r][0] = now
            self.tokens[r] = self.reqs[r][0][0].tolist()
            self.request[b0 + j] = r
            self.prompt_exits[r] = res.exit_loop[j]
            if self.keep_logits:
                self.outs[r].append(res.logits[j])
            self.chosen(b0 + j, picks[j])

    def plan(self, items: list[int], loop_list: list[int], pos_list: list[int]) -> list[list[int]] | None:
        """What :meth:`layout` reads from the device, as host lists: None for the dense layout (a run of slots at one
        loop and position), else the items' flat rows, positions, slots, loops and key/value offsets, head-major."""
        if _is_run(items) and min(loop_list) == max(loop_list) and min(pos_list) == max(pos_list):
            return None
        n_slots, seq = self.n_slots, self.T
        rows = [(lp - 1) * n_slots + b for b, lp in zip(items, loop_list, strict=True)]
        base = [r * self.heads * seq + p for r, p in zip(rows, pos_list, strict=True)]
        return [rows, pos_list, items, loop_list, [o + h * seq for h in range(self.heads) for o in base]]

    def layout(self, items: list[int], loop_list: list[int], pos_list: list[int], groups: list[str],
               meta: list[Tensor] | None) -> tuple[Attn, list[list[tuple[Tensor, Tensor]]], Tensor, Tensor]:
        """The attention layout of the items, the caches of each of ``groups`` as its blocks take them, and the items'
        slots and loops on the device: dense over one slab when ``meta`` is None, else :class:`_Items` from it."""
        n_slots, t, n = self.n_slots, pos_list[0], len(items)
        if meta is None:
            first, li = items[0], loop_list[0] - 1
            slots = self.slot_ids[first : first + n]
            attn = Attn(Tokens.window(n, t, t + 1, self.device), n, self.T, self.heads, self.rope, (t, t + 1))
            key = (*groups, li, first, n)
            views = self.views.get(key)
            if views is None:
                views = [[(k[li, first : first + n], v[li, first : first + n]) for k, v in self.groups[g][0]]
                         for g in groups]
                self.views[key] = views
            return attn, views, slots, slots.new_full((n,), loop_list[0])
        rows_t, pos_t, b_t, loops, kv_index = meta
        lockstep = (items[0], items[-1] + 1, loop_list[0] - 1, n_slots) if (
            _is_run(items) and min(loop_list) == max(loop_list)) else None
        t_k = max(pos_list) + 1
        mask = self.causal.index_select(0, pos_t)[..., :t_k]
        attn = _Items(rows_t, mask, t_k, self.rope, self.heads, lockstep, pos=pos_t, kv_index=kv_index)
        return attn, [self.groups[g][1] for g in groups], b_t, loops

    def join(self, joiners: list[int], pos_list: list[int], meta: list[Tensor] | None, ids: Tensor,
             init_rows: Tensor) -> None:
        """The new tokens of slots ``joiners``: their initial states and prelude."""
        model = self.model
        attn, (kvs,), slots, _ = self.layout(joiners, [1] * len(joiners), pos_list, ["prelude"], meta)
        x = model.token_embedding(ids)
        for block, kv in zip(model.prelude, kvs, strict=True):
            x = block_step(block, x, attn, kv, *self.rope, work=self.work)
        sel = slice(joiners[0], joiners[-1] + 1) if _is_run(joiners) else slots
        _put(self.inj, sel, x)
        _put(self.state, sel, self.init_rows.index_select(0, init_rows))
        self.joiners.clear()

    def exited(self, gone: list[tuple[int, int, int]]) -> None:
        """Items (slot, exit loop, position) offer their exit-loop keys/values at every later loop; the copies wait
        until the first step that can read one (e + 1 steps after an exit at loop e)."""
        src, dst = self.copies
        per_loop = self.n_slots * self.heads * self.T
        for b, loop, t in gone:
            at = (b * self.heads) * self.T + t
            for later in range(loop, self.L):
                for h in range(self.heads):
                    src.append((loop - 1) * per_loop + at + h * self.T)
                    dst.append(later * per_loop + at + h * self.T)
            self.copy_by = min(self.copy_by, self.steps + loop + 1)

    def copy_kv(self) -> None:
        """Make the pending copies of :meth:`exited` (one gather and one scatter for all blocks)."""
        src, dst = self.copies
        if not src:
            return
        both = torch.tensor(src + dst, device=self.device)
        rows = self.kv_rows
        rows.index_copy_(1, both[len(src) :], rows.index_select(1, both[: len(src)]))
        self.copies, self.copy_by = ([], []), math.inf

    def step(self) -> bool:
        """Admit waiting requests, run the new tokens' prelude, then one loop of every active item; False when no
        item is left."""
        if self.queue:
            self.admit()
        items = [b for b in range(self.n_slots) if self.request[b] >= 0 and self.loop[b] > 0]
        if not items:
            return False
        self.steps += 1
        if self.steps >= self.copy_by:
            self.copy_kv()
        loop_list = [self.loop[b] for b in items]
        pos_list = [self.pos[b] for b in items]
        joiners = sorted(self.joiners)
        join_pos = [self.pos[b] for b in joiners]
        plans = [self.plan(items, loop_list, pos_list), self.plan(joiners, [1] * len(joiners), join_pos)
                 if joiners else None]
        ints = [part for p in plans if p is not None for part in p]
        if joiners:
            ints.append([self.tokens[self.request[b]][-1] for b in joiners])
            ints.append([self.init_offset[self.request[b]] + self.pos[b] for b in joiners])
        # one host-to-device copy for all of them
        parts = iter(torch.tensor(list(itertools.chain(*ints)), device=self.device).split([len(p) for p in ints])
                     if ints else ())
        metas = [None if p is None else [next(parts) for _ in p] for p in plans]
        if joiners:
            self.join(joiners, join_pos, metas[1], next(parts), next(parts))
        attn, (core_kv, coda_kv), b_t, loops = self.layout(items, loop_list, pos_list, ["core", "coda"], metas[0])
        # items that are a run of slots are read and written through slices (views), not gathers
        sel: Tensor | slice = slice(items[0], items[-1] + 1) if _is_run(items) else b_t
        x = self.model.inject(_take(self.state, sel), _take(self.inj, sel))
        for block, kv in zip(self.model.core, core_kv, strict=True):
            x = block_step(block, x, attn, kv, *self.rope)
        self.work.core += len(items)
        kept, res, z = self._statistics(x, attn, coda_kv, b_t, sel, loops, loop_list)
        decide, gone, gone_list = self._decide(x, res, loops, loop_list)
        logits_g = self._exit_logits(x, attn, coda_kv, loops, loop_list, decide, gone, z)
        _put(self.state, sel, x)
        if self.per_loop:
            _put(self.z_prev, sel, z)
        for k, v in kept.items():
            if k not in self.prev:
                self.prev[k] = v.new_zeros(self.n_slots, *v.shape[1:])
            _put(self.prev[k], sel, v)
        if gone_list:
            self._emit(logits_g, [(items[i], loop_list[i], pos_list[i]) for i in gone_list])
        gone_set = set(gone_list)
        for i, b in enumerate(items):
            if i not in gone_set:
                self.loop[b] += 1
        return True

    def _statistics(self, x: Tensor, attn: Attn, coda_kv: list, b_t: Tensor, sel: Tensor | slice, loops: Tensor,
                    loop_list: list[int]) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
        """The items' statistics by ``generate``'s tracker: the values to keep, the statistics and the logits."""
        if not self.need:  # a rule that reads nothing (a uniform depth): no tracker, no statistics
            return {}, {}, self.z_none
        n_items = x.shape[0]
        tracker = Tracker(self.need, 0, self.V, self.like, False, self.fused)
        if self.prev:
            tracker.prev, tracker.loop = {k: _take(v, sel) for k, v in self.prev.items()}, 1
        res = tracker.states(x, 3)
        z = self.z_none
        if self.per_loop:
            y = coda(self.model, x, attn, coda_kv, work=self.work)
            tracker.bufs = [self.z_buf[:n_items], _take(self.z_prev, b_t)]
            res.update(tracker.readout(self.model, y, 3))
            z = tracker.bufs[0]
            self.work.head += n_items
            self.work.vocab_stats += n_items * tracker.vocab_passes
        if min(loop_list) < 3:  # items at loops 1 and 2: the values of a first (second) loop
            res = _masked(res, loops)
        tracker.done(3, x, res)
        return tracker.prev, res, z

    def _decide(self, x: Tensor, res: dict[str, Tensor], loops: Tensor,
                loop_list: list[int]) -> tuple[Tensor | None, Tensor | None, list[int]]:
        """Which items exit (None: none may yet): the criterion with the min/max-loop forcing per item."""
        rule, n_items = self.rule, x.shape[0]
        if max(loop_list) < rule.min_loops:  # no item may exit yet: no decision, no host sync
            return None, None, []
        if min(loop_list) >= rule.max_loops:  # every item must exit
            return (torch.ones(n_items, dtype=torch.bool, device=self.device),
                    torch.arange(n_items, device=self.device), list(range(n_items)))
        decide = rule.criterion(compact_stats(0, x, res)).reshape(n_items).to(torch.bool)
        if min(loop_list) < rule.min_loops:
            decide = decide & (loops >= rule.min_loops)
        if max(loop_list) >= rule.max_loops:
            decide = decide | (loops >= rule.max_loops)
        gone = decide.nonzero().squeeze(1)
        return decide, gone, gone.tolist()

    def _exit_logits(self, x: Tensor, attn: Attn, coda_kv: list, loops: Tensor, loop_list: list[int],
                     decide: Tensor | None, gone: Tensor | None, z: Tensor) -> Tensor:
        """The exiting items' logits; a rule on states only runs the coda here (every item at loop >= ``min_loops``
        writes its coda keys/values, the exiting ones run the last block and the head)."""
        if self.per_loop:
            return z.index_select(0, gone) if gone is not None else z[:0]
        min_loops = self.rule.min_loops
        if decide is None:  # no item at a loop whose coda keys/values are ever read
            return self.z_none
        if min(loop_list) >= min_loops:
            y = coda(self.model, x, attn, coda_kv, query=decide, work=self.work)
        else:
            late = (loops >= min_loops).nonzero().squeeze(1)
            y = coda(self.model, x.index_select(0, late), attn.select(late), coda_kv,
                     query=decide.index_select(0, late), work=self.work)
        self.work.head += y.shape[0]
        logits = self.model.head(y)
        return logits if logits.dtype == torch.float32 else logits.float()

    def _emit(self, logits_g: Tensor, gone: list[tuple[int, int, int]]) -> None:
        """The exiting items (slot, exit loop, position) choose their next tokens."""
        picks = choose_next(logits_g, self.temperature, self.generator).tolist()
        self.exited(gone)
        rows = logits_g.to(self.dtype) if self.keep_logits else None
        for j, (b, loop, _) in enumerate(gone):
            r = self.request[b]
            self.exits[r].append(loop)
            if rows is not None:
                self.outs[r].append(rows[j : j + 1])
            self.chosen(b, picks[j])

    def result(self) -> ContinuousResult:
        work, device = self.work, self.device
        work.tokens += sum(len(t) - 1 for t in self.tokens)
        completions = [
            Completion(torch.tensor(self.tokens[r], device=device),
                       torch.cat([self.prompt_exits[r], torch.tensor(self.exits[r], dtype=torch.long, device=device)]),
                       torch.cat(self.outs[r]) if self.keep_logits else None, self.init[r][0],
                       self.reqs[r][0].shape[1], *self.times[r])
            for r in range(len(self.reqs))
        ]
        return ContinuousResult(completions, str(self.rule), self.n_slots, self.steps, work, self.now_s())

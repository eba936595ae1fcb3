"""Continuous depth batching (arXiv 2608.09444): generation whose rows advance one loop at a time, each on its own.

:func:`~drc_core.halting.generate.generate` decodes step-synchronously, a step costing the depth of its deepest
row. :func:`generate_continuous` runs *core steps* instead: one loop of every active (row, token) item, each at its
own loop index; a row whose token exits runs coda + head, chooses its next token, whose prelude joins the next
step at loop 1; a finished row frees its slot for the next waiting request (serving mode). Every request gets
the tokens and exit loops of decoding it alone with ``generate`` from its initial states (logits to float
tolerance): a token at loop l attends to each earlier token of its row at loop min(l, e').

Caches per block are ``(L, S, H, T, hd)`` (S slots, L = ``rule.max_loops``); viewed as ``(L * S, H, T, hd)`` an
item of slot b at loop l is row (l - 1) * S + b of one flat batch, so one layout serves every block of a step,
whatever the items' loops (:meth:`_Decoder.layout`: a run of slots at one loop reads its slab in place, and at one
position too runs dense). Prompts run through :func:`~drc_core.halting.skipping.run_loops` on their slots' view of
the caches, a run of free slots with prompts of one length as one batch. The statistics are ``generate``'s (its
tracker, the previous loop's values kept per slot); a rule on states only runs the coda per step on the items at
loop >= ``min_loops`` and the last coda block and head on the exiting ones. One host sync per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import STATISTICS
from drc_core.errors import DrcError
from drc_core.halting.generate import check_generate_args, choose_next, prelude_step
from drc_core.halting.kvlayout import Attn, LoopCaches, Tokens, block_step, coda, empty_caches
from drc_core.halting.loopstats import Tracker, compact_stats, stat_fields
from drc_core.halting.rules import HaltingRule
from drc_core.halting.skipping import check_state, run_loops
from drc_core.halting.work import Work
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["Completion", "ContinuousResult", "generate_continuous"]


@dataclass
class Completion:
    """One request's output, as a row of :class:`~drc_core.halting.generate.GenerationResult` (``logits`` None
    unless ``keep_logits``), and its times in seconds since the call: ``admitted`` (its prompt began),
    ``first_token`` and ``finished`` (its first and last new token chosen)."""

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
    """What :func:`generate_continuous` returns: one :class:`Completion` per request, in order, the number of core
    steps of the decode phase, the work done and the wall time."""

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
    """The :class:`~drc_core.halting.kvlayout.Attn` of one item per flat cache row: item i writes position
    ``pos[i]`` of row ``rows[i]`` of caches (R, H, T, hd) and attends to its positions 0..pos[i]. Attention gathers
    each item's row unless ``lockstep`` = (first slot, end slot, loop, S): the items are those slots at one loop,
    one slab of the caches (L, S, H, T, hd) read in place. ``base``: the items' ``rows * heads * seq_len + pos``."""

    def __init__(self, rows: Tensor, pos: Tensor, t_k: int, seq_len: int, heads: int,
                 rope: tuple[Tensor, Tensor], base: Tensor | None = None,
                 lockstep: tuple[int, int, int, int] | None = None) -> None:
        self.toks, self.seq_len, self.heads, self.rope, self.t_k = Tokens(rows, pos), seq_len, heads, rope, t_k
        self.dense, self.pending, self.lockstep = False, {}, lockstep
        self.cos, self.sin = rope[0][pos], rope[1][pos]
        if base is None:
            base = rows * (heads * seq_len) + pos
        head_offsets = torch.arange(0, heads * seq_len, seq_len, device=rows.device)
        self.kv_index = (base[:, None] + head_offsets).reshape(-1)  # (N * H,) in (token, head) order
        self.mask = (torch.arange(t_k, device=rows.device) <= pos[:, None])[:, None, None]  # (N, 1, 1, t_k)

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        t_k = self.t_k
        if self.lockstep is not None:
            first, end, loop, n_slots = self.lockstep
            k, v = (c.view(-1, n_slots, *c.shape[1:])[loop, first:end, :, :t_k].to(q.dtype) for c in kv)
        else:
            rows = self.toks.rows  # index_select: ~4x faster than advanced indexing of the same rows on CPU
            k, v = (c[:, :, :t_k].index_select(0, rows).to(q.dtype) for c in kv)
        y = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=self.mask)
        return y.reshape(q.shape[0], -1)

    def select(self, keep: Tensor) -> _Items:
        toks = self.toks.select(keep)
        return _Items(toks.rows, toks.pos, self.t_k, self.seq_len, self.heads, self.rope)


def _is_run(slots: list[int]) -> bool:
    """Whether sorted, distinct ``slots`` are consecutive (read and written through a slice, not an index)."""
    return slots[-1] - slots[0] + 1 == len(slots)


def _masked(res: dict[str, Tensor], loops: Tensor) -> dict[str, Tensor]:
    """The first loop's values (of :func:`~drc_core.analysis.loops.loop_stats`) for the items at loop 1 (and 2, for
    the second-order statistics), whose slot's previous values belong to another token."""
    first, early = loops == 1, loops <= 2
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
    if states is None:
        states = [None] * n_req
    elif isinstance(states, Tensor):
        states = list(states)
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
    """Generate ``max_new_tokens`` (one int, or one per prompt) after each prompt with continuous depth batching.

    ``prompts``: (B, T0) token ids or a list of 1-D prompts of any lengths. ``slots``: rows decoded together
    (default: all requests; fewer is serving mode, a finished row's slot taking the next request). ``states``: each
    request's initial states (T0 + n, d), else drawn up front request by request with ``generator``.
    ``temperature`` and ``fused`` as in :func:`~drc_core.halting.generate.generate`; ``keep_logits=False`` keeps
    no logits. The rule must declare its ``reads`` (its decision for a token depends only on that token)."""
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
    device, dtype = model.rope_cos.device, model.tok_emb.weight.dtype
    like = torch.empty(0, dtype=dtype, device=device)
    init = []
    for i, (p, n, s) in enumerate(reqs):
        check_state(s, (p.shape[1] + n, d), f"(T0 + max_new_tokens, d_model) for prompt {i}")  # type: ignore[arg-type]
        s = model.initial_state(like.new_zeros(1, p.shape[1] + n, d), generator) if s is None else s[None]
        init.append(s.to(device=device, dtype=dtype))
    decoder = _Decoder(model, rule, reqs, init, min(n_slots, len(reqs)), t_start, temperature=temperature,
                       generator=generator, fused=fused, keep_logits=keep_logits)
    while decoder.step():
        pass
    return decoder.result()


class _Decoder:
    """The scheduler of :func:`generate_continuous`: the slots and their caches, the queue of waiting requests,
    each request's record (tokens, exit loops, logits, times), and :meth:`step`, one core step."""

    def __init__(self, model: DepthRecurrentLM, rule: HaltingRule, reqs: list[tuple[Tensor, int, Tensor | None]],
                 init: list[Tensor], n_slots: int, t_start: float, *, temperature: float,
                 generator: torch.Generator | None, fused: bool, keep_logits: bool) -> None:
        self.model, self.rule, self.reqs, self.init, self.n_slots = model, rule, reqs, init, n_slots
        self.t_start = t_start
        self.temperature, self.generator, self.fused, self.keep_logits = temperature, generator, fused, keep_logits
        cfg = model.cfg
        d, self.L, self.V, self.heads = cfg.d_model, rule.max_loops, cfg.vocab_size, cfg.n_heads
        self.device, self.dtype = model.rope_cos.device, model.tok_emb.weight.dtype
        like = self.like = torch.empty(0, dtype=self.dtype, device=self.device)
        self.T = T = max(p.shape[1] + n for p, n, _ in reqs)
        self.pre_kv = empty_caches(model, len(model.prelude), (n_slots, T), like)
        # every core and coda block's K and V in one tensor (exits copy keys/values once for all of them), each
        # loop-major (L, S, H, T, hd): one loop's slab of a run of slots is contiguous
        n_core = len(model.core)
        self.looped_kv = k0 = like.new_zeros(2 * (n_core + len(model.coda)), self.L, n_slots, cfg.n_heads, T,
                                             cfg.head_dim)
        pairs = [(k0[2 * j], k0[2 * j + 1]) for j in range(k0.shape[0] // 2)]
        self.core_kv, self.coda_kv = pairs[:n_core], pairs[n_core:]
        self.rope = (model.rope_cos, model.rope_sin)
        self.slot_ids = torch.arange(n_slots, device=self.device)
        self.pre_looped = [(k[None], v[None]) for k, v in self.pre_kv]  # the prelude's caches as one loop's slab
        self.views: dict[tuple[int, ...], list[list[tuple[Tensor, Tensor]]]] = {}  # cache views, made once
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
        self.z_none = like.new_empty(0, self.V, dtype=torch.float32)
        # this step's logits and each slot's previous ones (rules that read the output distribution)
        self.z_buf = like.new_empty(n_slots, self.V, dtype=torch.float32) if self.per_loop else self.z_none
        self.z_prev = like.new_zeros(n_slots, self.V, dtype=torch.float32) if self.per_loop else self.z_none
        self.steps = 0

    def active(self) -> list[int]:
        return [b for b in range(self.n_slots) if self.request[b] >= 0 and self.loop[b] > 0]

    def now_s(self) -> float:
        return time.perf_counter() - self.t_start

    def chosen(self, r: int, token: int) -> None:
        self.tokens[r].append(token)
        if len(self.tokens[r]) == self.reqs[r][0].shape[1] + 1:
            self.times[r][1] = self.now_s()

    def advance(self, b: int) -> None:
        """After slot b's token chose the next token: finish the request or queue that token's prelude."""
        r = self.request[b]
        t = len(self.tokens[r]) - 1  # the position of the token just chosen
        if t == self.reqs[r][0].shape[1] + self.reqs[r][1] - 1:  # the last new token: it is never processed
            self.times[r][2] = self.now_s()
            self.request[b], self.loop[b] = -1, 0
            return
        self.pos[b], self.loop[b] = t, 1
        self.state[b] = self.init[r][0, t]
        self.joiners.append(b)

    def admit(self) -> None:
        """Run the queued requests' prompts on the free slots, a run of slots with prompts of one length as one
        batch."""
        free = [b for b in range(self.n_slots) if self.request[b] < 0]
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
        prelude_step(model, ids, (0, t0), [(k[slots], v[slots]) for k, v in self.pre_kv], e, self.work)
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
            self.chosen(r, picks[j])
            self.advance(b0 + j)

    def join(self) -> None:
        """The prelude of every slot's new token (positions differ by row: one flat layout)."""
        if not self.joiners:
            return
        model = self.model
        joiners = sorted(self.joiners)
        pos_list = [self.pos[b] for b in joiners]
        # the prelude caches (S, H, T, hd) are one loop's slab
        attn, (kvs,), _, _ = self.layout(joiners, [1] * len(joiners), pos_list, [self.pre_looped])
        x = model.token_embedding(torch.tensor([self.tokens[self.request[b]][-1] for b in joiners],
                                               device=self.device))
        for block, kv in zip(model.prelude, kvs, strict=True):
            x = block_step(block, x, attn, kv, *self.rope, work=self.work)
        sel = slice(joiners[0], joiners[-1] + 1) if _is_run(joiners) else torch.tensor(joiners, device=self.device)
        self.inj[sel] = x
        self.joiners.clear()

    def layout(self, items: list[int], loop_list: list[int], pos_list: list[int],
               caches: list[list[tuple[Tensor, Tensor]]]) -> tuple[Attn, list[list[tuple[Tensor, Tensor]]], Tensor,
                                                                  Tensor]:
        """The attention layout of items (slots, their loops and positions), the views of each list of per-block
        caches (L, S, H, T, hd) its blocks use, and the items' slots and loops on the device: dense over one slab
        for a run of slots at one loop and position, else one flat row per item (:class:`_Items`) over the
        (L * S, H, T, hd) caches, from one host-to-device copy."""
        n_slots, t, n = self.n_slots, pos_list[0], len(items)
        run, one_loop = _is_run(items), min(loop_list) == max(loop_list)
        if run and one_loop and min(pos_list) == max(pos_list):
            first, li = items[0], loop_list[0] - 1
            slots = self.slot_ids[first : first + n]
            attn = Attn(Tokens.window(n, t, t + 1, self.device), n, self.T, self.heads, self.rope, (t, t + 1))
            key = (*map(id, caches), li, first, n)  # caches: lists the decoder keeps, so their ids are stable
            views = self.views.get(key)
            if views is None:
                views = [[(k[li, first : first + n], v[li, first : first + n]) for k, v in kvs] for kvs in caches]
                self.views[key] = views
            return attn, views, slots, slots.new_full((n,), loop_list[0])
        rows = [(lp - 1) * n_slots + b for b, lp in zip(items, loop_list, strict=True)]
        meta = torch.tensor([items, loop_list, rows, pos_list,
                             [r * self.heads * self.T + p for r, p in zip(rows, pos_list, strict=True)]],
                            device=self.device)
        b_t, loops, rows_t, pos_t, base_t = meta.unbind(0)
        lockstep = (items[0], items[-1] + 1, loop_list[0] - 1, n_slots) if run and one_loop else None
        attn = _Items(rows_t, pos_t, max(pos_list) + 1, self.T, self.heads, self.rope, base=base_t,
                      lockstep=lockstep)
        key = (*map(id, caches), -1)
        flat = self.views.get(key)
        if flat is None:
            flat = [[(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])) for k, v in kvs] for kvs in caches]
            self.views[key] = flat
        return attn, flat, b_t, loops

    def exited(self, gone: list[tuple[int, int, int]]) -> None:
        """Items (slot, exit loop, position) offer their exit-loop keys/values at every later loop (one gather and
        one scatter for every block)."""
        pairs = [(b, loop, t, later) for b, loop, t in gone for later in range(loop, self.L)]
        if not pairs:
            return
        b_i, src, t_i, dst = (torch.tensor(c, device=self.device) for c in zip(*pairs, strict=True))
        kv = self.looped_kv
        kv[:, dst, b_i, :, t_i] = kv[:, src - 1, b_i, :, t_i]

    def step(self) -> bool:
        """Admit waiting requests into free slots, run the new tokens' prelude, then one loop of every active
        item; the exiting items choose their next tokens. False when no item is left."""
        if self.queue:
            self.admit()
        self.join()
        items = self.active()
        if not items:
            return False
        self.steps += 1
        loop_list = [self.loop[b] for b in items]
        pos_list = [self.pos[b] for b in items]
        attn, (core_kv, coda_kv), b_t, loops = self.layout(items, loop_list, pos_list, [self.core_kv, self.coda_kv])
        # items that are a run of slots are read and written through slices (views), not gathers
        sel: Tensor | slice = slice(items[0], items[-1] + 1) if _is_run(items) else b_t
        x = self.model.inject(self.state[sel], self.inj[sel])
        for block, kv in zip(self.model.core, core_kv, strict=True):
            x = block_step(block, x, attn, kv, *self.rope)
        self.work.core += len(items)
        kept, res, z = self._statistics(x, attn, coda_kv, b_t, sel, loops, loop_list)
        decide, gone, gone_list = self._decide(x, res, loops, loop_list)
        logits_g = self._exit_logits(x, attn, coda_kv, loops, loop_list, decide, gone, z)
        self.state[sel] = x
        if self.per_loop:
            self.z_prev[sel] = z
        for k, v in kept.items():
            if k not in self.prev:
                self.prev[k] = v.new_zeros(self.n_slots, *v.shape[1:])
            self.prev[k][sel] = v
        if gone_list:
            self._emit(logits_g, [(items[i], loop_list[i], pos_list[i]) for i in gone_list])
        gone_set = set(gone_list)
        for i, b in enumerate(items):
            if i not in gone_set:
                self.loop[b] += 1
        return True

    def _statistics(self, x: Tensor, attn: Attn, coda_kv: list, b_t: Tensor, sel: Tensor | slice, loops: Tensor,
                    loop_list: list[int]) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
        """The items' statistics by ``generate``'s tracker against their slots' previous values: the values to keep
        for the next loop, the statistics and the step's logits (rules that read the output)."""
        if not self.need:  # a rule that reads nothing (a uniform depth): no tracker, no statistics
            return {}, {}, self.z_none
        n_items = x.shape[0]
        tracker = Tracker(self.need, 0, self.V, self.like, False, self.fused)
        if self.prev:
            tracker.prev, tracker.loop = {k: v[sel] for k, v in self.prev.items()}, 1
        res = tracker.states(x, 3)
        z = self.z_none
        if self.per_loop:
            y = coda(self.model, x, attn, coda_kv, work=self.work)
            tracker.bufs = [self.z_buf[:n_items], self.z_prev[b_t]]
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
        """The exiting items' logits. A rule on states only runs the coda here: every item at loop >= ``min_loops``
        writes its coda keys/values (later tokens read them), the exiting ones run the last block and the head."""
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
        return self.model.head(y).float()

    def _emit(self, logits_g: Tensor, gone: list[tuple[int, int, int]]) -> None:
        """The exiting items (slot, exit loop, position) choose their next tokens and fill the later loops' slabs."""
        picks = choose_next(logits_g, self.temperature, self.generator).tolist()
        self.exited(gone)
        rows = logits_g.to(self.dtype) if self.keep_logits else None
        for j, (b, loop, _) in enumerate(gone):
            r = self.request[b]
            self.exits[r].append(loop)
            if rows is not None:
                self.outs[r].append(rows[j : j + 1])
            self.chosen(r, picks[j])
            self.advance(b)

    def result(self) -> ContinuousResult:
        work, device = self.work, self.device
        work.tokens += sum(len(t) - 1 for t in self.tokens)
        completions = [
            Completion(tokens=torch.tensor(self.tokens[r], device=device),
                       exit_loop=torch.cat([self.prompt_exits[r],
                                            torch.tensor(self.exits[r], dtype=torch.long, device=device)]),
                       logits=torch.cat(self.outs[r]) if self.keep_logits else None,
                       initial_state=self.init[r][0], prompt_len=self.reqs[r][0].shape[1],
                       admitted=self.times[r][0], first_token=self.times[r][1], finished=self.times[r][2])
            for r in range(len(self.reqs))
        ]
        return ContinuousResult(completions, str(self.rule), self.n_slots, self.steps, work, self.now_s())

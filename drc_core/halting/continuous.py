"""Continuous depth batching: generation whose rows advance one loop at a time, each on its own.

:func:`~drc_core.halting.generate.generate` decodes a batch step-synchronously: every new token of every row
runs loop 1, then loop 2, ... until the deepest row's token exits, so a decode step costs the depth of its
deepest row. :func:`generate_continuous` schedules single loop iterations instead (Continuous Depth Batching,
arXiv 2608.09444): every *core step* runs one loop for every active (row, token) item, each at its own loop
index. A row whose token exits at this step runs coda + head, chooses its next token, and that token's prelude
joins the next core step at loop 1 while the other rows keep looping. A row that has generated all its tokens
frees its slot, and the next waiting request (``slots`` < number of requests: serving mode) takes it.

Semantics are those of :func:`~drc_core.halting.generate.generate` row by row: a token active at loop l
attends, in every core and coda block, to each earlier token of its row at loop min(l, e'); keys/values of an
exited token are copied into the later loops' slabs (the policy of ``masked_forward``). So the tokens and exit
loops of every request are those of decoding it alone with ``generate`` (``state`` = its initial states), and
its logits equal them to float tolerance (a decision can only differ where a statistic lies within rounding of
the threshold).

How. Caches per block are ``(S, L, H, T, hd)`` for S slots and L = ``rule.max_loops`` per-loop slabs; viewed as
``(S * L, H, T, hd)``, an item of slot b at loop l is a row b * L + l - 1 of one flat batch, so one
:class:`~drc_core.halting.kvlayout.Attn` layout (one query per row, causal mask by position) serves every core
and coda block of the step, whatever mix of loops the items are at. A request's prompt is processed alone, by
:func:`~drc_core.halting.skipping.run_loops` on its slot's view of the caches (exactly what ``generate`` does
for it). The rule's statistics of each item against the previous loop of the same token are those ``generate``
computes (its tracker, only the fields the rule reads), the previous loop's values kept per slot; the decision
is the rule's :meth:`~drc_core.halting.rules.HaltingRule.criterion` with the
min/max-loop forcing applied per item. A rule that reads states only runs the coda per step on the items at
loop >= ``min_loops`` (writing the coda keys/values later tokens read), the last coda block's attention and MLP
and the head only on the exiting items. Host syncs: one per step (which items exit).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import STATISTICS
from drc_core.errors import DrcError
from drc_core.halting.generate import _check, _choose, _prelude
from drc_core.halting.kvlayout import Attn, LoopCaches, Tokens, block_step, coda, empty_caches
from drc_core.halting.loopstats import Tracker, compact_stats, stat_fields
from drc_core.halting.rules import HaltingRule
from drc_core.halting.skipping import check_state, run_loops
from drc_core.halting.work import Work
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["Completion", "ContinuousResult", "generate_continuous"]


@dataclass
class Completion:
    """One request's output: ``tokens`` (T0 + n,) the prompt and its n new tokens; ``exit_loop`` (T0 + n - 1,) and
    ``logits`` (T0 + n - 1, V) (None unless ``keep_logits``) of every processed position, as in
    :class:`~drc_core.halting.generate.GenerationResult`; ``initial_state`` (T0 + n, d). Times are seconds since
    the call started: ``admitted`` (its prompt began), ``first_token`` (its first new token was chosen) and
    ``finished`` (its last)."""

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
    """What :func:`generate_continuous` returns: one :class:`Completion` per request (in request order), the
    number of core steps the decode phase ran, the :class:`~drc_core.halting.work.Work` done and the wall
    time."""

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
        """Percentiles (seconds) of the per-request latency: from the call (every request arrives at its start)
        to its last token; ``ttft p..`` the same for its first token."""
        done = np.array([c.finished for c in self.completions])
        first = np.array([c.first_token for c in self.completions])
        out = {f"p{g:g}": float(np.percentile(done, g)) for g in q}
        out.update({f"ttft p{g:g}": float(np.percentile(first, g)) for g in q})
        return out


class _Items(Attn):
    """The :class:`~drc_core.halting.kvlayout.Attn` of items with one query per flat cache row: item i writes its
    keys/values at position ``pos[i]`` of row ``rows[i]`` of caches (R, H, T, hd) and attends to that row's
    positions 0..pos[i] (no padding, no per-row counts: every row holds one item)."""

    def __init__(self, rows: Tensor, pos: Tensor, t_k: int, seq_len: int, heads: int,
                 rope: tuple[Tensor, Tensor], base: Tensor | None = None) -> None:
        """``base`` (N,): each item's offset ``rows * heads * seq_len + pos`` when the caller has it."""
        self.toks, self.seq_len, self.heads, self.rope, self.t_k = Tokens(rows, pos), seq_len, heads, rope, t_k
        self.dense, self.pending = False, {}
        self.cos, self.sin = rope[0][pos], rope[1][pos]
        if base is None:
            base = rows * (heads * seq_len) + pos
        head_offsets = torch.arange(0, heads * seq_len, seq_len, device=rows.device)
        self.kv_index = (base[:, None] + head_offsets).reshape(-1)  # (N * H,) in (token, head) order
        self.mask = (torch.arange(t_k, device=rows.device) <= pos[:, None])[:, None, None]  # (N, 1, 1, t_k)

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        rows, t_k = self.toks.rows, self.t_k
        k, v = kv[0][rows, :, :t_k].to(q.dtype), kv[1][rows, :, :t_k].to(q.dtype)
        y = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=self.mask)
        return y.reshape(q.shape[0], -1)

    def select(self, keep: Tensor) -> _Items:
        toks = self.toks.select(keep)
        return _Items(toks.rows, toks.pos, self.t_k, self.seq_len, self.heads, self.rope)


@dataclass
class _Slots:
    """Per-slot decode state: the token each slot processes (its position and loop), its state and injection, and
    the previous loop's statistics of that token (a :class:`LoopStats`-shaped dict over slots)."""

    n: int
    request: list[int]
    pos: list[int]
    loop: list[int]
    x: Tensor
    e: Tensor
    prev: dict[str, Tensor] = field(default_factory=dict)

    def active(self) -> list[int]:
        return [b for b in range(self.n) if self.request[b] >= 0 and self.loop[b] > 0]


def _masked(res: dict[str, Tensor], loops: Tensor) -> dict[str, Tensor]:
    """Give the items at loop 1 (and 2, for the second-order statistics) the values that
    :func:`~drc_core.analysis.loops.loop_stats` gives a first loop (their slot's previous values belong to
    another token)."""
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
def generate_continuous(
    model: DepthRecurrentLM,
    prompts: Tensor | Sequence[Tensor],
    max_new_tokens: int | Sequence[int],
    rule: HaltingRule,
    *,
    slots: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    states: Sequence[Tensor | None] | Tensor | None = None,
    fused: bool = False,
    keep_logits: bool = True,
) -> ContinuousResult:
    """Generate ``max_new_tokens`` (one int, or one per prompt) after each prompt with continuous depth batching
    (module docstring): every core step runs one loop of every active row's token at its own loop index.

    ``prompts``: (B, T0) token ids or a list of 1-D prompts of any lengths. ``slots``: rows decoded together
    (default: all requests at once); fewer slots than requests is serving mode, where a finished row's slot
    takes the next request in order. ``states``: each request's initial states (T0 + n, d), else drawn up front,
    request by request, with ``generator`` (as :func:`~drc_core.halting.generate.generate` draws them).
    ``temperature`` and ``fused`` as in ``generate``; greedy (0) outputs equal decoding each request alone with
    ``generate``. ``keep_logits=False`` keeps no (T, V) logits per request. The rule must declare the statistics
    it reads (:attr:`~drc_core.halting.rules.HaltingRule.reads`): its decision for a token may depend only on
    that token.

    One function on purpose: the scheduler's state (slots, caches, queue, per-request records) is shared by its
    nested steps (``admit``, ``join``, ``exited``) and the step loop; a class would hold the same state in
    attributes.
    """
    t_start = time.perf_counter()
    reqs = _request_list(prompts, max_new_tokens, states)
    for p, n, _ in reqs:
        _check(model, p, n, rule, temperature)
    if rule.reads is None:
        raise DrcError(f"rule {rule} does not declare the statistics it reads (reads=None: a router or a rule of "
                       "your own); continuous batching decides token by token, so use generate for it")
    n_slots = len(reqs) if slots is None else slots
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
        raise DrcError(f"slots={slots!r} is invalid; it must be an integer >= 1 (or None: one per request)")
    n_slots = min(n_slots, len(reqs))
    cfg = model.cfg
    d, L = cfg.d_model, rule.max_loops
    device, dtype = model.rope_cos.device, model.tok_emb.weight.dtype
    T = max(p.shape[1] + n for p, n, _ in reqs)
    like = torch.empty(0, dtype=dtype, device=device)
    init = []
    for i, (p, n, s) in enumerate(reqs):
        check_state(s, (p.shape[1] + n, d), f"(T0 + max_new_tokens, d_model) for prompt {i}")  # type: ignore[arg-type]
        s = model.initial_state(like.new_zeros(1, p.shape[1] + n, d), generator) if s is None else s[None]
        init.append(s.to(device=device, dtype=dtype))

    pre_kv = empty_caches(model, len(model.prelude), (n_slots, T), like)
    core_kv = empty_caches(model, len(model.core), (n_slots, L, T), like)
    coda_kv = empty_caches(model, len(model.coda), (n_slots, L, T), like)
    flat = [(k.view(n_slots * L, *k.shape[2:]), v.view(n_slots * L, *v.shape[2:])) for k, v in (*core_kv, *coda_kv)]
    core_flat, coda_flat = flat[: len(model.core)], flat[len(model.core) :]
    rope = (model.rope_cos, model.rope_sin)
    per_loop = rule.needs_log_probs
    work = Work()
    sl = _Slots(n_slots, [-1] * n_slots, [0] * n_slots, [0] * n_slots, like.new_zeros(n_slots, d),
                like.new_zeros(n_slots, d))
    tokens: list[list[int]] = [[] for _ in reqs]  # each request's tokens so far (host side)
    prompt_exits: list[Tensor] = [like for _ in reqs]
    exits: list[list[int]] = [[] for _ in reqs]  # exit loops of the decode phase
    outs: list[list[Tensor]] = [[] for _ in reqs]
    times = [[0.0, 0.0, 0.0] for _ in reqs]
    queue = list(range(len(reqs)))
    joiners: list[int] = []
    caches_all = [t for kv in (*core_kv, *coda_kv) for t in kv]

    def now_s() -> float:
        return time.perf_counter() - t_start

    def chosen(r: int, token: int) -> None:
        tokens[r].append(token)
        if len(tokens[r]) == reqs[r][0].shape[1] + 1:
            times[r][1] = now_s()

    def advance(b: int) -> None:
        """After slot b's token chose the next token: finish the request or queue that token's prelude."""
        r = sl.request[b]
        t = len(tokens[r]) - 1  # the position of the token just chosen
        if t == reqs[r][0].shape[1] + reqs[r][1] - 1:  # the last new token: it is never processed
            times[r][2] = now_s()
            sl.request[b], sl.loop[b] = -1, 0
            return
        sl.pos[b], sl.loop[b] = t, 1
        sl.x[b] = init[r][0, t]
        joiners.append(b)

    def admit(b: int) -> None:
        """Run the next queued request's prompt alone on slot b (what ``generate`` does with it)."""
        r = queue.pop(0)
        times[r][0] = now_s()
        prompt, n, _ = reqs[r]
        t0 = prompt.shape[1]
        ids = torch.zeros(1, t0 + n, dtype=torch.long, device=device)
        ids[0, :t0] = prompt[0].to(device)
        tokens[r] = prompt[0].tolist()
        e_r = like.new_zeros(1, t0 + n, d)
        s_r = init[r].clone()
        _prelude(model, ids, (0, t0), [(k[b : b + 1], v[b : b + 1]) for k, v in pre_kv], e_r, work)
        caches = LoopCaches(core=[(k[b][:, None], v[b][:, None]) for k, v in core_kv],
                            coda=[(k[b][:, None], v[b][:, None]) for k, v in coda_kv], per_loop=True)
        res = run_loops(model, rule, s_r, e_r, (0, t0), caches, work=work, fused=fused)
        sl.request[b] = r
        prompt_exits[r] = res.exit_loop[0]
        if keep_logits:
            outs[r].append(res.logits[0])
        chosen(r, int(_choose(res.logits[:, -1], temperature, generator)[0]))
        advance(b)

    def join() -> None:
        """The prelude of every slot's new token (positions differ by row: one flat layout)."""
        if not joiners:
            return
        joiners.sort()
        b_t = torch.tensor(joiners, device=device)
        pos_list = [sl.pos[b] for b in joiners]
        attn = _Items(b_t, torch.tensor(pos_list, device=device), max(pos_list) + 1, T, cfg.n_heads, rope)
        x = model.token_embedding(torch.tensor([tokens[sl.request[b]][-1] for b in joiners], device=device))
        for block, kv in zip(model.prelude, pre_kv, strict=True):
            x = block_step(block, x, attn, kv, *rope, work=work)
        sl.e[b_t] = x
        joiners.clear()

    def exited(gone: list[tuple[int, int, int]]) -> None:
        """Items (slot, exit loop, position) offer their exit-loop keys/values at every later loop: one gather
        and one scatter per cache tensor."""
        pairs = [(b, loop, t, later) for b, loop, t in gone for later in range(loop, L)]
        if not pairs:
            return
        b_i, src, t_i, dst = (torch.tensor(c, device=device) for c in zip(*pairs, strict=True))
        for c in caches_all:
            c[b_i, dst, :, t_i] = c[b_i, src - 1, :, t_i]

    V = cfg.vocab_size
    need = stat_fields(rule)
    z_none = like.new_empty(0, V, dtype=torch.float32)
    z_buf = like.new_empty(n_slots, V, dtype=torch.float32) if per_loop else z_none  # this step's logits
    z_prev = like.new_zeros(n_slots, V, dtype=torch.float32) if per_loop else z_none  # each slot's previous
    steps = 0
    while True:
        for b in range(n_slots):
            if sl.request[b] < 0 and queue:
                admit(b)
        join()
        items = sl.active()
        if not items:
            break
        steps += 1
        n_items = len(items)
        loop_list = [sl.loop[b] for b in items]
        pos_list = [sl.pos[b] for b in items]
        rows = [b * L + lp - 1 for b, lp in zip(items, loop_list, strict=True)]
        # one host-to-device copy per step: slots, loops, positions, flat rows and cache offsets
        meta = torch.tensor([items, loop_list, pos_list, rows,
                             [r * cfg.n_heads * T + t for r, t in zip(rows, pos_list, strict=True)]], device=device)
        b_t, loops, pos_t, rows_t, base_t = meta.unbind(0)
        attn = _Items(rows_t, pos_t, max(pos_list) + 1, T, cfg.n_heads, rope, base=base_t)
        x = model.inject(sl.x[b_t], sl.e[b_t])
        for block, kv in zip(model.core, core_flat, strict=True):
            x = block_step(block, x, attn, kv, *rope)
        work.core += n_items
        # the statistics: generate's own tracker, its previous loop being each item's slot's (items at loop 1 get
        # the first loop's values by _masked, as their slot's previous values belong to another token)
        tracker = Tracker(need, 0, V, like, False, fused)
        if sl.prev:
            tracker.prev, tracker.loop = {k: v[b_t] for k, v in sl.prev.items()}, 1
        res = tracker.states(x, 3)
        if per_loop:
            y = coda(model, x, attn, coda_flat, work=work)
            tracker.bufs = [z_buf[:n_items], z_prev[b_t]]
            res.update(tracker.readout(model, y, 3))
            z = tracker.bufs[0]
            work.head += n_items
            work.vocab_stats += n_items * tracker.vocab_passes
        if min(loop_list) < 3:  # items at loops 1 and 2: the values of a first (second) loop
            res = _masked(res, loops)
        tracker.done(3, x, res)
        if max(loop_list) < rule.min_loops:  # no item may exit yet: no decision, no host sync
            decide, gone, gone_list = torch.zeros(n_items, dtype=torch.bool, device=device), None, []
        elif min(loop_list) >= rule.max_loops:  # every item must exit
            decide = torch.ones(n_items, dtype=torch.bool, device=device)
            gone, gone_list = torch.arange(n_items, device=device), list(range(n_items))
        else:
            decide = rule.criterion(compact_stats(0, x, res)).reshape(n_items).to(torch.bool)
            if min(loop_list) < rule.min_loops:
                decide = decide & (loops >= rule.min_loops)
            if max(loop_list) >= rule.max_loops:
                decide = decide | (loops >= rule.max_loops)
            gone = decide.nonzero().squeeze(1)
            gone_list = gone.tolist()
        if per_loop:
            logits_g = z.index_select(0, gone) if gone is not None else z[:0]
        elif max(loop_list) < rule.min_loops:  # no item at a loop whose coda keys/values are ever read
            logits_g = z_none
        else:
            # every item at loop >= min_loops writes its coda keys/values (later tokens exiting at its loop read
            # them); the exiting ones run the last coda block and the head
            if min(loop_list) >= rule.min_loops:
                y = coda(model, x, attn, coda_flat, query=decide, work=work)
            else:
                late = (loops >= rule.min_loops).nonzero().squeeze(1)
                y = coda(model, x.index_select(0, late), attn.select(late), coda_flat,
                         query=decide.index_select(0, late), work=work)
            logits_g = model.head(y).float()
            work.head += y.shape[0]
        sl.x[b_t] = x
        if per_loop:
            z_prev[b_t] = z
        for k, v in tracker.prev.items():
            if k not in sl.prev:
                sl.prev[k] = v.new_zeros(n_slots, *v.shape[1:])
            sl.prev[k][b_t] = v
        if gone_list:
            picks = _choose(logits_g, temperature, generator).tolist()
            exited([(items[i], loop_list[i], pos_list[i]) for i in gone_list])
            rows = logits_g.to(dtype) if keep_logits else None
            for j, i in enumerate(gone_list):
                b = items[i]
                r = sl.request[b]
                exits[r].append(loop_list[i])
                if rows is not None:
                    outs[r].append(rows[j : j + 1])
                chosen(r, picks[j])
                advance(b)
        gone_set = set(gone_list)
        for i, b in enumerate(items):
            if i not in gone_set:
                sl.loop[b] += 1
    work.tokens += sum(len(t) - 1 for t in tokens)
    completions = [
        Completion(tokens=torch.tensor(tokens[r], device=device),
                   exit_loop=torch.cat([prompt_exits[r], torch.tensor(exits[r], dtype=torch.long, device=device)]),
                   logits=torch.cat(outs[r]) if keep_logits else None, initial_state=init[r][0],
                   prompt_len=reqs[r][0].shape[1], admitted=times[r][0], first_token=times[r][1],
                   finished=times[r][2])
        for r in range(len(reqs))
    ]
    return ContinuousResult(completions, str(rule), n_slots, steps, work, now_s())


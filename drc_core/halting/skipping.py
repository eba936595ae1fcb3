"""Per-token halting that really skips the halted tokens' compute (the "realized speedup": wall-clock against the
FLOP proxy and the honest FLOPs).

:func:`skip_forward` computes exactly what the masked reference :func:`drc_core.halting.reference.masked_forward`
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
projections, the head and the vocabulary-sized statistics); :func:`drc_book.cost.honest_flops`
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

from dataclasses import dataclass

import torch
from torch import Tensor

from drc_core.errors import DrcError
from drc_core.halting.kvlayout import Attn, KVSlab, LoopCaches, Tokens, block_step, coda, empty_caches
from drc_core.halting.loopstats import FullLayout, Tracker, compact_stats, stat_fields
from drc_core.halting.reference import AdaptiveResult
from drc_core.halting.rules import HaltingRule
from drc_core.halting.work import Work
from drc_core.model.lm import DepthRecurrentLM

__all__ = ["LoopResult", "SkipResult", "check_state", "run_loops", "skip_forward"]


# ----------------------------------------------------------------------------------------------------------
# The loop


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

    Long because the loop driver keeps the active set, the caches and the statistics in locals across loops;
    splitting it would pass them all back and forth.
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
    tracker = Tracker(need, len(toks), V, s, per_loop, fused)
    full = FullLayout((B, width), V, s) if rule.reads is None else None
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
            now = rule.decide(compact_stats(loop, x, res)).reshape(n)
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
    """:class:`~drc_core.halting.reference.AdaptiveResult` plus the :class:`Work` the skipping run did."""

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
    """:func:`drc_core.halting.reference.masked_forward`, computing only the active tokens at every loop.

    Same arguments, same :class:`~drc_core.halting.reference.AdaptiveResult` (a :class:`SkipResult`, which also
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

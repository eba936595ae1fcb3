"""Per-token halting that really skips the halted tokens' compute (the "realized speedup" of issue C).

:func:`skip_forward` computes exactly what the masked reference :func:`drc_core.halting.rules.masked_forward`
computes (to float tolerance, with the same exit loops), but at loop l it runs the core only on the tokens
still active at loop l. The semantics (see :func:`drc_core.model.iterate`): a token that
halts at loop e keeps s_e, and at every later loop offers, in every core and coda block, the keys/values it
computed at loop e; an active token at loop l therefore attends to each earlier token's loop-min(l, e)
keys/values, and a token's logits are its readout at its exit loop.

How. Tokens are handled as a flat list (N,) of (row, position) pairs in row-major order. Per block there is a
key/value cache (B, H, T, hd) that always holds every token's last computed keys/values: a loop computes
q/k/v, attention output and MLP only for the N active tokens (matmuls on (N, d)), writes their k/v into the
cache and lets their queries attend over the cache. For attention the queries are padded per row to the
largest active count M of any row that has one, with an explicit boolean mask (key position <= query
position; padding queries see key 0 only and are dropped), over the cached keys cropped to the last active
position + 1.

Readout. A rule with ``needs_log_probs`` (KL, entropy, argmax, confidence, routers) needs every active
token's log-probs at every loop, so the coda and the head run on the N active tokens per loop. A rule
without (:class:`~drc_core.halting.rules.StateDelta`, :class:`~drc_core.halting.rules.Cosine`,
:class:`~drc_core.halting.rules.Uniform`, :class:`~drc_core.halting.rules.Never`,
:class:`~drc_core.halting.rules.Oracle`)
sees stats computed from states only, and a token is read out once, at its exit loop: the coda then runs on
the tokens of its row that are still active at that loop and lie at or before the last exiting position
(their coda keys/values at that loop are what the exiting token sees), the last coda block's queries,
attention and MLP and the head only on the exiting tokens.

Cost model (matmul FLOPs per token, ``block`` and ``head = 2 d V`` as in
:meth:`~drc_core.model.DepthRecurrentLM.flops_per_token`, ``a`` the average exit loop, ``n_l`` the fraction of
tokens active at loop l, so ``sum_l n_l = a``)::

    uniform depth r (forward)             (P + C) * block + r * core + head              core = R * block + adapter
    skip_forward, rule with log-probs     P * block + a * (core + C * block + head)      + a * (log-softmax + stats) * V
    skip_forward, rule without            P * block + a * core + C' + head               C' <= sum_l n_l' * C * block

where ``C'`` is the coda context: with one coda block only the k/v projection (2 d^2 of the block) of the
context tokens each exit loop, exactly one block for the exiting token. The FLOP proxy ``r / a`` counts only
the core, so it is what a rule without log-probs can realise; a rule with log-probs pays a head (2 d V,
with V = 4096, d = 128 about 2.6 blocks) and a V-sized log-softmax per token per loop, so on a small-d,
large-V model its wall-clock speedup is far below the proxy. Attention is over the cached keys (T per query
at most), as in the dense model. Fixed costs per loop: index/gather/scatter of (N, d) tensors, a few small
syncs (the counts), and the padded attention mask (B, M, T).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import LoopStats, loop_stats, state_change, trajectory_step
from drc_core.errors import DrcError
from drc_core.halting.rules import AdaptiveResult, HaltingRule
from drc_core.model import Block, DepthRecurrentLM

__all__ = [
    "KVSlab", "LoopCaches", "LoopResult", "Tokens", "attend_cached", "block_step", "check_state", "coda_readout",
    "empty_caches", "run_loops", "skip_forward",
]

KVSlab = tuple[Tensor, Tensor]  # (K, V), each (B, H, T, hd): one block's cached keys/values at one loop
_STAT_FIELDS = tuple(f.name for f in fields(LoopStats) if f.name != "loop")


# ----------------------------------------------------------------------------------------------------------
# Flat tokens and cached attention


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


def attend_cached(q: Tensor, toks: Tokens, kv: KVSlab) -> Tensor:
    """Causal attention of queries q (N, H, hd) at ``toks`` over their rows' cached k/v: -> (N, H * hd).

    The query at position p sees the keys at positions 0..p of its row in ``kv`` (B, H, T, hd).
    """
    n, heads, hd = q.shape
    counts = torch.bincount(toks.rows, minlength=kv[0].shape[0])
    present = counts > 0
    compact_row = (torch.cumsum(present, 0) - 1)[toks.rows]
    slot = torch.arange(n, device=q.device) - (torch.cumsum(counts, 0) - counts)[toks.rows]
    n_rows, width, t_k = int(present.sum()), int(counts.max()), int(toks.pos.max()) + 1
    k, v = kv[0][:, :, :t_k], kv[1][:, :, :t_k]
    if n_rows < kv[0].shape[0]:
        used = present.nonzero().squeeze(1)
        k, v = k.index_select(0, used), v.index_select(0, used)
    q_pad = q.new_zeros(n_rows, width, heads, hd)
    q_pad[compact_row, slot] = q
    pos_pad = torch.zeros(n_rows, width, dtype=torch.long, device=q.device)
    pos_pad[compact_row, slot] = toks.pos
    mask = torch.arange(t_k, device=q.device) <= pos_pad[..., None]  # (rows, M, t_k)
    y = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, attn_mask=mask[:, None])
    return y.transpose(1, 2)[compact_row, slot].reshape(n, heads * hd)


def block_step(block: Block, x: Tensor, toks: Tokens, kv: KVSlab, cos: Tensor, sin: Tensor,
               query: Tensor | None = None) -> Tensor:
    """One transformer block on the flat tokens ``x`` (N, d) at ``toks``, attending over the cache ``kv``:
    :meth:`Block.qkv <drc_core.model.Block.qkv>` and :meth:`Block.finish <drc_core.model.Block.finish>`, the
    code of ``Block.forward``, around :func:`attend_cached` instead of dense causal attention.

    The tokens' keys/values are written into ``kv`` first (in place), so they see themselves and every other
    token's cached keys/values. ``query`` (N,) bool: only those tokens get the attention output and the MLP
    (all tokens still write their k/v); returns (N', d) for the N' selected tokens.
    """
    q, k, v = (t[0].transpose(0, 1) for t in block.qkv(x[None], cos[toks.pos], sin[toks.pos]))  # (N, H, hd)
    kv[0][toks.rows, :, toks.pos] = k
    kv[1][toks.rows, :, toks.pos] = v
    if query is not None:
        x, q, toks = x[query], q[query], toks.select(query)
        if len(toks) == 0:
            return x
    return block.finish(x, attend_cached(q, toks, kv))


def coda_readout(model: DepthRecurrentLM, x: Tensor, toks: Tokens, coda_kv: list[KVSlab],
                 query: Tensor | None = None) -> Tensor:
    """Coda + norm + head of the flat states ``x`` (N, d) at ``toks`` -> logits (N', V) of the ``query`` tokens.

    Every token in ``toks`` writes its coda keys/values (the context that later tokens see); only the
    ``query`` tokens (default all) run the last coda block's attention and MLP and the head.
    """
    cos, sin = model.rope_cos, model.rope_sin
    last = len(model.coda) - 1
    for j, (block, kv) in enumerate(zip(model.coda, coda_kv, strict=True)):
        x = block_step(block, x, toks, kv, cos, sin, query=query if j == last else None)
    if last < 0 and query is not None:
        x = x[query]
    return model.head(x)


def empty_caches(model: DepthRecurrentLM, n_blocks: int, shape: tuple[int, ...], like: Tensor) -> list[KVSlab]:
    """Zeroed (K, V) caches per block, each ``(*lead, B, H, T, hd)`` for ``shape = (*lead, B, T)`` (zeros, so
    that masked-out keys never hold NaN)."""
    *lead, B, T = shape
    size = (*lead, B, model.cfg.n_heads, T, model.cfg.head_dim)
    return [(like.new_zeros(size), like.new_zeros(size)) for _ in range(n_blocks)]


# ----------------------------------------------------------------------------------------------------------
# Statistics for the rule, active tokens only


class _Stats:
    """The rule's :class:`LoopStats` in the (B, W) layout of the positions being processed.

    Statistics are computed only for the active tokens (compact, (1, N)) and scattered into (B, W) buffers,
    so a halted token's entries keep its exit-loop values (its decisions are ignored anyway); ``state`` is
    the (B, W, d) state (halted tokens frozen). Without ``needs_log_probs`` the output-based fields are
    placeholders: ``log_probs`` (B, W, 0), ``kl``/``entropy``/``entropy_delta``/``top_prob`` NaN, ``argmax``
    -1 and ``argmax_run`` 0.
    """

    def __init__(self, needs_log_probs: bool, shape: tuple[int, int], vocab: int, state: Tensor) -> None:
        self.needs = needs_log_probs
        dev = state.device

        def nan() -> Tensor:
            return torch.full(shape, math.nan, device=dev)

        self.full: dict[str, Tensor] = {
            "log_probs": torch.zeros(*shape, vocab if needs_log_probs else 0, device=dev),
            "kl": nan(), "state_delta": nan(), "entropy": nan(), "entropy_delta": nan(), "cosine": nan(),
            "argmax": torch.full(shape, -1, dtype=torch.long, device=dev),
            "argmax_run": torch.zeros(shape, dtype=torch.long, device=dev), "top_prob": nan(), "minp_kl": nan(),
            "state_step": torch.zeros(*shape, state.shape[-1], device=dev), "accel": nan(), "accel_prev": nan(),
        }
        self.prev: LoopStats | None = None  # compact (1, N) stats of the previous loop's active tokens
        self.prev_state: Tensor | None = None
        self.prev_traj: _Trajectory | None = None  # state-only rules: the trajectory fields of the last loop

    def update(self, loop: int, rows: Tensor, cols: Tensor, state: Tensor, log_probs: Tensor | None,
               full_state: Tensor) -> LoopStats:
        """This loop's stats; ``rows``/``cols`` index the (B, W) layout, ``state`` (N, d) and ``log_probs``
        (N, V) are the active tokens' (the same tokens as the previous call, minus those that halted)."""
        if self.needs:
            assert log_probs is not None
            compact = loop_stats(self.prev, loop, log_probs[None], state[None])
            self.prev = compact
            for name in _STAT_FIELDS:
                if name != "state":
                    self.full[name][rows, cols] = getattr(compact, name)[0]
        else:
            if self.prev_state is None:
                delta = torch.full((state.shape[0],), math.inf, device=state.device)
                cosine = -delta
            else:
                delta, cosine = state_change(state, self.prev_state)
            self.prev_state = state
            self.full["state_delta"][rows, cols] = delta
            self.full["cosine"][rows, cols] = cosine
            step, accel, accel_prev = trajectory_step(state, self.prev_traj)  # type: ignore[arg-type]
            self.prev_traj = _Trajectory(loop, state, step, accel)
            self.full["state_step"][rows, cols] = step
            self.full["accel"][rows, cols] = accel
            self.full["accel_prev"][rows, cols] = accel_prev
        return LoopStats(loop=loop, state=full_state, **{k: v for k, v in self.full.items()})

    def keep(self, keep: Tensor) -> None:
        """Keep only the active tokens that did not halt (``keep`` (N,) bool) for the next loop."""
        if self.prev is not None:
            self.prev = LoopStats(loop=self.prev.loop,
                                  **{k: getattr(self.prev, k)[:, keep] for k in _STAT_FIELDS})
        if self.prev_state is not None:
            self.prev_state = self.prev_state[keep]
        if self.prev_traj is not None:
            t = self.prev_traj
            self.prev_traj = _Trajectory(t.loop, t.state[keep], t.state_step[keep], t.accel[keep])


@dataclass
class _Trajectory:
    """What :func:`~drc_core.analysis.loops.trajectory_step` reads of the previous loop, for state-only rules."""

    loop: int
    state: Tensor
    state_step: Tensor
    accel: Tensor


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

    def slabs(self, loop: int) -> tuple[list[KVSlab], list[KVSlab]]:
        """The core and coda slabs that loop ``loop`` reads and writes."""
        if not self.per_loop:
            return self.core, self.coda
        return ([(k[loop - 1], v[loop - 1]) for k, v in self.core],
                [(k[loop - 1], v[loop - 1]) for k, v in self.coda])

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
              caches: LoopCaches) -> LoopResult:
    """Run loops 1..``rule.max_loops`` with per-token halting on the tokens at positions [t0, t1) of every
    row, computing only the active ones; earlier positions must be complete (their caches filled).

    ``s`` (B, T, d) holds s_0 at the processed positions and is updated in place (a halted token keeps its
    exit state); ``e`` (B, T, d) is the prelude output. Stops as soon as every processed token has halted.
    """
    t0, t1 = window
    B, width = s.shape[0], t1 - t0
    device = s.device
    halted = torch.zeros(B, width, dtype=torch.bool, device=device)
    exit_loop = torch.zeros(B, width, dtype=torch.long, device=device)
    logits = torch.zeros(B, width, model.cfg.vocab_size, dtype=s.dtype, device=device)
    stats = _Stats(rule.needs_log_probs, (B, width), model.cfg.vocab_size, s)
    cos, sin = model.rope_cos, model.rope_sin
    for loop in range(1, rule.max_loops + 1):
        active = ~halted
        toks = Tokens.of(active)
        if len(toks) == 0:
            break
        local = toks.pos
        toks = Tokens(toks.rows, local + t0)
        core_kv, coda_kv = caches.slabs(loop)
        x = model.inject(toks.gather(s), toks.gather(e))
        for block, kv in zip(model.core, core_kv, strict=True):
            x = block_step(block, x, toks, kv, cos, sin)
        s[toks.rows, toks.pos] = x
        if rule.needs_log_probs:
            out = coda_readout(model, x, toks, coda_kv)
            st = stats.update(loop, toks.rows, local, x, F.log_softmax(out.float(), dim=-1), s[:, t0:t1])
            now = rule.decide(st) & active
            exiting = now[toks.rows, local]
            logits[toks.rows[exiting], local[exiting]] = out[exiting]
        else:
            st = stats.update(loop, toks.rows, local, x, None, s[:, t0:t1])
            now = rule.decide(st) & active
            _exit_readout(model, s, x, toks, local, now, coda_kv, logits, full_context=caches.per_loop)
        now_flat = now[toks.rows, local]
        caches.exited(toks.select(now_flat), loop)
        stats.keep(~now_flat)
        exit_loop.masked_fill_(now, loop)
        halted |= now
    return LoopResult(exit_loop=exit_loop, logits=logits)


def _exit_readout(model: DepthRecurrentLM, s: Tensor, x: Tensor, toks: Tokens, local: Tensor, now: Tensor,
                  coda_kv: list[KVSlab], logits: Tensor, *, full_context: bool) -> None:
    """Read out the tokens that exit now (``now`` (B, W)); the coda context is the active tokens of their rows
    at or before the last exiting position (every active token with ``full_context``)."""
    exiting = now[toks.rows, local]
    if not full_context:
        if not bool(exiting.any()):
            return
        last = torch.where(now, torch.arange(now.shape[1], device=now.device), -1).amax(dim=1)
        in_context = local <= last[toks.rows]
        x, toks, local, exiting = x[in_context], toks.select(in_context), local[in_context], exiting[in_context]
    out = coda_readout(model, x, toks, coda_kv, query=exiting)
    if out.shape[0]:
        logits[toks.rows[exiting], local[exiting]] = out


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


@torch.no_grad()
def skip_forward(
    model: DepthRecurrentLM,
    idx: Tensor,
    rule: HaltingRule,
    *,
    generator: torch.Generator | None = None,
    state: Tensor | None = None,
) -> AdaptiveResult:
    """:func:`drc_core.halting.rules.masked_forward`, computing only the active tokens at every loop.

    Same arguments, same :class:`~drc_core.halting.rules.AdaptiveResult`, same semantics (halted tokens frozen,
    offering their exit-loop keys/values in every core and coda block; logits from the exit loop), equal to
    it to float tolerance with the same exit loops (a decision can only differ where a statistic lies within
    rounding of the threshold). The rule gets :class:`~drc_core.analysis.loops.LoopStats` over (B, T) whose active
    entries equal the reference's; a halted token's entries are stale (its decisions are ignored); a rule
    whose ``needs_log_probs`` is False gets placeholder output fields (``log_probs`` (B, T, 0), NaN KL /
    entropy / top probability, argmax -1). Stops early once every token has halted. Runs under
    ``torch.no_grad()``; put the model in eval mode first if it has dropout. Cost: see the module docstring.
    """
    if not isinstance(rule, HaltingRule):
        raise DrcError(f"rule={rule!r} is not a HaltingRule; pass e.g. KLThreshold(1e-3)")
    if idx.dim() != 2:
        raise DrcError(f"idx must be (B, T) token ids; got shape {tuple(idx.shape)}")
    B, T = idx.shape
    check_state(state, (B, T, model.cfg.d_model))
    e = model.embed(idx)
    s = (model.initial_state(e, generator) if state is None else state).clone()
    caches = LoopCaches(core=empty_caches(model, len(model.core), (B, T), e),
                        coda=empty_caches(model, len(model.coda), (B, T), e), per_loop=False)
    res = run_loops(model, rule, s, e, (0, T), caches)
    return AdaptiveResult(exit_loop=res.exit_loop, logits=res.logits, avg_depth=float(res.exit_loop.float().mean()),
                          state=s, rule=str(rule))


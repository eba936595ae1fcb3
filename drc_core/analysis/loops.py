"""Per-token statistics of one loop against the previous one: the quantities every measurement, halting
rule and router reads.

Direction convention: the successive KL at loop l is ``KL(p_l || p_{l-1})`` (the new output against the
previous one); the relative state change is ``||s_l - s_{l-1}|| / ||s_l||``. See :class:`LoopStats`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.errors import DrcError
from drc_core.model.lm import RecurrentModel, iterate

__all__ = ["MIN_P", "LoopStats", "iterate_stats", "loop_stats", "minp_log_probs", "state_change", "trajectory_step"]



@dataclass
class LoopStats:
    """Per-token statistics of a batch after loop ``loop`` (1-based); every statistic is (B, T).

    ``log_probs`` (B, T, V) float32 and ``state`` (B, T, d) are loop l's readout and latent state. The
    statistics that compare with loop l-1 are undefined at the first loop and hold a value that never
    halts there: ``kl``, ``state_delta`` and ``entropy_delta`` are +inf and ``cosine`` is -inf.

    - ``kl`` = KL(p_l || p_{l-1}) (:func:`drc_core.model.passes.kl_successive`);
    - ``state_delta`` = ||s_l - s_{l-1}|| / ||s_l|| (L2 over d);
    - ``entropy`` = H(p_l) in nats, ``entropy_delta`` = |H_l - H_{l-1}|;
    - ``cosine`` = cos(s_l, s_{l-1});
    - ``argmax`` = argmax_v p_l(v) (long), ``argmax_run`` = the length of the current run of loops with this
      same argmax (1 at the first loop and after every change; long);
    - ``top_prob`` = max_v p_l(v);
    - ``minp_kl`` = KL(q_{l-1} || q_l) of the min-p filtered outputs q (Huginn's ``minp-kl`` exit criterion: every
      probability below 0.1 * max_v p(v) is replaced by 1/V, then renormalised; note the direction, previous ||
      current, as Huginn computes it), +inf at the first loop;
    - ``state_step`` = s_l - s_{l-1} (B, T, d) (zeros at the first loop), ``accel`` = ||Δs_l - Δs_{l-1}|| /
      ||s_l|| with Δs_l = ``state_step`` (the second-order "acceleration" of the latent trajectory, +inf at
      loops 1 and 2) and ``accel_prev`` the previous loop's ``accel`` (+inf through loop 3).

    Build it with :func:`loop_stats`, which keeps no reference to the previous loop's stats, so a loop-by-
    loop caller holds at most two loops' (B, T, V) tensors at once.
    """

    loop: int
    log_probs: Tensor
    state: Tensor
    kl: Tensor
    state_delta: Tensor
    entropy: Tensor
    entropy_delta: Tensor
    cosine: Tensor
    argmax: Tensor
    argmax_run: Tensor
    top_prob: Tensor
    minp_kl: Tensor
    state_step: Tensor
    accel: Tensor
    accel_prev: Tensor

    @property
    def shape(self) -> torch.Size:
        """(B, T)."""
        return self.state.shape[:2]


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` as one batched dot product, without the (..., V) product (several times faster on
    CPU than multiply-then-sum for vocabulary-sized rows)."""
    v = a.shape[-1]
    return torch.einsum("bnv,bnv->bn", a.reshape(1, -1, v), b.reshape(1, -1, v)).reshape(a.shape[:-1])


def _entropy(log_probs: Tensor, p: Tensor | None = None) -> Tensor:
    """H(p) in nats from log-probs (and their exp ``p``, if already computed); 0 * log 0 counts as 0."""
    p = log_probs.exp() if p is None else p
    h = -_dot(p, log_probs)
    if bool(torch.isnan(h).any()):  # a -inf log-prob (p = 0) makes 0 * -inf = NaN: redo without it
        h = -torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(-1)
    return h


def state_change(state: Tensor, prev_state: Tensor) -> tuple[Tensor, Tensor]:
    """``(state_delta, cosine)`` of states (..., d) against the previous loop's, in float32 (see
    :class:`LoopStats`); the statistics that need no readout."""
    s, s_prev = state.float(), prev_state.float()
    state_delta = (s - s_prev).norm(dim=-1) / s.norm(dim=-1).clamp_min(torch.finfo(s.dtype).tiny)
    return state_delta, F.cosine_similarity(s, s_prev, dim=-1)


MIN_P = 0.1  # Huginn's min-p filter: probabilities below MIN_P * max are replaced by 1/V


def minp_log_probs(log_probs: Tensor) -> Tensor:
    """Huginn's min-p filtered log-distribution of log-probs (..., V): p below ``MIN_P * max p`` -> 1/V,
    renormalised."""
    v = log_probs.shape[-1]
    top = log_probs.amax(dim=-1, keepdim=True)
    q = torch.where(log_probs < top + math.log(MIN_P), torch.full_like(log_probs, 1.0 / v), log_probs.exp())
    return q.log() - q.sum(dim=-1, keepdim=True).log()


def trajectory_step(state: Tensor, prev: LoopStats | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(state_step, accel, accel_prev)`` of ``state`` (..., d) after ``prev`` (see :class:`LoopStats`); the
    second-order statistics need no readout."""
    s = state.float()
    shape = s.shape[:-1]
    inf = torch.full(shape, math.inf, device=s.device)
    if prev is None:
        return torch.zeros_like(s), inf, inf
    step = s - prev.state.float()
    if prev.loop < 2:  # no previous step yet
        return step, inf, inf
    accel = (step - prev.state_step).norm(dim=-1) / s.norm(dim=-1).clamp_min(torch.finfo(s.dtype).tiny)
    return step, accel, prev.accel


def loop_stats(prev: LoopStats | None, loop: int, log_probs: Tensor, state: Tensor) -> LoopStats:
    """The :class:`LoopStats` of loop ``loop`` from its log-probs (B, T, V) and state (B, T, d), given the
    previous loop's stats ``prev`` (None at the first loop)."""
    if log_probs.dim() != 3 or state.dim() != 3 or log_probs.shape[:2] != state.shape[:2]:
        raise DrcError(
            f"log_probs must be (B, T, V) and state (B, T, d) with the same (B, T); got log_probs "
            f"{tuple(log_probs.shape)} and state {tuple(state.shape)}"
        )
    if prev is not None and (prev.log_probs.shape != log_probs.shape or prev.state.shape != state.shape):
        raise DrcError(
            f"loop {loop}'s log_probs {tuple(log_probs.shape)} / state {tuple(state.shape)} do not match the "
            f"previous loop's {tuple(prev.log_probs.shape)} / {tuple(prev.state.shape)}"
        )
    log_probs = log_probs.float()
    p = log_probs.exp()
    entropy = _entropy(log_probs, p)
    top_logp, argmax = log_probs.max(dim=-1)
    if prev is None:
        inf = torch.full(entropy.shape, math.inf, device=entropy.device)
        kl, state_delta, entropy_delta, cosine, minp_kl = inf, inf, inf, -inf, inf
        argmax_run = torch.ones_like(argmax)
    else:
        kl = _dot(p, log_probs - prev.log_probs)  # = kl_successive(log_probs, prev.log_probs)
        state_delta, cosine = state_change(state, prev.state)
        entropy_delta = (entropy - prev.entropy).abs()
        argmax_run = torch.where(argmax == prev.argmax, prev.argmax_run + 1, torch.ones_like(argmax))
        q_prev, q = minp_log_probs(prev.log_probs), minp_log_probs(log_probs)
        minp_kl = _dot(q_prev.exp(), q_prev - q)
    state_step, accel, accel_prev = trajectory_step(state, prev)
    return LoopStats(
        loop=loop,
        log_probs=log_probs,
        state=state,
        kl=kl,
        state_delta=state_delta,
        entropy=entropy,
        entropy_delta=entropy_delta,
        cosine=cosine,
        argmax=argmax,
        argmax_run=argmax_run,
        top_prob=top_logp.exp(),
        minp_kl=minp_kl,
        state_step=state_step,
        accel=accel,
        accel_prev=accel_prev,
    )


@torch.no_grad()
def iterate_stats(
    model: RecurrentModel,
    idx: Tensor,
    max_loops: int,
    *,
    generator: torch.Generator | None = None,
    state: Tensor | None = None,
) -> Iterator[LoopStats]:
    """:class:`LoopStats` after each loop 1..max_loops of a run without halting (uniform depth)."""
    prev: LoopStats | None = None
    for out in iterate(model, idx, max_loops, generator=generator, readout="log_probs", state=state):
        assert out.out is not None
        prev = loop_stats(prev, out.loop, out.out, out.state)
        yield prev

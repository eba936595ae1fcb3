"""Evaluation passes: the context every measurement runs in (eval mode, no grad, seeded initial states), its
batches of windows, and the successive-output KL they all compute."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from drc_core.errors import MAX_SEED, need_int
from drc_core.model.lm import RecurrentModel

__all__ = ["EVAL_STATE_SEED", "Batch", "eval_batches", "evaluation", "kl_successive"]

EVAL_STATE_SEED = 1234  # the initial latent state of every evaluation pass, so evaluations are comparable


@contextmanager
def evaluation(model: RecurrentModel, seed: int = EVAL_STATE_SEED) -> Iterator[torch.Generator]:
    """Eval mode and no grad (the mode restored after); yields the initial states' generator, seeded with ``seed``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            yield torch.Generator(device=device).manual_seed(need_int("seed", seed, 0, maximum=MAX_SEED))
    finally:
        model.train(was_training)


@dataclass
class Batch:
    """One batch of an evaluation pass: inputs ``x``, targets ``y``, the index of its first window and the
    ``generator`` positioned to draw its initial state."""

    start: int
    x: torch.Tensor
    y: torch.Tensor
    generator: torch.Generator

    def initial_state(self, model: RecurrentModel) -> torch.Tensor:
        """Draw this batch's s_0 as :func:`drc_core.model.lm.iterate` would (embed, then ``initial_state``)."""
        return model.initial_state(model.embed(self.x), self.generator)


def eval_batches(model: RecurrentModel, windows: torch.Tensor, batch_size: int = 16,
                 seed: int = EVAL_STATE_SEED) -> Iterator[Batch]:
    """The (N, T+1) ``windows`` in batches inside :func:`evaluation`; batch k's initial state is the k-th draw of one
    generator seeded with ``seed``, so passes over the same windows start from the same states."""
    batch_size = need_int("batch_size", batch_size, 1)
    with evaluation(model, seed) as gen:
        for start in range(0, len(windows), batch_size):
            w = windows[start : start + batch_size].to(gen.device)
            yield Batch(start=start, x=w[:, :-1], y=w[:, 1:], generator=gen)


def kl_successive(logp_new: torch.Tensor, logp_old: torch.Tensor, p_new: torch.Tensor | None = None) -> torch.Tensor:
    """KL(p_new || p_old) over the last axis, from log-probabilities (``p_new``: ``logp_new.exp()`` if known)."""
    return ((logp_new.exp() if p_new is None else p_new) * (logp_new - logp_old)).sum(-1)

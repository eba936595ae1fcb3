"""One-line :class:`~drc_core.errors.DrcError` checks of what a model is given: token ids it can read, an initial
state shaped like its prelude output."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from drc_core.errors import DrcError

__all__ = ["check_initial_state", "check_token_ids"]


class _Reads(Protocol):
    vocab_size: int
    max_seq_len: int


def check_token_ids(model: _Reads, ids: object, what: str = "windows", *, targets: bool = True) -> Tensor:
    """``ids`` unchanged if it is a non-empty integer tensor of ids in 0..vocab_size-1 whose T positions fit
    ``max_seq_len``: (N, T+1) windows with ``targets``, else (N, T)."""
    shape, least = ("(N, T+1)", 2) if targets else ("(N, T)", 1)
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < least:
        shown = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise DrcError(f"{what} must be a non-empty {shape} integer tensor with T >= 1; got {shown}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise DrcError(f"{what} must hold integer token ids (an integer tensor); got dtype {ids.dtype}")
    lo, hi, vocab = int(ids.min()), int(ids.max()), model.vocab_size
    if lo < 0 or hi >= vocab:
        raise DrcError(f"{what} hold token ids in [{lo}, {hi}] but the model's vocabulary is [0, {vocab - 1}]: "
                       "pass ids of the model's tokenizer (windows of the corpus it was trained on)")
    positions = ids.shape[1] - 1 if targets else ids.shape[1]
    if positions > model.max_seq_len:
        raise DrcError(f"{what} have T={positions} positions but the model's max_seq_len is {model.max_seq_len}: "
                       f"pass at most {model.max_seq_len + int(targets)} tokens (split a longer text into windows)")
    return ids


def check_initial_state(state: object, e: Tensor) -> Tensor:
    """``state`` unchanged if it is a float tensor shaped like the prelude output ``e`` (B, T, d_model)."""
    if not isinstance(state, Tensor) or tuple(state.shape) != tuple(e.shape) or not state.dtype.is_floating_point:
        shown = f"{tuple(state.shape)} {state.dtype}" if isinstance(state, Tensor) else type(state).__name__
        raise DrcError(f"state must be a float tensor of shape (B, T, d_model) = {tuple(e.shape)}; got {shown}: "
                       "pass s_0 for every position, or state=None to draw it")
    return state

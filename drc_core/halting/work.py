"""The work a skipping run actually did, counted as it runs; :func:`drc_book.cost.honest_flops` prices it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Work"]


@dataclass
class Work:
    """Token passes a skipping run computed: ``core`` (token-loops through the whole core, adapter included),
    ``blocks`` (full block applications outside the core: prelude, coda), ``qkv`` (tokens that only projected
    their coda keys/values as context), ``head`` (readouts through the final norm and the head), ``vocab_stats``
    (token-loops x vocabulary-sized passes: the softmax and what the rule reads, three for min-p KL) and
    ``tokens`` (the tokens processed)."""

    core: int = 0
    blocks: int = 0
    qkv: int = 0
    head: int = 0
    vocab_stats: int = 0
    tokens: int = 0

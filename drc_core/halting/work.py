"""The work a skipping run actually did, counted as it runs; :func:`drc_book.cost.honest_flops`
prices it."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Work"]


@dataclass
class Work:
    """Token passes a skipping run actually computed: ``core`` (token-loops through the whole core, adapter
    included), ``blocks`` (full block applications outside the core: prelude, coda), ``qkv`` (tokens that only
    projected their coda keys/values as context), ``head`` (readouts through the final norm and the head) and
    ``vocab_stats`` (token-loops x vocabulary-sized passes: the softmax and what the rule reads, three passes for
    min-p KL), and
    ``tokens`` (the tokens processed). :func:`drc_book.cost.honest_flops` prices them."""

    core: int = 0
    blocks: int = 0
    qkv: int = 0
    head: int = 0
    vocab_stats: int = 0
    tokens: int = 0

    def add(self, other: Work) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

"""The numbers one notebook hands to a later one, as typed records: the only way notebook 07 reads 01-04 and 06.

Each notebook writes its results as JSON (``drc_book.workspace.save_results``, integer keys become
strings). A class here names the fields a later notebook reads from one of those files and parses them
(:meth:`from_results`); a missing field is a one-line :class:`~drc_core.errors.DrcError` that names the
notebook to re-run. ``tests/test_handoff.py`` checks that every field is among the keys the producing
notebook writes (by reading its source) and that the reference book's results parse, so a renamed key fails
a fast test rather than the book run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from drc_core import DrcError

__all__ = ["HANDOFFS", "Convergence", "Cycles", "Halting", "Interval", "KnownDepth", "TokenTypes", "Training"]


def _num(x: Any) -> float:
    """A JSON number; null (how save_results writes NaN) is NaN."""
    return math.nan if x is None else float(x)


def _need(results: Mapping[str, Any], cls: type) -> None:
    missing = [f.name for f in fields(cls) if f.name not in results]
    if missing:
        raise DrcError(f"the results of {cls.NOTEBOOK} lack {', '.join(missing)}: re-run notebook {cls.NOTEBOOK} "
                       "of this profile")


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval (``{"value", "lo", "hi"}`` in the JSON; null is NaN)."""

    value: float
    lo: float
    hi: float

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> Interval:
        return cls(value=_num(d["value"]), lo=_num(d["lo"]), hi=_num(d["hi"]))


@dataclass(frozen=True)
class Cycles:
    """The tokens in a 2-cycle at the deepest loop (:func:`drc_core.analysis.measure.oscillating_tokens`): how
    many, and the share of the mean successive KL they carry at some loops (loop -> share)."""

    count: int
    share_of_mean_kl: dict[int, float]


@dataclass(frozen=True)
class Training:
    """From 01_training: the model's size and training tokens."""

    NOTEBOOK: ClassVar[str] = "01_training"
    n_params: int
    train_tokens: int

    @classmethod
    def from_results(cls, r: Mapping[str, Any]) -> Training:
        _need(r, cls)
        return cls(n_params=int(r["n_params"]), train_tokens=int(r["train_tokens"]))

    @property
    def scale(self) -> str:
        """e.g. ``1.4M-parameter, 12M-token``."""
        return f"{self.n_params / 1e6:.1f}M-parameter, {self.train_tokens / 1e6:.0f}M-token"


@dataclass(frozen=True)
class Convergence:
    """From 02_convergence, per loop l: ``kl_by_loop`` (mean KL(p_l || p_{l-1}), l >= 2), ``kl_final_by_loop``
    (mean KL(p_L || p_l), l < L), ``ce_by_loop``; the depth summaries at the profile's eps; the tokens in a
    2-cycle (``oscillating``); ``n_tokens``, the number of tokens these were measured on."""

    NOTEBOOK: ClassVar[str] = "02_convergence"
    kl_by_loop: dict[int, Interval]
    kl_final_by_loop: dict[int, float]
    ce_by_loop: dict[int, Interval]
    median_depth: Interval
    frac_updating: Interval
    oscillating: Cycles
    n_tokens: int = 0

    @classmethod
    def from_results(cls, r: Mapping[str, Any]) -> Convergence:
        _need(r, cls)
        return cls(
            kl_by_loop={int(k): Interval.of(v) for k, v in r["kl_by_loop"].items()},
            kl_final_by_loop={int(k): _num(v) for k, v in r["kl_final_by_loop"].items()},
            ce_by_loop={int(k): Interval.of(v) for k, v in r["ce_by_loop"].items()},
            median_depth=Interval.of(r["median_depth"]),
            frac_updating=Interval.of(r["frac_updating"]),
            oscillating=Cycles(count=int(r["oscillating"]["count"]),
                               share_of_mean_kl={int(k): _num(v)
                                                 for k, v in r["oscillating"]["share_of_mean_kl"].items()}),
            n_tokens=int(r["n_tokens"]),
        )


@dataclass(frozen=True)
class TokenTypes:
    """From 03_token_types: the token classes from shallowest to deepest mean convergence depth."""

    NOTEBOOK: ClassVar[str] = "03_token_types"
    order_shallow_to_deep: list[str]

    @classmethod
    def from_results(cls, r: Mapping[str, Any]) -> TokenTypes:
        _need(r, cls)
        return cls(order_shallow_to_deep=[str(c) for c in r["order_shallow_to_deep"]])


@dataclass(frozen=True)
class Halting:
    """From 04_halting_and_routers: the reference depth; per rule family, the (interpolated) average depth at
    which it matches uniform depth ``reference_loops``'s CE (NaN where it never does; absent families are None);
    and per family the loops it saves against the uniform depth of equal quality, with intervals (``gaps``:
    family -> ``family_depth``, ``uniform_depth``, ``saved``, ``saved_frac``, as
    :func:`drc_core.halting.sweep.gap_table` gives them)."""

    NOTEBOOK: ClassVar[str] = "04_halting_and_routers"
    reference_loops: int
    matching: dict[str, float]
    gaps: dict[str, dict[str, Interval]]

    @classmethod
    def from_results(cls, r: Mapping[str, Any]) -> Halting:
        _need(r, cls)
        stats = ("family_depth", "uniform_depth", "saved", "saved_frac")
        return cls(reference_loops=int(r["reference_loops"]),
                   matching={str(m["family"]): _num(m["ce_depth_interp"]) for m in r["matching"]},
                   gaps={str(g["family"]): {k: Interval(_num(g[k]), _num(g[f"{k}_lo"]), _num(g[f"{k}_hi"]))
                                            for k in stats} for g in r["gaps"]})

    def depth(self, family: str) -> float:
        """The family's matching depth, NaN when the family is not in the table."""
        return self.matching.get(family, math.nan)


@dataclass(frozen=True)
class KnownDepth:
    """From 06_known_depth (the model trained on natural text mixed with depth tasks): its training-mean depth
    ``reference_loops``, the share of its training tokens that are tasks, the range of lookups ``k_range``, the
    lowest answer accuracy over ``k`` at ``reference_loops`` loops, Spearman's correlation of ``k`` with the
    answers' convergence depth, and the loops each family saves against the uniform depth of equal quality
    (``gaps``: window set -> family -> stat, as in :class:`Halting`)."""

    NOTEBOOK: ClassVar[str] = "06_known_depth"
    reference_loops: int
    task_share: float
    k_range: list[int]
    min_accuracy_at_R: float
    spearman_depth: Interval
    gaps: dict[str, dict[str, dict[str, Interval]]]

    @classmethod
    def from_results(cls, r: Mapping[str, Any]) -> KnownDepth:
        _need(r, cls)
        stats = ("family_depth", "uniform_depth", "saved", "saved_frac")
        p, lo, hi = (_num(x) for x in r["spearman_depth"])
        return cls(reference_loops=int(r["reference_loops"]), task_share=_num(r["task_share"]),
                   k_range=[int(k) for k in r["k_range"]], min_accuracy_at_R=_num(r["min_accuracy_at_R"]),
                   spearman_depth=Interval(p, lo, hi),
                   gaps={name: {str(g["family"]): {k: Interval(_num(g[k]), _num(g[f"{k}_lo"]), _num(g[f"{k}_hi"]))
                                                   for k in stats} for g in rows}
                         for name, rows in r["gaps"].items()})


HANDOFFS = (Training, Convergence, TokenTypes, Halting, KnownDepth)

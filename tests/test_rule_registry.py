"""The registry of halting-rule families: today's names, grids and order pinned, so that deriving them from one
place changes no number."""

from __future__ import annotations

import pytest

from drc_core.halting.rules import (
    RULE_FAMILIES,
    Acceleration,
    ArgmaxPatience,
    Cosine,
    EntropyDelta,
    KLThreshold,
    MinPKL,
    Never,
    SoftmaxConfidence,
    StateDelta,
    Uniform,
    make_rule,
)
from drc_core.halting.sweep import RuleSpec, default_rules

HALF_DECADES = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5]
# default_rules as it was written out by hand before the registry: family, class and grid, in this order
PINNED_GRIDS = [
    ("kl", KLThreshold, HALF_DECADES),
    ("state_delta", StateDelta, [3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]),
    ("entropy_delta", EntropyDelta, HALF_DECADES),
    ("cosine", Cosine, [0.9, 0.99, 0.999, 0.9999, 0.99999]),
    ("argmax_patience", ArgmaxPatience, [1, 2, 3, 4, 6]),
    ("confidence", SoftmaxConfidence, [0.3, 0.5, 0.7, 0.9, 0.95, 0.99]),
    ("minp_kl", MinPKL, [*HALF_DECADES, 3e-6, 1e-6]),
    ("acceleration", Acceleration, [3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4]),
]
PINNED_FAMILIES = {
    "kl": KLThreshold,
    "state_delta": StateDelta,
    "entropy_delta": EntropyDelta,
    "cosine": Cosine,
    "argmax_patience": ArgmaxPatience,
    "confidence": SoftmaxConfidence,
    "minp_kl": MinPKL,
    "acceleration": Acceleration,
    "uniform": Uniform,
    "never": Never,
}


@pytest.mark.parametrize("kw", [{}, {"max_loops": 12}, {"max_loops": 32, "min_loops": 3}])
def test_default_rules_are_pinned(kw):
    pinned = [RuleSpec(fam, p, cls(p, max_loops=kw.get("max_loops", 16), min_loops=kw.get("min_loops", 1)))
              for fam, cls, grid in PINNED_GRIDS for p in grid]
    got = default_rules(**kw)
    assert len(got) == 60
    assert [repr(s) for s in got] == [repr(s) for s in pinned]  # families, params (and their types), order
    assert got == pinned


def test_rule_families_are_pinned():
    assert list(RULE_FAMILIES) == list(PINNED_FAMILIES)
    assert RULE_FAMILIES == PINNED_FAMILIES
    assert make_rule("kl", 1e-3, max_loops=16) == KLThreshold(1e-3, max_loops=16)
    assert make_rule("argmax_patience", 3, min_loops=2) == ArgmaxPatience(3, min_loops=2)
    assert make_rule("uniform", 4) == Uniform(4)
    assert make_rule("never", max_loops=8) == Never(max_loops=8)
    assert make_rule("minp_kl", 1e-5) == MinPKL(1e-5)
    assert make_rule("acceleration", tau=0.01) == Acceleration(0.01)

"""How many core loops each training step runs (``RecurrenceConfig.scheme``): ``"poisson-lognormal"`` (Huginn's
``r = Poisson(rate) + 1``, ``rate ~ LogNormal(ln(mean - 1) - sigma^2 / 2, sigma)``, so E[r] = ``mean``), ``"fixed"``
(r = mean) or ``"uniform"`` (low..high); ``max_loops`` clips every draw, ``backprop_loops`` is the truncated-backprop
depth. A draw is a pure function of (seed, step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from drc_core.errors import MAX_SEED, MAX_SIGMA, DrcError

SCHEMES = ("poisson-lognormal", "fixed", "uniform")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RecurrenceConfig:
    scheme: str = "poisson-lognormal"
    mean: float = 8.0
    sigma: float = 0.5
    low: int = 1
    high: int = 16
    max_loops: int | None = None
    backprop_loops: int | None = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise DrcError(f"scheme={self.scheme!r} is not supported; use one of {SCHEMES}")
        if self.scheme == "poisson-lognormal":
            if not _is_number(self.mean) or self.mean <= 1:
                raise DrcError(f"mean={self.mean!r} is invalid for scheme 'poisson-lognormal'; it must be > 1 "
                               "(r = Poisson(rate) + 1 >= 1), or use scheme='fixed' for one loop")
            if not _is_number(self.sigma) or not 0 <= self.sigma <= MAX_SIGMA:
                raise DrcError(f"sigma={self.sigma!r} is invalid; it must be a number in [0, {MAX_SIGMA:g}] (above, "
                               "the loop-count draw overflows)")
        fixed_ok = _is_number(self.mean) and self.mean >= 1 and self.mean == int(self.mean)
        if self.scheme == "fixed" and not fixed_ok:
            raise DrcError(f"mean={self.mean!r} is invalid for scheme 'fixed'; it must be an integer >= 1")
        if self.scheme == "uniform" and not (_is_int(self.low) and _is_int(self.high) and 1 <= self.low <= self.high):
            raise DrcError(f"low={self.low!r}, high={self.high!r} are invalid for scheme 'uniform'; "
                           "they must be integers with 1 <= low <= high")
        if self.max_loops is not None and not (_is_int(self.max_loops) and self.max_loops >= 1):
            raise DrcError(f"max_loops={self.max_loops!r} is invalid; use an integer >= 1 or None")
        k = self.backprop_loops
        if k is not None and not (_is_int(k) and k >= 1):
            raise DrcError(f"backprop_loops={k!r} is invalid; use an integer >= 1, or None for full backprop")
        if not (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise DrcError(f"seed={self.seed!r} is invalid; it must be an integer in 0..2**63-1")

    def expected_loops(self) -> float:
        """E[r] of the unclipped draw."""
        return (self.low + self.high) / 2 if self.scheme == "uniform" else float(self.mean)

    def variance_loops(self) -> float:
        """Var[r] of the unclipped draw."""
        if self.scheme == "fixed":
            return 0.0
        if self.scheme == "uniform":
            return ((self.high - self.low + 1) ** 2 - 1) / 12
        rate_mean = self.mean - 1
        return rate_mean + (math.exp(self.sigma**2) - 1) * rate_mean**2


class RecurrenceSampler:
    """Draws the number of core loops for a training step (see the module docstring)."""

    def __init__(self, cfg: RecurrenceConfig) -> None:
        self.cfg = cfg

    def sample(self, step: int) -> int:
        """The loop count r >= 1 for ``step``: a pure function of (cfg.seed, step)."""
        if not (_is_int(step) and step >= 0):
            raise DrcError(f"step={step!r} is invalid; it must be an integer >= 0")
        c = self.cfg
        if c.scheme == "fixed":
            r = int(c.mean)
        else:
            rng = np.random.default_rng([c.seed, step])
            if c.scheme == "uniform":
                r = int(rng.integers(c.low, c.high + 1))
            else:
                mu = math.log(c.mean - 1) - c.sigma**2 / 2
                r = int(rng.poisson(rng.lognormal(mu, c.sigma))) + 1
        return min(r, c.max_loops) if c.max_loops is not None else r

    def n_grad_loops(self, n: int) -> int | None:
        """How many of ``n`` loops carry gradient: min(backprop_loops, n), or None for full backprop."""
        k = self.cfg.backprop_loops
        return None if k is None else min(k, n)

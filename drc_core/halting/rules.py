"""Per-token halting rules: after loop l, :meth:`HaltingRule.decide` maps the loop's per-token statistics
(:class:`LoopStats`, from loops l and l-1 only) to the (B, T) tokens that halt now. A rule class declares its short
name (``family``) and default sweep grid (``grid``) in its body, and defining it registers it: :data:`RULE_FAMILIES`,
:func:`make_rule`, the sweeps' families and ``drc_core``'s exports read the registry. A token's depth is its exit
loop (1-based); the average depth, the mean exit loop, is the FLOP proxy."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from drc_core.analysis.loops import STATISTICS, LoopStats, with_needs
from drc_core.errors import MAX_LOOPS, DrcError, fmt_number, need_float, need_int

__all__ = ["Acceleration", "ArgmaxPatience", "Cosine", "EntropyDelta", "HaltingRule", "KLThreshold", "MinPKL", "Never",
           "Oracle", "RULE_FAMILIES", "rule_classes", "SoftmaxConfidence", "StateDelta", "huginn_presets", "Uniform",
           "make_rule", "statistics_read", "unregister_rule"]

_REGISTRY: dict[str, type[HaltingRule]] = {}  # family -> class, every registered rule (the oracle too)
RULE_FAMILIES: dict[str, type[HaltingRule]] = {}  # the deployable ones, as the sweeps' family column spells them
HALF_DECADES = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)  # the grid of the KL-like rules


def _register(cls: type[HaltingRule]) -> None:
    """Enter ``cls`` under ``cls.family`` (a class defined again by the same module and name replaces itself)."""
    family, grid, name = cls.family, cls.grid, (cls.__module__, cls.__qualname__)
    if not isinstance(family, str) or not family.isidentifier() or family != family.lower():
        raise DrcError(f"{cls.__name__}.family={family!r} is invalid; use a short lower-case name like 'kl'")
    if not isinstance(grid, tuple) or not all(isinstance(p, int | float) and not isinstance(p, bool) for p in grid):
        raise DrcError(f"{cls.__name__}.grid={grid!r} is invalid; use a tuple of thresholds (or () for none)")
    for other in _REGISTRY.values():
        taken = "family" if other.family == family else "class name" if other.__name__ == cls.__name__ else ""
        if taken and (other.__module__, other.__qualname__) != name:
            raise DrcError(f"{cls.__name__}: the {taken} of {other.__module__}.{other.__qualname__} "
                           f"(family {other.family!r}) is taken; pick another, or unregister_rule({other.family!r})")
    _REGISTRY.pop(next((f for f, c in _REGISTRY.items() if (c.__module__, c.__qualname__) == name), ""), None)
    _REGISTRY[family] = cls
    _sync()


def _sync() -> None:
    RULE_FAMILIES.clear()
    RULE_FAMILIES.update({f: c for f, c in _REGISTRY.items() if c.deployable})


def unregister_rule(family: str) -> type[HaltingRule]:
    """Take the rule class registered under ``family`` out of the registry (e.g. one a test defined); returns it."""
    if family not in _REGISTRY:
        raise DrcError(f"no halting rule is registered as {family!r}: registered are {', '.join(_REGISTRY)}")
    cls = _REGISTRY.pop(family)
    _sync()
    return cls


def rule_classes() -> dict[str, type[HaltingRule]]:
    """Every registered rule class (:data:`RULE_FAMILIES` and :class:`Oracle`) by class name, in definition order."""
    return {cls.__name__: cls for cls in _REGISTRY.values()}


@dataclass(kw_only=True)
class HaltingRule:
    """A per-token halting rule; ``decide(stats)`` -> (B, T) bool of the tokens that halt at ``stats.loop``: False
    before ``min_loops``, True from ``max_loops`` on, :meth:`criterion` (all a subclass implements) in between.
    :attr:`reads` names the :class:`LoopStats` fields the criterion reads, for a rule that decides each token on its
    own statistics (the skipping paths then compute only those, in a (1, N) layout); None means any field in the
    (B, T) layout. Registry class attributes: :attr:`family`, :attr:`grid` (the default sweep grid of the first
    argument), :attr:`title` (the family in words), :attr:`deployable` (False: :func:`make_rule` cannot build it)."""

    min_loops: int = 1
    max_loops: int = 32
    reads: ClassVar[frozenset[str] | None] = None
    family: ClassVar[str | None] = None
    title: ClassVar[str] = ""  # "": the family with "_" read as " "
    grid: ClassVar[tuple[float, ...]] = ()
    deployable: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            _register(cls)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        need_int("min_loops", self.min_loops, 1, owner)
        need_int("max_loops", self.max_loops, 1, owner)
        if self.max_loops > MAX_LOOPS:
            raise DrcError(f"{owner}: max_loops={self.max_loops} is above the limit of {MAX_LOOPS} loops: the state "
                           f"converges within tens of loops; use at most {MAX_LOOPS}")
        if self.min_loops > self.max_loops:
            raise DrcError(f"{owner}: min_loops={self.min_loops} > max_loops={self.max_loops} is invalid; "
                           "it must be 1 <= min_loops <= max_loops")
        self._validate(owner)

    def _validate(self, owner: str) -> None:
        """Check the rule's own parameters (raise a one-line DrcError)."""

    def criterion(self, stats: LoopStats) -> Tensor:
        """(B, T) bool: the rule's own halting test, before the min/max loop forcing."""
        raise NotImplementedError

    def decide(self, stats: LoopStats) -> Tensor:
        shape, device = stats.shape, stats.state.device
        if stats.loop < self.min_loops:
            return torch.zeros(shape, dtype=torch.bool, device=device)
        if stats.loop >= self.max_loops:
            return torch.ones(shape, dtype=torch.bool, device=device)
        return self.criterion(stats).to(dtype=torch.bool, device=device)

    __call__ = decide

    @property
    def needs_log_probs(self) -> bool:
        """Whether the rule reads, directly or through what a statistic needs, a statistic of the readout."""
        if self.reads is None:
            return True
        known = with_needs(n for n in self.reads if n in STATISTICS)
        return any(STATISTICS[n].reads == "output" for n in known)

    @property
    def name(self) -> str:
        """The criterion in a few characters, e.g. ``kl<1e-3``."""
        return type(self).__name__

    def __str__(self) -> str:
        extra = [f"min {self.min_loops}"] if self.min_loops != 1 else []
        if self.max_loops != 32:
            extra.append(f"max {self.max_loops}")
        return self.name + (f" ({', '.join(extra)})" if extra else "")


def statistics_read(rules: Iterable[HaltingRule]) -> frozenset[str] | None:
    """The union of the rules' :attr:`HaltingRule.reads`; None (every statistic) when one of them declares none."""
    reads = [rule.reads for rule in rules]
    return None if None in reads else frozenset().union(*reads)


@dataclass
class _BelowThreshold(HaltingRule):
    """Halt once the statistic ``stats.<_stat>`` < ``tau`` (with ``_above``: >= ``tau``); ``tau`` in ``_range``."""

    tau: float
    _stat = ""  # the LoopStats field (class attributes, not dataclass fields)
    _label = ""  # how the rule's name writes the statistic
    _above = False
    _range = (0.0, math.inf, False)  # lo, hi, lo excluded

    def _validate(self, owner: str) -> None:
        lo, hi, lo_open = self._range
        self.tau = need_float("tau", self.tau, lo, hi, lo_open=lo_open, owner=owner)

    def criterion(self, stats: LoopStats) -> Tensor:
        value = getattr(stats, self._stat)
        return value >= self.tau if self._above else value < self.tau

    @property
    def reads(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({self._stat})

    @property
    def name(self) -> str:
        return f"{self._label}{'>=' if self._above else '<'}{fmt_number(self.tau)}"


class KLThreshold(_BelowThreshold):
    """Halt once the successive-output KL(p_l || p_{l-1}) < ``tau`` (the paper's training-free rule)."""

    family, grid, title = "kl", HALF_DECADES, "KL"
    _stat = _label = "kl"


class StateDelta(_BelowThreshold):
    """Halt once the relative latent change ||s_l - s_{l-1}|| / ||s_l|| < ``tau``."""

    family, grid, title = "state_delta", (3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4), "state change"
    _stat, _label = "state_delta", "dstate"


class EntropyDelta(_BelowThreshold):
    """Halt once the output entropy changes by less than ``tau`` nats: |H_l - H_{l-1}| < ``tau``."""

    family, grid, title = "entropy_delta", HALF_DECADES, "entropy change"
    _stat, _label = "entropy_delta", "dH"


class Cosine(_BelowThreshold):
    """Halt once cos(s_l, s_{l-1}) >= ``tau`` (``tau`` in [-1, 1])."""

    family, grid = "cosine", (0.9, 0.99, 0.999, 0.9999, 0.99999)
    _stat, _label, _above, _range = "cosine", "cos", True, (-1.0, 1.0, False)


@dataclass
class ArgmaxPatience(HaltingRule):
    """Halt once the argmax has stayed unchanged for ``n`` successive loops (``argmax_run >= n + 1``)."""

    family, grid = "argmax_patience", (1, 2, 3, 4, 6)
    n: int
    reads = frozenset({"argmax_run"})

    def _validate(self, owner: str) -> None:
        need_int("n", self.n, 1, owner)

    def criterion(self, stats: LoopStats) -> Tensor:
        return stats.argmax_run > self.n

    @property
    def name(self) -> str:
        return f"argmax-stable{self.n}"


class SoftmaxConfidence(_BelowThreshold):
    """Halt once the top probability max_v p_l(v) >= ``tau`` (``tau`` in (0, 1])."""

    family, grid, title = "confidence", (0.3, 0.5, 0.7, 0.9, 0.95, 0.99), "top probability"
    _stat, _label, _above, _range = "top_prob", "pmax", True, (0.0, 1.0, True)


class MinPKL(_BelowThreshold):
    """Halt once the min-p filtered KL(q_{l-1} || q_l) < ``tau`` (Huginn's ``minp-kl`` criterion)."""

    family, grid, title = "minp_kl", (*HALF_DECADES, 3e-6, 1e-6), "min-p KL"
    _stat, _label = "minp_kl", "minp-kl"


class Acceleration(_BelowThreshold):
    """Halt once the relative second difference of the latent trajectory, ||Δs_l - Δs_{l-1}|| / ||s_l||, has been
    below ``tau`` at loops l-1 and l (arXiv 2509.23314); needs no readout, earliest halt at loop 4."""

    family, grid = "acceleration", (3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4)
    reads = frozenset({"accel", "accel_prev"})
    _label = "accel"

    def criterion(self, stats: LoopStats) -> Tensor:
        return (stats.accel < self.tau) & (stats.accel_prev < self.tau)

    @property
    def name(self) -> str:
        return f"{super().name}x2"


@dataclass
class Uniform(HaltingRule):
    """Every token halts at loop ``k`` exactly (``min_loops = max_loops = k``): the fixed-depth baseline."""

    family, title = "uniform", "uniform depth"  # no grid: sweeps run every uniform depth themselves
    k: int
    min_loops: int = field(default=1, init=False)
    max_loops: int = field(default=1, init=False)
    reads = frozenset(())

    def __post_init__(self) -> None:
        need_int("k", self.k, 1, type(self).__name__)
        self.min_loops = self.max_loops = self.k
        super().__post_init__()

    def criterion(self, stats: LoopStats) -> Tensor:
        return torch.ones(stats.shape, dtype=torch.bool, device=stats.state.device)

    @property
    def name(self) -> str:
        return f"uniform={self.k}"

    def __str__(self) -> str:
        return self.name


class Never(HaltingRule):
    """No token halts before ``max_loops`` (so every token runs the full depth)."""

    family = "never"
    reads = frozenset(())

    def criterion(self, stats: LoopStats) -> Tensor:
        return torch.zeros(stats.shape, dtype=torch.bool, device=stats.state.device)

    @property
    def name(self) -> str:
        return "never"


@dataclass(eq=False)
class Oracle(HaltingRule):
    """Precomputed per-token exit loops (B, T) (:func:`~drc_core.halting.reference.oracle_exit`) replayed as a rule,
    ``loop >= exit_loops``: an offline lower bound, not deployable; ``eps`` only names it."""

    family, deployable = "oracle", False  # exported, but make_rule cannot build it by name
    exit_loops: Tensor
    eps: float | None = None
    needs_log_probs = False  # reads every token's exit loop, no statistic (overrides the derived property)

    def _validate(self, owner: str) -> None:
        e = self.exit_loops
        if not isinstance(e, Tensor) or e.dim() != 2 or e.dtype.is_floating_point or e.dtype == torch.bool:
            shown = tuple(e.shape) if isinstance(e, Tensor) else type(e).__name__
            raise DrcError(f"{owner}: exit_loops must be a (B, T) integer tensor; got {shown}")
        if e.numel() and int(e.min()) < 1:
            raise DrcError(f"{owner}: exit_loops has loop {int(e.min())}; every exit loop must be >= 1")
        if e.numel() and int(e.max()) > self.max_loops:
            raise DrcError(f"{owner}: exit_loops reaches loop {int(e.max())} but max_loops={self.max_loops}; "
                           f"pass max_loops >= {int(e.max())}")
        if self.eps is not None:
            self.eps = need_float("eps", self.eps, 0.0, math.inf, owner=owner)

    def criterion(self, stats: LoopStats) -> Tensor:
        if tuple(self.exit_loops.shape) != tuple(stats.shape):
            raise DrcError(f"Oracle: exit_loops has shape {tuple(self.exit_loops.shape)} but the batch is "
                           f"{tuple(stats.shape)}; compute the oracle on the same batch")
        return self.exit_loops.to(stats.state.device) <= stats.loop

    @property
    def avg_depth(self) -> float:
        """Mean exit loop after the min/max clamp."""
        return float(self.exit_loops.clamp(self.min_loops, self.max_loops).float().mean())

    @property
    def name(self) -> str:
        return "oracle" if self.eps is None else f"oracle(kl<={fmt_number(self.eps)})"


def huginn_presets(max_loops: int = 32, min_loops: int = 1) -> dict[str, HaltingRule]:
    """Huginn's exit criteria at its documented default thresholds (and its paper's KL 5e-4) as rules on this model;
    its KL(p_{l-1} || p_l) equals :class:`KLThreshold`'s to first order, its 1 - cos < 1e-3 is ``Cosine(0.999)``."""
    kw = {"min_loops": min_loops, "max_loops": max_loops}
    return {
        "huginn kl 1e-3": KLThreshold(1e-3, **kw),
        "huginn kl 5e-4 (paper)": KLThreshold(5e-4, **kw),
        "huginn minp-kl 1e-5": MinPKL(1e-5, **kw),
        "huginn latent-diff 0.03": StateDelta(0.03, **kw),
        "huginn entropy-diff 1e-3": EntropyDelta(1e-3, **kw),
        "huginn cosine 1e-3": Cosine(1 - 1e-3, **kw),
        "huginn argmax-stability 5": ArgmaxPatience(5, **kw),
    }


def make_rule(name: str, *args: float, **kwargs: int) -> HaltingRule:
    """A halting rule by its short name (a key of :data:`RULE_FAMILIES`) and its class's arguments:
    ``make_rule("kl", 1e-3, max_loops=16)`` is ``KLThreshold(1e-3, max_loops=16)`` (no oracle: it is not deployable)."""
    if not isinstance(name, str) or name not in RULE_FAMILIES:
        raise DrcError(f"unknown halting rule {name!r}: choose from {', '.join(RULE_FAMILIES)}")
    try:
        return RULE_FAMILIES[name](*args, **kwargs)
    except TypeError as exc:
        raise DrcError(f"make_rule({name!r}, ...): {exc}") from None

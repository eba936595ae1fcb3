"""Per-token statistics of one loop against the previous one: what every measurement, halting rule and router reads.

:data:`STATISTICS` lists each :class:`Statistic` once, by the name that is its :class:`LoopStats` attribute, its
key in a measurement and in a rule's ``reads``. The built-ins are computed together (one softmax) by
:func:`loop_stats` and by the skipping paths' compact layout (:mod:`drc_core.halting.loopstats`); one added with
:func:`register_statistic` carries its own ``compute``, and then appears in both, in measurements and in traces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.errors import DrcError
from drc_core.model.lm import LoopOutput, RecurrentModel, iterate, read_out

__all__ = ["BUILTIN_STATISTICS", "MIN_P", "STATISTICS", "LoopStats", "Statistic", "extra_statistics", "extra_values",
           "frame_statistics", "iterate_stats", "loop_stats", "minp_log_probs", "register_statistic", "state_change",
           "trajectory_step", "unregister_statistic", "with_needs", "with_placeholders"]


@dataclass(frozen=True)
class Statistic:
    """One per-token statistic of a loop. ``reads``: ``"output"`` (needs the log-probs) or ``"state"``; ``needs``:
    the previous loop's statistics it is computed from; ``first``: its value at loop 1 when it compares with the
    previous loop (a value that never halts), else None; ``frame``: kept by every measurement (NaN at loop 1 where
    ``first`` is set); ``missing``: the placeholder where a skipping path did not compute it. ``compute(log_probs,
    state, prev)`` -> one value per token (last dimension only) is given for a registered statistic: ``log_probs``
    is None when it reads the state, ``prev`` the previous loop's values by name (None at loop 1)."""

    name: str
    doc: str
    reads: Literal["output", "state"]
    needs: tuple[str, ...] = ()
    first: float | None = None
    kind: Literal["float", "long", "vector", "distribution"] = "float"
    frame: bool = False
    missing: float | None = None
    compute: Callable[[Tensor | None, Tensor, Mapping[str, Tensor] | None], Tensor] | None = None

    def placeholder(self, shape: tuple[int, ...], device: torch.device | str) -> Tensor:
        """A float or long statistic's value where a skipping path did not compute it (``missing``), of ``shape``."""
        if self.kind == "long":
            return torch.full(shape, -1 if self.missing is None else int(self.missing), dtype=torch.long, device=device)
        return torch.full(shape, math.nan if self.missing is None else self.missing, device=device)


_BUILTIN = (
    Statistic("log_probs", "log p_l(v), the loop's readout", "output", kind="distribution"),
    Statistic("kl", "KL(p_l || p_{l-1})", "output", ("log_probs",), math.inf, frame=True),
    Statistic("state_delta", "||s_l - s_{l-1}|| / ||s_l||", "state", ("state",), math.inf, frame=True),
    Statistic("entropy", "H(p_l) in nats", "output", frame=True),
    Statistic("entropy_delta", "|H(p_l) - H(p_{l-1})|", "output", ("entropy",), math.inf),
    Statistic("cosine", "cos(s_l, s_{l-1})", "state", ("state",), -math.inf),
    Statistic("argmax", "argmax_v p_l(v)", "output", kind="long", frame=True),
    Statistic("argmax_run", "loops in the current run of the same argmax", "output", ("argmax", "argmax_run"),
              kind="long", missing=0),
    Statistic("top_prob", "max_v p_l(v)", "output"),
    Statistic("minp_kl", "KL(q_{l-1} || q_l) of the min-p filtered outputs", "output", ("log_probs",), math.inf),
    Statistic("state_step", "s_l - s_{l-1}", "state", ("state",), kind="vector"),
    Statistic("accel", "||(s_l - s_{l-1}) - (s_{l-1} - s_{l-2})|| / ||s_l||", "state", ("state", "state_step"),
              math.inf),
    Statistic("accel_prev", "the previous loop's accel", "state", ("accel",), math.inf),
)
BUILTIN_STATISTICS = frozenset(s.name for s in _BUILTIN)
STATISTICS: dict[str, Statistic] = {s.name: s for s in _BUILTIN}  # name -> definition, in registration order


def register_statistic(stat: Statistic) -> Statistic:
    """Add ``stat`` (with its ``compute``) to :data:`STATISTICS`; returns it. A name already taken, a missing
    ``compute`` or a ``needs`` entry that is no statistic is a :class:`DrcError`."""
    if stat.name in STATISTICS or stat.name in ("loop", "state", "extra") or hasattr(LoopStats, stat.name):
        raise DrcError(f"statistic {stat.name!r} is taken: pick another name, or unregister_statistic({stat.name!r})")
    if stat.compute is None:
        raise DrcError(f"statistic {stat.name!r} needs compute(log_probs, state, prev) -> (B, T)")
    unknown = [n for n in stat.needs if n not in STATISTICS and n not in ("state", stat.name)]
    if unknown:
        raise DrcError(f"statistic {stat.name!r} needs {unknown[0]!r}, which is no statistic: use one of "
                       f"{', '.join(STATISTICS)}")
    STATISTICS[stat.name] = stat
    return stat


def unregister_statistic(name: str) -> None:
    """Remove a statistic added with :func:`register_statistic` (the built-ins stay)."""
    if name in BUILTIN_STATISTICS:
        raise DrcError(f"{name!r} is a built-in statistic and cannot be removed")
    STATISTICS.pop(name, None)


def frame_statistics() -> tuple[str, ...]:
    """The statistics every :func:`~drc_core.analysis.measure.measure_windows` keeps, in registry order."""
    return tuple(s.name for s in STATISTICS.values() if s.frame)


def extra_statistics() -> tuple[Statistic, ...]:
    """The registered (non built-in) statistics."""
    return tuple(s for s in STATISTICS.values() if s.name not in BUILTIN_STATISTICS)


@dataclass
class LoopStats:
    """Per-token statistics (B, T) of a batch after loop ``loop`` (1-based), each as :data:`STATISTICS` defines it,
    with loop l's readout ``log_probs`` (B, T, V) and ``state`` (B, T, d). At loop 1 the comparisons hold a value
    that never halts (+inf; ``cosine`` -inf; ``state_step`` zeros); ``accel`` is +inf through loop 2, ``accel_prev``
    through loop 3. ``minp_kl`` is Huginn's exit criterion, KL(q_{l-1} || q_l) of the min-p filtered outputs.
    Registered statistics are in ``extra`` and read as attributes too. Built by :func:`loop_stats`."""

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
    extra: dict[str, Tensor] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Tensor:  # only called when the normal lookup fails: a registered statistic
        if name != "extra" and name in self.__dict__.get("extra", {}):
            return self.extra[name]
        raise AttributeError(f"LoopStats has no statistic {name!r}")

    @classmethod
    def of(cls, loop: int, state: Tensor, values: Mapping[str, Tensor]) -> LoopStats:
        """The stats of one loop from every statistic's values by name (built-ins as fields, the rest ``extra``)."""
        builtin = {k: v for k, v in values.items() if k in BUILTIN_STATISTICS}
        return cls(loop=loop, state=state, **builtin, extra={k: v for k, v in values.items() if k not in builtin})

    def values(self) -> dict[str, Tensor]:
        """Every statistic by name (the built-ins, ``extra``, and ``state``): what a registered statistic's
        ``compute`` gets as ``prev``."""
        return {**{name: getattr(self, name) for name in BUILTIN_STATISTICS}, **self.extra, "state": self.state}

    @property
    def shape(self) -> torch.Size:
        """(B, T)."""
        return self.state.shape[:2]


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` as one batched dot product, without the (..., V) product (faster on CPU)."""
    v = a.shape[-1]
    return torch.einsum("bnv,bnv->bn", a.reshape(1, -1, v), b.reshape(1, -1, v)).reshape(a.shape[:-1])


def state_change(state: Tensor, prev_state: Tensor) -> tuple[Tensor, Tensor]:
    """``(state_delta, cosine)`` of states (..., d) against the previous loop's, in float32 (see
    :class:`LoopStats`); the statistics that need no readout."""
    s, s_prev = state.float(), prev_state.float()
    state_delta = (s - s_prev).norm(dim=-1) / s.norm(dim=-1).clamp_min(torch.finfo(s.dtype).tiny)
    return state_delta, F.cosine_similarity(s, s_prev, dim=-1)


MIN_P = 0.1  # Huginn's min-p filter: probabilities below MIN_P * max are replaced by 1/V


def minp_log_probs(log_probs: Tensor, p: Tensor | None = None) -> Tensor:
    """Huginn's min-p filtered log-distribution of log-probs (..., V): p below ``MIN_P * max p`` -> 1/V,
    renormalised. ``p``: ``log_probs.exp()`` where the caller has it already."""
    v = log_probs.shape[-1]
    top = log_probs.amax(dim=-1, keepdim=True)
    q = torch.where(log_probs < top + math.log(MIN_P), 1.0 / v, log_probs.exp() if p is None else p)
    return q.log() - q.sum(dim=-1, keepdim=True).log()


def trajectory_step(state: Tensor, prev: LoopStats | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(state_step, accel, accel_prev)`` of ``state`` (..., d) after ``prev`` (see :class:`LoopStats`); the
    second-order statistics need no readout."""
    s = state.float()
    inf = torch.full(s.shape[:-1], math.inf, device=s.device)
    if prev is None:
        return torch.zeros_like(s), inf, inf
    step = s - prev.state.float()
    if prev.loop < 2:  # no previous step yet
        return step, inf, inf
    accel = (step - prev.state_step).norm(dim=-1) / s.norm(dim=-1).clamp_min(torch.finfo(s.dtype).tiny)
    return step, accel, prev.accel


def with_needs(names: Iterable[str], needs: Callable[[str], Iterable[str]] | None = None) -> frozenset[str]:
    """``names`` and, transitively, the statistics they are computed from (``needs``: a statistic's
    :attr:`Statistic.needs` without the state, by default). A name that is no statistic is a :class:`DrcError`."""
    out = set(names)
    unknown = sorted(out - set(STATISTICS))
    if unknown:
        raise DrcError(f"{unknown[0]!r} is no statistic: use one of {', '.join(STATISTICS)} (or register_statistic it)")
    step = needs or (lambda name: set(STATISTICS[name].needs) - {"state"})
    todo = list(out)
    while todo:
        more = set(step(todo.pop())) - out
        out |= more
        todo += more
    return frozenset(out)


def with_placeholders(values: Mapping[str, Tensor], shape: tuple[int, ...], device: torch.device | str
                      ) -> dict[str, Tensor]:
    """``values`` and, for every statistic missing from it, its :meth:`Statistic.placeholder` of ``shape`` (empty
    (..., 0) for a vector or distribution), one tensor shared per kind and value."""
    out = dict(values)
    shared: dict[tuple[str, float | None], Tensor] = {}
    for name, stat in STATISTICS.items():
        if name in out:
            continue
        key = ("vector", None) if stat.kind in ("distribution", "vector") else (stat.kind, stat.missing)
        if key not in shared:
            shared[key] = (torch.empty(*shape, 0, device=device) if key[0] == "vector"
                           else stat.placeholder(shape, device))
        out[name] = shared[key]
    return out


def loop_stats(prev: LoopStats | None, loop: int, log_probs: Tensor, state: Tensor, *,
               only: Iterable[str] | None = None) -> LoopStats:
    """The :class:`LoopStats` of loop ``loop`` from its log-probs (B, T, V) and state (B, T, d), after ``prev``
    (None at loop 1). ``only``: the statistics the caller reads; those and what they need are computed (the same
    values as with ``only=None`` when given at every loop), the others are placeholders."""
    if log_probs.dim() != 3 or state.dim() != 3 or log_probs.shape[:2] != state.shape[:2]:
        raise DrcError(f"log_probs must be (B, T, V) and state (B, T, d) with the same (B, T); got log_probs "
                       f"{tuple(log_probs.shape)} and state {tuple(state.shape)}")
    if prev is not None and (prev.log_probs.shape != log_probs.shape or prev.state.shape != state.shape):
        raise DrcError(f"loop {loop}'s log_probs {tuple(log_probs.shape)} / state {tuple(state.shape)} do not match "
                       f"the previous loop's {tuple(prev.log_probs.shape)} / {tuple(prev.state.shape)}")
    want = frozenset(STATISTICS) if only is None else with_needs(only)
    log_probs = log_probs.float()
    res: dict[str, Tensor] = {"log_probs": log_probs}
    shape, device = tuple(state.shape[:2]), state.device
    p = log_probs.exp() if want & {"kl", "entropy", "entropy_delta", "minp_kl"} else None
    if want & {"entropy", "entropy_delta"}:
        assert p is not None
        res["entropy"] = -_dot(p, log_probs)
        if bool(torch.isnan(res["entropy"]).any()):  # a -inf log-prob (p = 0) makes 0 * -inf = NaN: redo without it
            res["entropy"] = -torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(-1)
    if want & {"argmax", "argmax_run", "top_prob"}:
        top_logp, res["argmax"] = log_probs.max(dim=-1)
        res["top_prob"] = top_logp.exp()
    minp = minp_log_probs(log_probs, p) if "minp_kl" in want else None  # kept: the next loop's q_{l-1}
    if prev is None:  # each comparison's Statistic.first (accel and accel_prev are set with state_step below)
        res.update({s.name: torch.full(shape, s.first, device=device) for s in _BUILTIN
                    if s.first is not None and s.name in want})
        if "argmax_run" in want:
            res["argmax_run"] = torch.ones_like(res["argmax"])
    else:
        if "kl" in want:
            assert p is not None
            res["kl"] = _dot(p, log_probs - prev.log_probs)  # = kl_successive(log_probs, prev.log_probs)
        if want & {"state_delta", "cosine"}:
            res["state_delta"], res["cosine"] = state_change(state, prev.state)
        if "entropy_delta" in want:
            res["entropy_delta"] = (res["entropy"] - prev.entropy).abs()
        if "argmax_run" in want:
            res["argmax_run"] = torch.where(res["argmax"] == prev.argmax, prev.argmax_run + 1,
                                            torch.ones_like(res["argmax"]))
        if minp is not None:
            q_prev = getattr(prev, "_minp", None)  # kept by the previous loop_stats call
            q_prev = minp_log_probs(prev.log_probs) if q_prev is None else q_prev
            res["minp_kl"] = _dot(q_prev.exp(), q_prev - minp)
    if want & {"state_step", "accel", "accel_prev"}:
        res["state_step"], res["accel"], res["accel_prev"] = trajectory_step(state, prev)
    if extra_statistics():
        res.update(extra_values(log_probs, state, None if prev is None else prev.values(), only=want))
    stats = LoopStats.of(loop, state, with_placeholders(res, shape, device))
    stats._minp = minp  # not a statistic: the min-p filtered log-probs, so that the next loop does not redo them
    return stats


def extra_values(log_probs: Tensor | None, state: Tensor, prev: Mapping[str, Tensor] | None,
                 only: frozenset[str] | None = None) -> dict[str, Tensor]:
    """The registered statistics (those in ``only``, when given) of one loop, in either layout; ``prev``: the
    previous loop's values by name (None at loop 1)."""
    out: dict[str, Tensor] = {}
    for stat in extra_statistics():
        if only is not None and stat.name not in only:
            continue
        if prev is None and stat.first is not None:
            out[stat.name] = torch.full(state.shape[:-1], stat.first, device=state.device)
            continue
        assert stat.compute is not None
        value = stat.compute(log_probs if stat.reads == "output" else None, state, prev)
        if value.shape != state.shape[:-1]:
            raise DrcError(f"statistic {stat.name!r} returned shape {tuple(value.shape)}; it must be one value per "
                           f"token, {tuple(state.shape[:-1])}")
        out[stat.name] = value
    return out


@torch.no_grad()
def iterate_stats(model: RecurrentModel, idx: Tensor, max_loops: int, *, generator: torch.Generator | None = None,
                  state: Tensor | None = None, where: Tensor | None = None, only: Iterable[str] | None = None,
                  core: Iterable[LoopOutput] | None = None) -> Iterator[LoopStats]:
    """:class:`LoopStats` after each loop 1..max_loops at uniform depth. ``where``: a (B, T) bool mask of the tokens
    whose statistics are kept, shaped (1, n) (all tokens still run); ``only``: as :func:`loop_stats`. ``core``: the
    loops already running (``iterate(model, idx, ..., readout=None)``, shared with another pass), read out here
    instead of running them (the same values)."""
    if where is not None and (where.dtype != torch.bool or tuple(where.shape) != tuple(idx.shape)):
        raise DrcError(f"where must be a bool mask shaped like idx {tuple(idx.shape)}; got {where.dtype} "
                       f"{tuple(where.shape)}")
    want = None if only is None else with_needs(only)
    prev: LoopStats | None = None
    if core is None:
        core = iterate(model, idx, max_loops, generator=generator, readout="log_probs", state=state, positions=where)
    else:
        core = (replace(out, out=read_out(model, out.state, "log_probs", where)) for out in islice(core, max_loops))
    for out in core:
        assert out.out is not None
        log_probs, kept = (out.out, out.state) if where is None else (out.out[None], out.state[where][None])
        prev = loop_stats(prev, out.loop, log_probs, kept, only=want)
        yield prev

"""Running halting rules on a model: the masked reference forward (:func:`masked_forward`), the offline replay of
rules on a uniform run's statistics (:func:`offline_exits`; :func:`measured_exits` on a stored measurement), the
``halt`` callable of :func:`~drc_core.model.lm.iterate` (:func:`halt_fn`), and the oracle (:func:`oracle_exit`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import BUILTIN_STATISTICS, LoopStats, loop_stats
from drc_core.analysis.measure import Measurement
from drc_core.errors import DrcError, need_float, need_int
from drc_core.halting.rules import HaltingRule, Oracle
from drc_core.model.lm import HaltFn, LoopOutput, RecurrentModel, iterate
from drc_core.model.passes import kl_successive

__all__ = ["AdaptiveResult", "OracleResult", "first_within", "halt_fn", "masked_forward", "measured_exits",
           "offline_exits", "oracle_exit"]


def halt_fn(rule: HaltingRule, readout: str = "log_probs") -> HaltFn:
    """A fresh ``halt`` callable applying ``rule`` for one ``iterate(model, ..., readout=readout, halt=...)`` call
    (``readout`` "logits" or "log_probs", every position read out)."""
    if not isinstance(rule, HaltingRule):
        raise DrcError(f"rule={rule!r} is not a HaltingRule; pass e.g. KLThreshold(1e-3)")
    if readout not in ("logits", "log_probs"):
        raise DrcError(f"readout={readout!r} is not supported; use 'logits' or 'log_probs'")
    stats: LoopStats | None = None

    def halt(out: LoopOutput) -> Tensor:
        nonlocal stats
        if out.out is None:
            raise DrcError("the halting rule needs the readout; call iterate with readout='logits'/'log_probs'")
        if out.out.shape[:2] != out.state.shape[:2]:
            raise DrcError("the halting rule needs every position read out; call iterate with positions=None")
        logp = out.out if readout == "log_probs" else F.log_softmax(out.out.float(), dim=-1)
        stats = loop_stats(stats, out.loop, logp, out.state, only=rule.reads)
        return rule.decide(stats)

    return halt


@dataclass
class AdaptiveResult:
    """What :func:`masked_forward` returns: ``exit_loop`` (B, T), ``logits`` (B, T, V) at each token's exit loop,
    their mean ``avg_depth``, the final ``state`` (B, T, d) (a halted token's from its exit loop), ``str(rule)``."""

    exit_loop: Tensor
    logits: Tensor
    avg_depth: float
    state: Tensor
    rule: str

    def log_probs(self) -> Tensor:
        """float32 log-softmax of :attr:`logits`."""
        return F.log_softmax(self.logits.float(), dim=-1)


@torch.no_grad()
def masked_forward(model: RecurrentModel, idx: Tensor, rule: HaltingRule, *, generator: torch.Generator | None = None,
                   state: Tensor | None = None) -> AdaptiveResult:
    """Run ``model`` on ``idx`` (B, T) with per-token halting by ``rule``, up to ``rule.max_loops`` loops: a token
    that halts at loop e keeps s_e and offers its loop-e keys/values in every core and coda block from then on, its
    logits its readout at loop e. Every token is computed (the halted ones' results discarded); ``Uniform(r)``
    gives ``forward(idx, r)`` from the same ``generator`` state (or ``state`` s_0)."""
    halt = halt_fn(rule, "logits")
    logits: Tensor | None = None
    last: LoopOutput | None = None
    for out in iterate(model, idx, rule.max_loops, generator=generator, readout="logits", halt=halt, state=state):
        assert out.out is not None
        now = (out.exit_loop == out.loop)[..., None]
        logits = out.out.clone() if logits is None else torch.where(now, out.out, logits)
        last = out
    assert last is not None and logits is not None
    return AdaptiveResult(exit_loop=last.exit_loop, logits=logits, avg_depth=float(last.exit_loop.float().mean()),
                          state=last.state, rule=str(rule))


def offline_exits(stats: Iterable[LoopStats], rules: Sequence[HaltingRule]) -> list[Tensor]:
    """Each rule's per-token exit loop (B, T), its first loop deciding True, replayed on the stats of loops 1, 2, ...
    of a run without halting: equal to :func:`masked_forward` for a token whose earlier tokens run as long."""
    rules = list(rules)
    for rule in rules:
        if not isinstance(rule, HaltingRule):
            raise DrcError(f"rules must be HaltingRule instances; got {rule!r}")
    exits: list[Tensor] | None = None
    last_loop = 0
    for s in stats:
        if exits is None:
            exits = [torch.zeros(s.shape, dtype=torch.long, device=s.state.device) for _ in rules]
        last_loop = s.loop
        for rule, ex in zip(rules, exits, strict=True):
            now = rule.decide(s) & (ex == 0)
            ex.masked_fill_(now, s.loop)
        if all(bool((ex > 0).all()) for ex in exits):
            break
    if exits is None:
        raise DrcError("offline_exits got no loop stats; pass the stats of loops 1..max_loops")
    for rule, ex in zip(rules, exits, strict=True):
        if bool((ex == 0).any()):
            raise DrcError(f"rule {rule} left tokens running after the last loop given ({last_loop}); "
                           f"pass stats up to its max_loops={rule.max_loops}")
    return exits


def measured_exits(m: Measurement, rules: Sequence[HaltingRule]) -> list[np.ndarray]:
    """Each rule's exit loop per token of a stored measurement: :func:`offline_exits` on its statistics, which must
    hold everything the rules declare they read (NaN at loop 1 never halts)."""
    rules = list(rules)
    for rule in rules:
        missing = None if rule.reads is None else sorted(set(rule.reads) - set(m.stats))
        if missing is None or missing:
            raise DrcError(f"rule {rule} reads {'undeclared statistics' if missing is None else ', '.join(missing)}"
                           f", not in this measurement ({', '.join(m.stats)}); replay it with offline_pass")
    n = len(m)
    state = torch.zeros(n, 1, 0)
    blank = torch.full((n, 1), math.nan)

    def loops() -> Iterable[LoopStats]:
        for loop in range(1, m.max_loops + 1):
            values = {name: blank for name in BUILTIN_STATISTICS}
            values |= {name: torch.from_numpy(np.ascontiguousarray(a[:, loop - 1]))[:, None]
                       for name, a in m.stats.items()}
            yield LoopStats.of(loop, state, values)

    return [ex[:, 0].numpy() for ex in offline_exits(loops(), rules)]


@dataclass
class OracleResult:
    """What :func:`oracle_exit` returns: ``exit_loop`` (B, T), its mean ``avg_depth``, ``reached`` (B, T): whether the
    token came within ``eps`` of the reference (else it exits at ``reference_loop``)."""

    exit_loop: Tensor
    avg_depth: float
    reached: Tensor
    eps: float
    reference_loop: int

    def rule(self, **kwargs: int) -> Oracle:
        """These exit loops as an :class:`Oracle` rule (``max_loops`` defaults to ``reference_loop``)."""
        kwargs.setdefault("max_loops", max(self.reference_loop, int(self.exit_loop.max())))
        return Oracle(exit_loops=self.exit_loop, eps=self.eps, **kwargs)


def first_within(kl_to_reference: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The oracle's exits from KL(p_ref || p_l) (L, B, T): the first loop with KL <= ``eps`` (else L), ``reached``."""
    ok = kl_to_reference <= eps
    reached = ok.any(dim=0)
    exit_loop = torch.where(reached, ok.float().argmax(dim=0) + 1, kl_to_reference.shape[0])
    return exit_loop, reached


@torch.no_grad()
def oracle_exit(log_probs_per_loop: Tensor | Iterable[Tensor], reference_loop: int | None, eps: float, *,
                reference: Tensor | None = None, min_loops: int = 1) -> OracleResult:
    """The offline oracle: each token's earliest loop with ``KL(p_ref || p_l) <= eps`` (raised to ``min_loops``; else
    the last loop considered), from the log-probs of loops 1, 2, ... stacked (L, B, T, V) or as an iterable of
    (B, T, V). ``reference_loop``: the last loop considered (None: all); ``reference``: the reference log-probs
    (default, stacked input only: loop ``reference_loop``'s)."""
    eps = need_float("eps", eps, 0.0, math.inf, owner="oracle_exit")
    need_int("min_loops", min_loops, 1, "oracle_exit")
    if reference_loop is not None:
        need_int("reference_loop", reference_loop, 1, "oracle_exit")
    if isinstance(log_probs_per_loop, Tensor):
        stacked = log_probs_per_loop
        if stacked.dim() != 4:
            raise DrcError(f"oracle_exit: stacked log_probs_per_loop must be (L, B, T, V); got {tuple(stacked.shape)}")
        n_loops = stacked.shape[0]
        reference_loop = n_loops if reference_loop is None else reference_loop
        if reference_loop > n_loops:
            raise DrcError(f"oracle_exit: reference_loop={reference_loop} is invalid; it must be in [1, {n_loops}] "
                           f"(the number of loops given)")
        if reference is None:
            reference = stacked[reference_loop - 1]
        loops: Iterable[Tensor] = stacked[:reference_loop]
    elif reference is None:
        raise DrcError("oracle_exit: with an iterable of per-loop log-probs, pass reference= (the reference "
                       "loop's log-probs, B x T x V)")
    else:
        loops = log_probs_per_loop
    reference = reference.float()
    if reference.dim() != 3:
        raise DrcError(f"oracle_exit: reference must be (B, T, V); got {tuple(reference.shape)}")
    p_ref = reference.exp()
    kls = []
    for loop, logp in enumerate(loops, start=1):
        if reference_loop is not None and loop > reference_loop:
            break
        if logp.shape != reference.shape:
            raise DrcError(f"oracle_exit: loop {loop}'s log-probs have shape {tuple(logp.shape)} but the reference "
                           f"has {tuple(reference.shape)}")
        kls.append(kl_successive(reference, logp.float().to(reference.device), p_ref))  # (B, T) per loop
    last = len(kls)
    if last == 0:
        raise DrcError("oracle_exit got no loops; pass the log-probs of loops 1..reference_loop")
    if reference_loop is not None and last < reference_loop:
        raise DrcError(f"oracle_exit: reference_loop={reference_loop} but only {last} loops were given")
    exit_loop, reached = first_within(torch.stack(kls), eps)
    exit_loop.clamp_(min=min_loops)
    return OracleResult(exit_loop=exit_loop, avg_depth=float(exit_loop.float().mean()), reached=reached, eps=eps,
                        reference_loop=last)

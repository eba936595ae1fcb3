"""Running halting rules on a model: the masked reference forward (:func:`masked_forward`: every token computed,
halted tokens frozen with their exit-loop keys/values), the offline replay of rules on a uniform run's statistics
(:func:`offline_exits`), the ``halt`` callable of :func:`~drc_core.model.lm.iterate` (:func:`halt_fn`), and the
oracle (:func:`oracle_exit`: each token's first loop within eps of the reference depth). The rules themselves:
:mod:`drc_core.halting.rules`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from drc_core.analysis.loops import LoopStats, loop_stats
from drc_core.errors import DrcError, need_float, need_int
from drc_core.halting.rules import HaltingRule, Oracle
from drc_core.model.lm import HaltFn, LoopOutput, RecurrentModel, iterate
from drc_core.model.passes import kl_successive

__all__ = ["AdaptiveResult", "OracleResult", "first_within", "halt_fn", "masked_forward", "offline_exits",
           "oracle_exit"]


class _RuleHalt:
    """A ``halt`` callable for :func:`drc_core.model.lm.iterate` that feeds ``rule`` the loop's stats."""

    def __init__(self, rule: HaltingRule, readout: str) -> None:
        if not isinstance(rule, HaltingRule):
            raise DrcError(f"rule={rule!r} is not a HaltingRule; pass e.g. KLThreshold(1e-3)")
        if readout not in ("logits", "log_probs"):
            raise DrcError(f"readout={readout!r} is not supported; use 'logits' or 'log_probs'")
        self.rule, self.readout = rule, readout
        self.stats: LoopStats | None = None

    def __call__(self, out: LoopOutput) -> Tensor:
        if out.out is None:
            raise DrcError("the halting rule needs the readout; call iterate with readout='logits'/'log_probs'")
        if out.out.shape[:2] != out.state.shape[:2]:
            raise DrcError("the halting rule needs every position read out; call iterate with positions=None")
        logp = out.out if self.readout == "log_probs" else F.log_softmax(out.out.float(), dim=-1)
        self.stats = loop_stats(self.stats, out.loop, logp, out.state, only=self.rule.reads)
        return self.rule.decide(self.stats)


def halt_fn(rule: HaltingRule, readout: str = "log_probs") -> HaltFn:
    """A fresh ``halt`` callable for ``iterate(model, ..., readout=readout, halt=...)`` applying ``rule``.

    It remembers the previous loop's stats, so use one per ``iterate`` call. ``readout`` must be the one
    passed to ``iterate`` ("logits" or "log_probs"), with all positions read out.
    """
    return _RuleHalt(rule, readout)


@dataclass
class AdaptiveResult:
    """What :func:`masked_forward` returns.

    ``exit_loop`` (B, T) long: each token's exit loop; ``logits`` (B, T, V): each token's logits at its exit
    loop (model dtype, as ``forward`` returns them); ``avg_depth``: mean exit loop; ``state`` (B, T, d): the
    final latent state (a halted token's is its state at its exit loop); ``rule``: ``str(rule)``.
    """

    exit_loop: Tensor
    logits: Tensor
    avg_depth: float
    state: Tensor
    rule: str

    def log_probs(self) -> Tensor:
        """float32 log-softmax of :attr:`logits`."""
        return F.log_softmax(self.logits.float(), dim=-1)


@torch.no_grad()
def masked_forward(
    model: RecurrentModel,
    idx: Tensor,
    rule: HaltingRule,
    *,
    generator: torch.Generator | None = None,
    state: Tensor | None = None,
) -> AdaptiveResult:
    """Run ``model`` on ``idx`` (B, T) with per-token halting by ``rule``, up to ``rule.max_loops`` loops.

    Semantics (the masked reference of :func:`drc_core.model.lm.iterate`): after loop l the rule sees loop
    l's stats; a token that halts at loop e keeps s_e from then on, and at every later loop offers, in every
    core and coda block, the keys/values it computed at loop e (its last computed ones); so a token active at
    loop l attends to each earlier token's loop-min(l, e) keys/values. A token's ``logits`` are the readout
    at its exit loop. The core still runs on every token here (the halted tokens' results are discarded);
    :func:`drc_core.halting.skipping.skip_forward` gives the same result (to float tolerance) while computing only
    the active tokens.

    The log-probs the rule sees are ``log_softmax(logits.float())``, exactly iterate's "log_probs" readout.
    With the same ``generator`` state (or ``state`` s_0), :class:`Never` with ``max_loops=r`` gives
    ``forward(idx, r)`` and ``Uniform(k)`` gives ``forward(idx, k)``. Runs under ``torch.no_grad()``; put
    the model in eval mode first if it has dropout.
    """
    halt = _RuleHalt(rule, "logits")
    logits: Tensor | None = None
    last: LoopOutput | None = None
    for out in iterate(model, idx, rule.max_loops, generator=generator, readout="logits", halt=halt, state=state):
        assert out.out is not None
        now = (out.exit_loop == out.loop)[..., None]
        logits = out.out.clone() if logits is None else torch.where(now, out.out, logits)
        last = out
    assert last is not None and logits is not None
    exit_loop = last.exit_loop
    return AdaptiveResult(
        exit_loop=exit_loop,
        logits=logits,
        avg_depth=float(exit_loop.float().mean()),
        state=last.state,
        rule=str(rule),
    )


def offline_exits(stats: Iterable[LoopStats], rules: Sequence[HaltingRule]) -> list[Tensor]:
    """Each rule's per-token exit loop (B, T) long on one sequence of loop stats (loops 1, 2, ... in order).

    A token's exit is the first loop where ``rule.decide`` is True. The stats come from a run without
    halting (e.g. :func:`iterate_stats`), so this is the rule's decisions when halting changes no other
    token's trajectory -- cheap for sweeping many rules over one run, and equal to :func:`masked_forward`
    for a token whose earlier tokens all run at least as long as it does (e.g. the first position). The
    stats must reach every rule's ``max_loops`` unless every token has halted earlier.
    """
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
            raise DrcError(
                f"rule {rule} left tokens running after the last loop given ({last_loop}); "
                f"pass stats up to its max_loops={rule.max_loops}"
            )
    return exits


# ----------------------------------------------------------------------------------------------------------
# Oracle


@dataclass
class OracleResult:
    """What :func:`oracle_exit` returns.

    ``exit_loop`` (B, T) long; ``avg_depth`` its mean; ``reached`` (B, T) bool: the token came within ``eps``
    of the reference at its exit loop (False only where the reference is not one of the loops given and no
    loop got close enough; those tokens exit at the last loop considered); ``eps``; ``reference_loop`` (the
    last loop considered).
    """

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
    """The oracle's exits from ``kl_to_reference`` (L, B, T), KL(p_ref || p_l) for loops 1..L: ``exit_loop``
    (B, T) long, the first loop with KL <= ``eps`` or L where there is none, and ``reached`` (B, T) bool, whether
    any loop came within ``eps``."""
    ok = kl_to_reference <= eps
    reached = ok.any(dim=0)
    exit_loop = torch.where(reached, ok.float().argmax(dim=0) + 1, kl_to_reference.shape[0])
    return exit_loop, reached


@torch.no_grad()
def oracle_exit(
    log_probs_per_loop: Tensor | Iterable[Tensor],
    reference_loop: int | None,
    eps: float,
    *,
    reference: Tensor | None = None,
    min_loops: int = 1,
) -> OracleResult:
    """The offline oracle: each token's earliest loop l with ``KL(p_ref || p_l) <= eps``.

    Direction: the reference output p_ref is measured against the loop's output p_l,
    ``KL(p_ref || p_l) = sum_v p_ref(v) (log p_ref(v) - log p_l(v))``.

    ``log_probs_per_loop``: the uniform-depth log-probs of loops 1, 2, ..., either stacked (L, B, T, V) or
    (lighter on memory) an iterable of (B, T, V) tensors, consumed one at a time. ``reference_loop`` is the
    last loop considered (None: all loops given); ``reference`` the reference log-probs (B, T, V) -- with a
    stacked tensor it defaults to loop ``reference_loop``'s; with an iterable it is required. Tokens never
    within ``eps`` exit at the last loop considered (``reached`` False). Exits below ``min_loops`` are raised
    to it. The result is a lower bound on the average depth of any rule whose tokens end within ``eps`` of
    the reference (on the same uniform-depth outputs); it is not a deployable rule.
    """
    eps = need_float("eps", eps, 0.0, math.inf, owner="oracle_exit")
    need_int("min_loops", min_loops, 1, "oracle_exit")
    if reference_loop is not None:
        need_int("reference_loop", reference_loop, 1, "oracle_exit")
    if isinstance(log_probs_per_loop, Tensor):
        stacked = log_probs_per_loop
        if stacked.dim() != 4:
            raise DrcError(
                f"oracle_exit: stacked log_probs_per_loop must be (L, B, T, V); got {tuple(stacked.shape)}"
            )
        n_loops = stacked.shape[0]
        if reference_loop is None:
            reference_loop = n_loops
        if reference_loop > n_loops:
            raise DrcError(
                f"oracle_exit: reference_loop={reference_loop} is invalid; it must be in [1, {n_loops}] "
                f"(the number of loops given)"
            )
        if reference is None:
            reference = stacked[reference_loop - 1]
        loops: Iterable[Tensor] = stacked[:reference_loop]
    else:
        if reference is None:
            raise DrcError(
                "oracle_exit: with an iterable of per-loop log-probs, pass reference= (the reference "
                "loop's log-probs, B x T x V)"
            )
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
            raise DrcError(
                f"oracle_exit: loop {loop}'s log-probs have shape {tuple(logp.shape)} but the reference has "
                f"{tuple(reference.shape)}"
            )
        kls.append(kl_successive(reference, logp.float().to(reference.device), p_ref))  # (B, T) per loop
    last = len(kls)
    if last == 0:
        raise DrcError("oracle_exit got no loops; pass the log-probs of loops 1..reference_loop")
    if reference_loop is not None and last < reference_loop:
        raise DrcError(f"oracle_exit: reference_loop={reference_loop} but only {last} loops were given")
    exit_loop, reached = first_within(torch.stack(kls), eps)
    exit_loop.clamp_(min=min_loops)
    return OracleResult(
        exit_loop=exit_loop,
        avg_depth=float(exit_loop.float().mean()),
        reached=reached,
        eps=eps,
        reference_loop=reference_loop if reference_loop is not None else last,
    )

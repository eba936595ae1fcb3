import math

import pytest
import torch
import torch.nn.functional as F

from drc_core.analysis.loops import iterate_stats, loop_stats
from drc_core.halting.reference import halt_fn, masked_forward, offline_exits, oracle_exit
from drc_core.halting.rules import (
    ArgmaxPatience,
    Cosine,
    EntropyDelta,
    HaltingRule,
    KLThreshold,
    Never,
    Oracle,
    SoftmaxConfidence,
    StateDelta,
    Uniform,
)
from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM, iterate
from drc_core.model.passes import kl_successive

# ----------------------------------------------------------------------------------------------------------
# Synthetic statistics: token (b, t) "moves" until loop CONV[b, t] and is constant afterwards.

CONV = torch.tensor([[1, 2, 3], [5, 4, 6]])
SV, SD, SL = 5, 8, 8  # vocabulary, state size, loops


def synthetic_stats(conv: torch.Tensor = CONV, n_loops: int = SL) -> list:
    """At loop l token (b, t) uses m = min(l, conv): logits = m * onehot(m mod V), state = (m+1) * onehot(m mod d).

    While moving (l <= conv) the argmax changes every loop, the state turns by 90 degrees (cos 0), and KL,
    entropy and state all change; from loop conv on everything is constant.
    """
    stats, prev = [], None
    for loop in range(1, n_loops + 1):
        m = conv.clamp(max=loop)
        logits = F.one_hot(m % SV, SV).float() * m[..., None]
        state = F.one_hot(m % SD, SD).float() * (m[..., None] + 1)
        prev = loop_stats(prev, loop, F.log_softmax(logits, dim=-1), state)
        stats.append(prev)
    return stats


def top_prob(m: int) -> float:
    return math.exp(m) / (math.exp(m) + SV - 1)


def exits(rule: HaltingRule, stats: list | None = None) -> torch.Tensor:
    return offline_exits(stats if stats is not None else synthetic_stats(), [rule])[0]


def test_loop_stats_values() -> None:
    s1, s2, s3 = synthetic_stats()[:3]
    assert torch.isinf(s1.kl).all() and torch.isinf(s1.state_delta).all() and torch.isinf(s1.entropy_delta).all()
    assert (s1.cosine == -math.inf).all() and (s1.argmax_run == 1).all()
    # token (0, 0) converged at loop 1, (0, 1) at loop 2
    assert s2.kl[0, 0] == 0 and s2.kl[0, 1] > 0
    expected_kl = kl_successive(s2.log_probs, s1.log_probs)
    torch.testing.assert_close(s2.kl, expected_kl)
    assert s2.state_delta[0, 0] == 0 and s2.state_delta[0, 1] == pytest.approx(math.sqrt(4 + 9) / 3)
    assert s2.cosine[0, 0] == pytest.approx(1.0) and s2.cosine[0, 1] == pytest.approx(0.0, abs=1e-6)
    assert s3.argmax_run[0].tolist() == [3, 2, 1]
    assert s3.top_prob[0, 2] == pytest.approx(top_prob(3))
    p = s3.log_probs.exp()
    torch.testing.assert_close(s3.entropy, -(p * s3.log_probs).sum(-1))
    torch.testing.assert_close(s3.entropy_delta, (s3.entropy - s2.entropy).abs())
    assert s3.log_probs.dtype == torch.float32


@pytest.mark.parametrize(
    "rule",
    [KLThreshold(1e-6, max_loops=SL), StateDelta(1e-6, max_loops=SL), EntropyDelta(1e-6, max_loops=SL),
     Cosine(0.9999, max_loops=SL)],
    ids=str,
)
def test_delta_rules_halt_one_loop_after_convergence(rule: HaltingRule) -> None:
    assert exits(rule).tolist() == (CONV + 1).tolist()


def test_argmax_patience() -> None:
    for n in (1, 2, 3):
        expected = (CONV + n).clamp(max=SL)
        assert exits(ArgmaxPatience(n, max_loops=SL)).tolist() == expected.tolist()


def test_softmax_confidence() -> None:
    tau = (top_prob(3) + top_prob(4)) / 2  # true exactly once m = min(loop, conv) >= 4
    expected = torch.where(CONV >= 4, 4, SL)  # tokens that never reach m = 4 are forced at max_loops
    assert exits(SoftmaxConfidence(tau, max_loops=SL)).tolist() == expected.tolist()
    assert exits(SoftmaxConfidence(1.0, max_loops=SL)).tolist() == [[SL] * 3] * 2


def test_uniform_and_never() -> None:
    assert exits(Uniform(3)).tolist() == [[3] * 3] * 2
    assert exits(Never(max_loops=6)).tolist() == [[6] * 3] * 2
    u = Uniform(3)
    assert (u.min_loops, u.max_loops) == (3, 3)


def test_min_max_forcing() -> None:
    stats = synthetic_stats()
    natural = CONV + 1
    for lo, hi in ((1, SL), (4, SL), (1, 5), (3, 4), (2, 2)):
        rule = KLThreshold(1e-6, min_loops=lo, max_loops=hi)
        assert exits(rule, stats).tolist() == natural.clamp(lo, hi).tolist()
    # decide itself: False before min_loops even where the criterion holds, True at max_loops
    rule = KLThreshold(1e-6, min_loops=3, max_loops=5)
    assert rule.criterion(stats[1]).any() and not rule.decide(stats[1]).any()
    assert rule.decide(stats[4]).all() and rule.decide(stats[6]).all()
    assert not Never(max_loops=5).decide(stats[3]).any() and Never(max_loops=5)(stats[4]).all()


def test_oracle_rule_replays_exit_loops() -> None:
    exit_loops = torch.tensor([[1, 4, 2], [3, 8, 5]])
    assert exits(Oracle(exit_loops=exit_loops, max_loops=SL)).tolist() == exit_loops.tolist()
    assert exits(Oracle(exit_loops=exit_loops, min_loops=3, max_loops=SL)).tolist() == exit_loops.clamp(3).tolist()
    assert Oracle(exit_loops=exit_loops, max_loops=SL).avg_depth == pytest.approx(exit_loops.float().mean().item())


def test_names() -> None:
    assert str(KLThreshold(1e-3)) == "kl<1e-3"
    assert str(KLThreshold(2.5e-4, min_loops=2, max_loops=16)) == "kl<2.5e-4 (min 2, max 16)"
    assert str(Cosine(0.99)) == "cos>=0.99"
    assert str(StateDelta(0.01)) == "dstate<0.01"
    assert str(EntropyDelta(0.05)) == "dH<0.05"
    assert str(ArgmaxPatience(3)) == "argmax-stable3"
    assert str(SoftmaxConfidence(0.9)) == "pmax>=0.9"
    assert str(Uniform(4)) == "uniform=4"
    assert str(Never(max_loops=6)) == "never (max 6)"
    assert str(Oracle(exit_loops=torch.ones(1, 2, dtype=torch.long), eps=1e-2)) == "oracle(kl<=0.01)"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: KLThreshold(-1.0), "KLThreshold: tau=-1.0 is invalid; it must be a finite number in [0, inf)"),
        (lambda: KLThreshold(float("nan")), "tau=nan"),
        (lambda: StateDelta(float("inf")), "StateDelta: tau=inf is invalid"),
        (lambda: EntropyDelta("0.1"), "EntropyDelta: tau='0.1' is invalid"),
        (lambda: KLThreshold(True), "tau=True"),
        (lambda: Cosine(1.5), "Cosine: tau=1.5 is invalid; it must be a finite number in [-1, 1]"),
        (lambda: SoftmaxConfidence(0.0), "SoftmaxConfidence: tau=0.0 is invalid; it must be a finite number in (0, 1]"),
        (lambda: SoftmaxConfidence(1.01), "tau=1.01"),
        (lambda: ArgmaxPatience(0), "ArgmaxPatience: n=0 is invalid; it must be an integer >= 1"),
        (lambda: ArgmaxPatience(2.0), "n=2.0"),
        (lambda: Uniform(0), "Uniform: k=0 is invalid; it must be an integer >= 1"),
        (lambda: KLThreshold(1e-3, min_loops=0), "KLThreshold: min_loops=0 is invalid; it must be an integer >= 1"),
        (lambda: Never(max_loops=0), "Never: max_loops=0 is invalid"),
        (lambda: Cosine(0.9, min_loops=5, max_loops=3), "min_loops=5 > max_loops=3 is invalid; it must be 1 <= "),
        (lambda: Oracle(exit_loops=torch.zeros(1, 2, dtype=torch.long)), "exit_loops has loop 0"),
        (lambda: Oracle(exit_loops=torch.full((1, 2), 40)), "exit_loops reaches loop 40 but max_loops=32"),
        (lambda: Oracle(exit_loops=torch.ones(1, 2)), "exit_loops must be a (B, T) integer tensor"),
        (lambda: oracle_exit(torch.zeros(3, 1, 2, 4), None, -0.1), "oracle_exit: eps=-0.1 is invalid"),
        (lambda: oracle_exit(torch.zeros(3, 1, 2, 4), 4, 0.1), "reference_loop=4 is invalid; it must be in [1, 3]"),
        (lambda: oracle_exit(torch.zeros(3, 1, 2, 4), 0, 0.1), "reference_loop=0 is invalid"),
        (lambda: oracle_exit(iter([torch.zeros(1, 2, 4)]), None, 0.1), "pass reference="),
        (lambda: offline_exits(synthetic_stats(n_loops=3), [Never(max_loops=5)]), "pass stats up to its max_loops=5"),
    ],
)
def test_bad_parameters(make, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert needle in message and "\n" not in message


# ----------------------------------------------------------------------------------------------------------
# A tiny model

L = 8


@pytest.fixture(scope="module")
def model() -> DepthRecurrentLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1, max_seq_len=32)
    return DepthRecurrentLM(cfg).eval()


@pytest.fixture(scope="module")
def idx() -> torch.Tensor:
    return torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(7))


def gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_never_equals_uniform_depth(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    res = masked_forward(model, idx, Never(max_loops=6), generator=gen())
    with torch.no_grad():
        ref = model(idx, 6, generator=gen())
    torch.testing.assert_close(res.logits, ref, rtol=0, atol=0)
    assert (res.exit_loop == 6).all() and res.avg_depth == 6.0 and res.rule == "never (max 6)"


def test_uniform_k_equals_forward_k(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    res = masked_forward(model, idx, Uniform(3), generator=gen())
    with torch.no_grad():
        ref = model(idx, 3, generator=gen())
    torch.testing.assert_close(res.logits, ref, rtol=0, atol=0)
    torch.testing.assert_close(res.log_probs(), F.log_softmax(ref.float(), dim=-1))
    assert (res.exit_loop == 3).all() and res.avg_depth == 3.0
    # an explicit initial state gives the same as the generator that would draw it
    s0 = torch.randn(idx.shape[0], idx.shape[1], model.cfg.d_model, generator=gen(5))
    torch.testing.assert_close(masked_forward(model, idx, Uniform(3), state=s0).logits,
                               model(idx, 3, state=s0), rtol=0, atol=0)


def test_halted_states_frozen_and_logits_from_exit_loop(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    exit_loops = torch.randint(1, 7, idx.shape, generator=gen(3))
    rule = Oracle(exit_loops=exit_loops, max_loops=6)
    res = masked_forward(model, idx, rule, generator=gen())
    assert torch.equal(res.exit_loop, exit_loops)
    assert res.avg_depth == pytest.approx(exit_loops.float().mean().item())
    # replay the same masked run through iterate and keep every loop
    with torch.no_grad():
        outs = list(iterate(model, idx, 6, generator=gen(), readout="logits", halt=halt_fn(rule, "logits")))
    states = torch.stack([o.state for o in outs])  # (6, B, T, d)
    logits = torch.stack([o.out for o in outs])
    assert torch.equal(outs[-1].exit_loop, exit_loops)
    at_exit = exit_loops[None, ..., None].expand(1, *states.shape[1:3], 1) - 1
    frozen = states.gather(0, at_exit.expand(1, *states.shape[1:])).squeeze(0)
    for loop in range(1, 7):
        done = exit_loops <= loop
        assert torch.equal(states[loop - 1][done], frozen[done])
    torch.testing.assert_close(res.state, states[-1], rtol=0, atol=0)
    chosen = logits.gather(0, at_exit.expand(1, *logits.shape[1:])).squeeze(0)
    torch.testing.assert_close(res.logits, chosen, rtol=0, atol=0)
    # tokens that halted early changed later tokens' trajectories (they attend to frozen states)
    with torch.no_grad():
        full = model(idx, 6, generator=gen())
    late = exit_loops == 6
    assert not torch.allclose(res.logits[late], full[late])


def test_first_position_matches_offline_decisions(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    stats = list(iterate_stats(model, idx, L, generator=gen()))
    kl = torch.stack([s.kl for s in stats[1:]])
    rule = KLThreshold(float(kl.median()), max_loops=L)
    res = masked_forward(model, idx, rule, generator=gen())
    offline = offline_exits(stats, [rule])[0]
    # position 0 attends only to itself, so halting elsewhere cannot change its trajectory
    assert torch.equal(res.exit_loop[:, 0], offline[:, 0])
    assert 1 < res.avg_depth < L and res.exit_loop.min() >= 2


def test_oracle_from_iterator_equals_stacked(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    stats = list(iterate_stats(model, idx, L, generator=gen()))
    stack = torch.stack([s.log_probs for s in stats])
    eps = float(kl_successive(stack[-1], stack[2]).median())
    a = oracle_exit(stack, None, eps)
    b = oracle_exit((s.log_probs for s in stats), None, eps, reference=stack[-1])
    assert torch.equal(a.exit_loop, b.exit_loop) and a.reached.all() and b.reached.all()
    assert a.reference_loop == b.reference_loop == L and a.avg_depth == b.avg_depth
    # reference at loop 5: tokens exit by loop 5
    c = oracle_exit(stack, 5, eps)
    assert c.exit_loop.max() <= 5 and c.reference_loop == 5
    # eps = 0 is exact equality with the reference (only the reference loop itself is sure to qualify)
    assert (oracle_exit(stack, 5, 0.0).exit_loop <= 5).all()
    # a reference that none of the loops matches: not reached, exit at the last loop
    far = F.log_softmax(torch.randn(stack.shape[1:], generator=gen(9)) * 10, dim=-1)
    d = oracle_exit(stack, None, 1e-9, reference=far)
    assert not d.reached.any() and (d.exit_loop == L).all()
    assert oracle_exit(stack, None, eps, min_loops=3).exit_loop.min() >= 3
    assert c.rule().max_loops == 5


def test_oracle_lower_bounds_every_rule(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    stats = list(iterate_stats(model, idx, L, generator=gen()))
    stack = torch.stack([s.log_probs for s in stats])
    dist = torch.stack([kl_successive(stack[-1], lp) for lp in stack])  # (L, B, T): KL(p_ref || p_l)

    def q(name: str, lo: float = 0.3) -> float:
        values = torch.stack([getattr(s, name) for s in stats[1:]]).flatten()
        return float(values.quantile(lo))

    rules = [
        KLThreshold(q("kl"), max_loops=L),
        KLThreshold(q("kl", 0.6), min_loops=2, max_loops=L),
        StateDelta(q("state_delta"), max_loops=L),
        EntropyDelta(q("entropy_delta"), max_loops=L),
        Cosine(min(q("cosine", 0.7), 1.0), max_loops=L),
        ArgmaxPatience(2, max_loops=L),
        SoftmaxConfidence(float(stack.exp().amax(-1).median()), max_loops=L),
        Uniform(5),
        Never(max_loops=L),
    ]
    depths = []
    for rule, ex in zip(rules, offline_exits(stats, rules), strict=True):
        quality = dist.gather(0, (ex - 1)[None]).squeeze(0)  # each token's KL to the reference at its exit
        eps = float(quality.max())  # the rule's worst token: the oracle must match this quality
        oracle = oracle_exit(stack, L, eps)
        assert oracle.reached.all()
        assert (oracle.exit_loop <= ex).all(), rule
        assert oracle.avg_depth <= ex.float().mean().item(), rule
        depths.append(ex.float().mean().item())
    assert len(set(depths)) > 3  # the rules really differ on this model


def test_masked_forward_rejects_non_rules(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="is not a HaltingRule"):
        masked_forward(model, idx, 3)  # type: ignore[arg-type]


def test_measured_exits_agree_with_the_offline_pass(model: DepthRecurrentLM, idx: torch.Tensor) -> None:
    # the same rules replayed on a stored measurement and on the offline pass's own trajectory: the same exits
    from drc_core import default_rules, measure_windows, measured_exits, offline_pass

    specs = [s for s in default_rules(12) if not s.rule.needs_log_probs or s.family == "kl"]
    specs = [s for s in specs if s.rule.reads is not None and s.rule.reads <= {"kl", "state_delta", "entropy"}]
    assert {s.family for s in specs} >= {"kl", "state_delta"}
    windows = torch.cat([idx, idx[:, :1]], dim=1)
    m = measure_windows(model, windows, 12, kl_to_final=False)
    passed = offline_pass(model, windows, specs, reference_loops=8)
    at = (m.meta["window"].to_numpy(), m.meta["pos"].to_numpy())
    for spec, ex in zip(specs, measured_exits(m, [s.rule for s in specs]), strict=True):
        assert (ex == passed.exits[str(spec.rule)].numpy()[at]).all(), str(spec.rule)


def test_measured_exits_refuse_a_rule_reading_what_was_not_measured(model: DepthRecurrentLM,
                                                                     idx: torch.Tensor) -> None:
    from drc_core import DrcError, measure_windows, measured_exits

    m = measure_windows(model, torch.cat([idx, idx[:, :1]], dim=1), 4, kl_to_final=False)
    with pytest.raises(DrcError, match="not in this measurement"):
        measured_exits(m, [Cosine(0.99, max_loops=4)])

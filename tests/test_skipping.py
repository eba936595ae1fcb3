"""The compute-skipping paths: skip_forward equals the masked reference forward token by token for every rule
family; generate equals skip_forward on the sequence it generated; the skipping blocks run Block's own code."""

from __future__ import annotations

import pytest
import torch

from drc_core.analysis.loops import iterate_stats
from drc_core.halting import loopstats
from drc_core.halting.generate import generate, generate_fixed
from drc_core.halting.kvlayout import Attn, Tokens, block_step, empty_caches
from drc_core.halting.loopstats import stat_fields
from drc_core.halting.reference import masked_forward
from drc_core.halting.router import LinearRouter, RouterRule, harvest, train_router
from drc_core.halting.rules import (
    Acceleration,
    ArgmaxPatience,
    Cosine,
    EntropyDelta,
    HaltingRule,
    KLThreshold,
    MinPKL,
    Never,
    Oracle,
    SoftmaxConfidence,
    StateDelta,
    Uniform,
)
from drc_core.halting.skipping import skip_forward
from drc_core.model.blocks import Block
from drc_core.model.lm import DepthRecurrentLM

V, B, T, L = 64, 3, 14, 6
ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def model(moving_model) -> DepthRecurrentLM:
    return moving_model


@pytest.fixture(scope="module")
def idx() -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(11)


def _split(values: torch.Tensor) -> float:
    """A threshold in the widest gap of the middle half of ``values``: about half the tokens on each side and
    no token within rounding of it."""
    v = values.flatten().double().sort().values
    lo, hi = len(v) // 4, 3 * len(v) // 4
    gaps = v[lo + 1 : hi + 1] - v[lo:hi]
    k = lo + int(gaps.argmax())
    return float((v[k] + v[k + 1]) / 2)


@pytest.fixture(scope="module")
def rules(model, idx) -> dict[str, HaltingRule]:
    """One rule of every family, thresholds set from the loop-3 statistics of a uniform run."""
    stats = list(iterate_stats(model, idx, L, generator=_gen()))
    st, st4 = stats[2], stats[3]
    exits = torch.randint(1, L + 1, (B, T), generator=torch.Generator().manual_seed(5))
    windows = torch.randint(0, V, (8, T + 1), generator=torch.Generator().manual_seed(7))
    data = harvest(model, windows, L, _split(st.kl))  # labels of both kinds
    router = LinearRouter(data.n_features)
    train_router(router, data, epochs=5, seed=0)
    return {
        "kl": KLThreshold(_split(st.kl), max_loops=L),
        "state_delta": StateDelta(_split(st.state_delta), max_loops=L),
        "entropy_delta": EntropyDelta(_split(st.entropy_delta), max_loops=L),
        "cosine": Cosine(_split(st.cosine), max_loops=L),
        "argmax_patience": ArgmaxPatience(1, max_loops=L),
        "confidence": SoftmaxConfidence(_split(st.top_prob), max_loops=L),
        "minp_kl": MinPKL(_split(st.minp_kl), max_loops=L),
        "acceleration": Acceleration(_split(torch.maximum(st4.accel, st4.accel_prev)), max_loops=L),
        "uniform": Uniform(3),
        "never": Never(max_loops=L),
        "oracle": Oracle(exit_loops=exits, max_loops=L),
        "router": RouterRule(router=router, tau=0.5, min_loops=2, max_loops=L),
    }


@pytest.mark.parametrize("family", ["kl", "state_delta", "entropy_delta", "cosine", "argmax_patience", "confidence",
                                    "minp_kl", "acceleration", "uniform", "never", "oracle", "router"])
def test_skip_forward_equals_the_masked_reference(model, idx, rules, family):
    rule = rules[family]
    ref = masked_forward(model, idx, rule, generator=_gen())
    got = skip_forward(model, idx, rule, generator=_gen())
    assert torch.equal(got.exit_loop, ref.exit_loop)
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got.state, ref.state, atol=ATOL, rtol=RTOL)
    assert got.avg_depth == ref.avg_depth and got.rule == ref.rule
    if family in ("kl", "state_delta", "entropy_delta", "cosine", "confidence", "minp_kl", "acceleration", "oracle"):
        assert len(ref.exit_loop.unique()) >= 2, "the rule must halt tokens at different loops to test anything"


@pytest.mark.parametrize("family", ["kl", "state_delta", "argmax_patience", "acceleration", "uniform"])
def test_generate_equals_skip_forward_on_the_generated_sequence(model, idx, rules, family):
    rule = rules[family]
    prompt, n = idx[:, :5], 7
    res = generate(model, prompt, n, rule, generator=_gen())
    assert res.tokens.shape == (B, 5 + n) and torch.equal(res.tokens[:, :5], prompt)
    processed = res.tokens[:, :-1]  # the last generated token is never run through the model
    again = skip_forward(model, processed, rule, state=res.initial_state[:, :-1])
    assert torch.equal(again.exit_loop, res.exit_loop)
    torch.testing.assert_close(again.logits, res.logits, atol=ATOL, rtol=RTOL)
    masked = masked_forward(model, processed, rule, state=res.initial_state[:, :-1])
    assert torch.equal(masked.exit_loop, res.exit_loop)
    # greedy: every new token is the argmax of the logits of the position before it
    assert torch.equal(res.tokens[:, 5:], res.logits[:, 4:].argmax(-1))


def test_block_step_is_block_forward_on_a_full_window(model):
    block = model.core[0]
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope_cos, model.rope_sin
    with torch.no_grad():
        dense = block(x, cos[:T], sin[:T])
        toks = Tokens.window(B, 0, T, x.device)
        (kv,) = empty_caches(model, 1, (B, T), x)
        flat = block_step(block, toks.gather(x), toks, kv, cos, sin)
        # keys/values written into the cache are the block's own
        _, k, v = block.qkv(x, cos[:T], sin[:T])
    torch.testing.assert_close(flat.view(B, T, -1), dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[0], k)
    torch.testing.assert_close(kv[1], v)


def test_the_skipping_paths_follow_a_change_to_block(model, idx, rules, monkeypatch):
    """The skipping blocks call Block.qkv and Block.finish, the code of Block.forward: change finish and both the
    reference and the skipping path change, and still agree."""
    rule = rules["state_delta"]
    before = skip_forward(model, idx, rule, generator=_gen())
    original = Block.finish
    monkeypatch.setattr(Block, "finish", lambda self, x, y: original(self, x, 0.5 * y))
    ref = masked_forward(model, idx, rule, generator=_gen())
    got = skip_forward(model, idx, rule, generator=_gen())
    assert not torch.allclose(got.logits, before.logits)
    assert torch.equal(got.exit_loop, ref.exit_loop)
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=RTOL)
    gen = generate(model, idx[:, :4], 3, rule, generator=_gen())
    again = skip_forward(model, gen.tokens[:, :-1], rule, state=gen.initial_state[:, :-1])
    torch.testing.assert_close(again.logits, gen.logits, atol=ATOL, rtol=RTOL)


class _KLAnyLayout(KLThreshold):
    """The KL rule without declared reads: the skipping path gives it every statistic in the (B, T) layout."""

    reads = None


def test_compact_decisions_equal_the_full_layout(model, idx, rules):
    rule = rules["kl"]
    full = _KLAnyLayout(rule.tau, max_loops=rule.max_loops)
    assert full.reads is None and rule.reads == frozenset({"kl"})
    a = skip_forward(model, idx, rule, generator=_gen())
    b = skip_forward(model, idx, full, generator=_gen())
    assert torch.equal(a.exit_loop, b.exit_loop)
    torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=RTOL)


def test_stat_fields_are_what_the_rule_reads_and_their_inputs(rules):
    assert stat_fields(rules["kl"]) == {"kl"}
    assert stat_fields(rules["entropy_delta"]) == {"entropy_delta", "entropy"}
    assert stat_fields(rules["argmax_patience"]) == {"argmax_run", "argmax"}
    assert stat_fields(rules["acceleration"]) == {"accel", "accel_prev", "state_step"}
    assert stat_fields(rules["uniform"]) == set()
    assert stat_fields(rules["minp_kl"]) == {"minp_kl"} and "kl" in stat_fields(rules["router"])


def test_work_counts_what_was_computed(model, idx, rules):
    n = B * T
    u = skip_forward(model, idx, Uniform(4), generator=_gen()).work
    assert (u.core, u.blocks, u.qkv, u.head, u.vocab_stats, u.tokens) == (4 * n, n + 2 * n, 0, n, 0, n)
    res = skip_forward(model, idx, rules["kl"], generator=_gen())
    k = res.work
    loops = int(res.exit_loop.sum())
    assert k.core == loops and k.head == loops and k.vocab_stats == loops and k.blocks == n + 2 * loops
    res = skip_forward(model, idx, rules["state_delta"], generator=_gen())
    w = res.work
    assert w.core == int(res.exit_loop.sum()) and w.head == n and w.vocab_stats == 0
    assert w.blocks >= n + n and w.blocks + w.qkv <= n + 2 * w.core  # coda context at most every active token
    res = skip_forward(model, idx, rules["minp_kl"], generator=_gen())
    m = res.work  # min-p KL: the softmax plus two filtered distributions and their KL per token-loop
    assert m.head == int(res.exit_loop.sum()) and m.vocab_stats == 3 * m.head


def test_fused_kernel_equals_the_masked_reference(model, idx, rules, monkeypatch):
    monkeypatch.setattr(loopstats, "FUSED_MIN_ROWS", 1)  # the kernels at every loop, down to one active token
    for family in ("kl", "entropy_delta", "minp_kl", "confidence"):
        rule = rules[family]
        ref = masked_forward(model, idx, rule, generator=_gen())
        got = skip_forward(model, idx, rule, generator=_gen(), fused=True)
        assert torch.equal(got.exit_loop, ref.exit_loop), family
        torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=RTOL)


def test_generate_fixed_is_the_dense_decoder(model, idx, rules):
    prompt, n = idx[:, :5], 6
    res = generate(model, prompt, n, Uniform(4), generator=_gen())
    dense = generate_fixed(model, prompt, n, 4, state=res.initial_state)
    assert torch.equal(dense, res.tokens)
    assert res.work.core == 4 * B * (5 + n - 1)  # every processed position, four loops


def test_dense_layout_equals_the_padded_one(model):
    """The dense fast path (every position active) and the general padded path give the same block output."""
    block = model.core[0]
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(2))
    rope = (model.rope_cos, model.rope_sin)
    toks = Tokens.window(B, 0, T, x.device)
    with torch.no_grad():
        (kv1,) = empty_caches(model, 1, (B, T), x)
        (kv2,) = empty_caches(model, 1, (B, T), x)
        dense = block_step(block, toks.gather(x), Attn(toks, B, T, 2, rope, (0, T)), kv1, *rope)
        padded = block_step(block, toks.gather(x), Attn(toks, B, T, 2, rope), kv2, *rope)
    torch.testing.assert_close(dense, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv1[0], kv2[0])


class _KLPausing(KLThreshold):
    """The KL rule, but no token halts at loop 3: a loop without halts after a loop with some (the previous
    logits are then read without an index, from a buffer longer than the active set)."""

    def criterion(self, stats):
        return super().criterion(stats) & (stats.loop != 3)


@pytest.mark.parametrize("fused", [False, True])
def test_a_loop_without_halts_after_halts(model, idx, rules, fused, monkeypatch):
    monkeypatch.setattr(loopstats, "FUSED_MIN_ROWS", 1)
    rule = _KLPausing(rules["kl"].tau, max_loops=L)
    ref = masked_forward(model, idx, rule, generator=_gen())
    got = skip_forward(model, idx, rule, generator=_gen(), fused=fused)
    assert (ref.exit_loop == 2).any() and (ref.exit_loop > 3).any()
    assert torch.equal(got.exit_loop, ref.exit_loop)
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ["kl", "minp_kl", "entropy_delta"])
def test_fused_then_eager_as_the_active_set_shrinks(model, idx, rules, family, monkeypatch):
    """The kernels run while many tokens are active, the eager pass once few are: the switch keeps the
    previous loop's values (normaliser, logits, log-probs) consistent."""
    monkeypatch.setattr(loopstats, "FUSED_MIN_ROWS", 30)
    rule = rules[family]
    ref = masked_forward(model, idx, rule, generator=_gen())
    got = skip_forward(model, idx, rule, generator=_gen(), fused=True)
    active = [int((ref.exit_loop > loop).sum()) for loop in range(L)]  # active at loops 1..L
    assert active[0] >= 30 and any(0 < n < 30 for n in active)  # the switch happens while tokens still run
    assert torch.equal(got.exit_loop, ref.exit_loop)
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=RTOL)

"""The compute-skipping paths: skip_forward equals the masked reference forward token by token for every rule
family; generate equals skip_forward on the sequence it generated; the skipping blocks run Block's own code."""

from __future__ import annotations

import pytest
import torch

from drc_core.analysis.loops import iterate_stats
from drc_core.halting.generate import generate
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
    masked_forward,
)
from drc_core.halting.skipping import Tokens, block_step, empty_caches, skip_forward
from drc_core.model import Block, DepthRecurrentLM, ModelConfig

V, B, T, L = 64, 3, 14, 6
ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def model(one_thread) -> DepthRecurrentLM:
    """Two core and two coda blocks, the core scaled up so that tokens keep changing for several loops."""
    torch.manual_seed(0)
    m = DepthRecurrentLM(ModelConfig(vocab_size=V, d_model=32, n_heads=2, n_prelude=1, n_core=2, n_coda=2,
                                     max_seq_len=32, injection="add"))
    with torch.no_grad():
        for p in m.core.parameters():
            p.mul_(4.0)
    return m.eval()


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

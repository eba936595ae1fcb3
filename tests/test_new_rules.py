"""The exit rules added from 2025-2026 work (min-p KL, two-loop acceleration) and Huginn's presets, against direct
NumPy references of their definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from drc_core.analysis.loops import loop_stats
from drc_core.halting.reference import masked_forward
from drc_core.halting.rules import (
    Acceleration,
    ArgmaxPatience,
    Cosine,
    EntropyDelta,
    KLThreshold,
    MinPKL,
    StateDelta,
    huginn_presets,
    make_rule,
)


def _np_minp(logits: np.ndarray) -> np.ndarray:
    """Huginn's MinKLExitEvaluator filter, written out: softmax, p < 0.1 max -> 1/V, renormalise."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    v = p.shape[-1]
    q = np.where(p < 0.1 * p.max(-1, keepdims=True), 1.0 / v, p)
    return q / q.sum(-1, keepdims=True)


def _stats_over(logits: list[torch.Tensor], states: list[torch.Tensor]):
    prev, out = None, []
    for loop, (lg, s) in enumerate(zip(logits, states, strict=True), start=1):
        prev = loop_stats(prev, loop, torch.log_softmax(lg, -1), s)
        out.append(prev)
    return out


def test_minp_kl_matches_numpy():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(2, 5, 50, generator=g, dtype=torch.float64) * 3 for _ in range(3)]
    states = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
    stats = _stats_over(logits, states)
    assert torch.isinf(stats[0].minp_kl).all()
    for loop in (2, 3):
        q_prev, q = _np_minp(logits[loop - 2].numpy()), _np_minp(logits[loop - 1].numpy())
        want = (q_prev * (np.log(q_prev) - np.log(q))).sum(-1)  # KL(q_{l-1} || q_l), Huginn's direction
        np.testing.assert_allclose(stats[loop - 1].minp_kl.numpy(), want, rtol=1e-4, atol=1e-6)


def test_acceleration_matches_numpy_and_needs_two_loops_below():
    g = torch.Generator().manual_seed(1)
    states = [torch.randn(2, 4, 6, generator=g) for _ in range(6)]
    logits = [torch.randn(2, 4, 10, generator=g) for _ in range(6)]
    stats = _stats_over(logits, states)
    s = [x.numpy().astype(np.float64) for x in states]
    for loop in (1, 2):
        assert torch.isinf(stats[loop - 1].accel).all()
    assert torch.isinf(stats[2].accel_prev).all()
    for loop in range(3, 7):
        d_now, d_before = s[loop - 1] - s[loop - 2], s[loop - 2] - s[loop - 3]
        want = np.linalg.norm(d_now - d_before, axis=-1) / np.linalg.norm(s[loop - 1], axis=-1)
        np.testing.assert_allclose(stats[loop - 1].accel.numpy(), want, rtol=1e-5)
        if loop > 3:
            torch.testing.assert_close(stats[loop - 1].accel_prev, stats[loop - 2].accel)
    st = stats[4]
    tau = float(st.accel.median())
    rule = Acceleration(tau, max_loops=32)
    want = (st.accel.numpy() < tau) & (st.accel_prev.numpy() < tau)
    assert np.array_equal(rule.decide(st).numpy(), want)
    assert not rule.decide(stats[2]).any()  # loop 3: the previous loop's acceleration is undefined


def test_huginn_presets_are_its_documented_defaults():
    p = huginn_presets(max_loops=16)
    assert p["huginn kl 1e-3"] == KLThreshold(1e-3, max_loops=16)
    assert p["huginn kl 5e-4 (paper)"] == KLThreshold(5e-4, max_loops=16)
    assert p["huginn minp-kl 1e-5"] == MinPKL(1e-5, max_loops=16)
    assert p["huginn latent-diff 0.03"] == StateDelta(0.03, max_loops=16)
    assert p["huginn entropy-diff 1e-3"] == EntropyDelta(1e-3, max_loops=16)
    assert p["huginn cosine 1e-3"] == Cosine(1 - 1e-3, max_loops=16)
    assert p["huginn argmax-stability 5"] == ArgmaxPatience(5, max_loops=16)


def test_rules_by_short_name_and_on_a_model(tiny_model_factory):
    assert make_rule("minp_kl", 1e-5) == MinPKL(1e-5)
    assert make_rule("acceleration", 0.01).name == "accel<0.01x2"
    model = tiny_model_factory(40, core_scale=3.0).eval()
    idx = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    for name, rule in huginn_presets(max_loops=8).items():
        res = masked_forward(model, idx, rule, generator=torch.Generator().manual_seed(0))
        assert res.exit_loop.shape == (2, 9) and 1 <= res.avg_depth <= 8, name
    res = masked_forward(model, idx, Acceleration(1e30, max_loops=8), generator=torch.Generator().manual_seed(0))
    assert (res.exit_loop == 4).all()  # the earliest an acceleration exit can fire


@pytest.mark.parametrize("tau", [-1.0, math.nan])
def test_bad_thresholds(tau):
    with pytest.raises(ValueError, match="tau"):
        Acceleration(tau)
    with pytest.raises(ValueError, match="tau"):
        MinPKL(tau)

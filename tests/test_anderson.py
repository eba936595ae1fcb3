"""Anderson acceleration of the core iteration: the mixing weights against a direct NumPy least squares, plain
iteration as a special case of it, convergence on a linear contraction whose fixed point NumPy solves, and the
measurement agreeing with loss_by_depth."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from drc_book.fixed_point import fixed_point_costs, seconds_per_eval
from drc_core.analysis.measure import depth_from_successive_kl
from drc_core.errors import DrcError
from drc_core.model.anderson import PLAIN, AndersonConfig, anderson_iterate, anderson_weights, evals_to_converge
from drc_core.model.lm import iterate
from drc_core.training.evaluate import loss_by_depth


def test_weights_match_numpy_constrained_least_squares():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(5, 4, 9))  # 5 tokens, h = 4 residuals of dimension 9
    got = anderson_weights(torch.from_numpy(g), lam=0.0).numpy()
    for t in range(5):
        # minimise ||g_h + sum_{i<h} a_i (g_i - g_h)||, a_h = 1 - sum a_i: an unconstrained least squares
        d = (g[t, :-1] - g[t, -1]).T
        a, *_ = np.linalg.lstsq(d, -g[t, -1], rcond=None)
        want = np.append(a, 1 - a.sum())
        np.testing.assert_allclose(got[t], want, rtol=1e-6, atol=1e-8)
    assert np.allclose(got.sum(-1), 1)


def test_zero_residual_gets_equal_weights():
    w = anderson_weights(torch.zeros(2, 3, 5), lam=1e-4)
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))


def test_plain_config_is_iterate(tiny_model_factory):
    model = tiny_model_factory(50, core_scale=3.0).eval()
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        want = [o.state for o in iterate(model, x, 6, generator=torch.Generator().manual_seed(3), readout=None)]
        got = [o.state for o in anderson_iterate(model, x, 6, PLAIN, generator=torch.Generator().manual_seed(3),
                                                 readout=None)]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


class LinearCore(nn.Module):
    """A protocol model whose core is the affine contraction s -> s A^T + e (per token), fixed point (I - A)^-1 e."""

    def __init__(self, d: int = 6, radius: float = 0.95, seed: int = 0, lo: float | None = None,
                 noise: float = 0.05) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        lam = torch.linspace(-radius if lo is None else lo, radius, d, dtype=torch.float64)
        self.A = nn.Parameter(q @ torch.diag(lam) @ q.T + noise * torch.randn(d, d, generator=g, dtype=torch.float64),
                              requires_grad=False)
        self.emb = nn.Parameter(torch.randn(11, d, generator=g, dtype=torch.float64), requires_grad=False)
        self.vocab_size, self.max_seq_len = 11, 64

    def embed(self, idx):
        return self.emb[idx]

    def initial_state(self, e, generator=None):
        return torch.zeros_like(e)

    def core_step(self, s, e, *, frozen_kv=None, frozen=None):
        return s @ self.A.T + e

    def readout(self, state, positions=None, *, frozen_kv=None, frozen=None):
        return state[..., :11] if state.shape[-1] >= 11 else torch.cat([state, state], -1)[..., :11]


@pytest.mark.parametrize("scope", ["token", "sequence"])
def test_anderson_reaches_the_numpy_fixed_point_much_faster(scope):
    model = LinearCore()
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    e = model.embed(idx)
    a = model.A.detach().numpy()
    star = np.linalg.solve(np.eye(a.shape[0]) - a, e.numpy().reshape(-1, a.shape[0]).T).T.reshape(e.shape)

    def error_after(cfg, k):
        last = None
        for out in anderson_iterate(model, idx, k, cfg, readout=None):
            last = out.state
        return float((last - torch.from_numpy(star)).norm() / np.linalg.norm(star))

    plain = error_after(PLAIN, 12)
    assert plain > 0.05  # the slowest mode (|lambda| ~ 0.95) is still far from converged
    # for an affine map in d = 6 dimensions, a window of d + 1 iterates (m = 6) spans the Krylov space: exact
    assert error_after(AndersonConfig(m=6, lam=0.0, scope=scope), 12) < 1e-9
    assert error_after(AndersonConfig(m=3, lam=0.0, scope=scope), 12) < plain / 10  # a short window still helps


def test_damping_turns_a_near_two_cycle_into_a_contraction():
    # eigenvalues -0.99 .. 0.5: plain iteration oscillates (the -0.99 mode flips sign every step and barely
    # shrinks, like the reference's 2-cycle tokens); damped iteration x' = b f(x) + (1 - b) x has the same fixed
    # point and maps each eigenvalue l to b l + 1 - b, here at most 0.75 in modulus for b = 0.5
    model = LinearCore(lo=-0.99, radius=0.5, noise=0.0)
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    a = model.A.detach().numpy()
    e = model.embed(idx).numpy().reshape(-1, a.shape[0])
    star = torch.from_numpy(np.linalg.solve(np.eye(a.shape[0]) - a, e.T).T.reshape(2, 5, -1))

    def errors(cfg, k):
        return [float((o.state - star).norm() / star.norm()) for o in anderson_iterate(model, idx, k, cfg,
                                                                                        readout=None)]

    plain, damped = errors(PLAIN, 40), errors(AndersonConfig(m=0, beta=0.5), 40)
    assert plain[-1] > 0.05 and damped[-1] < 1e-4  # measured: 0.105 and 5e-6
    # plain iteration's error alternates along the slow mode; the damped one falls monotonically
    assert all(b < a for a, b in zip(damped[5:], damped[6:], strict=False))
    assert AndersonConfig(m=0, beta=0.5).label == "plain (beta 0.5)"


def test_evals_to_converge_is_convergence_depth():
    rng = np.random.default_rng(2)
    kl = 10 ** rng.uniform(-7, -1, size=(40, 15))
    for eps in (1e-3, 1e-5):
        np.testing.assert_array_equal(evals_to_converge(torch.from_numpy(kl), eps).numpy(),
                                      depth_from_successive_kl(kl, eps))


def test_config_is_validated():
    with pytest.raises(DrcError, match="beta"):
        AndersonConfig(beta=0.0)
    with pytest.raises(DrcError, match="scope"):
        AndersonConfig(scope="global")
    with pytest.raises(DrcError, match="m=-1"):
        AndersonConfig(m=-1)


def test_plain_curve_equals_loss_by_depth(tiny_model_factory):
    model = tiny_model_factory(40, core_scale=2.0)
    windows = torch.randint(0, 40, (6, 13), generator=torch.Generator().manual_seed(4))
    res = fixed_point_costs(model, windows, {"plain": PLAIN, "aa": AndersonConfig(m=3)}, max_evals=6, ref_loops=8,
                            batch_size=4)
    plain = res.curves[res.curves.method == "plain"].set_index("evals").ce
    want = loss_by_depth(model, windows, [1, 3, 6], batch_size=4)
    for k, v in want.items():
        assert plain[k] == pytest.approx(v, rel=1e-5)
    assert set(res.depths.method) == {"plain", "aa"} and len(res.depths) == 4
    assert (res.curves.kl_ref >= -1e-6).all()
    assert seconds_per_eval(model, windows[:2, :-1], AndersonConfig(m=2), evals=3, rounds=1) > 0

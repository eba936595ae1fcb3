"""Bring your own model: a minimal Huginn-style depth-recurrent LM that is not DepthRecurrentLM (additive
injection, sandwich norm, zero initial state, learned positions, no coda) implements drc_core.model.lm.RecurrentModel,
and the analysis, halting, sweep and router code runs on it and means the same thing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import drc_core
from drc_core.analysis.loops import iterate_stats
from drc_core.analysis.measure import convergence_depth, measure_windows
from drc_core.halting.reference import masked_forward, offline_exits
from drc_core.halting.router import harvest
from drc_core.halting.rules import KLThreshold, Never, Uniform
from drc_core.halting.sweep import default_rules, sweep
from drc_core.model.blocks import FrozenKV
from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM, RecurrentModel, iterate
from drc_core.model.passes import EVAL_STATE_SEED
from drc_core.training.evaluate import loss_by_depth, mean_successive_kl

V, T, L = 48, 12, 6


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, kv_fn=None) -> Tensor:
        B, n, d = x.shape
        q, k, v = self.qkv(x).view(B, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if kv_fn is not None:
            k, v = kv_fn(k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, n, d))


class _SandwichBlock(nn.Module):
    """x + norm(attn(norm(x))), then x + norm(mlp(norm(x))) (Huginn's sandwich norm)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n1, self.n2, self.n3, self.n4 = (nn.RMSNorm(d) for _ in range(4))
        self.attn = _Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: Tensor, kv_fn=None) -> Tensor:
        x = x + self.n2(self.attn(self.n1(x), kv_fn))
        return x + self.n4(self.mlp(self.n3(x)))


class TinyHuginn(nn.Module):
    """embed = token + learned position embeddings through one prelude block; s_0 = 0; a loop adds e to the
    state and runs two shared sandwich blocks; readout = norm + head (no coda)."""

    def __init__(self, vocab_size: int = V, d: int = 32, heads: int = 2, max_seq_len: int = 16) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.tok = nn.Embedding(vocab_size, d)
        self.pos = nn.Parameter(torch.randn(max_seq_len, d) * 0.1)
        self.prelude = _SandwichBlock(d, heads)
        self.core = nn.ModuleList(_SandwichBlock(d, heads) for _ in range(2))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab_size, bias=False)

    def embed(self, idx: Tensor) -> Tensor:
        return self.prelude(self.tok(idx) + self.pos[: idx.shape[1]])

    def initial_state(self, e: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return torch.zeros_like(e)

    def core_step(self, s: Tensor, e: Tensor, *, frozen_kv: FrozenKV | None = None,
                  frozen: Tensor | None = None) -> Tensor:
        x = s + e
        for j, block in enumerate(self.core):
            x = block(x, None if frozen_kv is None else frozen_kv.hook(j, frozen))
        return x

    def readout(self, state: Tensor, positions=None, *, frozen_kv: FrozenKV | None = None,
                frozen: Tensor | None = None) -> Tensor:
        if isinstance(positions, Tensor) and positions.dim() == 2:  # tokens (B, T) -> (n, d)
            x = state[positions]
        else:
            x = state if positions is None else state[:, positions]
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def model(one_thread) -> TinyHuginn:
    torch.manual_seed(0)
    return TinyHuginn().eval()


@pytest.fixture(scope="module")
def windows() -> Tensor:
    return torch.randint(0, V, (6, T + 1), generator=torch.Generator().manual_seed(1))


def _by_hand(model: TinyHuginn, x: Tensor, loops: int) -> list[Tensor]:
    """Logits after each loop, written out without the library."""
    with torch.no_grad():
        e = model.embed(x)
        s = torch.zeros_like(e)
        out = []
        for _ in range(loops):
            s = model.core_step(s, e)
            out.append(model.readout(s))
    return out


def test_both_models_implement_the_protocol(model):
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1, max_seq_len=16)
    assert isinstance(model, RecurrentModel)
    assert isinstance(DepthRecurrentLM(cfg), RecurrentModel)
    assert not isinstance(nn.Linear(2, 2), RecurrentModel)


def test_iterate_runs_the_loop_of_the_protocol(model, windows):
    x = windows[:, :-1]
    with torch.no_grad():
        outs = [o.out for o in iterate(model, x, L)]
    for got, want in zip(outs, _by_hand(model, x, L), strict=True):
        torch.testing.assert_close(got, want)


def test_measurements_mean_the_same_on_another_model(model, windows):
    meas = measure_windows(model, windows, L)
    frame = meas.to_frame()
    assert len(frame) == len(windows) * T * L
    logits = _by_hand(model, windows[:, :-1], L)
    logp = [F.log_softmax(z.float(), -1) for z in logits]
    kl = (logp[3].exp() * (logp[3] - logp[2])).sum(-1)  # KL(p_4 || p_3)
    np.testing.assert_allclose(frame[frame.loop == 4].kl.to_numpy(), kl.flatten().numpy(), rtol=1e-4,
                               atol=1e-7)
    ce = loss_by_depth(model, windows, range(1, L + 1))
    for n in range(1, L + 1):
        assert math.isclose(frame[frame.loop == n].ce.mean(), ce[n], rel_tol=1e-5)
    succ = mean_successive_kl(model, windows, L)
    assert math.isclose(frame[frame.loop == L].kl.mean(), succ[L], rel_tol=1e-4)
    depth = convergence_depth(meas, 1e-3)
    assert len(depth) == len(windows) * T and depth.depth.between(1, L).all()
    tr = drc_core.trace(model, windows[0].tolist(), max_loops=L)
    assert tr.tokens[0].startswith("#") and tr.matrix("kl_final").shape == (T + 1, L)


def test_masked_halting_on_another_model(model, windows):
    x = windows[:, :-1]
    never = masked_forward(model, x, Never(max_loops=L))
    torch.testing.assert_close(never.logits, _by_hand(model, x, L)[-1])
    assert (masked_forward(model, x, Uniform(3)).exit_loop == 3).all()
    rule = KLThreshold(1e-2, max_loops=L)
    res = masked_forward(model, x, rule)
    # the first position attends to nothing earlier, so halting the others cannot change it: its exit and
    # logits are the offline replay's on the unhalted run
    stats = list(iterate_stats(model, x, L))
    offline = offline_exits(stats, [rule])[0]
    assert torch.equal(res.exit_loop[:, 0], offline[:, 0])
    unhalted = _by_hand(model, x, L)
    for b in range(len(x)):
        e = int(res.exit_loop[b, 0])
        torch.testing.assert_close(res.logits[b, 0], unhalted[e - 1][b, 0])
    assert 1 <= res.avg_depth <= L


def test_sweeps_and_routers_run_on_another_model(model, windows):
    specs = [s for s in default_rules(max_loops=L) if s.family in ("kl", "state_delta")][:4]
    frame = sweep(model, windows, specs, reference_loops=L, mode="offline")
    uniform = frame[frame.family == "uniform"].groupby("param").ce.mean()
    ce = loss_by_depth(model, windows, range(1, L + 1), seed=EVAL_STATE_SEED)
    for n, value in uniform.items():
        assert math.isclose(value, ce[int(n)], rel_tol=1e-4)
    data = harvest(model, windows, L)
    assert len(data.features) == len(data.labels) > 0

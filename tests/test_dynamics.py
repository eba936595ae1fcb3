"""Per-token dynamics: the class rule on made-up trajectories, commit loop and overthinking, and the pass against
the measurement's relative state change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drc_core.analysis.dynamics import CLASSES, Dynamics, classify, commit_loop, overthinks, token_dynamics
from drc_core.analysis.measure import measure_windows
from drc_core.errors import DrcError


def _dyn_from_states(states: np.ndarray) -> Dynamics:
    """Dynamics of made-up trajectories: states (n, L, d) -> arrays (1, n, L)."""
    norm = np.linalg.norm(states, axis=-1)
    step = np.full(norm.shape, np.nan)
    step[:, 1:] = np.linalg.norm(np.diff(states, axis=1), axis=-1)
    step2 = np.full(norm.shape, np.nan)
    step2[:, 2:] = np.linalg.norm(states[:, 2:] - states[:, :-2], axis=-1)
    arg = np.zeros(norm.shape, dtype=np.int64)
    return Dynamics(norm[None], step[None], step2[None], arg[None])


def test_classify_tells_the_four_kinds_apart():
    L, d = 16, 4
    loops = np.arange(L)[:, None]
    base = np.ones((L, d))
    settled = base + 0.5**loops * np.eye(d)[0]  # steps halve: relative step tiny at L
    cycle = base + 0.3 * ((-1.0) ** loops) * np.eye(d)[1]  # alternates between two points
    contracting = base + 0.9**loops * np.eye(d)[2] * 5  # shrinks geometrically, not settled by L
    drifting = base + loops * np.eye(d)[3]  # constant steps, growing norm
    dyn = _dyn_from_states(np.stack([settled, cycle, contracting, drifting]))
    assert classify(dyn, tol=1e-3).tolist() == [["settled", "oscillating", "contracting", "drifting"]]
    with pytest.raises(DrcError):
        classify(dyn, tail=20)


def test_commit_loop_and_overthinking():
    arg = np.array([[1, 2, 2, 2], [3, 3, 3, 3], [1, 2, 1, 2]])
    assert commit_loop(arg).tolist() == [2, 1, 4]
    correct = np.array([[False, True, False, True], [True, True, True, True], [False, False, True, True]])
    assert overthinks(correct).tolist() == [True, False, False]


def test_the_pass_keeps_norms_and_steps_of_the_states(tiny_model_factory, one_thread):
    """The dynamics columns against the states of a plain iterate pass (NumPy norms), the same initial states;
    positions give those tokens' rows of the full pass; a measurement without them is refused."""
    from drc_core.model.lm import iterate
    from drc_core.model.passes import EVAL_STATE_SEED

    torch.manual_seed(0)
    model = tiny_model_factory(64, core_scale=3.0)
    windows = torch.randint(0, 64, (3, 9))
    dyn = token_dynamics(model, windows, 6, batch_size=2)
    gen = torch.Generator().manual_seed(EVAL_STATE_SEED)
    states = []
    with torch.no_grad():
        for start in (0, 2):
            x = windows[start : start + 2, :-1]
            states.append(np.stack([o.state.numpy() for o in iterate(model, x, 6, generator=gen, readout=None)], 2))
    s = np.concatenate(states).astype(np.float64)  # (N, T, L, d)
    np.testing.assert_allclose(dyn.norm, np.linalg.norm(s, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(dyn.step[..., 1:], np.linalg.norm(s[:, :, 1:] - s[:, :, :-1], axis=-1), rtol=1e-4)
    np.testing.assert_allclose(dyn.step2[..., 2:], np.linalg.norm(s[:, :, 2:] - s[:, :, :-2], axis=-1), rtol=1e-4)
    meas = measure_windows(model, windows, 6, batch_size=2, kl_to_final=False)
    assert (dyn.argmax == meas.stats["argmax"].reshape(3, 8, 6)).all()
    assert np.isnan(dyn.step[..., 0]).all() and np.isnan(dyn.step2[..., :2]).all()
    assert dyn.contraction().shape == (3, 8, 4)
    mask = np.zeros((3, 8), dtype=bool)
    mask[0, 3] = mask[2, [0, 7]] = True
    part = token_dynamics(model, windows, 6, batch_size=2, positions=mask)
    np.testing.assert_allclose(part.norm, dyn.norm[mask], rtol=1e-6)
    np.testing.assert_allclose(part.step, dyn.step[mask], rtol=1e-6)
    np.testing.assert_allclose(part.step2, dyn.step2[mask], rtol=1e-6)
    full = measure_windows(model, windows, 6, batch_size=2, kl_to_final=False, dynamics=True)
    assert np.array_equal(Dynamics.of(full).step, full.stats["state_step1"], equal_nan=True)  # stored, not rebuilt
    with pytest.raises(DrcError, match="dynamics=True"):
        Dynamics.of(meas)


def test_trace_keeps_the_per_token_dynamics(tiny_model_factory, one_thread):
    """drc_core.trace adds norm and contraction per loop, class and commit loop per token: the same numbers
    token_dynamics, classify and commit_loop give on that sequence."""
    import drc_core

    torch.manual_seed(1)
    model = tiny_model_factory(64, core_scale=3.0)
    ids = torch.randint(0, 64, (10,))
    tr = drc_core.trace(model, ids, 12)
    window = torch.cat([ids, ids[-1:]])[None]
    dyn = token_dynamics(model, window, 12)
    np.testing.assert_allclose(tr.matrix("norm"), dyn.norm[0], rtol=1e-6)
    rho = tr.matrix("contraction")
    assert np.isnan(rho[:, :2]).all()
    np.testing.assert_allclose(rho[:, 2:], dyn.contraction()[0], rtol=1e-5)
    # the step into loop l over the step into loop l-1
    np.testing.assert_allclose(rho[:, 5], dyn.step[0, :, 5] / dyn.step[0, :, 4], rtol=1e-5)
    per_token = tr.dynamics()
    assert per_token["dyn_class"].tolist() == classify(dyn, tail=8)[0].tolist()
    assert per_token["commit_loop"].tolist() == commit_loop(dyn.argmax[0]).tolist()
    assert per_token["text"].tolist() == tr.tokens and len(per_token) == 10
    np.testing.assert_allclose(per_token["contraction"],
                               np.exp(np.nanmean(np.log(dyn.contraction()[0, :, -8:]), axis=1)), rtol=1e-5)
    # every loop's row of a token's long frame carries its class and commit loop
    assert (tr.to_frame().groupby("pos")[["dyn_class", "commit_loop"]].nunique() == 1).all().all()
    short = drc_core.trace(model, ids, 4)  # tail shrinks to the loops there are
    assert short.dynamics()["dyn_class"].isin(["settled", "oscillating", "contracting", "drifting"]).all()
    two = drc_core.trace(model, ids, 2)  # no contraction factor: nothing to classify
    assert np.isnan(two.matrix("contraction")).all() and two.dynamics()["dyn_class"].isna().all()


def test_class_and_group_shares_with_document_intervals():
    from drc_core.analysis.dynamics import class_shares, group_shares

    classes = np.array(["settled"] * 6 + ["drifting"] * 2 + ["oscillating"] * 2)
    types = np.array(["word", "punct"] * 5)
    docs = np.repeat([0, 1], 5)
    out = class_shares(classes, types, docs, n_boot=200, seed=0)
    assert set(out.group) == {"all", "punct", "word"} and set(out["class"]) == set(CLASSES)
    overall = out[out.group == "all"].set_index("class")
    assert overall.share.to_dict() == {"settled": 0.6, "oscillating": 0.2, "contracting": 0.0, "drifting": 0.2}
    assert (overall.ci_low <= overall.share).all() and (overall.share <= overall.ci_high).all()
    word = out[out.group == "word"].set_index("class")
    assert word.loc["settled", "share"] == pytest.approx(3 / 5) and word.n_tokens.iloc[0] == 5
    assert out.groupby("group").share.sum().round(9).eq(1).all()
    flags = group_shares({"x": np.arange(10) < 3}, clusters=docs, n_boot=50)
    assert flags.share.tolist() == [0.3] and flags.group.tolist() == ["all"]
    with pytest.raises(DrcError):
        group_shares({"x": np.ones(3, bool)}, groups=np.array(["a", "b"]))


def test_norm_percentiles_by_loop():
    from drc_core.analysis.dynamics import norm_percentiles

    states = np.stack([np.outer(np.arange(1, 7), np.ones(4)) * (k + 1) for k in range(5)])  # norms grow linearly
    dyn = _dyn_from_states(states)
    out = norm_percentiles(dyn, q=(50,))
    assert out.loop.tolist() == list(range(1, 7))
    np.testing.assert_allclose(out.p50, np.arange(1, 7) * 3 * 2)  # median token: scale 3, |(1,1,1,1)| = 2
    np.testing.assert_allclose(out.median_growth, np.arange(1, 7))

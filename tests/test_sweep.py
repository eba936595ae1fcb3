"""Sweeps of quality vs average depth, matching depths and calibration (drc_core/halting/sweep.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from drc_core.analysis.loops import iterate_stats
from drc_core.errors import DrcError
from drc_core.halting.reference import first_within, masked_forward, offline_exits
from drc_core.halting.rules import KLThreshold, Never, Uniform
from drc_core.halting.sweep import (
    ROUTER_FAMILIES,
    RuleSpec,
    calibrate,
    calibrated_families,
    calibration_table,
    default_rules,
    matching_depth,
    matching_gap,
    matching_table,
    offline_pass,
    online_vs_offline,
    summarize,
    sweep,
    token_exits,
    uniform_ce,
    window_clusters,
)
from drc_core.model.passes import EVAL_STATE_SEED, kl_successive
from drc_core.training.evaluate import loss_by_depth

V = 64


@pytest.fixture(scope="module")
def model(one_thread, tiny_model_factory):
    return tiny_model_factory(V, core_scale=2.5).eval()


@pytest.fixture(scope="module")
def windows():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, V, (6, 17), generator=g)


@pytest.fixture(scope="module")
def frame(model, windows):
    rules = [RuleSpec("kl", t, KLThreshold(t, max_loops=8)) for t in (1e-1, 1e-2, 1e-3, 1e-5)]
    rules.append(RuleSpec("never", 8, Never(max_loops=8)))
    return sweep(model, windows, rules, reference_loops=4, batch_size=4, oracle_eps=(1e-1, 1e-3))


def test_uniform_rows_equal_loss_by_depth(model, windows, frame):
    s = summarize(frame, n_boot=50)
    uni = s[s.family == "uniform"].set_index("param")
    assert list(uni.index) == [float(k) for k in range(1, 9)]
    want = loss_by_depth(model, windows, list(range(1, 9)), batch_size=4)
    for k, loss in want.items():
        assert uni.loc[float(k), "ce"] == pytest.approx(loss, rel=1e-5)
        assert uni.loc[float(k), "avg_depth"] == k
    assert uni.loc[4.0, "kl_ref"] == pytest.approx(0.0, abs=1e-7)  # the reference against itself
    assert uni.loc[1.0, "kl_ref"] > 0


@torch.no_grad()
def test_rule_rows_equal_masked_forward(model, windows, frame):
    # batch 1 (windows 4, 5) is the generator's second draw
    gen = torch.Generator().manual_seed(EVAL_STATE_SEED)
    x0 = windows[:4, :-1]
    model.initial_state(model.embed(x0), gen)
    x, y = windows[4:, :-1], windows[4:, 1:]
    s0 = model.initial_state(model.embed(x), gen)
    res = masked_forward(model, x, KLThreshold(1e-2, max_loops=8), state=s0)
    ref = F.log_softmax(model(x, 4, state=s0).float(), dim=-1)
    logp = res.log_probs()
    ce = -logp.gather(-1, y[..., None]).squeeze(-1)
    kl = kl_successive(ref, logp)
    rows = frame[(frame.family == "kl") & (frame.param == 1e-2)].set_index("window")
    for i, w in enumerate((4, 5)):
        assert rows.loc[w, "avg_depth"] == pytest.approx(float(res.exit_loop[i].float().mean()))
        assert rows.loc[w, "ce"] == pytest.approx(float(ce[i].mean()), rel=1e-5)
        assert rows.loc[w, "kl_ref"] == pytest.approx(float(kl[i].mean()), rel=1e-4, abs=1e-9)
    never = frame[frame.family == "never"]
    assert (never.avg_depth == 8).all()
    uni8 = frame[(frame.family == "uniform") & (frame.param == 8)].set_index("window")
    np.testing.assert_allclose(never.set_index("window").ce, uni8.ce, rtol=1e-5)


def test_thresholds_order_depth(frame):
    s = summarize(frame, n_boot=50)
    kl = s[s.family == "kl"].sort_values("param")
    assert kl.avg_depth.is_monotonic_decreasing  # a looser threshold halts earlier
    assert kl.avg_depth.iloc[0] > kl.avg_depth.iloc[-1]
    assert (s.avg_depth_lo <= s.avg_depth + 1e-12).all() and (s.ce_hi >= s.ce - 1e-12).all()


def test_oracle_rows(frame):
    o = frame[frame.family == "oracle"]
    assert set(o.param) == {1e-1, 1e-3}
    assert (o.avg_depth <= 4).all()  # never beyond the reference loop
    tight = summarize(frame, n_boot=20).set_index(["family", "param"])
    assert tight.loc[("oracle", 1e-3), "kl_ref"] <= 1e-3
    assert tight.loc[("oracle", 1e-1), "avg_depth"] <= tight.loc[("oracle", 1e-3), "avg_depth"]


def test_oracle_is_a_lower_bound_at_equal_worst_token_quality(model, windows):
    """On uniform trajectories every token of a rule ends within eps = its worst token's KL to the reference;
    the oracle at that eps exits each token no later, so its average depth is no larger."""
    x = windows[:, :-1]
    s0 = torch.randn(x.shape[0], x.shape[1], model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    stats = list(iterate_stats(model, x, 8, state=s0))
    logps = torch.stack([s.log_probs for s in stats])
    ref = logps[3]  # reference depth 4
    for tau in (1e-1, 1e-2, 1e-3):
        ex = offline_exits(stats, [KLThreshold(tau, max_loops=8)])[0]
        at_exit = logps.gather(0, (ex - 1)[None, ..., None].expand(1, *ex.shape, V))[0]
        eps = float(kl_successive(ref, at_exit).max())
        kl_by_loop = torch.stack([kl_successive(ref, logps[i]) for i in range(4)])
        oracle, _ = first_within(kl_by_loop, eps)
        assert (oracle <= ex.clamp(max=8)).all()
        assert oracle.float().mean() <= ex.float().mean()


def test_matching_depth_interpolates():
    s = pd.DataFrame({"family": "f", "param": [1.0, 2.0, 3.0], "avg_depth": [2.0, 4.0, 6.0],
                      "ce": [5.0, 4.0, 3.0], "kl_ref": [0.3, 0.2, 0.1]})
    m = matching_depth(s, "f", 3.5)
    assert m["grid"] == 6.0 and m["param"] == 3.0 and m["interpolated"] == pytest.approx(5.0)
    assert matching_depth(s, "f", 6.0)["interpolated"] == 2.0
    assert math.isnan(matching_depth(s, "f", 1.0)["grid"])
    assert matching_depth(s, "f", 0.2, quality="kl_ref")["grid"] == 4.0
    with pytest.raises(ValueError, match="family 'g' is not in the summary"):
        matching_depth(s, "g", 1.0)
    with pytest.raises(ValueError, match="quality='bpb' is not supported"):
        matching_depth(s, "f", 1.0, quality="bpb")


def test_calibrate_on_one_split_checks_the_other(frame):
    calib = summarize(frame, windows=[0, 1, 2], n_boot=20)
    held = summarize(frame, windows=[3, 4, 5], n_boot=20)
    uni8 = float(calib[(calib.family == "uniform") & (calib.param == 8)].ce.iloc[0])
    c = calibrate(calib, held, "kl", uni8 + 0.01)
    assert not math.isnan(c.param)
    row = held[(held.family == "kl") & (held.param == c.param)].iloc[0]
    assert c.heldout_depth == pytest.approx(row.avg_depth) and c.holds == (row.ce <= uni8 + 0.01)
    impossible = calibrate(calib, held, "kl", -1.0)
    assert math.isnan(impossible.param) and not impossible.holds
    # a relative target: judged against the held-out split's own baseline, not the calibration split's number
    held_uni8 = float(held[(held.family == "uniform") & (held.param == 8)].ce.iloc[0])
    rel = calibrate(calib, held, "kl", uni8 + 0.01, heldout_target=held_uni8 + 0.01)
    assert rel.param == c.param and rel.holds == (row.ce <= held_uni8 + 0.01)
    assert calibrate(calib, held, "kl", uni8 + 0.01, heldout_target=row.ce).holds
    assert not calibrate(calib, held, "kl", uni8 + 0.01, heldout_target=row.ce - 1e-6).holds


def test_window_clusters_and_summary_restriction(frame):
    docs = np.array([[0, 0, 1], [2, 2, 2], [1, 3, 3], [4, 4, 4], [5, 6, 6], [7, 7, 7]])
    cl = window_clusters(docs)
    assert cl.tolist() == [0, 2, 3, 4, 6, 7]
    s = summarize(frame, clusters=cl, n_boot=20)
    assert (s.n_windows == 6).all()
    with pytest.raises(ValueError, match="no rows left"):
        summarize(frame, windows=[99])
    with pytest.raises(ValueError, match="lacks columns"):
        summarize(frame.drop(columns="ce"))


def test_default_rules_and_bad_inputs(model, windows):
    specs = default_rules(max_loops=12)
    fams = {s.family for s in specs}
    assert fams == {"kl", "state_delta", "entropy_delta", "cosine", "argmax_patience", "confidence", "minp_kl",
                    "acceleration"}
    assert all(s.rule.max_loops == 12 for s in specs)
    with pytest.raises(ValueError, match="windows must be a non-empty"):
        sweep(model, windows[:0], specs)
    with pytest.raises(ValueError, match="rules must be RuleSpec"):
        sweep(model, windows, [Uniform(2)])
    with pytest.raises(ValueError, match="reference_loops=0 is invalid"):
        sweep(model, windows, specs, reference_loops=0)
    with pytest.raises(ValueError, match="mode='replay' is invalid"):
        sweep(model, windows, specs, mode="replay")


def test_offline_mode_replays_rules_on_one_trajectory(model, windows, frame):
    rules = [RuleSpec("kl", t, KLThreshold(t, max_loops=8)) for t in (1e-1, 1e-2, 1e-3, 1e-5)]
    rules.append(RuleSpec("never", 8, Never(max_loops=8)))
    off = sweep(model, windows, rules, reference_loops=4, batch_size=4, oracle_eps=(1e-1, 1e-3), mode="offline")
    key = ["family", "param", "window"]
    on = frame.set_index(key).sort_index()
    off = off.set_index(key).sort_index()
    assert on.index.equals(off.index)
    # uniform, oracle and never-halting rows are the same trajectory in both modes
    same = on.index.get_level_values("family").isin(["uniform", "oracle", "never"])
    np.testing.assert_allclose(off[same][["avg_depth", "ce", "kl_ref"]], on[same][["avg_depth", "ce", "kl_ref"]],
                               rtol=1e-5, atol=1e-7)
    # offline exits are offline_exits on the uniform trajectory, with quality read at the exit loop
    x = windows[:4, :-1]
    with torch.no_grad():
        gen = torch.Generator().manual_seed(EVAL_STATE_SEED)
        s0 = model.initial_state(model.embed(x), gen)
        (ex,) = offline_exits(iterate_stats(model, x, 8, state=s0), [rules[1].rule])
    assert off.loc[("kl", 1e-2, 0), "avg_depth"] == pytest.approx(ex[0].double().mean().item())
    varied = off.loc["kl"].avg_depth.groupby("param").mean()
    assert varied.nunique() > 1  # the thresholds really halt at different depths


def test_one_offline_pass_gives_the_sweep_and_the_token_exits(model, windows):
    """The pass a notebook keeps: its frame is sweep(mode="offline")'s row for row, its exits token_exits', and
    each rule row's avg_depth is the window's mean exit loop."""
    rules = [RuleSpec("kl", t, KLThreshold(t, max_loops=8)) for t in (1e-1, 1e-3)]
    rules.append(RuleSpec("never", 8, Never(max_loops=8)))
    op = offline_pass(model, windows, rules, reference_loops=4, batch_size=4)
    off = sweep(model, windows, rules, reference_loops=4, batch_size=4, oracle_eps=(1e-1, 1e-3), mode="offline")
    pd.testing.assert_frame_equal(op.frame(oracle_eps=(1e-1, 1e-3)), off)
    direct = token_exits(model, windows, rules, reference_loops=4, batch_size=4, oracle_eps=(1e-3,))
    kept = op.token_exits(oracle_eps=(1e-3,))
    assert kept.keys() == direct.keys() and "oracle(kl<=0.001)" in kept
    for name in direct:
        np.testing.assert_array_equal(kept[name], direct[name])
    rows = off[off.rule == str(rules[0].rule)].set_index("window").avg_depth
    np.testing.assert_allclose(rows.to_numpy(), kept[str(rules[0].rule)].mean(axis=1))
    with pytest.raises(DrcError, match="uniform_loops"):
        op.frame(uniform_loops=[9])


def test_reference_from_the_same_pass_equals_a_separate_reference_pass(model, windows, monkeypatch):
    """The offline pass reads the reference depth's output from its own pass (the earlier loops' log-probs wait for
    it): every per-loop CE, KL to the reference, argmax and exit equals the two-pass result bit for bit."""
    import drc_core.halting.sweep as sweep_module

    rules = [RuleSpec("kl", t, KLThreshold(t, max_loops=8)) for t in (1e-1, 1e-3)]
    one = offline_pass(model, windows, rules, reference_loops=4, batch_size=4)
    monkeypatch.setattr(sweep_module, "ONE_PASS_BYTES", 0)  # nothing fits: a separate depth-4 pass first
    two = offline_pass(model, windows, rules, reference_loops=4, batch_size=4)
    for a, b in ((one.ce, two.ce), (one.kl_ref, two.kl_ref), (one.argmax, two.argmax)):
        assert torch.equal(a, b)
    assert one.exits.keys() == two.exits.keys()
    assert all(torch.equal(one.exits[k], two.exits[k]) for k in one.exits)
    assert float(two.kl_ref[3].abs().max()) == 0.0  # the reference loop against itself


def test_offline_equals_online_for_one_token_windows(model):
    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, V, (8, 2), generator=g)  # T = 1: no earlier token whose freezing could matter
    rules = [RuleSpec("kl", t, KLThreshold(t, max_loops=8)) for t in (1e-1, 1e-2, 1e-3)]
    on = sweep(model, w, rules, reference_loops=4, batch_size=4)
    off = sweep(model, w, rules, reference_loops=4, batch_size=4, mode="offline")
    np.testing.assert_allclose(off[["avg_depth", "ce", "kl_ref"]], on[["avg_depth", "ce", "kl_ref"]], rtol=1e-5,
                               atol=1e-6)
    assert on.avg_depth.nunique() > 1


def test_notebook_tables(model, windows, frame):
    """matching_table, calibration_table and online_vs_offline: what notebook 4 shows, from the library."""
    s = summarize(frame, n_boot=50)
    ce4 = uniform_ce(s, 4)
    assert ce4 == float(s[(s.family == "uniform") & (s.param == 4)].ce.iloc[0])
    match = matching_table(s, 4, 0.01, 1e-3)
    assert set(match.index) == set(s.family)
    for fam in match.index:
        m = matching_depth(s, fam, ce4 + 0.01)
        got = match.loc[fam, "ce_depth"]
        assert got == m["grid"] or (math.isnan(m["grid"]) and math.isnan(got))
    assert match.loc["uniform", "ce_depth"] <= 4
    assert match.loc["uniform", "cut_vs_8_ce"] == pytest.approx(1 - match.loc["uniform", "ce_depth_interp"] / 4)
    calib, held = summarize(frame, windows=[0, 1, 2], n_boot=50), summarize(frame, windows=[3, 4, 5], n_boot=50)
    cal = calibration_table(calib, held, 4, 0.01, 1e-3, families=["kl"])
    assert list(cal.quality) == ["ce", "kl_ref"] and (cal.family == "kl").all()
    want = calibrate(calib, held, "kl", uniform_ce(calib, 4) + 0.01, heldout_target=uniform_ce(held, 4) + 0.01)
    assert cal.iloc[0].param == want.param and cal.iloc[0].heldout_target == uniform_ce(held, 4) + 0.01
    specs = [RuleSpec("kl", t, KLThreshold(t, max_loops=8)) for t in (1e-1, 1e-2, 1e-3, 1e-5)]
    online = online_vs_offline(model, windows, frame, specs, match, [1, 4], 4, seed=0, n_boot=20)
    assert list(online.family) == ["kl"]
    row = online.iloc[0]
    assert row.depth_diff == pytest.approx(row.avg_depth_online - row.avg_depth_offline)
    with pytest.raises(DrcError, match="no uniform"):
        uniform_ce(s, 99)


def test_matching_table_reproduces_the_reference_book():
    """From the held-out summary the reference notebook 4 saved, matching_table gives exactly its matching table."""
    path = Path(__file__).resolve().parents[1] / "papermill_runs/reference/results/04_halting_and_routers.json"
    r = json.loads(path.read_text())
    got = matching_table(pd.DataFrame(r["held_out_points"]), r["reference_loops"], r["ce_tolerance"], r["kl_target"])
    want = pd.DataFrame(r["matching"]).set_index("family")
    assert set(got.index) == set(want.index)
    for fam, row in want.iterrows():
        for col, value in row.items():
            mine = got.loc[fam, col]
            missing = value is None or (isinstance(value, float) and math.isnan(value))  # saved NaN is null
            assert (missing and math.isnan(mine)) or (not missing and mine == value), (fam, col)


def _synthetic_sweep(n_windows: int = 24, seed: int = 0) -> pd.DataFrame:
    """Per-window rows of a uniform curve (depth 1..8, CE falling to a plateau at 4) and a 'kl' family that
    reaches the plateau at fewer loops, with window-level noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for w in range(n_windows):
        base, noise = rng.normal(4.0, 0.2), rng.normal(0, 0.01, size=16)
        for d in range(1, 9):
            rows.append({"family": "uniform", "param": float(d), "rule": f"uniform({d})", "window": w,
                         "avg_depth": float(d), "ce": base + 0.5 * 2.0 ** (1 - d) + noise[d], "kl_ref": 0.0})
        for j, (t, d) in enumerate(((0.1, 1.5), (0.03, 2.2), (0.01, 2.9), (0.003, 3.6))):
            depth = d + rng.normal(0, 0.05)
            rows.append({"family": "kl", "param": t, "rule": f"kl<{t}", "window": w, "avg_depth": depth,
                         "ce": base + 0.5 * 2.0 ** (1 - 2.5 * depth) + noise[8 + j], "kl_ref": 0.0})
    return pd.DataFrame(rows)


def test_matching_gap_agrees_with_matching_table_and_brackets_it():
    frame = _synthetic_sweep()
    table = matching_table(summarize(frame, n_boot=1), 8, 0.005, 0.01)
    gap = matching_gap(frame, "kl", reference=8, ce_tolerance=0.005, n_boot=200, seed=1)
    assert gap["family_depth"][0] == pytest.approx(table.loc["kl", "ce_depth_interp"])
    assert gap["uniform_depth"][0] == pytest.approx(table.loc["uniform", "ce_depth_interp"])
    p, lo, hi = gap["saved"]
    assert p == pytest.approx(gap["uniform_depth"][0] - gap["family_depth"][0]) and p > 0
    assert lo < p < hi and gap["saved_frac"][0] == pytest.approx(p / gap["uniform_depth"][0])
    # clusters coarser than windows (pairs of windows): a valid, different resampling
    pairs = np.arange(24) // 2
    coarse = matching_gap(frame, "kl", reference=8, ce_tolerance=0.005, clusters=pairs, n_boot=200, seed=1)
    assert coarse["saved"][0] == pytest.approx(p) and coarse["saved"][1:] != gap["saved"][1:]


def test_matching_gap_names_a_missing_family():
    with pytest.raises(DrcError, match="family 'state_delta' is not in the frame"):
        matching_gap(_synthetic_sweep(4), "state_delta", reference=8, ce_tolerance=0.005, n_boot=10)


def test_every_training_free_family_is_calibrated():
    """Notebook 4's held-out calibration covers every family of the default sweep (the new rules included)
    and both routers."""
    from drc_core.halting.router import _KINDS

    families = list(dict.fromkeys(s.family for s in default_rules(8)))
    assert calibrated_families() == [*families, "router_linear", "router_mlp"]
    assert set(ROUTER_FAMILIES) == {f"router_{kind}" for kind in _KINDS}  # trained_router_specs' families

"""Risk-controlled halting thresholds (Learn then Test): p-values against scipy and exact computations, fixed-
sequence testing, a synthetic check where the true risk is known, and calibration on a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from drc_core.errors import DrcError
from drc_core.halting.calibrate import (
    family_specs,
    hb_pvalue,
    learn_then_test,
    loss_table,
    token_losses,
    unit_risks,
    validity,
)
from drc_core.halting.rules import RULE_FAMILIES


@pytest.mark.parametrize("n,r,alpha", [(50, 0.0, 0.1), (200, 0.05, 0.1), (30, 0.2, 0.1), (1000, 0.011, 0.02)])
def test_hb_pvalue_is_the_smaller_of_hoeffding_and_bentkus(n, r, alpha):
    a = min(r, alpha)
    h = (a * math.log(a / alpha) if a else 0.0) + (1 - a) * math.log((1 - a) / (1 - alpha))
    expected = min(math.exp(-n * h), math.e * sps.binom.cdf(math.ceil(n * r), n, alpha), 1.0)
    assert hb_pvalue(r, n, alpha) == pytest.approx(expected, rel=1e-12)


def test_hb_pvalue_small_cases_by_hand():
    # no violation among 50 units, alpha 0.1: Hoeffding's exp(-50 log(1/0.9)) = 0.9**50 beats e * 0.9**50
    assert hb_pvalue(0.0, 50, 0.1) == pytest.approx(0.9**50)
    assert hb_pvalue(0.5, 10, 0.1) == 1.0  # far above alpha: no evidence
    assert hb_pvalue(0.0, 10, 0.1) > 0.1  # ten units cannot certify 10% at delta 0.1


def test_hb_pvalue_is_valid_under_the_null():
    """Losses in [0, 1] with mean exactly alpha (the boundary of the null): P(p <= delta) <= delta."""
    rng = np.random.default_rng(0)
    alpha, n, delta = 0.1, 80, 0.1
    ps = [hb_pvalue(float(rng.beta(1, 9, size=n).mean()), n, alpha) for _ in range(4000)]
    assert np.mean(np.array(ps) <= delta) <= delta + 0.015


def test_fixed_sequence_stops_at_the_first_failure():
    losses = np.array([[0.0] * 100, [0.01] * 100, [0.5] * 100, [0.0] * 100])
    k, p = learn_then_test(losses, alpha=0.1, delta=0.1)
    assert k == 2 and p[2] > 0.1 and p[3] <= 0.1  # row 3 would pass alone but comes after a failure


def test_learn_then_test_controls_the_risk_on_a_synthetic_family():
    """Thresholds whose true per-unit risk grows along the sequence; over many calibration draws the chosen
    threshold's true risk exceeds alpha at most delta of the time."""
    rng = np.random.default_rng(1)
    true = np.linspace(0.0, 0.3, 16)  # true mean loss of each threshold, conservative first
    alpha, delta, n = 0.1, 0.1, 60
    bad = 0
    trials = 600
    for _ in range(trials):
        losses = rng.binomial(20, true[:, None], size=(16, n)) / 20  # a unit's share of 20 tokens
        k, _ = learn_then_test(losses, alpha, delta)
        if k and true[k - 1] > alpha:
            bad += 1
    assert bad / trials <= delta
    # and it is not vacuous: with this many units it certifies thresholds near alpha
    losses = rng.binomial(20, true[:, None], size=(16, 2000)) / 20
    k, _ = learn_then_test(losses, alpha, delta)
    assert true[k - 1] > 0.05


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(DrcError):
        learn_then_test(np.array([[1.5]]), 0.1, 0.1)
    with pytest.raises(DrcError):
        learn_then_test(np.zeros((2, 3)), 0.1, 1.0)
    with pytest.raises(DrcError):
        hb_pvalue(0.1, 10, 0.0)
    with pytest.raises(DrcError):
        family_specs("no_such_rule", 8, 4)


def test_token_losses_and_unit_risks():
    argmax = np.array([[[1, 2, 2, 2], [5, 5, 6, 6]]])  # (N=1, T=2, L=4)
    ce = np.array([[[3.0, 2.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.5]]])
    exits = np.array([[2, 1]])
    top1 = token_losses(argmax, ce, exits, reference_loops=3, risk="top1")
    assert top1.tolist() == [[False, True]]
    ce_loss = token_losses(argmax, ce, exits, reference_loops=3, risk="ce", tolerance=0.5)
    assert ce_loss.tolist() == [[True, False]]
    risks, ids = unit_risks(np.array([[[1.0, 0.0, 1.0, 1.0]]]).reshape(1, 2, 2), np.array([[0, 0], [7, -1]]))
    assert ids.tolist() == [0, 7] and risks.tolist() == [[0.5, 1.0]]


def test_grids_run_from_earliest_to_latest_halting(tiny_model_factory, one_thread):
    """The order Learn then Test relies on: along each registered grid the mean exit loop does not fall."""
    torch.manual_seed(0)
    model = tiny_model_factory(64, core_scale=3.0)
    windows = torch.randint(0, 64, (4, 17))
    units = np.repeat(np.arange(4), 16).reshape(4, 16)
    fams = [f for f, c in RULE_FAMILIES.items() if c.grid]
    table = loss_table(model, windows, units, fams, reference_loops=4, max_loops=8)
    for fam in fams:
        depth = table.loops[fam].mean(axis=1)  # conservative first: non-increasing
        assert (np.diff(depth) <= 1e-9).all(), fam
    assert table.risks["uniform"][0].max() == 0.0  # depth R against itself
    cert = table.certify("kl", alpha=0.5, delta=0.5)
    assert cert.n_units == 4 and "kl" in str(cert)


def test_validity_splits_and_a_given_split(tiny_model_factory, one_thread):
    torch.manual_seed(1)
    model = tiny_model_factory(64, core_scale=3.0)
    windows = torch.randint(0, 64, (8, 17))
    units = np.repeat(np.arange(8), 16).reshape(8, 16)
    table = loss_table(model, windows, units, ["kl"], reference_loops=4, max_loops=8)
    v = validity(table, "kl", [0.3, 0.6], delta=0.4, n_splits=5)
    assert len(v) == 10 and set(v.alpha) == {0.3, 0.6}
    certified = v[v.certified]
    assert (certified.violated == (certified.test_risk > certified.alpha)).all()
    one = validity(table, "kl", [0.6], delta=0.4, calib=np.arange(4), test=np.arange(4, 8))
    assert len(one) == 1
    some = validity(table, "kl", [0.6], delta=0.4, n_splits=3, among=np.array([1, 3, 5, 7]))
    assert (some.n_calib == 2).all() and (some.n_test == 2).all()
    with pytest.raises(DrcError, match="among"):
        validity(table, "kl", [0.6], delta=0.4, among=np.array([1, 8]))


def test_the_loss_pass_agrees_with_the_measurement(tiny_model_factory, one_thread):
    """The offline pass the loss tables read (argmax and CE per loop) sees the trajectories every evaluation pass
    sees."""
    from drc_core.analysis.measure import measure_windows
    from drc_core.halting.sweep import offline_pass

    torch.manual_seed(2)
    model = tiny_model_factory(64, core_scale=3.0)
    windows = torch.randint(0, 64, (5, 9))
    passed = offline_pass(model, windows, [], reference_loops=3, loops=6, batch_size=2, seed=7)
    meas = measure_windows(model, windows, 6, batch_size=2, seed=7, kl_to_final=False)
    argmax, ce = passed.argmax.permute(1, 2, 0).numpy(), passed.ce.permute(1, 2, 0).numpy()
    assert (argmax == meas.stats["argmax"].reshape(5, 8, 6)).all()
    np.testing.assert_allclose(ce, meas.stats["ce"].reshape(5, 8, 6), rtol=1e-5, atol=1e-6)


def test_loss_tables_from_a_sweeps_pass_equal_their_own_pass(tiny_model_factory, one_thread):
    """A notebook's offline pass of default_rules gives the loss tables loss_tables computes itself; joined passes
    give the tables of their windows together; a pass without the family's thresholds is refused."""
    from drc_core.halting.calibrate import loss_tables, pass_loss_tables
    from drc_core.halting.sweep import OfflinePass, default_rules, offline_pass

    torch.manual_seed(3)
    model = tiny_model_factory(64, core_scale=3.0)
    windows = torch.randint(0, 64, (6, 13))
    units = np.repeat(np.arange(6), 12).reshape(6, 12)
    own = loss_tables(model, windows, units, ["kl", "state_delta"], reference_loops=4, max_loops=8)
    passed = offline_pass(model, windows, default_rules(8), reference_loops=4)
    from_pass = pass_loss_tables(passed, units, ["kl", "state_delta"])
    # each pass draws its own initial states: the second part equals that part measured alone
    second = offline_pass(model, windows[4:], default_rules(8), reference_loops=4)
    joined = OfflinePass.cat([offline_pass(model, windows[:4], default_rules(8), reference_loops=4), second])
    from_joined = pass_loss_tables(joined, units, ["kl", "state_delta"])
    alone = pass_loss_tables(second, units[4:] - 4, ["kl", "state_delta"])
    for risk in own:
        for fam in ("kl", "state_delta", "uniform"):
            np.testing.assert_array_equal(from_pass[risk].risks[fam], own[risk].risks[fam])
            np.testing.assert_array_equal(from_pass[risk].loops[fam], own[risk].loops[fam])
            np.testing.assert_array_equal(from_joined[risk].risks[fam][:, :4], own[risk].risks[fam][:, :4])
            np.testing.assert_array_equal(from_joined[risk].risks[fam][:, 4:], alone[risk].risks[fam])
    with pytest.raises(DrcError, match="did not replay"):
        pass_loss_tables(offline_pass(model, windows, default_rules(8)[:2], reference_loops=4), units, ["kl"])


@pytest.mark.parametrize("alpha,delta", [(0.1, 0.1), (0.05, 0.1), (0.01, 0.1), (0.2, 0.05)])
def test_min_units_is_the_first_n_that_can_certify(alpha, delta):
    from drc_core.halting.calibrate import min_units

    n = min_units(alpha, delta)
    assert hb_pvalue(0.0, n, alpha) <= delta < hb_pvalue(0.0, n - 1, alpha) if n > 1 else True
    k, _ = learn_then_test(np.zeros((1, n - 1)), alpha, delta)
    assert k == 0  # one unit fewer: not even a zero-risk threshold
    assert min_units(0.1, 0.1) == 22 and min_units(0.05, 0.1) == 45


def test_validity_summary_counts_violations_with_their_error():
    import pandas as pd

    from drc_core.halting.calibrate import validity_summary

    rows = pd.DataFrame({"family": "kl", "alpha": 0.1, "split": range(10), "n_calib": 20, "n_test": 20,
                         "certified": [True] * 8 + [False] * 2, "threshold": 0.01, "uniform_depth": 4.0,
                         "test_risk": [0.05] * 6 + [0.2] * 2 + [np.nan] * 2,
                         "violated": [False] * 6 + [True] * 2 + [False] * 2, "loops": 3.0, "saved_frac": 0.25})
    s = validity_summary(rows, delta=0.1).iloc[0]
    assert s.splits == 10 and s.certified == 0.8 and s.violation == 0.2
    assert s.violation_se == pytest.approx(math.sqrt(0.2 * 0.8 / 10))
    assert s.violation_lo == pytest.approx(sps.beta.ppf(0.025, 2, 9)) and s.violation_hi > 0.2
    assert s.kept and s.loops == 3.0 and s.saved_frac == 0.25 and s.test_risk == pytest.approx(0.0875)


def test_loss_tables_share_one_pass(tiny_model_factory, one_thread):
    from drc_core.halting.calibrate import loss_tables

    torch.manual_seed(3)
    model = tiny_model_factory(64, core_scale=3.0)
    windows = torch.randint(0, 64, (4, 13))
    units = np.repeat(np.arange(4), 12).reshape(4, 12)
    both = loss_tables(model, windows, units, ["kl"], reference_loops=4, max_loops=8, tolerance=0.1)
    for risk in ("top1", "ce"):
        one = loss_table(model, windows, units, ["kl"], risk=risk, reference_loops=4, max_loops=8, tolerance=0.1)
        np.testing.assert_array_equal(both[risk].risks["kl"], one.risks["kl"])
        np.testing.assert_array_equal(both[risk].loops["kl"], one.loops["kl"])
    assert both["ce"].risk == "ce" and both["top1"].units.tolist() == [0, 1, 2, 3]

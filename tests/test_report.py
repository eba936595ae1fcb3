"""The reproduction report's pieces (drc_book/report.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from drc_book.handoff import Convergence, Cycles, Halting, Interval
from drc_book.report import (
    PAPER,
    across_seeds,
    headline_numbers,
    lever_effects,
    plateau_depth,
    reference_targets,
    reproduction_table,
    scale_table,
)
from drc_core.analysis.tokens import TokenClass
from drc_core.data.tokenizer import train_bpe
from drc_core.errors import DrcError


def test_plateau_depth():
    loss = {1: 5.0, 2: 4.6, 4: 4.51, 8: 4.505, 16: 4.504, 32: 4.504}
    assert plateau_depth(loss, tol=0.01) == 4
    assert plateau_depth(loss, tol=0.0) == 16
    # a loss that gets worse with depth plateaus where it is lowest
    assert plateau_depth({1: 5.0, 4: 4.0, 8: 4.2, 16: 4.5}, tol=0.0) == 4
    with pytest.raises(ValueError, match="loss_by_loops is empty"):
        plateau_depth({})


def test_across_seeds_t_interval():
    seeds = [{"a": 1.0, "b": 10.0, "order": ["x"]}, {"a": 2.0, "b": 10.0, "order": ["y"]},
             {"a": 3.0, "b": 10.0, "order": ["x"]}]
    t = across_seeds(seeds)
    assert list(t.index) == ["a", "b"]  # non-numeric keys are left out
    assert t.loc["a", "mean"] == 2.0 and t.loc["a", "std"] == pytest.approx(1.0)
    half = 4.302652729911275 / math.sqrt(3)  # t_{0.975, 2}
    assert t.loc["a", "lo"] == pytest.approx(2.0 - half) and t.loc["a", "hi"] == pytest.approx(2.0 + half)
    assert t.loc["b", "lo"] == t.loc["b", "hi"] == 10.0
    assert math.isnan(across_seeds(seeds[:1]).loc["a", "lo"])
    with pytest.raises(ValueError, match="per_seed is empty"):
        across_seeds([])


PAPER_LIKE = {"kl_2": 0.39, "kl_16": 8.5e-6, "median_depth": 6, "frac_updating": 0.1,
              "class_order": ["whitespace", "punctuation", "function", "content"], "kl_rule_depth": 4.94,
              "router_depth": 7.9, "ce_1": 3.8, "ce_8": 3.2, "ce_max": 3.2}


def test_reproduction_table_agrees_with_the_paper_itself():
    table = reproduction_table(PAPER_LIKE)
    assert len(table) == len(PAPER)
    assert (table.verdict == "agree").all(), table[table.verdict != "agree"]


@pytest.mark.parametrize(("key", "value"), [
    ("kl_2", 0.01), ("kl_16", 1e-3), ("median_depth", 9), ("frac_updating", 0.5),
    ("class_order", ["content", "whitespace"]), ("kl_rule_depth", 7.5), ("router_depth", 3.0), ("ce_max", 3.5),
])
def test_each_claim_can_differ(key, value):
    ours = {**PAPER_LIKE, key: value}
    table = reproduction_table(ours, notes={"kl_2": "scale"}).set_index("claim")
    verdicts = dict(zip([c.key for c in PAPER], table.verdict, strict=True))
    claim_key = {"router_depth": "router", "ce_max": "ce_curve"}.get(key, key)
    assert verdicts[claim_key] == "differ"
    assert sum(v == "differ" for v in verdicts.values()) == 1
    assert table.why.iloc[0] == "scale"


def test_seed_column_formats_intervals():
    seeds = across_seeds([PAPER_LIKE, {**PAPER_LIKE, "kl_2": 0.5}, {**PAPER_LIKE, "kl_2": 0.3}])
    table = reproduction_table(PAPER_LIKE, seeds)
    assert table["across seeds (small preset)"].iloc[0].endswith("(n=3)")


def test_headline_numbers_on_a_tiny_model(one_thread, tiny_model_factory, tmp_path):
    texts = ["The cat sat on the mat, and 42 dogs ran.\n", "A bird sang in the tree; it was 7 am.\n"] * 20
    tok = train_bpe(texts, vocab_size=300)
    model = tiny_model_factory(300, core_scale=2.0).eval()
    ids = torch.tensor(tok.encode("".join(texts)).ids[: 4 * 17]).view(4, 17)
    h = headline_numbers(model, ids, tok, max_loops=8, reference_loops=4, rule_max_loops=8)
    for k in ("ce_1", "ce_8", "ce_max", "kl_2", "kl_16", "median_depth", "frac_updating", "kl_rule_depth",
              "uniform_depth"):
        assert isinstance(h[k], float), k
    assert h["kl_2"] > h["kl_16"] >= 0
    assert 1 <= h["median_depth"] <= 8 and 0 <= h["frac_updating"] <= 1
    assert h["uniform_depth"] <= 4 + 1e-9  # uniform depth 4 meets its own CE
    assert set(h["class_order"]) <= {c.value for c in TokenClass}


def test_table_intervals_and_explanations():
    from drc_book.report import explain

    ours = {"kl_2": 0.2, "kl_16": 2e-5, "median_depth": 4.0, "frac_updating": 0.03,
            "class_order": ["whitespace/newline", "content word"], "kl_rule_depth": 3.6, "router_depth": 7.0,
            "uniform_depth": 3.8, "oracle_depth": 3.0, "ce_1": 4.7, "ce_8": 4.5, "ce_max": 4.5,
            "kl_end_same_parity": 1e-5, "kl_end_other_parity": 6e-5}
    notes = explain(ours, "6.5M-parameter")
    assert set(notes) == {c.key for c in PAPER}
    assert "2-cycle" in notes["kl_16"] and "0.20 nats" in notes["ce_curve"]
    t = reproduction_table(ours, notes=notes, intervals={"kl_2": (0.18, 0.22), "frac_updating": (0.02, 0.04)})
    row = t.set_index("claim").loc["mean successive KL at loop 2"]
    assert row.ours == "0.2 [0.18, 0.22]" and row.why == notes["kl_2"]
    assert t.set_index("claim").loc["fraction of tokens still updating at depth 8"].ours == "3.0% [2.0%, 4.0%]"


def test_class_order_verdict_leaves_out_special_tokens() -> None:
    from drc_book.report import _verdict

    text, ok = _verdict("class_order", {"class_order": ["special", "whitespace", "function", "content"]})
    assert ok and text == "whitespace < function < content"
    _, ok = _verdict("class_order", {"class_order": ["special", "whitespace", "content", "continuation"]})
    assert not ok


def test_depth_curve_and_its_plateau_row():
    from drc_book.report import depth_curve

    loss = {1: 4.0, 2: 3.5, 3: 3.3, 4: 3.301, 5: 3.302, 6: 3.299}
    curve, row = depth_curve(loss, 4, tol=0.005)
    assert curve.loops.tolist() == [1, 2, 3, 4, 5, 6] and curve.loss.tolist() == list(loss.values())
    assert (curve.series == "mean 4").all()
    assert row == {"train_mean_depth": 4, "plateau_depth": 3, "ce_1": 4.0, "ce_at_mean": 3.301, "ce_max": 3.299,
                   "best_depth": 6, "best_ce": 3.299}


def _records(ce1: float, ce8: float, kl16: float, uniform: float, kl_rule: float):
    iv = lambda v: Interval(v, v - 0.01, v + 0.01)  # noqa: E731
    conv = Convergence(profile="test", eps=1e-3, train_mean_depth=8.0, n_tokens=100, n_docs=10,
                       kl_by_loop={2: iv(0.1), 16: iv(kl16)}, state_delta_by_loop={}, kl_final_by_loop={},
                       ce_by_loop={1: iv(ce1), 8: iv(ce8)}, median_depth=iv(4), mean_depth=iv(4.5),
                       frac_updating=iv(0.05), frac_unconverged=iv(0.01), kl_concentration={},
                       oscillating=Cycles(count=3, share_of_mean_kl={16: 0.9}, tokens=[]), eps_sensitivity={},
                       dynamics={}, notebook_seconds=1.0)
    gap = {"family": "kl"}
    for k, v in (("family_depth", kl_rule), ("uniform_depth", uniform), ("saved", uniform - kl_rule),
                 ("saved_frac", 1 - kl_rule / uniform)):
        gap.update({k: v, f"{k}_lo": v - 0.01, f"{k}_hi": v + 0.01})
    matching = [{"family": "uniform", "ce_depth_interp": uniform}, {"family": "kl", "ce_depth_interp": kl_rule}]
    return conv, Halting(profile="test", reference_loops=8, rule_max_loops=16, ce_tolerance=0.005, kl_target=0.01,
                         ce_uniform_ref=ce8, matching=matching, gaps=[gap], calibration=[], held_out_points=[],
                         n_windows={}, online_check=[], risk_control={}, notebook_seconds=1.0)


def test_reference_targets_are_met_or_not_by_their_stated_thresholds():
    good = reference_targets(*_records(4.2, 3.8, 8e-6, 5.0, 3.5), previous_ce=3.957)
    assert good.met.tolist() == ["yes", "yes", "yes", "yes", "—"]
    assert "3 tokens in a 2-cycle carry 90% of it" in good.measured[3]
    assert "saves 1.50 [1.49, 1.51] loops, 30%" in good.measured[4]
    bad = reference_targets(*_records(4.0, 3.9, 2e-5, 3.2, 3.0), previous_ce=3.957)
    assert bad.met.tolist() == ["no", "no", "no", "no", "—"]
    assert bad.criterion[1].startswith("CE(R) ≤ 3.857")


def test_scale_table_reads_the_shipped_grid():
    root = Path(__file__).resolve().parents[1] / "data" / "scale"
    table = scale_table(root)
    s = json.loads((root / "d256-m8" / "summary.json").read_text())
    row = table.loc["d256-m8"]
    assert (row.d, row.R, row.k) == (256, 8, 4)
    assert row["CE(1)-CE(R)"] == pytest.approx(s["ce"]["1"] - s["ce"]["8"])
    assert row.uniform_match == s["uniform_match_R"] and row["KL@2R"] == s["kl"]["16"]
    assert row["train CE(1)-CE(R)"] == pytest.approx(s["ce_train"]["1"] - s["ce_train"]["8"])


def test_scale_table_says_when_there_is_nothing(tmp_path):
    with pytest.raises(DrcError, match="no runs under .*scripts/depth_scale.py"):
        scale_table(tmp_path)


def test_lever_effects_are_differences_of_the_grid_rows():
    grid = scale_table(Path(__file__).resolve().parents[1] / "data" / "scale")
    fx = lever_effects(grid)
    row = fx.loc["tokens x1 -> x5 (the reference)"]
    a, b = grid.loc["d256-m8"], grid.loc["cpu-ref"]
    assert row["d CE@R"] == pytest.approx(b["CE@R"] - a["CE@R"]) and row["gain"] == b["CE(1)-CE(R)"]
    assert row["d gain"] == pytest.approx(b["CE(1)-CE(R)"] - a["CE(1)-CE(R)"])
    # the gain grew (0.09 -> 0.17) and the deep model improved by more than that: share > 1
    assert row["deep share"] == pytest.approx(-row["d CE@R"] / row["d gain"]) and row["deep share"] > 1
    # the backprop lever lowered the gain: no share
    assert math.isnan(fx.loc["backprop 4 -> 8 loops", "deep share"])
    # a lever whose runs are not both in the grid is left out; none at all is one clear error
    assert "made-up" not in fx.index
    fx2 = lever_effects(grid, [("made-up", "d256-m8", "no-such-run"), ("width", "d128-m8", "d256-m8")])
    assert list(fx2.index) == ["width"]
    with pytest.raises(DrcError, match="SCALE_LEVERS"):
        lever_effects(grid, [("made-up", "d256-m8", "no-such-run")])

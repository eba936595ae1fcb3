"""The registry of halting-rule families: today's names, grids and order pinned, so that deriving them from one
place changes no number."""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch

import drc_core
from drc_book.speed import SpeedConfig
from drc_core.errors import DrcError
from drc_core.halting.rules import (
    RULE_FAMILIES,
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
    make_rule,
    rule_classes,
    unregister_rule,
)
from drc_core.halting.sweep import (
    RuleSpec,
    calibrated_families,
    calibration_table,
    default_families,
    default_rules,
)

ROOT = Path(__file__).resolve().parents[1]
README_LINE = "Rule families (drc_core.RULE_FAMILIES): "

HALF_DECADES = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5]
# default_rules as it was written out by hand before the registry: family, class and grid, in this order
PINNED_GRIDS = [
    ("kl", KLThreshold, HALF_DECADES),
    ("state_delta", StateDelta, [3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]),
    ("entropy_delta", EntropyDelta, HALF_DECADES),
    ("cosine", Cosine, [0.9, 0.99, 0.999, 0.9999, 0.99999]),
    ("argmax_patience", ArgmaxPatience, [1, 2, 3, 4, 6]),
    ("confidence", SoftmaxConfidence, [0.3, 0.5, 0.7, 0.9, 0.95, 0.99]),
    ("minp_kl", MinPKL, [*HALF_DECADES, 3e-6, 1e-6]),
    ("acceleration", Acceleration, [3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4]),
]
PINNED_FAMILIES = {
    "kl": KLThreshold,
    "state_delta": StateDelta,
    "entropy_delta": EntropyDelta,
    "cosine": Cosine,
    "argmax_patience": ArgmaxPatience,
    "confidence": SoftmaxConfidence,
    "minp_kl": MinPKL,
    "acceleration": Acceleration,
    "uniform": Uniform,
    "never": Never,
}


@pytest.mark.parametrize("kw", [{}, {"max_loops": 12}, {"max_loops": 32, "min_loops": 3}])
def test_default_rules_are_pinned(kw):
    pinned = [RuleSpec(fam, p, cls(p, max_loops=kw.get("max_loops", 16), min_loops=kw.get("min_loops", 1)))
              for fam, cls, grid in PINNED_GRIDS for p in grid]
    got = default_rules(**kw)
    assert len(got) == 60
    assert [repr(s) for s in got] == [repr(s) for s in pinned]  # families, params (and their types), order
    assert got == pinned


def test_rule_families_are_pinned():
    assert list(RULE_FAMILIES) == list(PINNED_FAMILIES)
    assert RULE_FAMILIES == PINNED_FAMILIES
    assert make_rule("kl", 1e-3, max_loops=16) == KLThreshold(1e-3, max_loops=16)
    assert make_rule("argmax_patience", 3, min_loops=2) == ArgmaxPatience(3, min_loops=2)
    assert make_rule("uniform", 4) == Uniform(4)
    assert make_rule("never", max_loops=8) == Never(max_loops=8)
    assert make_rule("minp_kl", 1e-5) == MinPKL(1e-5)
    assert make_rule("acceleration", tau=0.01) == Acceleration(0.01)


def test_every_rule_class_is_exported():
    names = ["KLThreshold", "StateDelta", "EntropyDelta", "Cosine", "ArgmaxPatience", "SoftmaxConfidence", "MinPKL",
             "Acceleration", "Uniform", "Never", "Oracle"]
    assert list(rule_classes()) == names
    for name in names:
        assert getattr(drc_core, name) is rule_classes()[name]
        assert name in drc_core.__all__ and name in dir(drc_core)
    assert Oracle.family == "oracle" and "oracle" not in RULE_FAMILIES  # exported, not built by name
    with pytest.raises(DrcError, match="unknown halting rule 'oracle'"):
        make_rule("oracle")


def _bench_module():
    spec = importlib.util.spec_from_file_location("adaptive_speed", ROOT / "bench" / "adaptive_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_rule_defined_in_one_place_is_found_everywhere():
    pinned = default_rules(12)

    @dataclass
    class TopTwoGap(HaltingRule):  # the one place: the class, its short name and its grid
        """Halt once the top probability reaches ``tau`` (a stand-in for a new rule)."""

        family, grid = "test_top_gap", (0.25, 0.75)
        tau: float
        reads = frozenset({"top_prob"})

        def criterion(self, stats):
            return stats.top_prob >= self.tau

    try:
        assert list(RULE_FAMILIES)[-1] == "test_top_gap" and RULE_FAMILIES["test_top_gap"] is TopTwoGap
        assert make_rule("test_top_gap", 0.5, max_loops=8) == TopTwoGap(0.5, max_loops=8)
        specs = default_rules(12)
        assert specs[:-2] == pinned
        assert [(s.family, s.param, s.rule) for s in specs[-2:]] == [
            ("test_top_gap", p, TopTwoGap(p, max_loops=12)) for p in (0.25, 0.75)]
        assert default_families()[-1] == "test_top_gap" and "test_top_gap" in calibrated_families()
        assert drc_core.TopTwoGap is TopTwoGap and "TopTwoGap" in drc_core.__all__
        assert SpeedConfig(families=("test_top_gap",)).families == ("test_top_gap",)  # notebook 5 / the bench
        args = _bench_module().build_parser().parse_args([])
        assert args.families.split(",") == default_families()
    finally:
        unregister_rule("test_top_gap")
    assert "test_top_gap" not in RULE_FAMILIES and "test_top_gap" not in default_families()
    assert not hasattr(drc_core, "TopTwoGap") and "TopTwoGap" not in drc_core.__all__
    assert default_rules(12) == pinned


def test_registry_rejects_a_taken_or_bad_name():
    with pytest.raises(DrcError, match="family of drc_core.halting.rules.KLThreshold"):

        class AnotherKL(HaltingRule):
            family = "kl"

    with pytest.raises(DrcError, match="is invalid"):

        class BadName(HaltingRule):
            family = "Bad Name"

    with pytest.raises(DrcError, match="grid"):

        class BadGrid(HaltingRule):
            family, grid = "test_bad_grid", [0.1]

    with pytest.raises(DrcError, match="no halting rule is registered"):
        unregister_rule("test_nothing")
    assert list(RULE_FAMILIES)[-1] == "never"

    class Unnamed(KLThreshold):  # no family of its own: a variant, not registered
        pass

    assert "Unnamed" not in rule_classes() and RULE_FAMILIES["kl"] is KLThreshold


def test_calibration_table_defaults_to_the_calibrated_families():
    frames = []
    for fam in [*calibrated_families(), "uniform"]:
        frames.append({"family": fam, "param": 8.0 if fam == "uniform" else 0.1, "rule": fam, "avg_depth": 4.0,
                       "ce": 3.0, "ce_lo": 2.9, "ce_hi": 3.1, "kl_ref": 1e-3, "kl_ref_lo": 0, "kl_ref_hi": 2e-3})
    summary = pd.DataFrame(frames)
    table = calibration_table(summary, summary, 8, 0.01, 1e-2)
    assert list(dict.fromkeys(table.family)) == calibrated_families()


def test_readme_lists_every_rule_family():
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith(README_LINE)]
    assert len(lines) == 1, f"README.md has no (single) line starting with {README_LINE!r}"
    assert re.findall(r"`([^`]+)`", lines[0]) == list(drc_core.RULE_FAMILIES)


def test_oracle_rule_still_replays_exits():
    rule = Oracle(exit_loops=torch.tensor([[1, 2]]), max_loops=2)
    assert rule.avg_depth == 1.5 and rule.name == "oracle"


# ----------------------------------------------------------------------------------------------------------
# Rule and family lists come from the registry: no literal collection of family names outside it

_ROOT = Path(__file__).resolve().parents[1]
# the registry itself, and the statistics modules (their statistics share names with the rules built on them)
_NAMES_ALLOWED_IN = {"drc_core/halting/rules.py", "drc_core/analysis/loops.py", "drc_core/halting/loopstats.py"}


def literal_family_lists(root: Path, dirs: tuple[str, ...] = ("drc_core", "drc_book", "book", "scripts", "bench")
                         ) -> list[str]:
    """Tuples, lists, sets and dict key sets written as two or more string literals that are all rule or router
    families (as the registry names them), in every .py under ``dirs`` but the registry and statistics modules."""
    from drc_core.halting.sweep import ROUTER_FAMILIES

    families = {cls.family for cls in rule_classes().values()} | set(ROUTER_FAMILIES)
    found = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel in _NAMES_ALLOWED_IN:
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                elts = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else (
                    node.keys if isinstance(node, ast.Dict) else None)
                if not elts or len(elts) < 2:
                    continue
                if all(isinstance(e, ast.Constant) and e.value in families for e in elts):
                    found.append(f"{rel}:{node.lineno}: {[e.value for e in elts]}")
    return found


def test_no_hand_typed_list_of_rule_families() -> None:
    assert literal_family_lists(_ROOT) == []


def test_family_list_check_sees_each_form(tmp_path: Path) -> None:
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "n.py").write_text('a = ("kl", "cosine")\nb = {"oracle": 1, "router_mlp": 2}\n'
                                            'c = ["kl", "loop"]\nd = ("kl",)\n')
    assert literal_family_lists(tmp_path, ("book",)) == [
        "book/n.py:1: ['kl', 'cosine']", "book/n.py:2: ['oracle', 'router_mlp']"]


def test_family_titles_and_state_families() -> None:
    assert drc_core.family_title("state_delta") == "state change" and drc_core.family_title("kl") == "KL"
    assert drc_core.family_title("router_mlp") == "MLP router"
    assert drc_core.family_title("argmax_patience") == "argmax patience"  # no title: the family, spaced
    # the state families are exactly the swept rules that read no readout statistic
    for fam in drc_core.default_families():
        rule = drc_core.RULE_FAMILIES[fam](drc_core.RULE_FAMILIES[fam].grid[0])
        assert (fam in drc_core.state_families()) == (not rule.needs_log_probs)
    assert drc_core.state_families() == ["state_delta", "cosine", "acceleration"]

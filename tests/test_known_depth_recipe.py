"""scripts/known_depth_recipe.py's plans and its budget: the last stage's step cap is what is left of the budget at
the slowest earlier stage's seconds per step, fixed once written, and a spent budget is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drc_core.errors import DrcError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe(script):
    return script("known_depth_recipe")


def test_plans_end_with_one_decaying_stage_and_distinct_names(recipe):
    for name, stages in recipe.PLANS.items():
        assert [s.decay for s in stages] == [False] * (len(stages) - 1) + [True], name
        assert len({s.name for s in stages}) == len(stages), name
        assert all(s.first_probe <= s.cap for s in stages), name


def test_budget_cap(recipe, tmp_path):
    last = recipe.PLANS["long-k2"][-1]
    records = [{"train_wall_s": 600.0, "step": 1000}, {"train_wall_s": 1200.0, "step": 1000}]  # 0.6, 1.2 s/step
    st = recipe.budget_cap(last, tmp_path / "k3", records, 60.0)
    assert st.cap == 1500  # (3600 - 1800) s / 1.2 s per step, a multiple of the preset's checkpoint interval (250)
    assert st.name == last.name and st.lr == last.lr
    # fixed once written: a resumed driver keeps the cap whatever the records now say
    assert recipe.budget_cap(last, tmp_path / "k3", [{"train_wall_s": 3000.0, "step": 10}], 60.0).cap == 1500
    assert json.loads((tmp_path / "k3" / "cap.json").read_text())["s_per_step"] == pytest.approx(1.2)
    # never above the stage's own cap; no budget or no earlier stage: the stage as declared
    assert recipe.budget_cap(last, tmp_path / "a", records, 1000.0).cap == last.cap
    assert recipe.budget_cap(last, tmp_path / "b", records, None) == last
    assert recipe.budget_cap(last, tmp_path / "c", [], 60.0) == last
    with pytest.raises(DrcError, match="raise --budget-min"):
        recipe.budget_cap(last, tmp_path / "d", records, 31.0)
    assert not (tmp_path / "d").exists()


def test_train_command_carries_the_stage_settings(recipe, tmp_path):
    copy2 = recipe.PLANS["shallow-copy"][0]
    cmd = recipe.train_command(copy2, tmp_path / "corpus", tmp_path / "run", tmp_path / "init")
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert "recurrence.mean=2.0" in sets and "recurrence.backprop_loops=2" in sets and "min_lr_ratio=1.0" in sets
    assert cmd[-2:] == ["--init", str(tmp_path / "init")]
    last = recipe.PLANS["copy-first"][-1]  # the preset's depth, a decaying rate, from random weights
    cmd = recipe.train_command(last, tmp_path / "corpus", tmp_path / "run", None)
    assert not any(a.startswith("recurrence.") for a in cmd) and "min_lr_ratio=0.1" in cmd and "--init" not in cmd


def test_skill_accuracy_reads_each_k_at_the_probed_loops(recipe, one_thread):
    """The probe's numbers: accuracy per k at the asked loops only, each a share of that k's answers."""
    from tokenizers import Tokenizer

    from drc_book.known_depth import generated_task_windows
    from drc_core import DepthRecurrentLM, DepthTaskConfig, ModelConfig

    tok = Tokenizer.from_file(str(ROOT / "data" / "depth-tasks" / "tokenizer.json"))
    tw = generated_task_windows(tok, DepthTaskConfig(docs=6, min_k=1, max_k=3), 128, 0)
    torch.manual_seed(0)
    model = DepthRecurrentLM(ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_heads=2, n_prelude=1,
                                         n_core=1, n_coda=1, max_seq_len=128)).eval()
    by = recipe.skill_accuracy(model, tw, [1, 4])
    assert set(by) == {f"k{k}" for k in sorted(set(tw.answers.k))}
    assert all(set(v) == {1, 4} and all(0.0 <= a <= 1.0 for a in v.values()) for v in by.values())


@pytest.mark.parametrize("stop", [True, False])
def test_a_stage_stops_at_its_target_only_when_asked(recipe, tmp_path, monkeypatch, stop):
    """Both checkpoints meet the target: a stage that stops at it ends at the first; one trained to its cap (the
    task-only plan, whose extrapolation may come after a long phase past the target) probes both and ends at the
    last. The corpus is prepared from the stage's own sources."""
    import sys
    from dataclasses import replace

    stage = replace(recipe.PLANS["task-only"][0], stop_at_target=stop)
    assert recipe.PLANS["task-only"][0].source == "depth-tasks" and not recipe.PLANS["task-only"][0].stop_at_target
    prepared = []
    monkeypatch.setattr(recipe.subprocess, "run", lambda cmd, **kw: prepared.append(cmd))
    monkeypatch.setattr(recipe, "train_command", lambda *a: [sys.executable, "-c", "pass"])
    monkeypatch.setattr(recipe.time, "sleep", lambda s: None)  # the driver's wait for the trainer
    run = tmp_path / "out" / stage.name / "run"
    monkeypatch.setattr(recipe, "checkpoints", lambda r: [run / "step-500", run / "step-750"])
    probed = []
    monkeypatch.setattr(recipe.Driver, "probe", lambda self, st, ckpt, corpus: probed.append(ckpt.name) or
                        {"checkpoint": str(ckpt), "met": True, "accuracy": {}})
    rec = recipe.Driver(tmp_path / "out", 1).run_stage(stage, None)
    assert prepared[0][prepared[0].index("--source") + 1] == "depth-tasks"
    assert probed == (["step-500"] if stop else ["step-500", "step-750"])
    assert rec["step"] == (500 if stop else 750) and rec["met"]

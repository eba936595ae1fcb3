"""One reader of run directories: a training run, its final/ and a shipped copy open the same way; the evaluate CLI
takes its windows' length from the run, never from a default, and a bad checkpoint is one error line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError, run_cli
from drc_core.model.lm import DepthRecurrentLM
from drc_core.training.config import apply_overrides, preset
from drc_core.training.evaluate import main as evaluate_main
from drc_core.training.rundir import corpus_record, open_run


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    """A training run R (config.json = TrainConfig, metrics, final/), and a shipped copy of it."""
    root = tmp_path_factory.mktemp("runs")
    cfg = apply_overrides(preset("tiny"), ["seq_len=24", "model.max_seq_len=32"])
    torch.manual_seed(0)
    run = root / "run"
    DepthRecurrentLM(cfg.model).save(run / "final")
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 6.0, "seconds": 1.0}\n')
    shipped = root / "shipped"
    shutil.copytree(run / "final", shipped)
    shutil.copy2(run / "config.json", shipped / "train_config.json")
    shutil.copy2(run / "metrics.jsonl", shipped)
    bare = root / "bare"
    shutil.copytree(run / "final", bare)
    return {"run": run, "final": run / "final", "shipped": shipped, "bare": bare}


def test_run_final_and_shipped_copy_open_the_same_way(layouts):
    opened = {k: open_run(layouts[k]) for k in ("run", "final", "shipped")}
    assert opened["run"].weights == opened["final"].weights == layouts["final"]
    assert opened["shipped"].weights == layouts["shipped"]
    assert opened["final"].run == layouts["run"] and opened["run"].run == layouts["run"]
    configs = {k: (r.model_config(), r.train_config()) for k, r in opened.items()}
    assert configs["run"] == configs["final"] == configs["shipped"]
    assert configs["run"][1].seq_len == 24
    states = [r.load_model().state_dict() for r in opened.values()]
    for s in states[1:]:
        assert all(torch.equal(s[k], states[0][k]) for k in s)
    assert all(len(r.metrics()) == 1 for r in opened.values())
    assert not opened["run"].load_model().training


def test_missing_pieces_are_one_line_errors(layouts, tmp_path):
    bare = open_run(layouts["bare"])
    assert bare.weights == layouts["bare"] and bare.train_config_path is None and bare.metrics_path is None
    with pytest.raises(DrcError, match="no training config"):
        bare.train_config()
    with pytest.raises(DrcError, match="no metrics.jsonl"):
        bare.metrics()
    metrics_only = tmp_path / "levers"
    metrics_only.mkdir()
    shutil.copy2(layouts["run"] / "config.json", metrics_only)
    only = open_run(metrics_only)
    assert only.weights is None and only.train_config().seq_len == 24
    with pytest.raises(DrcError, match="holds no model.safetensors"):
        only.load_model()
    with pytest.raises(DrcError, match="is not a directory"):
        open_run(tmp_path / "nope")


def _one_error_line(capsys, rc: int) -> str:
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_evaluate_on_bare_weights_refuses_to_guess_seq_len(layouts, capsys, local_corpus):
    line = _one_error_line(capsys, run_cli(evaluate_main, ["--run", str(layouts["bare"]), "--data", str(local_corpus)]))
    assert "no training config" in line


def test_evaluate_on_a_damaged_checkpoint_is_one_line(layouts, capsys, tmp_path, local_corpus):
    broken = tmp_path / "broken"
    shutil.copytree(layouts["shipped"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    line = _one_error_line(capsys, run_cli(evaluate_main, ["--run", str(broken), "--data", str(local_corpus)]))
    assert "cannot load the model" in line


def test_ship_writes_the_shipped_layout_that_opens_like_the_run(layouts, tmp_path, local_corpus):
    corpus = Corpus.open(local_corpus)
    run = open_run(layouts["run"])
    (layouts["run"] / "corpus.json").write_text(json.dumps(corpus_record(corpus)))
    (layouts["run"] / "eval.json").write_text('{"loss_all": {}}')
    try:
        dest = run.ship(tmp_path / "ref", corpus=corpus, side_files=("eval.json", "absent.json"),
                        info={"command": "x"})
    finally:
        (layouts["run"] / "corpus.json").unlink()
        (layouts["run"] / "eval.json").unlink()
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["model.safetensors", "config.json", "train_config.json", "metrics.jsonl", "tokenizer.json",
         "corpus_meta.json", "eval.json", "source.json"])
    shipped = open_run(dest)
    assert shipped.weights == dest and shipped.train_config() == run.train_config()
    a, b = run.load_model().state_dict(), shipped.load_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    shipped.check_corpus(corpus)  # corpus_meta.json carries what the check reads
    assert json.loads((dest / "corpus_meta.json").read_text())["fingerprint"] == corpus.fingerprint
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(DrcError, match="exists and is not empty.*nothing was written"):
        open_run(layouts["final"]).ship(dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before


def test_ship_refuses_a_corpus_the_run_was_not_trained_on(layouts, tmp_path, local_corpus):
    corpus = Corpus.open(local_corpus)
    (layouts["run"] / "corpus.json").write_text(json.dumps({"tokenizer_sha256": "0" * 64, "fingerprint": "f"}))
    try:
        with pytest.raises(DrcError, match="another tokenizer"):
            open_run(layouts["run"]).ship(tmp_path / "ref", corpus=corpus)
    finally:
        (layouts["run"] / "corpus.json").unlink()
    assert not (tmp_path / "ref").exists() and not (tmp_path / "ref.tmp").exists()

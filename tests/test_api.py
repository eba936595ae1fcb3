"""The public API (drc_core.load / trace / generate / make_rule) and the README's "From Python" example."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import drc_core
from drc_core.analysis.measure import convergence_depth, measure_windows
from drc_core.errors import DrcError
from drc_core.halting.generate import generate as generate_ids
from drc_core.halting.rules import RULE_FAMILIES, KLThreshold, make_rule

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "data" / "reference"
TEXT = "The Congress shall have power to lay and collect taxes."


@pytest.fixture(scope="module")
def lm(one_thread) -> drc_core.Model:
    return drc_core.load(REFERENCE)


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## From Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the From Python section holds one python block"
    return blocks[0]


def _readme_parts() -> tuple[str, str]:
    """The example up to the calibration, and the calibration: its last three lines (they use ``lm``)."""
    lines = _readme_example().rstrip("\n").split("\n")
    return "\n".join(lines[:-3]) + "\n", "\n".join(lines[-3:]) + "\n"


def test_readme_example_runs(monkeypatch, capsys, one_thread):
    code, _ = _readme_parts()
    assert "drc_core.load(" in code and ".trace(" in code and ".generate(" in code
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md:From Python", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "depth" in out and "converged" in out


def test_readme_calibration_runs_on_a_tiny_model(tiny_model_factory, capsys, one_thread):
    """The README's three calibration lines, exactly, with ``lm`` a tiny model behind the reference tokenizer."""
    _, code = _readme_parts()
    assert "drc_core.calibrate(" in code and "print(" in code
    tokenizer = drc_core.load(REFERENCE).tokenizer
    tiny = tiny_model_factory(tokenizer.get_vocab_size(), core_scale=3.0).eval()
    lm = drc_core.Model(model=tiny, tokenizer=tokenizer, config=None, run=None)
    namespace = {"__name__": "readme", "drc_core": drc_core, "lm": lm}
    exec(compile(code, "README.md:From Python (calibration)", "exec"), namespace)
    out = capsys.readouterr().out
    cal = namespace["cal"]
    assert isinstance(cal, drc_core.CalibratedRule) and str(cal.certificate) in out
    assert cal.certificate.family == "kl" and cal.certificate.n_units == len(namespace["docs"]) > 20
    assert (cal.rule is None) == (cal.certificate.threshold is None)


def test_calibrate_takes_documents_as_units(tiny_model_factory, one_thread):
    """drc_core.calibrate cuts each document into windows that share its unit, leaves out documents shorter than a
    window, and certifies exactly as halting.calibrate does on those windows."""
    from drc_core.api import document_windows
    from drc_core.halting.calibrate import calibrate as calibrate_windows

    torch.manual_seed(0)
    model = tiny_model_factory(64, core_scale=3.0).eval()
    docs = [list(torch.randint(0, 64, (n,)).tolist()) for n in (40, 5, 80, 40, 60, 33)]
    windows, units = document_windows(None, docs, 16, windows_per_doc=2)
    assert windows.shape == (10, 17) and sorted(set(units.ravel().tolist())) == [0, 2, 3, 4, 5]
    assert (windows[0] == torch.tensor(docs[0][:17])).all() and (units[:2] == 0).all()
    kw = dict(alpha=0.4, delta=0.3, reference_loops=4, max_loops=8)
    got = drc_core.calibrate(model, docs, "kl", seq_len=16, windows_per_doc=2, **kw)
    want = calibrate_windows(model, windows, units, "kl", **kw)
    assert got.certificate == want.certificate and got.certificate.n_units == 5
    assert str(got) == str(got.certificate)
    with pytest.raises(DrcError, match="no document"):
        drc_core.calibrate(model, [[1, 2, 3]], "kl", seq_len=16)
    with pytest.raises(DrcError, match="tokenizer"):
        drc_core.calibrate(model, ["a text"], "kl", seq_len=16)


@pytest.mark.parametrize("args,kwargs,match", [
    (([],), {}, "non-empty list"),
    (("one text",), {}, "non-empty list"),
    (([Path("/no/such/file.txt")],), {}, "document 0 .* cannot be read"),
    (([[1, 2, 3]],), {"alpha": 2.0}, "alpha=2.0"),
    (([[1, 2, 3]],), {"delta": 0}, "delta=0"),
    (([[1, 2, 3]], "nope"), {}, "family 'nope'"),
    (([[1, 2, 3]],), {"risk": "nope"}, "risk='nope'"),
])
def test_calibrate_checks_its_arguments_before_reading_documents(tiny_model_factory, args, kwargs, match):
    """Bad arguments are one line each, checked before the documents are read or the model runs (a bad alpha is
    named even when no document is long enough)."""
    model = tiny_model_factory(64).eval()
    with pytest.raises(DrcError, match=match):
        drc_core.calibrate(model, *args, seq_len=16, **kwargs)


def test_every_exported_name_resolves():
    for name in drc_core.__all__:
        assert getattr(drc_core, name) is not None
    with pytest.raises(AttributeError):
        drc_core.no_such_name  # noqa: B018


def test_load_gives_model_tokenizer_and_config(lm):
    assert not lm.model.training
    assert lm.tokenizer.get_vocab_size() == lm.model.cfg.vocab_size
    assert lm.config is not None and lm.config.model == lm.model.cfg


def test_load_without_a_tokenizer_needs_the_corpus(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("model.safetensors", "config.json"):
        shutil.copy2(REFERENCE / f, bare)
    with pytest.raises(DrcError, match="corpus="):
        drc_core.load(bare)
    loaded = drc_core.load(bare, corpus=REFERENCE)  # a directory holding tokenizer.json
    assert loaded.config is None and loaded.tokenizer.get_vocab_size() == loaded.model.cfg.vocab_size


def test_trace_equals_measure_windows_and_keeps_every_token(lm):
    ids = lm.tokenizer.encode(TEXT).ids
    tr = lm.trace(TEXT, max_loops=8)
    assert tr.ids.tolist() == ids and len(tr.tokens) == len(ids)
    assert len(tr) == len(ids) and tr.max_loops == 8 and len(tr.to_frame()) == len(ids) * 8
    assert tr.meta["text"].tolist() == tr.tokens and tr.meta["target"].iloc[-1] == -1
    # the reference: the text followed by an extra next token, so every position has a target
    extra = lm.tokenizer.encode(TEXT + " The").ids
    assert extra[: len(ids)] == ids
    ref = measure_windows(lm.model, torch.tensor([extra[: len(ids) + 1]]), 8)
    for col in ("kl", "kl_final", "state_delta", "entropy"):
        np.testing.assert_allclose(tr.matrix(col), ref.matrix(col), rtol=1e-5, atol=1e-7, equal_nan=True)
    ce, ce_ref = tr.matrix("ce"), ref.matrix("ce")
    np.testing.assert_allclose(ce[:-1], ce_ref[:-1], rtol=1e-5)
    assert np.isnan(ce[-1]).all()
    assert (tr.matrix("kl_final")[:, -1] == 0).all()
    no_targets = lm.trace(ids, max_loops=8, targets=False)
    assert np.isnan(no_targets.matrix("ce")).all()
    np.testing.assert_array_equal(no_targets.matrix("kl"), tr.matrix("kl"))


def test_trace_convergence_depth_at_any_eps(lm):
    tr = lm.trace(TEXT, max_loops=12)
    for eps in (1e-2, 1e-4):
        depth = tr.convergence_depth(eps)
        ref = convergence_depth(tr, eps)
        assert depth["depth"].tolist() == ref["depth"].tolist()
        assert depth["text"].tolist() == tr.tokens
    assert (tr.convergence_depth(1e-4)["depth"] >= tr.convergence_depth(1e-2)["depth"]).all()
    assert set(tr.to_frame().columns) >= {"pos", "loop", "text", "kl", "kl_final", "state_delta", "entropy",
                                          "ce"}


def test_trace_explorer_is_the_live_widget(lm):
    pytest.importorskip("ipywidgets")
    ex = lm.trace(TEXT, max_loops=6).explorer()
    ex.slider.value = 3
    assert "span" in ex.text.value


@pytest.mark.parametrize("bad", ["", [], [[1, 2]], [0.5, 1.5]])
def test_trace_rejects_bad_inputs(lm, bad):
    with pytest.raises(DrcError):
        lm.trace(bad, max_loops=4)


def test_generate_from_a_prompt_is_the_skipping_generator(lm):
    rule = make_rule("kl", 1e-3, max_loops=16)
    gen = lm.generate("The President said", max_new_tokens=6, rule=rule, seed=3)
    prompt = torch.tensor([lm.tokenizer.encode("The President said").ids])
    ref = generate_ids(lm.model, prompt, 6, rule, generator=torch.Generator().manual_seed(3))
    assert gen.ids == ref.new_tokens[0].tolist()
    assert gen.text == lm.tokenizer.decode(gen.ids) and len(gen.tokens) == 6 and len(gen.exit_loops) == 6
    assert math.isclose(gen.avg_depth, ref.new_avg_depth) and gen.exit_loops.max() <= 16
    assert lm.generate("The President said", max_new_tokens=6, seed=3).ids  # "kl" by name: KL < 1e-3
    with pytest.raises(DrcError, match="no default threshold"):
        lm.generate("The", max_new_tokens=2, rule="cosine")


def test_rules_by_short_name():
    assert make_rule("kl", 1e-3) == KLThreshold(1e-3)
    for name, cls in RULE_FAMILIES.items():
        args = () if name == "never" else ((2,) if name in ("uniform", "argmax_patience") else (0.5,))
        assert isinstance(make_rule(name, *args), cls)
    with pytest.raises(DrcError, match="unknown halting rule"):
        make_rule("oracle")
    with pytest.raises(DrcError, match="make_rule"):
        make_rule("kl")

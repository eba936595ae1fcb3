"""The one reader of model and run directories: a training run, its ``final/``, and a shipped copy open the same way.

Three layouts exist, written by :func:`drc_core.training.train.train` and copied by hand or by the book:

- a training run ``R/``: ``config.json`` (the :class:`~drc_core.training.config.TrainConfig`), ``metrics.jsonl``,
  ``checkpoints/`` and, once finished, ``final/`` (the weights);
- its ``R/final/``: ``model.safetensors`` + ``config.json`` (the :class:`~drc_core.model.lm.ModelConfig`), and
  each ``R/checkpoints/step-N/`` likewise (plus the optimizer state);
- a shipped copy (``data/reference``, ``data/experiments/<run>``, the book's ``work_dir/model``):
  ``model.safetensors`` + ``config.json`` (the ModelConfig) beside ``train_config.json`` (the TrainConfig),
  ``metrics.jsonl`` and optionally ``tokenizer.json`` / ``corpus_meta.json``.

The model config is always ``config.json`` next to ``model.safetensors``; the training config is the run's
``config.json`` (for ``R/``, ``R/final/`` and its checkpoints) or ``train_config.json`` (a shipped copy). A
directory without weights (a run still training, or metrics kept without weights as under ``data/levers``) opens
too; asking it for the model is then a one-line :class:`~drc_core.errors.DrcError`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from safetensors import SafetensorError

from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError, first_line
from drc_core.model.config import ModelConfig
from drc_core.model.lm import CONFIG_FILE, WEIGHTS_FILE, DepthRecurrentLM
from drc_core.training.config import TrainConfig

__all__ = ["CHECKPOINTS_DIR", "CORPUS_RECORD", "FINAL_DIR", "METRICS_FILE", "SHIPPED_TRAIN_CONFIG", "RunDir",
           "check_corpus_record", "corpus_record", "open_run"]

FINAL_DIR = "final"
CHECKPOINTS_DIR = "checkpoints"  # R/checkpoints/step-NNNNNNN/, written by drc_core.training.train
METRICS_FILE = "metrics.jsonl"
SHIPPED_TRAIN_CONFIG = "train_config.json"
SHIPPED_CORPUS_META = "corpus_meta.json"
SHIPPED_CORPUS_META_KEYS = ("source", "fingerprint", "documents", "characters", "tokens", "per_source", "seed",
                            "tokenizer_sha256", "vocab_size")


@dataclass(frozen=True)
class RunDir:
    """Where a run's pieces are. ``path``: the directory opened; ``run``: the run it belongs to (``path``, or
    its parent for a ``final/``); ``weights``: the directory holding ``model.safetensors`` and the model's
    ``config.json`` (None without weights); ``train_config_path`` and ``metrics_path``: None where absent."""

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
        """The model in eval mode; a damaged or mismatching checkpoint is a one-line :class:`DrcError`."""
        weights = self.need_weights()
        try:
            return DepthRecurrentLM.load(weights, map_location=map_location).eval()
        except DrcError:
            raise
        except (ValueError, OSError, RuntimeError, KeyError, TypeError, SafetensorError) as exc:
            raise DrcError(f"cannot load the model in '{weights}': {first_line(exc)}") from exc

    def metrics(self) -> pd.DataFrame:
        """``metrics.jsonl`` as a frame (one row per logged train or eval record)."""
        if self.metrics_path is None:
            raise DrcError(f"'{self.path}' has no {METRICS_FILE}: pass a training run or a shipped copy with metrics")
        return pd.read_json(self.metrics_path, lines=True)

    def ship(self, dest: str | Path, *, corpus: Corpus | None = None, side_files: tuple[str, ...] = (),
             info: dict | None = None, replace: bool = False) -> Path:
        """Write this run as a shipped copy at ``dest`` (the layout of ``data/reference``): the weights and the
        model's ``config.json``, ``train_config.json``, ``metrics.jsonl``; with ``corpus``, its ``tokenizer.json``
        and ``corpus_meta.json`` (what :meth:`check_corpus` reads); each of ``side_files`` the run has (e.g.
        ``eval.json``); ``info`` as ``source.json``. Written into a temporary sibling and renamed, so ``dest`` is
        complete or untouched; an existing non-empty ``dest`` is an error unless ``replace``."""
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
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for name, path in files.items():
                shutil.copy2(path, tmp / name)
            if corpus is not None:
                meta = {k: corpus.meta[k] for k in SHIPPED_CORPUS_META_KEYS if k in corpus.meta}
                (tmp / SHIPPED_CORPUS_META).write_text(json.dumps(meta, indent=2) + "\n")
            if info is not None:
                (tmp / "source.json").write_text(json.dumps(info, indent=2) + "\n")
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return dest

    def corpus_record(self) -> dict | None:
        """What the run recorded of its corpus (``corpus.json`` of a run, ``corpus_meta.json`` of a shipped copy):
        at least ``fingerprint`` and ``tokenizer_sha256``; None for runs made before runs recorded it."""
        for name in (CORPUS_RECORD, SHIPPED_CORPUS_META):
            path = self.file(name)
            if path is not None:
                return _read_json(path)
        return None

    def check_corpus(self, corpus: Corpus) -> None:
        """A one-line :class:`DrcError` unless ``corpus`` is the one the run recorded (tokenizer and inputs)."""
        record = self.corpus_record()
        if record is not None:
            check_corpus_record(record, corpus, f"the model in '{self.path}'")

    def file(self, name: str) -> Path | None:
        """A side file of the run (``eval.json``, ``tokenizer.json``, ``corpus_meta.json``, ...), looked up in the
        directory given and, for a ``final/``, in its run; None where absent."""
        for d in dict.fromkeys([self.path, self.run]):
            if (d / name).is_file():
                return d / name
        return None


CORPUS_RECORD = "corpus.json"


def corpus_record(corpus: Corpus) -> dict:
    """What a run records of its corpus: the path, the input fingerprint, the tokenizer hash and the vocabulary."""
    return {"path": str(corpus.path), "fingerprint": corpus.fingerprint, "tokenizer_sha256": corpus.tokenizer_hash,
            "vocab_size": corpus.vocab_size}


def _trained_on(record: dict) -> str:
    """The corpus a record names, for a message: its path (a run's corpus.json), else what a shipped copy's
    corpus_meta.json says of it (source, documents, vocabulary)."""
    if record.get("path"):
        return str(record["path"])
    docs = record.get("documents")
    n = sum(docs.values()) if isinstance(docs, dict) and all(isinstance(v, int) for v in docs.values()) else None
    parts = [f"source {record['source']}" if record.get("source") else "",
             f"{n} documents" if n is not None else "", f"vocab {record['vocab_size']}" if "vocab_size" in record
             else ""]
    return "prepared with " + ", ".join(p for p in parts if p) if any(parts) else "see its corpus record"


def check_corpus_record(record: dict, corpus: Corpus, where: str) -> None:
    """A one-line :class:`DrcError` unless ``corpus`` has the tokenizer (and inputs) ``record`` was made with."""
    if record.get("tokenizer_sha256") != corpus.tokenizer_hash:
        raise DrcError(f"{where} was trained on a corpus with another tokenizer (sha256 "
                       f"{str(record.get('tokenizer_sha256'))[:12]}..., corpus '{corpus.path}' has "
                       f"{corpus.tokenizer_hash[:12]}...): pass the corpus it was trained on ({_trained_on(record)})")
    if record.get("fingerprint") != corpus.fingerprint:
        raise DrcError(f"{where} was trained on other documents than corpus '{corpus.path}' holds (input "
                       f"fingerprints differ): pass the corpus it was trained on ({_trained_on(record)})")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DrcError(f"cannot read '{path}': {exc}") from exc


def _is_train_config(path: Path) -> bool:
    return path.is_file() and "model" in _read_json(path)


def open_run(path: str | Path) -> RunDir:
    """Open a training run, its ``final/`` or a shipped copy (see the module docstring); a missing directory
    is a :class:`DrcError`."""
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
    train_config = None
    for candidate in (root / SHIPPED_TRAIN_CONFIG, root / CONFIG_FILE):
        if _is_train_config(candidate):
            train_config = candidate
            break
    metrics = root / METRICS_FILE
    return RunDir(path=p, run=root, weights=weights, train_config_path=train_config,
                  metrics_path=metrics if metrics.is_file() else None)

"""The book's artifacts, the one place that knows their layout: the corpus, the studied model in ``work_dir/model/``
(a shipped checkpoint or a run trained in ``work_dir/train/``) and each notebook's ``results_dir/<notebook>.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

from drc_book.paths import committed_counterpart
from drc_core import (
    CHECKPOINTS_DIR,
    FINAL_DIR,
    METRICS_FILE,
    SHIPPED_TRAIN_CONFIG,
    WEIGHTS_FILE,
    Corpus,
    DepthRecurrentLM,
    DepthTaskConfig,
    DrcError,
    PrepareConfig,
    RecurrenceConfig,
    SourceSpec,
    TrainConfig,
    load,
    open_run,
    prepare,
    preset_for,
    read_json,
    train,
    val_windows_with_docs,
    write_file,
)

__all__ = ["Study", "ensure_corpus", "load_results", "open_model", "open_study", "provide_model", "provide_run",
           "save_results", "train_or_reuse"]


def ensure_corpus(corpus_dir: str | Path, source: str, vocab_size: int, *, max_docs: int | None = None,
                  seq_len: int = 256, data_files: Sequence[str | Path] = (), tasks: DepthTaskConfig | None = None,
                  tokenizer: str | Path = "", progress: bool = True) -> Corpus:
    """``corpus_dir`` prepared from ``source`` unless it is up to date (``data_files``: local parquet shards;
    ``tasks``: the ``depth-tasks`` source's; ``tokenizer``: one to reuse)."""
    spec = SourceSpec(name=source, max_docs=max_docs, data_files=tuple(str(f) for f in data_files),
                      tasks=tasks or DepthTaskConfig())
    prepare(PrepareConfig(source=spec, out=str(corpus_dir), vocab_size=vocab_size, seq_len=seq_len,
                          tokenizer=str(tokenizer)), progress=progress)
    return Corpus.open(corpus_dir)


def train_or_reuse(cfg: TrainConfig, corpus_dir: str | Path, out: str | Path, *, progress: bool = True,
                   init: str | Path | None = None) -> Path:
    """``out`` holding ``cfg`` trained (a partial run resumed, a finished one with this config and corpus reused);
    ``init``: start from another run's weights."""
    out = Path(out)
    run = open_run(out) if out.is_dir() else None
    if run is not None and run.weights == out / FINAL_DIR:
        if run.train_config() != cfg:
            raise DrcError(f"'{out}' holds a finished run with another config: delete it or choose another work_dir")
        try:
            run.check_corpus(Corpus.open(corpus_dir), required=True)
        except DrcError as exc:
            raise DrcError(f"'{out}' holds a finished run trained on another corpus than '{corpus_dir}' (other "
                           "documents or tokenizer): delete it or choose another work_dir") from exc
        return out
    train(cfg, corpus_dir, out, resume=(out / CHECKPOINTS_DIR).exists(), progress=progress, init=init)
    return out


def provide_model(work_dir: str | Path, corpus: Corpus, *, preset_name: str, overrides: list[str],
                  checkpoint: str = "", retrain: bool = False, init: str = "", progress: bool = True) -> dict[str, Any]:
    """Put the studied model in ``work_dir/model``: a copy of ``checkpoint`` or (none, or ``retrain``) a run of
    ``preset_name`` + ``overrides`` trained here; returns ``source.json``'s content."""
    work = Path(work_dir)
    model_dir = work / "model"
    if checkpoint and not retrain:
        src = Path(checkpoint)
        run = open_run(src) if src.is_dir() else None
        have = {WEIGHTS_FILE: run and run.weights, SHIPPED_TRAIN_CONFIG: run and run.train_config_path,
                METRICS_FILE: run and run.metrics_path}
        missing = [f for f, found in have.items() if not found]
        if missing:
            raise DrcError(f"checkpoint '{src}' lacks {', '.join(missing)}: pass a directory like data/reference "
                           "or set retrain=true")
        run.check_corpus(corpus)  # the tokenizer and documents its corpus_meta.json records
        info = {"kind": "checkpoint", "path": str(src)}
    else:
        cfg = preset_for(preset_name, list(overrides), corpus)
        run = open_run(train_or_reuse(cfg, corpus.path, work / "train", progress=progress, init=init or None))
        info = {"kind": "trained", "path": str(run.path), "preset": preset_name, "overrides": list(overrides)}
        if init:
            info["init"] = str(init)
    run.ship(model_dir, info=info, replace=True)
    return info


def provide_run(run_dir: str | Path, corpus_dir: str | Path, *, preset_name: str, overrides: list[str],
                progress: bool = False) -> tuple[Path, TrainConfig]:
    """A side experiment's weights directory and config: ``run_dir`` if shipped, else its ``final/``, trained there."""
    run = open_run(run_dir) if Path(run_dir).is_dir() else None
    if run is not None and run.weights == run.path and run.train_config_path is not None:
        return run.path, run.train_config()
    cfg = preset_for(preset_name, list(overrides), Corpus.open(corpus_dir))
    return train_or_reuse(cfg, corpus_dir, run_dir, progress=progress) / FINAL_DIR, cfg


class Study(NamedTuple):
    """What notebooks 2-5 open first (:func:`open_study`)."""

    model: DepthRecurrentLM
    cfg: TrainConfig
    corpus: Corpus
    windows: torch.Tensor  # (N, seq_len + 1) validation windows spread over the split
    docs: torch.Tensor  # (N, seq_len) row in corpus.docs of each input token's document
    reference: int  # the training-mean depth, rounded: the reference depth of every comparison


@dataclass(frozen=True)
class CheckpointConfig:
    """What the notebooks read of a training config, for a checkpoint trained elsewhere (Huginn)."""

    seq_len: int
    recurrence: RecurrenceConfig


def open_study(work_dir: str | Path, corpus_dir: str | Path, n_windows: int, checkpoint: str | Path = "") -> Study:
    """The studied model (:func:`open_model`), its corpus and ``n_windows`` validation windows with documents."""
    model, cfg, _ = open_model(work_dir, checkpoint)
    corpus = Corpus.open(corpus_dir)
    windows, docs = val_windows_with_docs(corpus, cfg.seq_len, n_windows)
    return Study(model, cfg, corpus, windows, docs, int(round(cfg.recurrence.mean)))


def open_model(work_dir: str | Path, checkpoint: str | Path = "") -> tuple[Any, Any, pd.DataFrame]:
    """The studied model, its training config and metrics; with ``checkpoint``, that model, its config or a
    :class:`CheckpointConfig`, and no metrics."""
    if checkpoint:
        m = load(checkpoint)
        if m.config is not None:  # one of this project's runs, given by path
            return m.model, m.config, pd.DataFrame()
        depth = RecurrenceConfig(mean=float(m.model.mean_recurrence))  # a checkpoint states its trained depth
        return m.model, CheckpointConfig(seq_len=int(m.model.max_seq_len), recurrence=depth), pd.DataFrame()
    model_dir = Path(work_dir) / "model"
    if not (model_dir / WEIGHTS_FILE).is_file():
        raise DrcError(f"no model in '{model_dir}': run 01_training of this profile first")
    run = open_run(model_dir)
    return run.load_model(), run.train_config(), run.metrics()


def _plain(x: Any) -> Any:
    """JSON-ready: numpy scalars/arrays to Python, NaN/inf to None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def save_results(results_dir: str | Path, name: str, results: dict[str, Any]) -> Path:
    """Write ``results_dir/<name>.json`` (sorted keys, NaN as null) and return its path."""
    path = Path(results_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(_plain(results), indent=2, sort_keys=True) + "\n")  # atomic, never through a link
    return path


def load_results(results_dir: str | Path, name: str) -> dict[str, Any]:
    """``results_dir/<name>.json`` (an interactive run's, else the committed one); missing, it names the notebook."""
    path = Path(results_dir) / f"{name}.json"
    committed = committed_counterpart(results_dir)
    if not path.is_file() and committed is not None and (committed / f"{name}.json").is_file():
        path = committed / f"{name}.json"
    if not path.is_file():
        raise DrcError(f"{path} not found: run notebook {name} of this profile first")
    data = read_json(path, "the results file", f"run notebook {name} of this profile again")
    if not isinstance(data, dict):
        raise DrcError(f"the results file '{path}' is damaged (a {type(data).__name__}, not an object): run notebook "
                       f"{name} of this profile again")
    return data

"""The researcher's entry points, re-exported by ``drc_core`` (see the README's "From Python"): :func:`load` a model,
:func:`trace` a text through its loops (one :func:`~drc_core.analysis.measure.measure_windows` pass: O(L x T) numbers,
never the L x T x V outputs), :func:`generate` with per-token halting, :func:`calibrate` a threshold with a guarantee.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tokenizers import Tokenizer

from drc_core.analysis.dynamics import Dynamics, classify, commit_loop
from drc_core.analysis.measure import DEFAULT_EPS, DYNAMICS_COLUMNS, Measurement, convergence_depth, measure_windows
from drc_core.analysis.tokens import token_texts
from drc_core.data.sampler import Corpus, eval_windows
from drc_core.data.tokenizer import encode_checked, load_tokenizer
from drc_core.errors import MAX_DOCUMENT_TOKENS, MAX_TEXT_FILE_BYTES, DrcError, need_int
from drc_core.guard import read_regular
from drc_core.halting.calibrate import CalibratedRule, check_calibration
from drc_core.halting.calibrate import calibrate as calibrate_windows
from drc_core.halting.generate import generate as generate_ids
from drc_core.halting.rules import HaltingRule, KLThreshold, Never, make_rule
from drc_core.heap import bound_freed_memory, heap_policy
from drc_core.model.huginn import HuginnLM
from drc_core.model.huginn_checkpoint import hf_config, load_huginn, load_huginn_tokenizer
from drc_core.model.lm import DepthRecurrentLM, RecurrentModel
from drc_core.model.passes import EVAL_STATE_SEED, evaluation
from drc_core.training.config import TrainConfig
from drc_core.training.rundir import RunDir, open_run

if TYPE_CHECKING:  # the explorer needs the book extras (plotly, ipywidgets): imported where one is made
    from drc_core.explorer import DepthExplorer

__all__ = ["Generation", "Model", "Trace", "calibrate", "generate", "load", "trace"]

TOKENIZER_FILE = "tokenizer.json"


@dataclass(kw_only=True)
class Trace(Measurement):
    """Per token and loop statistics of one sequence from :func:`trace`: a
    :class:`~drc_core.analysis.measure.Measurement` (``window`` 0) with the input ``ids``, each token's string
    (``tokens``, also ``meta["text"]``) and the ``tokenizer``. ``stats``: ``kl`` = KL(p_l || p_{l-1}), ``kl_final``
    = KL(p_L || p_l), ``state_delta``, ``entropy``, ``argmax``, ``ce`` (NaN where the next token is unknown), and the
    dynamics ``norm`` = ||s_l|| and ``contraction`` (the step into loop l over the one before; NaN at loops 1-2);
    ``meta``: ``dyn_class`` (:func:`~drc_core.analysis.dynamics.classify` over the last ``min(8, L - 2)`` factors)
    and ``commit_loop`` (from which the argmax no longer changes)."""

    ids: np.ndarray
    tokens: list[str]
    tokenizer: Tokenizer | None

    def dynamics(self) -> pd.DataFrame:
        """Per token: ``pos``, ``text``, ``dyn_class``, ``commit_loop``, ``contraction`` (the geometric mean of the
        last ``min(8, L - 2)`` factors), ``norm_first`` and ``norm_last`` (||s_1||, ||s_L||)."""
        tail = min(8, self.max_loops - 2)
        gm = np.full(len(self.ids), np.nan)
        if tail > 0:
            with np.errstate(divide="ignore"):
                log_rho = np.log(self.matrix("contraction")[:, -tail:])
            ok = np.isfinite(log_rho).any(axis=1)  # a token whose steps vanished has no factor
            gm[ok] = np.exp(np.nanmean(log_rho[ok], axis=1))
        norm = self.matrix("norm")
        return pd.DataFrame({"pos": np.arange(len(self.ids)), "text": self.tokens,
                             "dyn_class": self.meta["dyn_class"].to_numpy(),
                             "commit_loop": self.meta["commit_loop"].to_numpy(), "contraction": gm,
                             "norm_first": norm[:, 0], "norm_last": norm[:, -1]})

    def convergence_depth(self, eps: float = DEFAULT_EPS) -> pd.DataFrame:
        """Per token: ``pos``, ``text``, ``depth`` (:func:`drc_core.analysis.measure.convergence_depth`) and
        ``converged`` (False when the KL was still >= eps at loop L; the depth is then L)."""
        depth = convergence_depth(self, eps)
        depth.insert(2, "text", [self.tokens[int(p)] for p in depth["pos"]])
        return depth.drop(columns="window")

    def explorer(self, eps: float = DEFAULT_EPS) -> DepthExplorer:
        """The live per-token depth explorer (display ``.widget``); needs the book extras."""
        try:
            from drc_core.explorer import DepthExplorer
        except ImportError as exc:
            raise DrcError(f"Trace.explorer needs the book extras ({exc}): pip install 'drc-book[book]'") from None
        return DepthExplorer(self, self.tokenizer, window=0, eps=eps, max_tokens=max(len(self.ids), 1))


@dataclass
class Generation:
    """What :func:`generate` returns: the continuation's ``text``, its tokens' strings and ids, ``exit_loops`` (the
    exit loop of the position whose output chose each new token) and their mean ``avg_depth``."""

    prompt: str
    text: str
    tokens: list[str]
    ids: list[int]
    exit_loops: np.ndarray
    avg_depth: float


def _encode(tokenizer: Tokenizer | None, text_or_ids: str | Sequence[int] | torch.Tensor, max_tokens: int,
            what: str = "the text") -> np.ndarray:
    """Token ids of a text (at most ``max_tokens``, refused from its length before tokenizing) or of ids as given."""
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise DrcError("a text needs a tokenizer: pass tokenizer=, or token ids instead of text")
        ids = np.asarray(encode_checked(tokenizer, text_or_ids, max_tokens, what), dtype=np.int64)
    else:
        ids = np.asarray(text_or_ids.cpu() if isinstance(text_or_ids, torch.Tensor) else text_or_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise DrcError(f"token ids must be a 1-D sequence of integers; got shape {ids.shape}, dtype {ids.dtype}")
        ids = ids.astype(np.int64)
    if ids.size == 0:
        raise DrcError("the text encodes to no tokens: pass a non-empty text")
    return ids


def _module(model: object, what: str) -> RecurrentModel:
    """``model`` as the network itself (a :class:`Model` from :func:`load` gives its ``model``), else one line."""
    module = model.model if isinstance(model, Model) else model
    if not isinstance(module, torch.nn.Module) or not hasattr(module, "max_seq_len"):
        raise DrcError(f"{what} needs a model, got {type(model).__name__}: pass drc_core.load(path) or its .model")
    return module


def trace(model: RecurrentModel, text_or_ids: str | Sequence[int] | torch.Tensor, max_loops: int = 32, *,
          tokenizer: Tokenizer | None = None, targets: bool = True, seed: int = EVAL_STATE_SEED) -> Trace:
    """Run a text (with ``tokenizer``) or token ids through ``max_loops`` loops of ``model``: the per token and loop
    statistics of :class:`Trace`, every input token traced (with ``targets``, the next one is its ``ce`` target),
    the initial state drawn from ``seed``."""
    model = _module(model, "trace")
    max_loops = need_int("max_loops", max_loops, 2)
    if heap_policy() is None:  # memory O(loops x tokens) unless the process chose a policy (drc_core.heap)
        bound_freed_memory()
    ids = _encode(tokenizer, text_or_ids, model.max_seq_len)
    window = torch.from_numpy(np.append(ids, ids[-1]))[None]  # the last target is a placeholder, blanked below
    m = measure_windows(model, window, max_loops, seed=seed, kl_to_final=True, dynamics=True)
    stats, meta = m.stats, m.meta
    blank = slice(None) if not targets else len(ids) - 1  # the tokens without a known next token
    stats["ce"][blank] = math.nan
    meta.loc[meta.index[blank], "target"] = -1
    texts = token_texts(tokenizer, ids.tolist())
    meta["text"] = texts
    if max_loops < 3:  # no contraction factor yet: nothing to classify
        nan = np.full(stats["kl"].shape, np.nan, np.float32)
        stats["norm"], stats["contraction"] = nan, nan.copy()
        meta["dyn_class"], meta["commit_loop"] = None, -1
    else:
        dyn = Dynamics.of(m)  # (T, L): one row per position
        stats["norm"] = dyn.norm
        stats["contraction"] = np.full(dyn.norm.shape, np.nan, np.float32)
        stats["contraction"][:, 2:] = dyn.contraction()  # rho_{l-1} = step_l / step_{l-1} at loop l
        meta["dyn_class"] = classify(dyn, tail=min(8, max_loops - 2))
        meta["commit_loop"] = commit_loop(dyn.argmax)
    for name in DYNAMICS_COLUMNS:
        del stats[name]
    return Trace(stats=stats, meta=meta, attrs=m.attrs, ids=ids, tokens=texts, tokenizer=tokenizer)


def generate(model: DepthRecurrentLM, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 32, *,
             rule: HaltingRule | str = "kl", temperature: float = 0.0, seed: int = 0) -> Generation:
    """Continue ``prompt`` by ``max_new_tokens`` tokens on the compute-skipping path, halting every token by ``rule``
    (a :class:`~drc_core.halting.rules.HaltingRule`, or ``"kl"`` (KL < 1e-3 within 32 loops) or ``"never"``); greedy
    at ``temperature`` 0; ``seed`` fixes the initial states and the sampling."""
    model = _module(model, "generate")
    if isinstance(rule, str):
        defaults = {KLThreshold.family: (DEFAULT_EPS,), Never.family: ()}  # the rules with a default by name
        if rule not in defaults:
            raise DrcError(f"rule={rule!r} has no default threshold here: pass make_rule({rule!r}, <threshold>)")
        rule = make_rule(rule, *defaults[rule])
    ids = torch.from_numpy(_encode(tokenizer, prompt, model.max_seq_len, "the prompt"))[None]
    with evaluation(model, seed):  # eval mode, restored after; it checks the seed, which seeds a CPU generator here
        out = generate_ids(model, ids, max_new_tokens, rule, temperature=temperature,
                           generator=torch.Generator().manual_seed(int(seed)))
    new = out.new_tokens[0].tolist()
    exits = out.exit_loop[0, out.prompt_len - 1 :].cpu().numpy()
    return Generation(prompt=prompt, text=tokenizer.decode(new), tokens=token_texts(tokenizer, new), ids=new,
                      exit_loops=exits, avg_depth=float(out.new_avg_depth))


def document_windows(tokenizer: Tokenizer | None, documents: Sequence[str | Path | Sequence[int]], seq_len: int,
                     windows_per_doc: int = 1) -> tuple[torch.Tensor, np.ndarray]:
    """``windows_per_doc`` evenly spaced windows (N, seq_len+1) of each document (a text, a text file's path or ids;
    one shorter than a window is left out) and each input position's document number (N, seq_len)."""
    seq_len = need_int("seq_len", seq_len, 1)
    windows_per_doc = need_int("windows_per_doc", windows_per_doc, 1)
    if isinstance(documents, str | Path) or not isinstance(documents, Sequence) or not documents:
        raise DrcError("documents must be a non-empty list of texts, text files' paths or token id lists; got "
                       f"{type(documents).__name__ if documents else 'an empty list'}")
    parts, units = [], []
    for i, doc in enumerate(documents):
        if isinstance(doc, Path):
            try:
                doc = read_regular(doc, f"document {i}", MAX_TEXT_FILE_BYTES).decode("utf-8")  # no FIFO, no /dev/zero
            except (OSError, UnicodeDecodeError) as exc:
                raise DrcError(f"document {i} ('{doc}') cannot be read as UTF-8 text ({exc.__class__.__name__}): "
                               "pass an existing text file") from exc
        ids = _encode(tokenizer, doc, MAX_DOCUMENT_TOKENS, f"document {i}")
        if len(ids) < seq_len + 1:
            continue
        w = eval_windows(ids, seq_len, windows_per_doc, spread=True)
        parts.append(w)
        units.append(np.full((len(w), seq_len), i, dtype=np.int64))
    if not parts:
        raise DrcError(f"no document holds {seq_len + 1} tokens: pass longer documents or a smaller seq_len")
    return torch.cat(parts), np.concatenate(units)


def calibrate(model: Model | RecurrentModel, documents: Sequence[str | Path | Sequence[int]], family: str = "kl", *,
              alpha: float = 0.05, delta: float = 0.1, risk: str = "top1", tolerance: float = 0.0,
              reference_loops: int | None = None, max_loops: int = 16, tokenizer: Tokenizer | None = None,
              seq_len: int | None = None, windows_per_doc: int = 1, seed: int = EVAL_STATE_SEED) -> CalibratedRule:
    """A halting threshold of ``family`` such that, with probability ``1 - delta`` over the calibration
    ``documents`` (the units of Learn then Test), the expected share of a new document's tokens whose top prediction
    differs from depth ``reference_loops`` (``risk="ce"``: whose CE exceeds it by more than ``tolerance``) is at most
    ``alpha``. ``model``: a :class:`Model` (its tokenizer and training mean depth) or a
    :class:`~drc_core.model.lm.RecurrentModel` with ``tokenizer`` (reference 8 loops); windows of ``seq_len`` tokens
    (default ``max_seq_len``, at most 256). The rule is None where nothing was certified."""
    if isinstance(model, Model):
        tokenizer = tokenizer or model.tokenizer
        if reference_loops is None and model.config is not None:
            reference_loops = int(round(model.config.recurrence.mean))
        elif reference_loops is None and isinstance(model.model, HuginnLM):
            reference_loops = model.model.mean_recurrence
        model = model.model
    model = _module(model, "calibrate")
    check_calibration(family, alpha, delta, risk)
    reference_loops = 8 if reference_loops is None else reference_loops
    seq_len = min(int(model.max_seq_len), 256) if seq_len is None else seq_len
    windows, units = document_windows(tokenizer, documents, seq_len, windows_per_doc)
    return calibrate_windows(model, windows, units, family, alpha=alpha, delta=delta, risk=risk, tolerance=tolerance,
                             reference_loops=reference_loops, max_loops=max_loops, seed=seed)


@dataclass
class Model:
    """A loaded model with its tokenizer (None for a Huginn checkpoint without one) and training config (None for a
    bare weights copy or a Huginn checkpoint); see :func:`load`."""

    model: DepthRecurrentLM | HuginnLM
    tokenizer: Tokenizer | None
    config: TrainConfig | None
    run: RunDir

    def _need_tokenizer(self, text: object) -> None:
        if isinstance(text, str) and self.tokenizer is None:
            raise DrcError(f"'{self.run.path}' has no {TOKENIZER_FILE}, so text cannot be encoded: pass token ids "
                           f"(drc_core.generate_ids for generation), or put the checkpoint's "
                           f"{TOKENIZER_FILE} there")

    def trace(self, text_or_ids: str | Sequence[int] | torch.Tensor, max_loops: int | None = None,
              **kwargs) -> Trace:
        """:func:`trace` with this model and tokenizer; ``max_loops`` defaults to 32 (Huginn: its mean depth)."""
        self._need_tokenizer(text_or_ids)
        if max_loops is None:
            max_loops = self.model.mean_recurrence if isinstance(self.model, HuginnLM) else 32
        return trace(self.model, text_or_ids, max_loops, tokenizer=self.tokenizer, **kwargs)

    def generate(self, prompt: str, max_new_tokens: int = 32, **kwargs) -> Generation:
        """:func:`generate` with this model and tokenizer."""
        self._need_tokenizer(prompt)
        return generate(self.model, self.tokenizer, prompt, max_new_tokens, **kwargs)

    def calibrate(self, documents: Sequence[str | Path | Sequence[int]], family: str = "kl", **kwargs
                  ) -> CalibratedRule:
        """:func:`calibrate` with this model, its tokenizer and its training mean depth as reference."""
        return calibrate(self, documents, family, **kwargs)


def load(path: str | Path, *, corpus: str | Path | None = None, map_location: str = "cpu",
         dtype: torch.dtype | str | None = None) -> Model:
    """Open a training run, its ``final/`` or a shipped copy: the model in eval mode, the tokenizer (the directory's,
    else the prepared ``corpus``'s, its sha256 checked against the record) and the training config. A Huginn-0125
    checkpoint directory opens too (:func:`~drc_core.model.huginn_checkpoint.load_huginn`, weights memory-mapped in
    ``dtype``, which applies to Huginn only; docs/huginn.md)."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise DrcError(f"path={path!r} is not a path: pass a training run, its final/, a shipped copy like "
                       "data/reference or a Huginn checkpoint directory")
    if hf_config(path) is not None:  # a Hugging Face-style config.json: Huginn, or a one-line error
        if corpus is not None:
            raise DrcError(f"'{path}' is a Hugging Face-style checkpoint with its own {TOKENIZER_FILE}: drop corpus=")
        model = load_huginn(path, dtype=dtype, map_location=map_location)
        p = Path(path)
        return Model(model=model, tokenizer=load_huginn_tokenizer(p, model.cfg), config=None,
                     run=RunDir(path=p, run=p, weights=p, train_config_path=None, metrics_path=None))
    if dtype is not None and dtype not in (torch.float32, "float32"):
        raise DrcError(f"dtype={dtype!r} applies to Huginn checkpoints; this project's runs load in float32 (use "
                       "drc_core.model.precision for bf16 autocast)")
    run = open_run(path)
    found = run.file(TOKENIZER_FILE)
    if found is None and corpus is None:
        raise DrcError(f"'{path}' has no {TOKENIZER_FILE}: pass corpus= the prepared corpus the model was trained on")
    if found is None and (Path(corpus) / "meta.json").is_file():  # a prepared corpus: checked, and the run's own
        prepared = Corpus.open(corpus)
        run.check_corpus(prepared, required=True)
        tokenizer = prepared.tokenizer()
    else:
        record = run.corpus_record() if found is not None else None
        if found is not None and record is None:
            raise DrcError(f"'{path}' has a {TOKENIZER_FILE} but no record of its hash (corpus.json / "
                           "corpus_meta.json): restore it, or pass corpus= the prepared corpus it was trained on")
        want = record.get("tokenizer_sha256") if isinstance(record, dict) else None
        tokenizer = load_tokenizer(found if found is not None else Path(corpus), want)
    config = run.train_config() if run.train_config_path is not None else None
    model = run.load_model(map_location)
    if tokenizer.get_vocab_size() > model.vocab_size:
        raise DrcError(f"the tokenizer of '{path}' has {tokenizer.get_vocab_size()} ids but the model's vocabulary "
                       f"is {model.vocab_size}: pass the tokenizer (corpus) the model was trained with")
    return Model(model=model, tokenizer=tokenizer, config=config, run=run)

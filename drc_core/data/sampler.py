"""Reading a prepared corpus, and seeded random windows for training."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from drc_core.data.tokenizer import load_tokenizer
from drc_core.errors import MAX_VOCAB, DrcError, first_line
from drc_core.guard import parse_json, read_regular

CORPUS_META_KEYS = ("vocab_size", "dtype", "tokens", "fingerprint", "tokenizer_sha256")
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass
class Corpus:
    """A prepared corpus directory (see :mod:`drc_core.data.prepare`)."""

    path: Path
    meta: dict

    @classmethod
    def open(cls, path: str | Path) -> Corpus:
        """Open a prepared corpus after checking its ``meta.json``, that every file is there, each token file as long
        as recorded, the tokenizer's sha256 and every token id; any problem is a one-line :class:`DrcError`."""
        if not isinstance(path, str | os.PathLike) or not str(path):
            raise DrcError(f"corpus path {path!r} is not a path: pass a prepared corpus directory")
        p = Path(path)
        again = f"prepare it again: `python -m drc_core.data prepare --force --out {p}` (with its original options)"
        if p.exists() and not p.is_dir():
            raise DrcError(f"corpus '{p}' is a file, not a prepared corpus directory: pass the directory that "
                           "`python -m drc_core.data prepare --out` wrote")
        if not p.is_dir():
            raise DrcError(f"corpus '{p}' does not exist: run `python -m drc_core.data prepare --out {p}` first")
        if not (p / "meta.json").exists():
            raise DrcError(f"'{p}' is not a prepared corpus (no meta.json): run `python -m drc_core.data prepare "
                           f"--out {p}` first")
        try:
            meta = parse_json(read_regular(p / "meta.json", "a corpus's meta.json"))
        except (OSError, ValueError) as exc:  # a DrcError (a FIFO, too large) is a ValueError too
            raise DrcError(f"corpus '{p}' has a damaged meta.json ({first_line(exc, 160)}): {again}") from None
        if not isinstance(meta, dict):
            raise DrcError(f"corpus '{p}' has a damaged meta.json (a {type(meta).__name__}, not an object): {again}")
        missing = [k for k in CORPUS_META_KEYS if k not in meta]
        if missing:
            raise DrcError(f"corpus '{p}' has a meta.json without {', '.join(missing)}: {again}")
        for name in ("tokenizer.json", "docs.parquet"):
            if not (p / name).is_file():
                raise DrcError(f"corpus '{p}' lacks {name}: {again}")
        tokens = meta["tokens"]
        counts_ok = isinstance(tokens, dict) and all(
            isinstance(tokens.get(k), int) and not isinstance(tokens.get(k), bool) and tokens[k] >= 0
            for k in ("train", "val"))
        vocab = meta["vocab_size"]
        if not counts_ok or isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise DrcError(f"corpus '{p}' has a meta.json whose vocab_size or token counts are not counts: {again}")
        if vocab > MAX_VOCAB:
            raise DrcError(f"corpus '{p}' has a meta.json with vocab_size {vocab:,}, above the limit of {MAX_VOCAB:,} "
                           f"(drc_core.errors.MAX_VOCAB): {again}")
        if not all(isinstance(meta[k], str) and meta[k] for k in ("fingerprint", "tokenizer_sha256")):
            raise DrcError(f"corpus '{p}' has a meta.json whose fingerprint or tokenizer_sha256 is not a hash: {again}")
        if not isinstance(meta["dtype"], str) or meta["dtype"] not in TOKEN_DTYPES:
            raise DrcError(f"corpus '{p}' has a meta.json with dtype {meta['dtype']!r}, not one of "
                           f"{', '.join(TOKEN_DTYPES)}: {again}")
        for split in ("train", "val"):
            f = p / f"{split}.bin"
            want = int(meta["tokens"][split]) * np.dtype(meta["dtype"]).itemsize
            have = f.stat().st_size if f.is_file() else None  # a FIFO or a device is no token file
            if have != want:
                state = ("is missing" if not f.exists() else "is not a regular file" if have is None else
                         f"has {have} bytes, not the {want} meta.json records")
                raise DrcError(f"corpus '{p}': {split}.bin {state}: {again}")
        load_tokenizer(p, str(meta["tokenizer_sha256"]))  # the tokenizer file is the one meta.json records
        corpus = cls(p, meta)
        for split in ("train", "val"):  # one vectorised pass per split: every id must be in the vocabulary
            tokens = corpus.tokens(split)
            top = int(tokens.max()) if len(tokens) else -1
            if top >= corpus.vocab_size:
                raise DrcError(f"corpus '{p}': {split}.bin holds token id {top} but the vocabulary has "
                               f"{corpus.vocab_size} ids (0..{corpus.vocab_size - 1}): the file is damaged; {again}")
        return corpus

    @property
    def tokenizer_hash(self) -> str:
        return str(self.meta["tokenizer_sha256"])

    @property
    def fingerprint(self) -> str:
        return str(self.meta["fingerprint"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def tokens(self, split: str) -> np.memmap:
        if split not in ("train", "val"):
            raise DrcError(f"unknown split '{split}': use 'train' or 'val'")
        return np.memmap(self.path / f"{split}.bin", dtype=np.dtype(self.meta["dtype"]), mode="r")

    @cached_property
    def docs(self) -> pd.DataFrame:
        try:
            return pd.read_parquet(self.path / "docs.parquet")
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DrcError(f"corpus '{self.path}' has a damaged docs.parquet ({str(exc).splitlines()[0]}): prepare it "
                           f"again with `python -m drc_core.data prepare --force --out {self.path}`") from None

    def tokenizer(self):
        """The corpus's tokenizer, read (and its sha256 checked against ``meta.json``) on every call."""
        return load_tokenizer(self.path, self.tokenizer_hash)


class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens, a pure function of ``(seed, step)``: ``batch(step)`` is this rank's
    share of the global batch; the whole state is the step counter."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if seq_len < 1 or batch_size < 1:
            raise DrcError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
        if len(tokens) < seq_len + 1:
            raise DrcError(f"split has {len(tokens)} tokens, fewer than seq_len+1={seq_len + 1}: lower seq_len")
        if batch_size % world_size:
            raise DrcError(f"batch_size={batch_size} is not divisible by world_size={world_size}: pick a multiple")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.step = 0

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.batch_size // self.world_size
        starts = self.starts(step)[self.rank * local : (self.rank + 1) * local]
        win = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        w = torch.from_numpy(win)
        return w[:, :-1], w[:, 1:]

    def target_weights(self, step: int, weights: np.ndarray) -> torch.Tensor:
        """Per-token weights (B, T) of this rank's targets at ``step`` (``weights``: one per token of the split)."""
        local = self.batch_size // self.world_size
        starts = self.starts(step)[self.rank * local : (self.rank + 1) * local]
        return torch.from_numpy(np.stack([weights[s + 1 : s + self.seq_len + 1] for s in starts]))

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def __iter__(self) -> WindowSampler:
        return self

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise DrcError(f"sampler state has seed {state['seed']} but this run uses {self.seed}: keep the seed")
        self.step = int(state["step"])


def window_slots(n_tokens: int, seq_len: int, max_windows: int | None = None, spread: bool = False) -> np.ndarray:
    """Which of the split's non-overlapping ``seq_len`` slots :func:`eval_windows` takes: the first ``max_windows``,
    or with ``spread`` as many evenly spaced over the whole split."""
    total = (n_tokens - 1) // seq_len
    if total < 1:
        raise DrcError(f"split has {n_tokens} tokens, fewer than seq_len+1={seq_len + 1}: lower seq_len")
    n = total if max_windows is None else min(total, max_windows)
    if not spread or n == total:
        return np.arange(n)
    return np.round(np.linspace(0, total - 1, n)).astype(np.int64)  # distinct: the step is >= 1


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None,
                 spread: bool = False) -> torch.Tensor:
    """Non-overlapping ``seq_len + 1`` windows (N, seq_len+1) of a split (:func:`window_slots`)."""
    slots = window_slots(len(tokens), seq_len, max_windows, spread)
    idx = slots[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))

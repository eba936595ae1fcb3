"""Byte-level BPE, trained with Hugging Face ``tokenizers`` on the training split only."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from drc_core.errors import DrcError, first_line

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte symbols + the document separator
MAX_VOCAB = 1 << 20


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DrcError(
            f"vocab size {vocab_size} is out of range: byte-level BPE needs {MIN_VOCAB}..{MAX_VOCAB} "
            "(256 bytes + <|endoftext|> at least); pass e.g. --vocab-size 4096"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE. Deterministic for the same texts in the same order."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def tokenizer_hash(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def recorded_hash(directory: str | Path) -> str | None:
    """The tokenizer sha256 that ``directory`` records for its ``tokenizer.json``: ``meta.json`` of a prepared
    corpus or ``corpus_meta.json`` of a shipped model copy; None when neither records one."""
    import json

    for name in ("meta.json", "corpus_meta.json"):
        f = Path(directory) / name
        if f.is_file():
            try:
                meta = json.loads(f.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(meta, dict) and isinstance(meta.get("tokenizer_sha256"), str):
                return meta["tokenizer_sha256"]
    return None


def load_tokenizer(path: str | Path, sha256: str | None = None) -> Tokenizer:
    """The byte-level BPE tokenizer (``tokenizers.Tokenizer``) in ``path``: a ``tokenizer.json`` file, or a directory
    holding one (a prepared corpus, or a shipped model copy like ``data/reference``). Its sha256 is checked against
    ``sha256`` or, when that is None, against the hash its directory records (:func:`recorded_hash`), so a replaced
    file is never used silently. A missing, unreadable or replaced file is a one-line :class:`DrcError`;
    ``tok.encode(text).ids`` gives the token ids, ``tok.decode(ids)`` the text."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise DrcError(f"no tokenizer at '{p}': run `python -m drc_core.data prepare --out {p.parent}` first")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise DrcError(f"'{p}' is not a readable tokenizer ({first_line(exc, 120)}): restore it, or prepare the "
                       "corpus again with --force") from None
    want = sha256 if sha256 is not None else recorded_hash(p.parent)
    if want is not None and tokenizer_hash(tok) != want:
        raise DrcError(f"'{p}' is not the tokenizer recorded beside it (sha256 {tokenizer_hash(tok)[:12]}..., "
                       f"recorded {want[:12]}...): the file was replaced; restore it, or prepare the corpus again "
                       "with --force")
    return tok

"""Byte-level BPE, trained with Hugging Face ``tokenizers`` on the training split only."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from drc_core.errors import DrcError

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


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The byte-level BPE tokenizer (``tokenizers.Tokenizer``) in ``path``: a ``tokenizer.json`` file, or a directory
    holding one (a prepared corpus, or a shipped model copy like ``data/reference``). A missing file is a one-line
    :class:`DrcError`; ``tok.encode(text).ids`` gives the token ids, ``tok.decode(ids)`` the text."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise DrcError(f"no tokenizer at '{p}': run `python -m drc_core.data prepare --out {p.parent}` first")
    return Tokenizer.from_file(str(p))

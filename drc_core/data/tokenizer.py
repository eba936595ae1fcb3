"""Byte-level BPE, trained with Hugging Face ``tokenizers`` on the training split only."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from drc_core.errors import MAX_JSON_BYTES, MAX_VOCAB, DrcError, first_line
from drc_core.guard import parse_json, read_regular

EOT = "<|endoftext|>"
# the document separator under the names other models' tokenizers give it (a tokenizer passed to prepare)
EOT_NAMES = (EOT, "<|end_text|>", "<|end_of_text|>", "</s>", "<eos>")
MIN_VOCAB = 257  # 256 byte symbols + the document separator
__all__ = ["EOT", "EOT_NAMES", "MAX_VOCAB", "MIN_VOCAB", "check_vocab_size", "encode_checked", "eot_id",
           "load_tokenizer", "recorded_hash", "tokenizer_hash", "train_bpe"]


def _is_panic(exc: BaseException) -> bool:
    """The Rust library's panic (``pyo3_runtime.PanicException``, a BaseException), reported as one line."""
    return type(exc).__name__ == "PanicException"


def check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DrcError(f"vocab size {vocab_size} is out of range: byte-level BPE needs {MIN_VOCAB}..{MAX_VOCAB} "
                       "(256 bytes + <|endoftext|> at least); pass e.g. --vocab-size 4096")


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE. Deterministic for the same texts in the same order."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def tokenizer_hash(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def recorded_hash(directory: str | Path) -> str | None:
    """The tokenizer sha256 that ``directory``'s ``meta.json`` or ``corpus_meta.json`` records, else None."""
    for name in ("meta.json", "corpus_meta.json"):
        try:  # missing or not a regular file: an OSError or a DrcError (a ValueError)
            meta = parse_json(read_regular(Path(directory) / name, name))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("tokenizer_sha256"), str):
            return meta["tokenizer_sha256"]
    return None


def load_tokenizer(path: str | Path, sha256: str | None = None) -> Tokenizer:
    """The tokenizer in ``path`` (a ``tokenizer.json`` or a directory holding one), its sha256 checked against
    ``sha256`` or the hash its directory records; a missing, unreadable or replaced file is a one-line
    :class:`DrcError`."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise DrcError(f"tokenizer path {path!r} is not a path: pass a tokenizer.json or a directory holding one")
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise DrcError(f"no tokenizer at '{p}': run `python -m drc_core.data prepare --out {p.parent}` first")
    raw = read_regular(p, "a tokenizer.json", MAX_JSON_BYTES)  # a FIFO, a device, too large: its own one line
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except BaseException as exc:  # tokenizers raises a bare Exception for a malformed file, or panics
        if not isinstance(exc, Exception) and not _is_panic(exc):
            raise
        why = first_line(exc, 120) if isinstance(exc, Exception) else \
            f"the tokenizers library panicked: {first_line(exc, 100)}"
        raise DrcError(f"'{p}' is not a readable tokenizer ({why}): restore it, or prepare the corpus again with "
                       "--force") from None
    want = sha256 if sha256 is not None else recorded_hash(p.parent)
    if want is not None and tokenizer_hash(tok) != want:
        raise DrcError(f"'{p}' is not the tokenizer recorded beside it (sha256 {tokenizer_hash(tok)[:12]}..., "
                       f"recorded {str(want)[:12]}...): the file was replaced; restore it, or prepare the corpus "
                       "again with --force")
    return tok


def encode_checked(tok: Tokenizer, text: str, max_tokens: int, what: str = "text") -> list[int]:
    """The token ids of ``text``, or a one-line :class:`DrcError` when it is not valid Unicode, holds more than
    ``max_tokens`` ids (refused from its length before tokenizing where it must) or the library fails on it."""
    if not isinstance(tok, Tokenizer):
        raise DrcError(f"tokenizer={tok!r} is not a tokenizers.Tokenizer: pass the model's own, e.g. "
                       "drc_core.load(path).tokenizer")
    if not isinstance(text, str):
        raise DrcError(f"{what} is {type(text).__name__}, not a str: pass text or token ids")
    try:
        n_bytes = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise DrcError(f"{what} holds an unpaired surrogate (character {exc.start}, {text[exc.start]!r}) and is "
                       "not valid Unicode: pass valid text, e.g. decoded with errors='replace'") from None
    # no token covers more bytes than the vocabulary's longest entry; 4x: room for a normalizer that shortens text
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tok.get_vocab()), default=1) or 1
    if n_bytes > 4 * max_tokens * longest:
        raise DrcError(f"{what} has {n_bytes:,} bytes, more than {max_tokens:,} tokens can hold (the limit): pass "
                       f"a shorter text, at most {max_tokens:,} tokens")
    try:
        ids = tok.encode(text).ids
    except Exception as exc:
        raise DrcError(f"the tokenizer cannot encode {what}: {first_line(exc, 120)}") from None
    except BaseException as exc:
        if not _is_panic(exc):
            raise
        raise DrcError(f"the tokenizers library panicked on {what} ({first_line(exc, 100)}): the tokenizer file is "
                       "malformed; restore it") from None
    if len(ids) > max_tokens:
        raise DrcError(f"{what} has {len(ids):,} tokens, more than the limit of {max_tokens:,}: pass a shorter text")
    return ids


def eot_id(tok: Tokenizer, where: str = "the tokenizer") -> int:
    """The id of the first of :data:`EOT_NAMES` the tokenizer has, else a one-line :class:`DrcError`."""
    for name in EOT_NAMES:
        if (found := tok.token_to_id(name)) is not None:
            return int(found)
    raise DrcError(f"{where} has no end-of-text token (none of {', '.join(EOT_NAMES)}): pass a tokenizer that "
                   "has one, e.g. one written by prepare")

"""Token classes from decoded text, and mean convergence depth per class with bootstrap CIs.

Every token gets one :class:`TokenClass`, by the first rule that matches its decoded text ("core": the text with
surrounding whitespace stripped):

1. ``special``: an added special token (``<|endoftext|>``), or a text that decodes to "";
2. ``whitespace``: whitespace only (the paper's one class);
3. ``number``: optional leading whitespace, then digits only (``"1,000"`` arrives as three tokens);
4. ``punctuation``: a non-empty core without letters or digits (symbols included);
5. ``continuation``: a *word piece* (anything left) without leading whitespace that starts with a word character
   (letter, digit or partial UTF-8 byte) right after a token ending in one (``"ong"`` in ``" C|ong|ress"``);
6. ``function``: the first piece of a word whose whole text (with its continuation pieces), lower-cased and
   stripped, is in :data:`FUNCTION_WORDS`; its later pieces stay ``continuation``;
7. ``content``: every other word piece that starts a word.

:func:`classify_sequence` uses context: a piece starts a new word at the start of a row or after a non-word
character (rule 5); rule 6 looks ahead (``" the|ory"`` is content); a clitic split as ``"'"`` then ``"s"`` after a
word character is ``function``; each maximal run of partial UTF-8 tokens is decoded together and is
``punctuation`` when it has no letter or digit (em dash), else word pieces. :func:`classify_vocab` has no context:
rule 5 needs no previous token, rule 6 reads the piece alone and a partial UTF-8 id is a word piece. Clitics
(``'s``, ...) are function words; other mixes of letters and punctuation (``"-based"``) are looked up without their
surrounding punctuation; curly apostrophes count as ``'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import pandas as pd

from drc_core.analysis.intervals import bootstrap_ci, percentile_interval
from drc_core.errors import DrcError, need_int, need_level


class TokenClass(StrEnum):
    SPECIAL = "special"
    WHITESPACE = "whitespace"
    NUMBER = "number"
    PUNCTUATION = "punctuation"
    CONTINUATION = "continuation"
    FUNCTION = "function"
    CONTENT = "content"


# Codes used internally; the order is that of TokenClass.
_SPECIAL, _WS, _NUM, _PUNCT, _CONT, _FUNC, _CONTENT = range(len(TokenClass))
_NAMES = np.array([c.value for c in TokenClass], dtype=object)

# ------------------------------------------------------------------------------------ closed classes


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# the closed classes of English; auxiliaries include the stems GPT-2 pre-tokenization cuts off before "'t"
# ("don't" -> "don" + "'t"), but not "won" (usually the verb) and "ain"
FUNCTION_WORD_CATEGORIES: dict[str, frozenset[str]] = {
    "determiners": _words(
        "the a an this that these those my your his her its our their whose which what whatever whichever some any no "
        "every each either neither all both half several many much more most few fewer fewest little less least enough "
        "such another other thy"
    ),
    "pronouns": _words(
        "i me mine myself you yours yourself yourselves he him himself she hers herself it itself we us ours ourselves "
        "they them theirs themselves one oneself who whom whoever whomever someone somebody something anyone anybody "
        "anything everyone everybody everything nobody nothing none thee thou ye thine"
    ),
    "prepositions": _words(
        "about above across after against along amid amidst among amongst around as at before behind below beneath "
        "beside besides between beyond by concerning despite down during except for from in inside into like near of "
        "off on onto out outside over past per regarding since than through throughout till to toward towards under "
        "underneath unlike until unto up upon via with within without versus"
    ),
    "conjunctions": _words(
        "and or but nor so yet for because although though while whilst whereas if unless whether lest once when "
        "whenever where wherever whereby why how"
    ),
    "auxiliaries": _words(
        "be am is are was were been being have has had having do does did will would shall should can could may might "
        "must ought don doesn didn isn aren wasn weren hasn haven hadn wouldn shouldn couldn mustn cannot"
    ),
    "particles": _words("to not there"),
    "clitics": _words("'s 't 're 've 'm 'll 'd n't"),
}
FUNCTION_WORDS: frozenset[str] = frozenset().union(*FUNCTION_WORD_CATEGORIES.values())
_MAX_FUNCTION_BYTES = max(len(w.encode()) for w in FUNCTION_WORDS) + 4  # room for leading whitespace

_REPLACEMENT = "\ufffd"
_APOSTROPHES = ("'", "\u2019")

# --------------------------------------------------------------------------------- byte-level pieces


# The GPT-2 byte-level map from the stand-in character back to its byte: printable bytes (not space) stand for
# themselves, the others, in increasing order, for code points 256, 257, ...
_PRINTABLE = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
_BYTE_OF = {chr(b): b for b in _PRINTABLE} | {
    chr(256 + k): b for k, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}


def _token_bytes(tokenizer, i: int, special: bool) -> tuple[bytes, str]:
    """The raw bytes of id ``i`` and its decoded text (U+FFFD for partial UTF-8)."""
    piece = tokenizer.id_to_token(i)
    if piece is None:
        return b"", ""
    if special:
        return piece.encode(), piece
    if piece and all(ch in _BYTE_OF for ch in piece):
        raw = bytes(_BYTE_OF[ch] for ch in piece)
        return raw, raw.decode("utf-8", errors="replace")
    text = tokenizer.decode([i])  # not a byte-level vocabulary: trust the decoder
    return text.encode(), text


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == _REPLACEMENT


def _is_function(text: str) -> bool:
    key = text.strip().lower().replace("\u2019", "'")
    return key in FUNCTION_WORDS or key.strip("\"()[]{}<>.,;:!?-_*/\\|`~") in FUNCTION_WORDS


def _classify_text(text: str, partial: bool) -> int:
    """Context-free rules 2-7 for one non-special token."""
    if not text:
        return _SPECIAL
    if text.isspace():
        return _WS
    if text.lstrip().isdigit():
        return _NUM
    if not partial and not any(ch.isalnum() for ch in text.strip()):
        return _PUNCT
    if not text[0].isspace() and _is_word_char(text[0]):
        return _CONT
    return _FUNC if not partial and _is_function(text) else _CONTENT


@dataclass(frozen=True)
class VocabFeatures:
    """Per-id features, computed once per tokenizer (``vocab_features``)."""

    base: np.ndarray  # int8 class code, context-free
    raw: list[bytes]  # raw bytes per id
    lead_ws: np.ndarray  # text starts with whitespace
    first_word: np.ndarray  # first character is a word character (or partial byte)
    last_word: np.ndarray  # last character is a word character (or partial byte); False for specials
    partial: np.ndarray  # bytes are not valid UTF-8 on their own
    function_self: np.ndarray  # the piece alone is a function word
    apostrophe: np.ndarray  # the stripped text is a lone apostrophe
    nbytes: np.ndarray


def vocab_features(tokenizer) -> VocabFeatures:
    """Decode every id once and derive the features the classifiers use."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    added = getattr(tokenizer, "get_added_tokens_decoder", dict)()
    specials = {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    base = np.empty(n, np.int8)
    lead_ws, first_word, last_word, partial, function_self, apostrophe = (np.zeros(n, bool) for _ in range(6))
    raw_all: list[bytes] = []
    for i in range(n):
        special = i in specials
        raw, text = _token_bytes(tokenizer, i, special)
        raw_all.append(raw)
        partial[i] = part = text.encode() != raw  # the bytes are no valid UTF-8 (text has U+FFFD in their place)
        if special:
            base[i] = _SPECIAL
            continue
        base[i] = _classify_text(text, part)
        if text:
            lead_ws[i] = text[0].isspace()
            first_word[i] = _is_word_char(text[0])
            last_word[i] = _is_word_char(text[-1])
            function_self[i] = not part and _is_function(text)
            apostrophe[i] = text.strip() in _APOSTROPHES
    return VocabFeatures(base, raw_all, lead_ws, first_word, last_word, partial, function_self, apostrophe,
                         np.array([len(r) for r in raw_all], np.int64))


def classify_vocab(tokenizer) -> list[str]:
    """One class per id, without context (see the module docstring); index = token id."""
    return _NAMES[vocab_features(tokenizer).base].tolist()


def classify_sequence(tokenizer, ids, features: VocabFeatures | None = None) -> list:
    """Class names of ``ids`` (1-D: one stream; 2-D: rows that each start fresh), same shape, using the previous and
    following tokens. ``features=vocab_features(tokenizer)`` reuses the per-id decoding across calls."""
    arr = np.asarray(ids)
    if arr.ndim not in (1, 2):
        raise DrcError(f"ids must be 1-D or 2-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DrcError(f"ids must be integers, got dtype {arr.dtype}")
    f = features if features is not None else vocab_features(tokenizer)
    flat = arr.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= len(f.base)):
        raise DrcError(f"ids must lie in 0..{len(f.base) - 1} (the tokenizer's vocabulary), "
                         f"got {flat.min()}..{flat.max()}")
    codes = _classify_flat(f, flat, row_len=arr.shape[-1] if arr.ndim == 2 else max(flat.size, 1))
    return _NAMES[codes].reshape(arr.shape).tolist()


def _classify_flat(f: VocabFeatures, ids: np.ndarray, row_len: int) -> np.ndarray:
    n = ids.size
    codes = f.base[ids].copy()
    if n == 0:
        return codes
    row_start = np.zeros(n, bool)
    row_start[::row_len] = True
    wordpiece = f.base[ids] >= _CONT  # a word piece: continuation, function or content
    last_word = f.last_word[ids].copy()

    # partial UTF-8 runs: decode each maximal run together
    partial = f.partial[ids]
    if partial.any():
        nxt_row_start = np.r_[row_start[1:], True]
        run_first = np.flatnonzero(partial & (row_start | ~np.r_[False, partial[:-1]]))
        run_end = np.flatnonzero(partial & (nxt_row_start | ~np.r_[partial[1:], False])) + 1
        for s, e in zip(run_first, run_end, strict=True):
            text = b"".join(f.raw[i] for i in ids[s:e]).decode("utf-8", errors="replace")
            if text.strip() and not any(ch.isalnum() for ch in text):
                codes[s:e] = _PUNCT
                wordpiece[s:e] = False
                last_word[s:e] = False
            else:
                last_word[e - 1] = _is_word_char(text[-1]) if text else False

    prev_word = np.r_[False, last_word[:-1]] & ~row_start
    cont = wordpiece & ~f.lead_ws[ids] & f.first_word[ids] & prev_word
    start = wordpiece & ~cont
    codes[cont] = _CONT

    # a word is a start piece plus the continuation pieces right after it
    nxt_cont = np.r_[cont[1:], False] & ~np.r_[row_start[1:], False]
    single = start & ~nxt_cont
    codes[single] = np.where(f.function_self[ids[single]], _FUNC, _CONTENT)
    multi = np.flatnonzero(start & nxt_cont)
    if multi.size:
        codes[multi] = _CONTENT
        group = np.cumsum(~cont | row_start)  # one group per word start (or other non-continuation)
        group_bytes = np.bincount(group, weights=f.nbytes[ids])
        short = multi[group_bytes[group[multi]] <= _MAX_FUNCTION_BYTES]
        for s in short:
            e = np.searchsorted(group, group[s], side="right")  # the word's pieces: its group, s..e-1
            text = b"".join(f.raw[i] for i in ids[s:e]).decode("utf-8", errors="replace")
            if _REPLACEMENT not in text and _is_function(text):
                codes[s] = _FUNC

    # split clitics: word char, "'", then letters ("Nation|'|s")
    idx = np.arange(2, n)
    ok = (single[idx] & ~f.lead_ws[ids[idx]] & f.apostrophe[ids[idx - 1]] & last_word[idx - 2]
          & ~row_start[idx] & ~row_start[idx - 1])
    for i in idx[ok]:
        text = f.raw[ids[i]].decode("utf-8", errors="replace")
        if ("'" + text.strip().lower()) in FUNCTION_WORD_CATEGORIES["clitics"]:
            codes[i] = _FUNC
    return codes


# --------------------------------------------------------------------------------- depth per class


def _token_boot_means(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap means of ``x`` resampled with replacement (a multinomial draw over few distinct values)."""
    n = x.size
    values, counts = np.unique(x, return_counts=True)
    if values.size <= 4096:
        draws = rng.multinomial(n, counts / n, size=n_boot)
        return draws @ values / n
    out = np.empty(n_boot)
    chunk = max(1, 4_000_000 // n)
    for b in range(0, n_boot, chunk):
        m = min(chunk, n_boot - b)
        out[b : b + m] = x[rng.integers(0, n, size=(m, n))].mean(axis=1)
    return out


def class_depth_summary(classes: Sequence[str], depths, doc_ids=None, n_boot: int = 1000, seed: int = 0,
                        level: float = 0.95) -> pd.DataFrame:
    """Mean convergence depth per token class (``classes``, ``depths``: per token, aligned), with a percentile
    bootstrap CI that resamples documents (``doc_ids``; the same draws for every class), else tokens within each
    class. Rows by mean depth: ``class``, ``count``, ``share``, ``n_docs`` (NaN without ``doc_ids``),
    ``mean_depth``, ``median_depth``, ``ci_low``, ``ci_high``."""
    cls = np.asarray(classes).reshape(-1).astype(str)
    d = np.asarray(depths, dtype=float).reshape(-1)
    if cls.size != d.size:
        raise DrcError(f"classes and depths differ in length ({cls.size} vs {d.size}): pass one class per depth")
    if cls.size == 0:
        raise DrcError("no tokens: classes and depths are empty")
    if not np.isfinite(d).all():
        raise DrcError(f"depths has {int((~np.isfinite(d)).sum())} non-finite values: drop or cap them first")
    n_boot = need_int("n_boot", n_boot, 1)
    level = need_level(level)

    names, cls_code = np.unique(cls, return_inverse=True)
    k = names.size
    counts = np.bincount(cls_code, minlength=k)
    means = np.bincount(cls_code, weights=d, minlength=k) / counts
    medians = np.array([np.median(d[cls_code == c]) for c in range(k)])
    if doc_ids is None:
        n_docs = np.full(k, np.nan)
        rng = np.random.default_rng(seed)
        boot = np.column_stack([_token_boot_means(d[cls_code == c], n_boot, rng) for c in range(k)])
        lo, hi = percentile_interval(boot, level)
    else:
        docs = np.asarray(doc_ids).reshape(-1)
        if docs.size != d.size:
            raise DrcError(f"doc_ids and depths differ in length ({docs.size} vs {d.size}): pass one doc id per token")
        by_class = np.full((d.size, k), np.nan)  # column c: the depths of class c's tokens, NaN elsewhere
        by_class[np.arange(d.size), cls_code] = d
        n_docs = np.array([np.unique(docs[cls_code == c]).size for c in range(k)], dtype=float)
        _, lo, hi = bootstrap_ci(by_class, docs, n_boot=n_boot, seed=seed, level=level)

    out = pd.DataFrame({"class": names, "count": counts, "share": counts / counts.sum(), "n_docs": n_docs,
                        "mean_depth": means, "median_depth": medians, "ci_low": lo, "ci_high": hi})
    return out.sort_values(["mean_depth", "class"], kind="stable").reset_index(drop=True)


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own (``tokenizer.decode([id])``); a special token that decodes to nothing shows
    its name, and without a tokenizer the id itself (``#17``)."""
    cache: dict[int, str] = {}
    out = []
    for i in (int(v) for v in ids):
        if i not in cache:
            if tokenizer is None:
                cache[i] = f"#{i}"
            else:
                text = tokenizer.decode([i])
                if text == "" and hasattr(tokenizer, "id_to_token"):
                    text = tokenizer.id_to_token(i) or ""
                cache[i] = text or f"<{i}>"
        out.append(cache[i])
    return out

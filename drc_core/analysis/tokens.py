"""Token classes from decoded text, and mean convergence depth per class with bootstrap CIs.

Every token gets exactly one :class:`TokenClass`. The rules are applied in this order (the first that
matches wins); "text" is the token's decoded text, "core" the text with surrounding whitespace stripped:

1. ``special``      -- an added *special* token of the tokenizer (``<|endoftext|>``), or a token whose
                       text decodes to the empty string.
2. ``whitespace``   -- the text is whitespace only (spaces, tabs, newlines: ``" "``, ``"\\n\\n"``).
                       The paper's "whitespace" class is exactly this one class (no space/newline split).
3. ``number``       -- optional leading whitespace followed by digits only (``"17"``, ``" 1790"``).
                       The GPT-2 pre-tokenizer never merges digits with letters or punctuation, so
                       ``"1,000"`` arrives as number, punctuation, number.
4. ``punctuation``  -- the core is non-empty and has no letter or digit (``","``, ``" ."``, ``"$"``,
                       ``"--"``; symbols count as punctuation).
5. ``continuation`` -- a *word piece* (anything left: the core contains a letter, or the token holds
                       a partial UTF-8 sequence) that has no leading whitespace, starts with a word
                       character (a letter or digit, or a partial UTF-8 byte), and directly follows a
                       token whose text ends in a word character (``"ong"`` in ``" C|ong|ress"``,
                       ``"s"`` in ``"1790|s"``).
6. ``function``     -- a word piece that starts a word, when the *whole word* (this piece plus the
                       continuation pieces after it), lower-cased and stripped, is in
                       :data:`FUNCTION_WORDS`. Only the word's first piece is ``function``; its later
                       pieces stay ``continuation``.
7. ``content``      -- every other word piece that starts a word.

Context (``classify_sequence``). Rule 5 looks at the previous token: a piece without a leading space is
a continuation only after a word character, so ``"The"`` after ``"\\n"``, after ``<|endoftext|>``, at the
start of a sequence (or of a row of a 2-D batch), or ``"N"`` after a lone ``" "`` token starts a new
word and goes through rules 6-7. Rule 6 looks ahead: ``" the"`` followed by ``"ory"`` is the first
piece of ``" theory"``, so it is ``content``, not ``function``.

Context-free (``classify_vocab``, one class per id). There is no previous token, so every word piece
without leading whitespace that starts with a word character is ``continuation``, and rule 6 looks up
the piece's own text (``" the"`` is ``function``).

Letters mixed with punctuation. Byte-level GPT-2 pre-tokenization only mixes them in the English
clitics ``'s 't 're 've 'm 'll 'd``. Such a token is a word piece that never counts as a continuation
(it starts with an apostrophe); it is looked up as is, and the clitics are in :data:`FUNCTION_WORDS`
(category ``clitics``). When the clitic arrives split (``"'"`` then ``"s"``) after a word character,
``classify_sequence`` looks up ``"'" + piece`` for the letters, so ``"s"`` in ``"Nation|'|s"`` is
``function``. Any other mix (from other tokenizers, e.g. ``"-based"``) is a word piece looked up with
its surrounding punctuation removed. Curly apostrophes (U+2019) are normalised to ``'`` for lookups.

Partial UTF-8. A byte-level id can hold part of a multi-byte character (the three bytes of an em dash
may be three tokens); on its own it decodes to U+FFFD. ``classify_vocab`` treats such an id as a word
piece: ``continuation`` without a leading space, else ``content``. ``classify_sequence`` first decodes
each maximal run of consecutive partial tokens together: if the run's text has no letter or digit
(em dash, curly quotes) every token of the run is ``punctuation``; otherwise (``"ï"`` in
``"naïvely"``) its tokens are word pieces, a partial byte counts as a word character, and rules 5-7
apply as usual (so ``" na|\\xc3|\\xaf|ve|ly"`` is content then four continuations).
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
_CLASSES = list(TokenClass)
_CODE = {c: i for i, c in enumerate(_CLASSES)}
_SPECIAL, _WS, _NUM, _PUNCT, _CONT, _FUNC, _CONTENT = range(len(_CLASSES))
_NAMES = np.array([c.value for c in _CLASSES], dtype=object)

# ------------------------------------------------------------------------------------ closed classes


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


DETERMINERS = _words(
    "the a an this that these those my your his her its our their whose which what whatever whichever "
    "some any no every each either neither all both half several many much more most few fewer fewest "
    "little less least enough such another other thy"
)
PRONOUNS = _words(
    "i me mine myself you yours yourself yourselves he him himself she hers herself it itself we us "
    "ours ourselves they them theirs themselves one oneself who whom whoever whomever someone somebody "
    "something anyone anybody anything everyone everybody everything nobody nothing none thee thou ye "
    "thine"
)
PREPOSITIONS = _words(
    "about above across after against along amid amidst among amongst around as at before behind below "
    "beneath beside besides between beyond by concerning despite down during except for from in inside "
    "into like near of off on onto out outside over past per regarding since than through throughout "
    "till to toward towards under underneath unlike until unto up upon via with within without "
    "versus"
)
CONJUNCTIONS = _words(
    "and or but nor so yet for because although though while whilst whereas if unless whether lest once "
    "when whenever where wherever whereby why how"
)
AUXILIARIES = _words(
    # primary auxiliaries, modals, and the stems that GPT-2 pre-tokenization cuts off before "'t"
    # ("don't" -> "don" + "'t"); "won" (won't) and "ain" are left out: "won" is usually the verb.
    "be am is are was were been being have has had having do does did will would shall should can "
    "could may might must ought don doesn didn isn aren wasn weren hasn haven hadn wouldn shouldn "
    "couldn mustn cannot"
)
PARTICLES = _words("to not there")
CLITICS = _words("'s 't 're 've 'm 'll 'd n't")

FUNCTION_WORD_CATEGORIES: dict[str, frozenset[str]] = {
    "determiners": DETERMINERS,
    "pronouns": PRONOUNS,
    "prepositions": PREPOSITIONS,
    "conjunctions": CONJUNCTIONS,
    "auxiliaries": AUXILIARIES,
    "particles": PARTICLES,
    "clitics": CLITICS,
}
FUNCTION_WORDS: frozenset[str] = frozenset().union(*FUNCTION_WORD_CATEGORIES.values())
_MAX_FUNCTION_BYTES = max(len(w.encode()) for w in FUNCTION_WORDS) + 4  # room for leading whitespace

_REPLACEMENT = "\ufffd"
_APOSTROPHES = ("'", "\u2019")

# --------------------------------------------------------------------------------- byte-level pieces


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level map from the printable stand-in character back to its byte.

    Bytes that are printable and not space map to themselves; the remaining bytes, in increasing
    order, map to code points 256, 257, ...
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF = _byte_level_alphabet()


def _special_ids(tokenizer) -> set[int]:
    getter = getattr(tokenizer, "get_added_tokens_decoder", None)
    if getter is None:
        return set()
    return {int(i) for i, tok in getter().items() if getattr(tok, "special", False)}


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


def _lookup_key(text: str) -> str:
    key = text.strip().lower().replace("\u2019", "'")
    if key in FUNCTION_WORDS:
        return key
    return key.strip("\"()[]{}<>.,;:!?-_*/\\|`~")


def _is_function(text: str) -> bool:
    return _lookup_key(text) in FUNCTION_WORDS


def _classify_text(text: str, partial: bool) -> int:
    """Context-free rules 2-7 for one non-special token."""
    if not text:
        return _SPECIAL
    if text.isspace():
        return _WS
    core = text.lstrip()
    if core.isdigit():
        return _NUM
    stripped = text.strip()
    if not partial and not any(ch.isalnum() for ch in stripped):
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
    wordpiece: np.ndarray  # base class is continuation/function/content
    function_self: np.ndarray  # the piece alone is a function word
    apostrophe: np.ndarray  # the stripped text is a lone apostrophe
    nbytes: np.ndarray


def vocab_features(tokenizer) -> VocabFeatures:
    """Decode every id once and derive the features the classifiers use."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    specials = _special_ids(tokenizer)
    base = np.empty(n, np.int8)
    lead_ws, first_word, last_word, partial, function_self, apostrophe = (np.zeros(n, bool) for _ in range(6))
    nbytes = np.zeros(n, np.int64)
    raw_all: list[bytes] = []
    for i in range(n):
        special = i in specials
        raw, text = _token_bytes(tokenizer, i, special)
        raw_all.append(raw)
        nbytes[i] = len(raw)
        try:
            raw.decode("utf-8")
            part = False
        except UnicodeDecodeError:
            part = True
        partial[i] = part
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
    wordpiece = (base == _CONT) | (base == _FUNC) | (base == _CONTENT)
    return VocabFeatures(base, raw_all, lead_ws, first_word, last_word, partial, wordpiece, function_self,
                         apostrophe, nbytes)


def classify_vocab(tokenizer) -> list[str]:
    """One class per id, without context (see the module docstring); index = token id."""
    return _NAMES[vocab_features(tokenizer).base].tolist()


def classify_sequence(tokenizer, ids, features: VocabFeatures | None = None) -> list:
    """Classes of a token sequence, using the previous and following tokens (see the module docstring).

    ``ids`` is 1-D (one stream; ``<|endoftext|>`` separates documents) or 2-D (independent rows, e.g.
    windows; each row starts fresh). Returns a list of class names of the same shape (nested for 2-D).
    Pass ``features=vocab_features(tokenizer)`` to reuse the per-id decoding across calls.
    """
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
    names = _NAMES[codes]
    return names.reshape(arr.shape).tolist()


def _classify_flat(f: VocabFeatures, ids: np.ndarray, row_len: int) -> np.ndarray:
    n = ids.size
    codes = f.base[ids].copy()
    if n == 0:
        return codes
    row_start = np.zeros(n, bool)
    row_start[::row_len] = True
    wordpiece = f.wordpiece[ids].copy()
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
            e = s + 1
            while e < n and cont[e] and not row_start[e]:
                e += 1
            text = b"".join(f.raw[i] for i in ids[s:e]).decode("utf-8", errors="replace")
            if _REPLACEMENT not in text and _is_function(text):
                codes[s] = _FUNC

    # split clitics: word char, "'", then letters ("Nation|'|s")
    idx = np.arange(2, n)
    ok = (single[idx] & ~f.lead_ws[ids[idx]] & f.apostrophe[ids[idx - 1]] & last_word[idx - 2]
          & ~row_start[idx] & ~row_start[idx - 1])
    after_apos = idx[ok]
    for i in after_apos:
        text = f.raw[ids[i]].decode("utf-8", errors="replace")
        if ("'" + text.strip().lower()) in CLITICS:
            codes[i] = _FUNC
    return codes


# --------------------------------------------------------------------------------- depth per class


def _token_boot_means(x: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap means resampling the values of ``x`` with replacement.

    With few distinct values (integer depths) a resample is a multinomial draw over the distinct
    values, which has exactly the same distribution and needs no per-token indices.
    """
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
    """Mean convergence depth per token class, with a percentile bootstrap CI of the mean.

    ``classes`` and ``depths`` (finite numbers) are per token, flat and aligned. With ``doc_ids`` (one
    per token) the bootstrap resamples whole documents with replacement -- the same documents for every
    class in a replicate -- and a class's replicate mean is its pooled mean over the drawn documents'
    tokens; this respects the correlation of tokens within a document. Without ``doc_ids`` it resamples
    tokens within each class. Deterministic for a given ``seed``.

    Returns one row per class, sorted by mean depth (shallowest first), with columns ``class``,
    ``count``, ``share`` (of all tokens), ``n_docs`` (documents holding the class; NaN without
    ``doc_ids``), ``mean_depth``, ``median_depth``, ``ci_low`` and ``ci_high``.
    """
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
            raise DrcError(f"doc_ids and depths differ in length ({docs.size} vs {d.size}): pass one doc id "
                             "per token")
        by_class = np.full((d.size, k), np.nan)  # column c: the depths of class c's tokens, NaN elsewhere
        by_class[np.arange(d.size), cls_code] = d
        n_docs = np.array([np.unique(docs[cls_code == c]).size for c in range(k)], dtype=float)
        _, lo, hi = bootstrap_ci(by_class, docs, n_boot=n_boot, seed=seed, level=level)

    out = pd.DataFrame({
        "class": names,
        "count": counts,
        "share": counts / counts.sum(),
        "n_docs": n_docs,
        "mean_depth": means,
        "median_depth": medians,
        "ci_low": lo,
        "ci_high": hi,
    })
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

"""Token classes (decoded-text rules, context rule, partial UTF-8) and depth-per-class bootstrap summaries."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from drc_core.analysis.tokens import (
    FUNCTION_WORD_CATEGORIES,
    FUNCTION_WORDS,
    TokenClass,
    class_depth_summary,
    classify_sequence,
    classify_vocab,
    vocab_features,
)
from drc_core.data import PrepareConfig, SourceSpec, prepare
from drc_core.data.sampler import Corpus
from drc_core.data.sources import sotu_speech_files
from drc_core.data.tokenizer import EOT, train_bpe


@pytest.fixture(scope="module")
def tok():
    return train_bpe([p.read_text() for p in sotu_speech_files()[:8]], 600)


@pytest.fixture(scope="module")
def vocab(tok):
    return classify_vocab(tok)


def one_id(tok, text: str) -> int:
    ids = tok.encode(text).ids
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens in the test tokenizer: pick another string"
    return ids[0]


def seq(tok, text: str) -> list[tuple[str, str]]:
    ids = tok.encode(text).ids
    return list(zip([tok.decode([i]) for i in ids], classify_sequence(tok, ids), strict=True))


# ------------------------------------------------------------------------------------ the word lists


def test_function_words_are_a_closed_lowercase_list():
    assert len(FUNCTION_WORDS) >= 200
    assert set(FUNCTION_WORD_CATEGORIES) >= {"determiners", "pronouns", "prepositions", "conjunctions",
                                             "auxiliaries", "particles"}
    assert all(isinstance(v, frozenset) for v in FUNCTION_WORD_CATEGORIES.values())
    assert all(w == w.lower() and w.strip() == w for w in FUNCTION_WORDS)
    assert {"the", "of", "and", "is", "to", "not", "would", "they", "between"} <= FUNCTION_WORDS
    assert not {"congress", "nation", "government", "war"} & FUNCTION_WORDS


# ------------------------------------------------------------------------------------ per-id classes


def test_vocab_classes_of_hand_made_strings(tok, vocab):
    assert len(vocab) == tok.get_vocab_size()
    assert set(vocab) <= {c.value for c in TokenClass}
    for word in (" the", " of", " and", " is"):
        assert vocab[one_id(tok, word)] == "function", word
    congress = tok.encode(" Congress").ids
    assert vocab[congress[0]] == "content" and all(vocab[i] == "continuation" for i in congress[1:])
    long_word = tok.encode(" unconstitutionally").ids
    assert len(long_word) >= 3 and all(vocab[i] == "continuation" for i in long_word[1:-1])
    for ws in ("\n", " ", "\t"):
        assert vocab[one_id(tok, ws)] == "whitespace", repr(ws)
    for i in tok.encode("\n\n").ids:
        assert vocab[i] == "whitespace"
    year = tok.encode(" 1790").ids
    assert {vocab[i] for i in year} <= {"number", "whitespace"} and "number" in {vocab[i] for i in year}
    assert all(vocab[i] == "number" for i in year if tok.decode([i]).strip())
    for p in (",", ".", ";", "$"):
        assert vocab[one_id(tok, p)] == "punctuation", p
    assert vocab[tok.token_to_id(EOT)] == "special"


def test_partial_utf8_ids_follow_the_leading_space_rule(tok, vocab):
    f = vocab_features(tok)
    partial = np.flatnonzero(f.partial)
    assert partial.size >= 64  # the 128 bytes >= 0x80 are in the alphabet
    for i in partial:
        expected = "content" if f.raw[i][:1].isspace() else "continuation"
        assert vocab[i] == expected, (i, f.raw[i])


def test_byte_level_bytes_agree_with_the_decoder(tok):
    f = vocab_features(tok)
    eot = tok.token_to_id(EOT)
    for i in range(tok.get_vocab_size()):
        if i != eot:
            assert f.raw[i].decode("utf-8", errors="replace") == tok.decode([i]), i


# ------------------------------------------------------------------------------------ context


def test_sequence_classes_of_a_sentence(tok):
    got = seq(tok, "The Congress of the United States is not 1790, and the theory\n\n")
    assert got[0] == ("The", "function")  # document start: not a continuation
    texts = [t for t, _ in got]
    c = texts.index(" C")
    assert got[c][1] == "content" and got[c + 1][1] == got[c + 2][1] == "continuation"
    assert dict((t, k) for t, k in got if t in (" of", " is", " not", " and")) == {
        " of": "function", " is": "function", " not": "function", " and": "function"}
    assert all(k == "number" for t, k in got if t.strip().isdigit())
    assert (",", "punctuation") in got and got[-1] == ("\n", "whitespace")
    # look-ahead: " the" that starts " theory" is the first piece of a content word
    th = len(texts) - 1 - texts[::-1].index(" the")
    assert texts[th + 1] != " " and got[th][1] == "content"
    assert all(k == "continuation" for _, k in got[th + 1 : -2])


def test_same_id_is_continuation_only_after_a_word_character(tok):
    ong, c, nl, sp = (one_id(tok, s) for s in ("ong", " C", "\n", " "))
    eot = tok.token_to_id(EOT)
    assert classify_sequence(tok, [c, ong]) == ["content", "continuation"]
    assert classify_sequence(tok, [nl, ong]) == ["whitespace", "content"]
    assert classify_sequence(tok, [sp, ong]) == ["whitespace", "content"]
    assert classify_sequence(tok, [eot, ong]) == ["special", "content"]
    assert classify_sequence(tok, [ong]) == ["content"]
    # 2-D input: every row starts fresh
    assert classify_sequence(tok, np.array([[c, ong], [ong, ong]])) == [["content", "continuation"],
                                                                        ["content", "continuation"]]
    text = "The\nThe"
    assert [k for _, k in seq(tok, text)] == ["function", "whitespace", "function"]
    assert classify_sequence(tok, []) == []


def test_clitics_and_split_function_words(tok):
    got = seq(tok, " Nation's don't")
    assert ("'", "punctuation") in got
    assert got[got.index(("'", "punctuation")) + 1] == ("s", "function")
    d = [t for t, _ in got].index(" d")
    assert got[d] == (" d", "function")  # " d" + "on" is the auxiliary stem "don"
    assert got[d + 1] == ("on", "continuation") and got[-1] == ("t", "function")


def test_partial_utf8_runs_decode_together(tok):
    ids = tok.encode(" naïvely").ids
    f = vocab_features(tok)
    assert f.partial[ids].any()  # "ï" is split into bytes in this small vocabulary
    classes = classify_sequence(tok, ids)
    assert classes[0] == "content" and set(classes[1:]) == {"continuation"}
    # an em dash and curly quotes are runs of partial bytes with no letter: punctuation, not words
    for text in (" —", "\n“", "”"):
        ids = tok.encode(text).ids
        got = classify_sequence(tok, ids)
        assert all(k == "punctuation" for i, k in zip(ids, got, strict=True) if f.partial[i]), (text, got)
    assert classify_sequence(tok, tok.encode("\n“The").ids)[-1] == "function"  # "The" starts a word
    assert classify_sequence(tok, tok.encode("the—The").ids)[-1] == "function"


def test_classify_sequence_on_a_prepared_corpus(tmp_path):
    prepare(PrepareConfig(source=SourceSpec("sotu", max_docs=20), out=str(tmp_path / "c"), vocab_size=512,
                          seq_len=64), progress=False)
    corpus = Corpus.open(tmp_path / "c")
    tokens = np.asarray(corpus.tokens("val"))
    classes = classify_sequence(corpus.tokenizer(), tokens)
    assert len(classes) == len(tokens)
    counts = pd.Series(classes).value_counts()
    assert {"function", "content", "continuation", "punctuation", "special"} <= set(counts.index)
    assert counts["special"] == (tokens == corpus.tokenizer().token_to_id(EOT)).sum()
    assert counts["function"] > 0.1 * len(tokens)


def test_classify_sequence_rejects_bad_ids(tok):
    with pytest.raises(ValueError, match="vocabulary"):
        classify_sequence(tok, [0, 600])
    with pytest.raises(ValueError, match="1-D or 2-D"):
        classify_sequence(tok, np.zeros((2, 2, 2), int))


# ------------------------------------------------------------------------------------ depth summary


def _fake(n_per_class: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    classes = np.repeat(["whitespace", "function", "content"], n_per_class)
    depths = np.concatenate([rng.integers(1, 6, n_per_class), rng.integers(4, 10, n_per_class),
                             rng.integers(8, 16, n_per_class)])
    return classes, depths


def test_summary_columns_order_and_ci_contains_mean():
    classes, depths = _fake(500)
    s = class_depth_summary(classes, depths, n_boot=300)
    assert list(s.columns) == ["class", "count", "share", "n_docs", "mean_depth", "median_depth", "ci_low",
                               "ci_high"]
    assert list(s["class"]) == ["whitespace", "function", "content"]  # shallowest first
    assert (s["count"] == 500).all() and np.isclose(s["share"].sum(), 1.0)
    assert ((s.ci_low <= s.mean_depth) & (s.mean_depth <= s.ci_high)).all()
    assert np.allclose(s.mean_depth, [depths[classes == c].mean() for c in s["class"]])
    # non-integer depths take the index-resampling path
    f = class_depth_summary(classes, depths + np.linspace(0, 0.5, depths.size), n_boot=200)
    assert ((f.ci_low <= f.mean_depth) & (f.mean_depth <= f.ci_high)).all()


def test_ci_narrows_with_more_data():
    small = class_depth_summary(*_fake(50), n_boot=400).set_index("class")
    big = class_depth_summary(*_fake(5000), n_boot=400).set_index("class")
    assert ((big.ci_high - big.ci_low) < 0.5 * (small.ci_high - small.ci_low)).all()


def test_cluster_bootstrap_differs_from_token_bootstrap_when_documents_differ():
    rng = np.random.default_rng(1)
    n_docs, per_doc = 20, 100
    doc_ids = np.repeat(np.arange(n_docs), per_doc)
    doc_shift = rng.normal(0, 3, n_docs)[doc_ids]  # documents differ strongly in mean depth
    depths = 10 + doc_shift + rng.normal(0, 1, doc_ids.size)
    classes = np.where(rng.random(doc_ids.size) < 0.5, "function", "content")
    tokens = class_depth_summary(classes, depths, n_boot=500).set_index("class")
    docs = class_depth_summary(classes, depths, doc_ids=doc_ids, n_boot=500).set_index("class")
    assert np.allclose(tokens.mean_depth, docs.mean_depth)
    assert ((docs.ci_high - docs.ci_low) > 2 * (tokens.ci_high - tokens.ci_low)).all()
    assert (docs.n_docs == n_docs).all() and tokens.n_docs.isna().all()
    assert ((docs.ci_low <= docs.mean_depth) & (docs.mean_depth <= docs.ci_high)).all()


def test_summary_is_deterministic_by_seed():
    classes, depths = _fake(200)
    docs = np.arange(depths.size) % 13
    for d in (None, docs):
        a = class_depth_summary(classes, depths, doc_ids=d, n_boot=200, seed=3)
        b = class_depth_summary(classes, depths, doc_ids=d, n_boot=200, seed=3)
        c = class_depth_summary(classes, depths, doc_ids=d, n_boot=200, seed=4)
        pd.testing.assert_frame_equal(a, b)
        assert not np.allclose(a.ci_low, c.ci_low)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"classes": ["a", "b"], "depths": [1.0]}, "differ in length"),
    ({"n_boot": 0}, "n_boot=0 is invalid; it must be an integer >= 1"),
    ({"n_boot": 2.5}, "n_boot=2.5 is invalid; it must be an integer >= 1"),
    ({"doc_ids": [0]}, "doc_ids and depths differ in length"),
    ({"depths": [1.0, float("nan")]}, "non-finite"),
    ({"classes": [], "depths": []}, "no tokens"),
    ({"level": 1.5}, "level=1.5 is invalid; it must lie strictly between 0 and 1"),
])
def test_summary_rejects_bad_input_with_one_line(kwargs, match):
    args = {"classes": ["a", "b"], "depths": [1.0, 2.0]} | kwargs
    with pytest.raises(ValueError, match=match) as err:
        class_depth_summary(**args)
    assert "\n" not in str(err.value)

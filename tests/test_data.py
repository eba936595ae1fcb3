"""Data pipeline: sources, document split, tokenizer, cache, memmaps, sampler and bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from drc_core.data import (
    Corpus,
    PrepareConfig,
    SourceSpec,
    WindowSampler,
    eval_windows,
    load_documents,
    prepare,
    split_documents,
    train_bpe,
)
from drc_core.data.__main__ import main as data_main
from drc_core.data.sources import sotu_speech_files
from drc_core.data.tokenizer import EOT, tokenizer_hash
from drc_core.errors import DrcError, run_cli


def _speeches(n: int) -> list[str]:
    return [f.read_text() for f in sotu_speech_files()[:n]]


@pytest.fixture(scope="session")
def fineweb_parquet(tmp_path_factory) -> Path:
    """A parquet shard with FineWeb-Edu's column schema, filled with real English prose."""
    texts = [p for s in _speeches(6) for p in s.split("\n\n") if len(p) > 400][:60]
    frame = pd.DataFrame(
        {
            "text": texts,
            "id": [f"<urn:uuid:{i:08d}>" for i in range(len(texts))],
            "dump": "CC-MAIN-2024-10",
            "url": [f"https://example.org/{i}" for i in range(len(texts))],
            "file_path": "s3://commoncrawl/fixture.warc.gz",
            "language": "en",
            "language_score": 0.97,
            "token_count": [len(t.split()) for t in texts],
            "score": 3.1,
            "int_score": 3,
        }
    )
    path = tmp_path_factory.mktemp("fineweb") / "000_00000.parquet"
    frame.to_parquet(path, index=False)
    return path


@pytest.fixture()
def txt_dir(tmp_path) -> Path:
    d = tmp_path / "txt"
    d.mkdir()
    for i, s in enumerate(_speeches(8)):
        (d / f"doc{i}.txt").write_text(s[:20000])
    return d


def _cfg(tmp_path, spec: SourceSpec, **kw) -> PrepareConfig:
    kw.setdefault("vocab_size", 512)
    kw.setdefault("seq_len", 64)
    return PrepareConfig(source=spec, out=str(tmp_path / "out"), **kw)


def _digest(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


# ------------------------------------------------------------------------------------------ sources


def test_fineweb_edu_path_on_parquet_fixture(tmp_path, fineweb_parquet):
    spec = SourceSpec("fineweb-edu", data_files=(str(fineweb_parquet),), max_docs=40)
    docs = load_documents(spec)
    assert len(docs) == 40 and set(docs["source"]) == {"fineweb-edu"}
    assert docs[0]["doc_id"] == "<urn:uuid:00000000>"
    res = prepare(_cfg(tmp_path, spec), progress=False)
    assert res.meta["documents"]["train"] + res.meta["documents"]["val"] == 40
    assert res.meta["source"] == "fineweb-edu"


def test_fineweb_edu_needs_max_docs_and_schema(tmp_path, fineweb_parquet):
    with pytest.raises(DrcError, match="--max-docs"):
        load_documents(SourceSpec("fineweb-edu", data_files=(str(fineweb_parquet),)))
    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"content": ["x" * 100]}).to_parquet(bad)
    with pytest.raises(DrcError, match="schema"):
        load_documents(SourceSpec("fineweb-edu", data_files=(str(bad),), max_docs=3))


def test_local_txt_jsonl_parquet(tmp_path, txt_dir):
    texts = _speeches(6)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t[:5000], "id": f"j{i}"}) + "\n"
                                              for i, t in enumerate(texts)))
    pd.DataFrame({"text": [t[:5000] for t in texts]}).to_parquet(tmp_path / "b.parquet")
    docs = load_documents(SourceSpec("local", paths=(str(txt_dir), str(tmp_path / "a.jsonl"),
                                                     str(tmp_path / "b.parquet"))))
    assert len(docs) == 8 + 6 + 6
    assert "j3" in docs["doc_id"]
    assert docs[0]["text"] == (txt_dir / "doc0.txt").read_text()


def test_embedded_default_slice(tmp_path):
    spec = SourceSpec("wikipedia+sotu", max_docs=6)
    docs = load_documents(spec)
    assert sorted(set(docs["source"])) == ["sotu", "wikipedia"]
    wiki = [t for t, s in zip(docs["text"], docs["source"], strict=True) if s == "wikipedia"]
    assert len(wiki) == 6 and all("'''" not in t for t in wiki)
    assert wiki[0].split("\n")[0] == docs["doc_id"][0]  # the article starts with its title
    res = prepare(_cfg(tmp_path, spec), progress=False)
    per = res.meta["per_source"]
    assert {"train/sotu", "val/sotu", "train/wikipedia", "val/wikipedia"} <= set(per)


# ------------------------------------------------------------------------------ split and tokenizer


def test_split_is_by_document_and_deterministic(tmp_path, txt_dir):
    spec = SourceSpec("local", paths=(str(txt_dir),))
    res = prepare(_cfg(tmp_path, spec, val_fraction=0.25), progress=False)
    corpus = Corpus.open(res.out)
    docs = corpus.docs
    train_ids = set(docs[docs.split == "train"].doc_id)
    val_ids = set(docs[docs.split == "val"].doc_id)
    assert train_ids and val_ids and not train_ids & val_ids
    # the index ranges tile each memmap exactly, each document ending in <|endoftext|>
    eot = corpus.meta["eot_id"]
    for split in ("train", "val"):
        toks = corpus.tokens(split)
        part = docs[docs.split == split]
        assert part.tok_start.iloc[0] == 0 and part.tok_end.iloc[-1] == len(toks)
        assert (part.tok_start.iloc[1:].to_numpy() == part.tok_end.iloc[:-1].to_numpy()).all()
        assert (toks[part.tok_end.to_numpy() - 1] == eot).all()
    # a validation document's text never reaches the training tokens
    tok = corpus.tokenizer()
    val_row = docs[docs.split == "val"].iloc[0]
    decoded = tok.decode(corpus.tokens("val")[val_row.tok_start : val_row.tok_end - 1].tolist())
    assert decoded == Path(val_row.doc_id).read_text()
    assert decoded[:2000] not in tok.decode(corpus.tokens("train").tolist())
    mask = split_documents(["a"] * 10 + ["b"] * 4, 0.25, seed=3)
    assert (mask == split_documents(["a"] * 10 + ["b"] * 4, 0.25, seed=3)).all()
    assert mask[:10].sum() >= 1 and mask[10:].sum() >= 1 and not mask.all()
    assert not (mask == split_documents(["a"] * 10 + ["b"] * 4, 0.25, seed=4)).all()


def test_tokenizer_is_deterministic_and_round_trips():
    texts = _speeches(4)
    a, b = train_bpe(texts, 600), train_bpe(texts, 600)
    assert tokenizer_hash(a) == tokenizer_hash(b)
    assert a.get_vocab_size() == 600 and a.token_to_id(EOT) == 0
    sample = "The Congress shall — naïvely — assemble 1791 times.\n\n"
    assert a.decode(a.encode(sample).ids) == sample


def test_prepare_is_deterministic_across_runs(tmp_path, txt_dir):
    spec = SourceSpec("local", paths=(str(txt_dir),))
    r1 = prepare(PrepareConfig(spec, out=str(tmp_path / "x"), vocab_size=512, seq_len=64), progress=False)
    r2 = prepare(PrepareConfig(spec, out=str(tmp_path / "y"), vocab_size=512, seq_len=64), progress=False)
    d1, d2 = _digest(r1.out), _digest(r2.out)
    assert d1.pop("meta.json") != d2.pop("meta.json")  # it records its own output path...
    assert d1 == d2  # ...while tokens, index and tokenizer are byte-identical
    assert r1.meta["tokenizer_sha256"] == r2.meta["tokenizer_sha256"]


def test_uint32_when_vocab_exceeds_uint16():
    from drc_core.data.prepare import token_dtype

    assert token_dtype(65536) is np.uint16 and token_dtype(65537) is np.uint32


# ------------------------------------------------------------------------------------------- cache


def test_cache_hit_and_miss(tmp_path, txt_dir, capsys):
    spec = SourceSpec("local", paths=(str(txt_dir),))
    cfg = _cfg(tmp_path, spec)
    first = prepare(cfg, progress=False)
    before = _digest(first.out)
    again = prepare(cfg, progress=False)
    assert again.cached and not first.cached and _digest(again.out) == before
    # the CLI says so
    args = ["prepare", "--source", "local", "--path", str(txt_dir), "--out", cfg.out, "--vocab-size", "512",
            "--seq-len", "64", "--quiet"]
    assert data_main(args) == 0
    assert "nothing to do" in capsys.readouterr().out
    # changed inputs rebuild: another vocab, then an edited file
    assert not prepare(_cfg(tmp_path, spec, vocab_size=600), progress=False).cached
    (txt_dir / "doc0.txt").write_text("A changed document about the Union and its prospects. " * 50)
    rebuilt = prepare(_cfg(tmp_path, spec, vocab_size=600), progress=False)
    assert not rebuilt.cached and rebuilt.meta["vocab_size"] == 600


# ------------------------------------------------------------------------------------- bad input


def _fails(args: list[str], capsys, match: str) -> None:
    assert run_cli(data_main, args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and match in err, err


@pytest.fixture()
def prepared(tmp_path, txt_dir):
    cfg = _cfg(tmp_path, SourceSpec("local", paths=(str(txt_dir),)))
    res = prepare(cfg, progress=False)
    return res.out, _digest(res.out)


def _cli(out: Path, *extra: str) -> list[str]:
    return ["prepare", "--out", str(out), "--vocab-size", "512", "--seq-len", "64", "--quiet", *extra]


def test_bad_inputs_fail_cleanly_and_keep_prepared_data(tmp_path, prepared, capsys):
    out, digest = prepared
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n\n ")
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_bytes("caf\xe9 au lait ".encode("latin-1") * 20)
    small = tmp_path / "small"
    small.mkdir()
    for i in range(3):
        (small / f"s{i}.txt").write_text(f"A short note number {i}.")
    cases = [
        (["--source", "local", "--path", str(tmp_path / "missing")], "does not exist"),
        (["--source", "local", "--path", str(empty)], "no non-empty documents"),
        (["--source", "local", "--path", str(latin)], "not valid UTF-8 (byte 0xe9 at offset 3)"),
        (["--source", "local", "--path", str(small)], "fewer than seq_len+1"),
        (["--source", "wikipedia+nonsense"], "unknown source 'nonsense'"),
        (["--source", "local", "--path", str(small), "--vocab-size", "100"], "vocab size 100 is out of range"),
        (["--source", "local", "--path", str(small), "--vocab-size", str(1 << 21)], "out of range"),
        (["--source", "local", "--path", str(small), "--val-fraction", "1.5"], "between 0 and 1"),
    ]
    for extra, match in cases:
        _fails(_cli(out, *extra), capsys, match)
        assert _digest(out) == digest, f"{extra} touched the prepared corpus"
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []


def test_refuses_to_overwrite_foreign_directory(tmp_path, txt_dir, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    _fails(["prepare", "--source", "local", "--path", str(txt_dir), "--out", str(foreign), "--quiet"], capsys,
           "not a prepared corpus")
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_single_document_cannot_be_split(tmp_path, txt_dir, capsys):
    _fails(_cli(tmp_path / "o", "--source", "local", "--path", str(txt_dir / "doc0.txt")), capsys,
           "at least 2")


# ------------------------------------------------------------------------------------------ sampler


def test_window_sampler_is_seeded_resumable_and_rank_consistent():
    toks = np.arange(10_000, dtype=np.uint16)
    s = WindowSampler(toks, seq_len=32, batch_size=8, seed=1)
    x, y = next(s)
    assert x.shape == (8, 32) and (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == x[:, -1] + 1).all()
    x2, _ = next(s)
    t = WindowSampler(toks, seq_len=32, batch_size=8, seed=1)
    t.load_state_dict({"step": 1, "seed": 1})
    assert (next(t)[0] == x2).all()
    assert not (WindowSampler(toks, 32, 8, seed=2).batch(0)[0] == x).all()
    halves = [WindowSampler(toks, 32, 8, seed=1, rank=r, world_size=2).batch(0)[0] for r in range(2)]
    assert (np.concatenate(halves) == x.numpy()).all()
    with pytest.raises(DrcError, match="divisible"):
        WindowSampler(toks, 32, 7, world_size=2)
    with pytest.raises(DrcError, match="seed"):
        t.load_state_dict({"step": 0, "seed": 9})


def test_eval_windows_cover_the_split_in_order():
    toks = np.arange(1000, dtype=np.uint16)
    w = eval_windows(toks, 100)
    assert w.shape == (9, 101) and w[1, 0] == 100 and w[-1, -1] == 900
    assert eval_windows(toks, 100, max_windows=3).shape == (3, 101)
    with pytest.raises(DrcError):
        eval_windows(toks[:50], 100)


@pytest.mark.slow
def test_full_embedded_default_corpus(tmp_path):
    """The whole default corpus, as `make book` prepares it: both sources, both splits, sane sizes."""
    res = prepare(PrepareConfig(out=str(tmp_path / "default")), progress=False)
    m = res.meta
    assert m["source"] == "wikipedia+sotu" and m["vocab_size"] == 4096
    assert m["documents"] == {"train": 319, "val": 36}
    assert 3.0e6 < m["tokens"]["train"] < 4.0e6 and 3.5e5 < m["tokens"]["val"] < 6e5
    assert m["per_source"]["val/wikipedia"]["documents"] == 11
    assert prepare(PrepareConfig(out=str(tmp_path / "default")), progress=False).cached

"""Prepare a corpus: read documents, split by document, train BPE on train, write token memmaps.

``out`` holds ``train.bin`` / ``val.bin`` (token ids, uint16 or uint32, <|endoftext|> after each document),
``docs.parquet`` (one row per document), ``labels.parquet`` (depth-tasks only, :mod:`drc_core.data.labels`),
``tokenizer.json`` and ``meta.json`` (counts, tokenizer hash, the input fingerprint: a rerun with the same inputs
does nothing). Everything is built in a temporary sibling and swapped in only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from drc_core.data.depth_tasks import SOURCE_NAME as TASK_SOURCE
from drc_core.data.depth_tasks import solve, token_labels
from drc_core.data.labels import LABELS_FILE, LABELS_VERSION, labels_version, write_labels
from drc_core.data.sampler import Corpus
from drc_core.data.sources import SourceSpec, fingerprint, load_documents
from drc_core.data.tokenizer import check_vocab_size, eot_id, load_tokenizer, tokenizer_hash, train_bpe
from drc_core.errors import MAX_SEED, MAX_SEQ_LEN, DrcError, first_line, need_disk
from drc_core.guard import exclusive, parse_json, read_regular, remove_leftovers

FORMAT_VERSION = 2
DEFAULT_OUT = "data/corpus/default"


@dataclass
class PrepareConfig:
    source: SourceSpec = field(default_factory=SourceSpec)
    out: str = DEFAULT_OUT
    vocab_size: int = 4096
    val_fraction: float = 0.1
    seed: int = 0
    seq_len: int = 256  # each split must hold at least one window of seq_len + 1 tokens
    force: bool = False
    tokenizer: str = ""  # a tokenizer.json (or a directory with one) to use instead of training a BPE

    def validate(self) -> None:
        if not isinstance(self.source, SourceSpec):
            raise DrcError(f"source={self.source!r} is not a SourceSpec: pass SourceSpec('sotu'), for example")
        for name in ("out", "tokenizer"):
            v = getattr(self, name)
            if not isinstance(v, str | os.PathLike) or (name == "out" and not str(v)):
                raise DrcError(f"{name}={v!r} is not a path: pass a directory path for out, a tokenizer.json path "
                               "(or '') for tokenizer")
        if not isinstance(self.force, bool):
            raise DrcError(f"force={self.force!r} must be True or False")
        check_vocab_size(self.vocab_size)
        for name in ("seq_len", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise DrcError(f"{name}={v!r} must be an integer")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, int | float) or not (
                0.0 < self.val_fraction < 1.0):
            raise DrcError(f"val fraction {self.val_fraction!r} must be strictly between 0 and 1: e.g. 0.1")
        if self.seq_len < 1:
            raise DrcError(f"seq_len {self.seq_len} must be positive: e.g. --seq-len 256")
        if self.seq_len > MAX_SEQ_LEN:
            raise DrcError(f"seq_len {self.seq_len} is above the limit of {MAX_SEQ_LEN}: e.g. --seq-len 256")
        if self.seed < 0 or self.seed > MAX_SEED:
            raise DrcError(f"seed {self.seed} must be >= 0 and < 2**63: e.g. --seed 0")
        max_docs = self.source.max_docs
        if max_docs is not None and (isinstance(max_docs, bool) or not isinstance(max_docs, int)):
            raise DrcError(f"--max-docs {max_docs!r} must be an integer")
        if self.source.max_docs is not None and self.source.max_docs < 1:
            raise DrcError(f"--max-docs {self.source.max_docs} must be >= 1 (documents per source), or left out to "
                           "read every document")
        self.source.parts()

    def fingerprint(self) -> str:
        blob = {"format": FORMAT_VERSION, "source": fingerprint(self.source), "vocab_size": self.vocab_size,
                "val_fraction": self.val_fraction, "seed": self.seed, "seq_len": self.seq_len}
        if self.tokenizer:  # left out when empty: corpora prepared before the option keep their fingerprint
            blob["tokenizer"] = tokenizer_hash(load_tokenizer(self.tokenizer))
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


@dataclass
class PrepareResult:
    out: Path
    meta: dict
    cached: bool
    seconds: float


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def split_documents(sources: list[str], val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of validation documents: per source (at least one in each split), seeded by the seed and the
    source's name, so a source keeps its validation documents in any mix."""
    sources_arr = np.asarray(sources)
    is_val = np.zeros(len(sources_arr), dtype=bool)
    for src in sorted(set(sources)):
        idx = np.flatnonzero(sources_arr == src)
        if len(idx) < 2:
            raise DrcError(f"source '{src}' has {len(idx)} document(s): a document-level split needs at least 2; add "
                           "text or raise --max-docs")
        rng = np.random.default_rng([seed, zlib.crc32(src.encode())])
        n_val = min(len(idx) - 1, max(1, round(val_fraction * len(idx))))
        is_val[rng.permutation(idx)[:n_val]] = True
    return is_val


def is_prepared(out: Path) -> bool:
    return (out / "meta.json").exists()


CORPUS_FILES = frozenset({"train.bin", "val.bin", "docs.parquet", "tokenizer.json", "meta.json", LABELS_FILE})


def _encode(tok, texts: list[str], labelled: list[bool], eot_id: int, desc: str,
            progress: bool) -> tuple[list[np.ndarray], list[dict], int]:
    """Token ids of each document (with <|endoftext|> after it), the label rows of the ``labelled`` documents
    (``doc``, ``pos``, ...) and how many answers were left out because the tokenizer splits them."""
    chunks, labels, split_answers = [], [], 0
    with tqdm(total=len(texts), desc=desc, unit="doc", disable=not progress) as bar:
        for start in range(0, len(texts), 64):
            batch = texts[start : start + 64]
            for i, enc in enumerate(tok.encode_batch(batch), start=start):
                chunks.append(np.asarray(enc.ids + [eot_id], dtype=np.int64))
                if labelled[i]:
                    answers = solve(texts[i])
                    found = token_labels(texts[i], enc, strict=False, answers=answers)
                    labels += [{"doc": i, "pos": pos, "k": a.k, "family": a.family, "answer": a.word,
                                "problem": a.problem} for pos, a in found]
                    split_answers += len(answers) - len(found)
            bar.update(len(batch))
    return chunks, labels, split_answers


def prepare(cfg: PrepareConfig, progress: bool = True) -> PrepareResult:
    """Build (or find cached) the prepared corpus of ``cfg``, under the lock of ``out``; ``out`` is replaced only
    when it holds nothing but a corpus's own files (:data:`CORPUS_FILES`)."""
    t0 = time.perf_counter()
    cfg.validate()
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise DrcError(f"output '{out}' is a file: pass a directory to --out")
    with exclusive(out, "corpus directory"):
        remove_leftovers(out)
        return _prepare(cfg, out, progress, t0)


def _prepare(cfg: PrepareConfig, out: Path, progress: bool, t0: float) -> PrepareResult:
    """Read the sources, train or load the tokenizer, tokenize, label and write into a temporary sibling that
    replaces ``out`` only when complete (one function: the steps share their data and read in order)."""
    if out.is_dir() and any(out.iterdir()) and not is_prepared(out):
        raise DrcError(f"output '{out}' holds files that are not a prepared corpus: choose an empty --out")
    fp = cfg.fingerprint()
    if is_prepared(out) and not cfg.force:
        try:
            meta = parse_json(read_regular(out / "meta.json", "a corpus's meta.json"))
            files = list(meta["files"])
            if not all(isinstance(f, str) and f in CORPUS_FILES for f in files):
                raise ValueError("its files are not a corpus's")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DrcError(f"'{out}' holds a damaged prepared corpus (meta.json: {first_line(exc, 120)}): rebuild it "
                           "with --force, or choose another --out") from None
        if meta.get("fingerprint") == fp and all((out / f).exists() for f in files) and (
                LABELS_FILE not in files or labels_version(out / LABELS_FILE) == LABELS_VERSION):
            Corpus.open(out)  # up to date only if intact: sizes, the tokenizer's hash, the token ids
            return PrepareResult(out, meta, cached=True, seconds=time.perf_counter() - t0)
    if foreign := sorted(p.name for p in out.iterdir() if p.name not in CORPUS_FILES) if out.is_dir() else []:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DrcError(f"output '{out}' holds a prepared corpus and other files ({shown}) that rebuilding it would "
                       "delete: move them out of it, or choose another --out (nothing was changed)")

    docs = load_documents(cfg.source).to_dict()  # plain lists: a Dataset column indexed row by row costs ~0.5 ms a row
    texts: list[str] = docs["text"]
    sources: list[str] = docs["source"]
    doc_ids: list[str] = docs["doc_id"]
    is_val = split_documents(sources, cfg.val_fraction, cfg.seed)
    train_idx, val_idx = np.flatnonzero(~is_val), np.flatnonzero(is_val)

    train_texts = [texts[i] for i in train_idx]
    if cfg.tokenizer:  # e.g. another model's: a corpus it can read (the vocabulary is that tokenizer's)
        tok = load_tokenizer(cfg.tokenizer)
        eot = eot_id(tok, f"tokenizer '{cfg.tokenizer}'")
    else:
        tok = train_bpe(train_texts, cfg.vocab_size, length=len(train_texts))
        eot = eot_id(tok)
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)

    rows, counts, label_rows, unlabelled = [], {}, [], {}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        for split, idx in (("train", train_idx), ("val", val_idx)):
            chunks, labels, n_split = _encode(tok, [texts[i] for i in idx], [sources[i] == TASK_SOURCE for i in idx],
                                              eot, f"tokenize {split}", progress)
            starts = np.cumsum([0] + [len(c) for c in chunks])
            total = int(starts[-1])
            if total < cfg.seq_len + 1:
                raise DrcError(f"{split} split has {total} tokens, fewer than seq_len+1={cfg.seq_len + 1}: add text, "
                               "raise --val-fraction/--max-docs, or lower --seq-len")
            # buffered writes after checking the free space: a full disk raises ENOSPC, a memmap would die with SIGBUS
            need_disk(tmp, total * np.dtype(dtype).itemsize, f"{split}.bin ({total:,} tokens)")
            with open(tmp / f"{split}.bin", "wb") as f:
                f.writelines(np.ascontiguousarray(c, dtype=dtype).tobytes() for c in chunks)
            label_rows += [{"split": split, **r, "token": int(starts[r["doc"]] + r["pos"]),
                            "doc_id": doc_ids[idx[r["doc"]]]} for r in labels]
            for i, c, a in zip(idx, chunks, starts[:-1], strict=True):
                rows.append({"split": split, "source": sources[i], "doc_id": doc_ids[i], "n_chars": len(texts[i]),
                             "n_bytes": len(texts[i].encode()), "tok_start": a, "tok_end": a + len(c)})
            counts[split] = total
            unlabelled[split] = n_split
        tok.save(str(tmp / "tokenizer.json"))
        frame = pd.DataFrame(rows)
        frame.to_parquet(tmp / "docs.parquet", index=False)
        files = ["train.bin", "val.bin", "docs.parquet", "tokenizer.json", "meta.json"]
        if label_rows:
            write_labels(tmp / LABELS_FILE, pd.DataFrame(label_rows))
            files.append(LABELS_FILE)
        per_source = {f"{split}/{src}": {"documents": int(len(g)), "characters": int(g.n_chars.sum()),
                                         "tokens": int((g.tok_end - g.tok_start).sum())}
                      for (split, src), g in frame.groupby(["split", "source"])}
        meta = {"format": FORMAT_VERSION, "source": cfg.source.name, "config": {**asdict(cfg), "force": False},
                "fingerprint": fp, "documents": {"train": int(len(train_idx)), "val": int(len(val_idx))},
                "characters": {s: int(frame[frame.split == s].n_chars.sum()) for s in ("train", "val")},
                "tokens": counts, "per_source": per_source, "vocab_size": vocab, "vocab_size_requested": cfg.vocab_size,
                "eot_id": eot, "dtype": np.dtype(dtype).name, "tokenizer_sha256": tokenizer_hash(tok), "seed": cfg.seed,
                "files": files}
        if TASK_SOURCE in cfg.source.parts():  # answers labelled, and left out because the tokenizer splits the word
            labelled = {s: int(sum(r["split"] == s for r in label_rows)) for s in ("train", "val")}
            meta["depth_task_answers"] = {"labelled": labelled, "split_answers": unlabelled}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        # the old out is removed only after the rename; a run killed between the two renames leaves .<out>.old-*,
        # which the next run renames back (drc_core.guard.remove_leftovers)
        old = out.with_name(f".{out.name}.old-{os.getpid()}") if out.exists() else None
        if old is not None:
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(out, meta, cached=False, seconds=time.perf_counter() - t0)

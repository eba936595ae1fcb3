"""The depth-task label table of a prepared corpus (``labels.parquet``): one row per answer token of a
``depth-tasks`` document, with its ``split``, ``doc_id``, ``doc`` (index within the split), ``pos`` (token index in
the document), ``token`` (index in ``<split>.bin``), ``k`` (:func:`drc_core.data.depth_tasks.solve`), ``family``,
``answer`` and ``problem``. The file records :data:`LABELS_VERSION`, the labelling rule; a table of an older rule
is refused (version 2 counts an answered question as a shortcut for the questions after it).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from drc_core.errors import DrcError, first_line

LABELS_FILE = "labels.parquet"
LABEL_COLUMNS = ("split", "doc_id", "doc", "pos", "token", "k", "family", "answer", "problem")
LABELS_VERSION = 2  # bump when depth_tasks.solve labels the same text otherwise
_VERSION_KEY = b"drc_labels_version"


def write_labels(path: Path, frame: pd.DataFrame) -> None:
    frame = frame.loc[:, list(LABEL_COLUMNS)].astype({"doc": "int64", "pos": "int64", "token": "int64",
                                                      "k": "int64", "problem": "int64"})
    table = pa.Table.from_pandas(frame, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), _VERSION_KEY: str(LABELS_VERSION).encode()})
    pq.write_table(table, path)


def labels_version(path: Path) -> int:
    """The labelling rule a label file was written with (1: files from before the version was recorded)."""
    meta = pq.read_schema(path).metadata or {}
    return int(meta.get(_VERSION_KEY, b"1"))


def read_labels(corpus_dir: str | Path, split: str | None = None) -> pd.DataFrame:
    """The labels of a prepared corpus (all splits, or one). A corpus without depth tasks is a :class:`DrcError`."""
    p = Path(corpus_dir) / LABELS_FILE
    if not p.is_file():
        raise DrcError(f"corpus '{corpus_dir}' has no {LABELS_FILE}: prepare it with the depth-tasks source, e.g. "
                       f"`python -m drc_core.data prepare --source wikipedia+sotu+depth-tasks --out {corpus_dir}`")
    try:
        version = labels_version(p)
        frame = pd.read_parquet(p) if version == LABELS_VERSION else None
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DrcError(f"'{p}' is damaged ({first_line(exc, 120)}): prepare the corpus again with --force") from None
    if frame is None:
        raise DrcError(f"'{p}' holds labels of an older rule (version {version}, now {LABELS_VERSION}: "
                       "k did not count answered questions): prepare the corpus again (the same command)")
    missing = [c for c in LABEL_COLUMNS if c not in frame.columns]
    if missing:
        raise DrcError(f"'{p}' lacks columns {missing}: prepare the corpus again with --force")
    return frame if split is None else frame[frame.split == split].reset_index(drop=True)

"""The depth-task label table of a prepared corpus (``labels.parquet``): one owner of the format.

One row per answer token of a ``depth-tasks`` document:

========== =====================================================================================
split      ``train`` or ``val``
doc_id     the document (``depth-tasks:<index>``)
doc        the document's index within its split
pos        the answer's token index within its document
token      the answer's token index within the split's token file (``<split>.bin``)
k          sequential lookups the answer needs (computed by :func:`drc_core.data.depth_tasks.solve`)
family     ``containers``, ``swaps`` or ``hops``
answer     the answer word
problem    index of the problem (paragraph) in its document
========== =====================================================================================
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from drc_core.errors import DrcError

LABELS_FILE = "labels.parquet"
LABEL_COLUMNS = ("split", "doc_id", "doc", "pos", "token", "k", "family", "answer", "problem")


def write_labels(path: Path, frame: pd.DataFrame) -> None:
    frame = frame.loc[:, list(LABEL_COLUMNS)].astype({"doc": "int64", "pos": "int64", "token": "int64",
                                                      "k": "int64", "problem": "int64"})
    frame.to_parquet(path, index=False)


def read_labels(corpus_dir: str | Path, split: str | None = None) -> pd.DataFrame:
    """The labels of a prepared corpus (all splits, or one). A corpus without depth tasks is a :class:`DrcError`."""
    p = Path(corpus_dir) / LABELS_FILE
    if not p.is_file():
        raise DrcError(f"corpus '{corpus_dir}' has no {LABELS_FILE}: prepare it with the depth-tasks source, e.g. "
                       f"`python -m drc_core.data prepare --source wikipedia+sotu+depth-tasks --out {corpus_dir}`")
    frame = pd.read_parquet(p)
    missing = [c for c in LABEL_COLUMNS if c not in frame.columns]
    if missing:
        raise DrcError(f"'{p}' lacks columns {missing}: prepare the corpus again with --force")
    return frame if split is None else frame[frame.split == split].reset_index(drop=True)

"""The look shared by the depth explorer and every figure built on this library: one template, one height, the
colours of converged / still-updating / undefined tokens, the log floor and the colour scales, and two helpers
(:func:`style` a figure, :func:`need_columns` of a table). Public as ``drc_core.plotting``."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.colors as pcolors
import plotly.graph_objects as go

from drc_core.errors import DrcError

__all__ = ["CONVERGED_COLOR", "HEIGHT", "KL_SCALE", "LOG_FLOOR", "NAN_COLOR", "PALETTE", "SEQ_SCALE", "TEMPLATE",
           "UPDATING_COLOR", "need_columns", "style"]

TEMPLATE = "plotly_white"
HEIGHT = 400
LOG_FLOOR = 1e-10  # log-scale colours clip smaller values (and zeros) to this
NAN_COLOR = "#d9d9d9"  # tokens without a value at a loop (successive KL / state change at loop 1)
CONVERGED_COLOR = "#a6dba0"
UPDATING_COLOR = "#f4a582"
PALETTE = pcolors.qualitative.Plotly
KL_SCALE = ("#1a9850", "#ffffbf", "#d73027")  # low (converged) -> eps -> high (still changing)
SEQ_SCALE = "YlOrRd"


def style(fig: go.Figure, title: str, height: int = HEIGHT, **layout) -> go.Figure:
    """``fig`` with the shared template, ``title`` and ``height`` (and any other layout keys)."""
    layout.setdefault("margin", {"l": 60, "r": 30, "t": 60, "b": 50})
    fig.update_layout(template=TEMPLATE, title=title, height=height, **layout)
    return fig


def need_columns(df: object, columns: Sequence[str], what: str) -> pd.DataFrame:
    """A DataFrame with ``columns``, else one-line DrcError naming the first missing column and the source."""
    if not isinstance(df, pd.DataFrame):
        raise DrcError(f"expected a pandas DataFrame ({what}); got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DrcError(f"the table lacks column {missing[0]!r} (has {list(map(str, df.columns))}); pass {what}")
    if len(df) == 0:
        raise DrcError(f"the table is empty; pass {what}")
    return df

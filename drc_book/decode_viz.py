"""Figures of the decoder comparison (:mod:`drc_book.continuous_speed`): tokens per second of the
dense decoder, the step-synchronous decoder and continuous depth batching, per batch size and rule."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from drc_book.viz import _PALETTE, _need_columns, _style

__all__ = ["decoder_bars"]

_PATH_ORDER = ("dense decode", "generate", "continuous")


def decoder_bars(table: pd.DataFrame) -> go.Figure:
    """Wall-clock speed-up over the dense decoder (bars, one colour per path) for each (batch, rule) of a
    :func:`~drc_book.continuous_speed.time_decoders` table; a marker at the honest-FLOP speed-up
    (what the clock would give if it followed the work) and a dotted line at 1."""
    _need_columns(table, ("batch", "rule", "path", "x_dense", "flop_speedup", "avg_loops", "tokens_per_s"),
                  "the output of drc_book.continuous_speed.time_decoders")
    rows = table[table.path != "dense decode"]
    fig = go.Figure()
    for i, path in enumerate(p for p in _PATH_ORDER if p in set(rows.path)):
        part = rows[rows.path == path]
        x = [[f"batch {b}" for b in part.batch], part.rule.astype(str).tolist()]
        fig.add_bar(x=x, y=part.x_dense, name=path, marker_color=_PALETTE[i], offsetgroup=path,
                    customdata=part[["avg_loops", "tokens_per_s"]].to_numpy(),
                    text=[f"{v:.2f}x" for v in part.x_dense], textposition="outside",
                    hovertemplate="%{x}<br>%{y:.2f}x the dense decoder<br>avg loops %{customdata[0]:.2f}<br>"
                                  "%{customdata[1]:.0f} tokens/s<extra>%{fullData.name}</extra>")
        fig.add_scatter(x=x, y=part.flop_speedup, mode="markers", name=f"honest-FLOP speed-up ({path})",
                        offsetgroup=path, showlegend=i == 0, legendgroup="flops",
                        marker={"symbol": "line-ew-open", "size": 22, "color": "black", "line": {"width": 2}},
                        hovertemplate="%{x}<br>honest FLOPs: %{y:.2f}x<extra></extra>")
    fig.add_hline(y=1, line_dash="dot", line_color="grey")
    return _style(fig, "Decoding speed-up over the dense decoder at depth r", barmode="group", scattermode="group",
                  xaxis_title="batch / rule", yaxis_title="speed-up (x)", legend={"orientation": "h", "y": -0.3})

"""Figures of the known-depth chapter (answers of :mod:`drc_core.data.depth_tasks`, measured by
:mod:`drc_book.known_depth`): accuracy by required lookups and loop, and where each measure of depth
lands for answers of each ``k``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from drc_book.viz import _PALETTE, _band, _need_columns, _style

__all__ = ["accuracy_heatmap", "depth_by_k_figure"]


def accuracy_heatmap(acc: pd.DataFrame, value: str = "acc", title: str = "") -> go.Figure:
    """Rows ``k`` (lookups the answer needs), columns loops; each cell the answers' ``value`` (``acc`` or ``ce``)
    at that loop, from :func:`drc_book.known_depth.accuracy_by_k`. Hover shows the 95% interval."""
    _need_columns(acc, ("k", "loop", value, f"{value}_lo", f"{value}_hi", "n"),
                  "the output of drc_book.known_depth.accuracy_by_k")
    grid = acc.pivot(index="k", columns="loop", values=value)
    lo = acc.pivot(index="k", columns="loop", values=f"{value}_lo").to_numpy()
    hi = acc.pivot(index="k", columns="loop", values=f"{value}_hi").to_numpy()
    n = acc.pivot(index="k", columns="loop", values="n").to_numpy()
    custom = np.stack([lo, hi, n], axis=-1)
    is_acc = value == "acc"
    fig = go.Figure(go.Heatmap(
        z=grid.to_numpy(), x=grid.columns.to_numpy(), y=[str(k) for k in grid.index], customdata=custom,
        colorscale="Viridis" if is_acc else "Viridis_r", zmin=0 if is_acc else None, zmax=1 if is_acc else None,
        colorbar={"title": {"text": "accuracy" if is_acc else "CE (nats)"}},
        hovertemplate="k=%{y}, loop %{x}: %{z:.3f} [%{customdata[0]:.3f}, %{customdata[1]:.3f}], "
                      "n=%{customdata[2]}<extra></extra>"))
    fig.update_xaxes(title_text="loops", dtick=1 if grid.shape[1] <= 16 else 2)
    fig.update_yaxes(title_text="lookups needed (k)")
    return _style(fig, title or ("Answer accuracy" if is_acc else "Answer cross-entropy") + " by k and loop")


def depth_by_k_figure(table: pd.DataFrame, title: str = "") -> go.Figure:
    """One line per ``series`` of ``table`` (columns ``series, k, value, lo, hi``): a loop count for the answers of
    each ``k`` (e.g. convergence depth, commit loop, a rule's exit loop), with its 95% interval as a band, and the
    diagonal ``loops = k`` for reference."""
    _need_columns(table, ("series", "k", "value", "lo", "hi"), "a table with series, k, value, lo, hi")
    fig = go.Figure()
    ks = np.sort(table["k"].unique()).astype(float)
    fig.add_trace(go.Scatter(x=ks, y=ks, mode="lines", name="loops = k", line={"color": "grey", "dash": "dot"}))
    for i, (name, g) in enumerate(table.groupby("series", sort=False)):
        g = g.sort_values("k")
        color = _PALETTE[i % len(_PALETTE)]
        _band(fig, g["k"], g["lo"], g["hi"], color, str(name))
        fig.add_trace(go.Scatter(x=g["k"], y=g["value"], mode="lines+markers", name=str(name),
                                 line={"color": color}, legendgroup=str(name)))
    fig.update_xaxes(title_text="lookups needed (k)", dtick=1)
    fig.update_yaxes(title_text="loops")
    return _style(fig, title or "Depth by k")

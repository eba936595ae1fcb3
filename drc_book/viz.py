"""The book's figures: plotly ``graph_objects`` in :mod:`drc_core.plotting`'s look (``plotly_white``), none a
``FigureWidget`` so that executed notebooks stay small. Each takes the table of the function its docstring names."""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.colors as pcolors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from drc_core import DrcError, need_int, plotting

__all__ = ["accuracy_heatmap", "class_depth_bars", "commit_vs_convergence", "decoder_bars", "depth_by_k_figure",
           "depth_histogram", "loss_curves", "loss_vs_depth", "norm_by_loop", "per_loop_figure", "quality_vs_depth",
           "risk_validity", "speedup_bars"]

_PALETTE, _style, _need_columns = plotting.PALETTE, plotting.style, plotting.need_columns
HEIGHT = plotting.HEIGHT
_PATH_ORDER = ("dense decode", "generate", "continuous")  # the decoders of drc_book.speed.time_decoders, in order


def _floats(values) -> np.ndarray:
    return np.asarray(values, dtype=float)


def _color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def _error(value: np.ndarray, lo, hi, **style) -> dict:
    """Asymmetric error bars from ``value`` to ``lo`` and ``hi``."""
    return {"type": "data", "array": _floats(hi) - value, "arrayminus": value - _floats(lo), **style}


def _band(fig: go.Figure, x, lo, hi, color: str, name: str, *, log: bool = False, **where) -> None:
    """A shaded interval from ``lo`` to ``hi`` (two traces: upper edge, then lower edge filled to it)."""
    x, lo, hi = np.asarray(x), _floats(lo), _floats(hi)
    ok = np.isfinite(lo) & np.isfinite(hi)
    if log:
        ok &= (lo > 0) & (hi > 0)
    if not ok.any():
        return
    common = {"mode": "lines", "line": {"width": 0}, "legendgroup": name, "showlegend": False, "hoverinfo": "skip"}
    fig.add_trace(go.Scatter(x=x[ok], y=hi[ok], **common), **where)
    r, g, b = pcolors.hex_to_rgb(color) if color.startswith("#") else pcolors.unlabel_rgb(color)
    fig.add_trace(go.Scatter(x=x[ok], y=lo[ok], fill="tonexty", fillcolor=f"rgba({int(r)}, {int(g)}, {int(b)}, 0.2)",
                             **common), **where)


def _reference_line(fig: go.Figure, x: pd.Series, y: float, label: str) -> None:
    """A dashed horizontal line across ``x``'s range, as a trace (so it has a legend entry and works on log axes)."""
    fig.add_trace(go.Scatter(x=[float(x.min()), float(x.max())], y=[y, y], mode="lines", name=f"{label} ({y:.4g})",
                             line={"color": "grey", "dash": "dash", "width": 1.5},
                             hovertemplate=f"{html.escape(label)}: {y:.4g}<extra></extra>"))


def number_table(df: pd.DataFrame, digits: int = 3):
    """``df`` styled for a page: "KL..." columns in scientific notation, integer-valued ones as integers, other
    numbers with ``digits`` decimals."""
    fmt: dict[str, str] = {}
    for c in [c for c in df.columns if pd.api.types.is_numeric_dtype(df[c])]:
        if str(c).startswith("KL"):
            fmt[c] = "{:.2e}"
        elif bool(np.all(np.isclose(df[c].dropna() % 1, 0))):
            fmt[c] = "{:.0f}"
        else:
            fmt[c] = f"{{:.{digits}f}}"
    return df.style.format(fmt)


def loss_curves(metrics: pd.DataFrame) -> go.Figure:
    """Training loss per step (raw and a rolling mean) and validation loss at each eval depth, from
    ``metrics.jsonl`` as a frame (rows of ``kind`` "train" and "eval"); the y range zoomed to the validation rows."""
    _need_columns(metrics, ("step", "loss"), "metrics.jsonl as a frame (drc_book.workspace.open_model)")
    kind = metrics["kind"] if "kind" in metrics.columns else pd.Series("train", index=metrics.index)
    train = metrics[kind == "train"].dropna(subset=["step", "loss"]).sort_values("step")
    evals = metrics[kind == "eval"].dropna(subset=["step", "loss"])
    fig = go.Figure()
    if len(train):
        window = max(1, min(25, len(train) // 10))
        fig.add_trace(go.Scatter(x=train["step"], y=train["loss"], mode="lines", name="train (each step)",
                                 line={"color": _PALETTE[0], "width": 1}, opacity=0.35))
        fig.add_trace(go.Scatter(x=train["step"], y=train["loss"].rolling(window, min_periods=1).mean(),
                                 mode="lines", name=f"train (mean of {window} logs)", line={"color": _PALETTE[0]}))
    if len(evals) and "loops" in evals.columns:
        depths = sorted(int(v) for v in evals["loops"].dropna().unique())
        colors = pcolors.sample_colorscale("Viridis", list(np.linspace(0, 0.9, len(depths))))
        for depth, color in zip(depths, colors, strict=True):
            g = evals[evals["loops"] == depth].sort_values("step")
            name = f"val, {depth} loop" + ("s" if depth != 1 else "")
            fig.add_trace(go.Scatter(x=g["step"], y=g["loss"], mode="lines+markers", name=name,
                                     line={"color": color}, marker={"size": 5}))
        lo = float(np.nanmin(np.r_[evals["loss"].to_numpy(float), train["loss"].to_numpy(float)]))
        hi = float(evals["loss"].max())
        fig.update_yaxes(range=[lo - 0.05 * (hi - lo + 0.1), hi + 0.3 * (hi - lo + 0.1)])
    return _style(fig, "Training and validation loss", xaxis_title="step",
                  yaxis_title="loss (nats/token)", hovermode="x unified")


def loss_vs_depth(table: pd.DataFrame, reference: float | None = None, reference_label: str = "") -> go.Figure:
    """Loss against loops (log-2 axis), one line per ``series``, with ``lo``/``hi`` bands and a ``reference`` line."""
    _need_columns(table, ("loops", "loss"), "a table with columns loops, loss (optional series, lo, hi)")
    df = table.reset_index(drop=True)
    series = df["series"].astype(str) if "series" in df.columns else pd.Series("loss", index=df.index)
    fig = go.Figure()
    for i, name in enumerate(dict.fromkeys(series)):
        g = df[series == name].sort_values("loops")
        color = _color(i)
        if {"lo", "hi"} <= set(g.columns):
            _band(fig, g["loops"], g["lo"], g["hi"], color, name)
        fig.add_trace(go.Scatter(x=g["loops"], y=g["loss"], mode="lines+markers", name=name, legendgroup=name,
                                 line={"color": color},
                                 hovertemplate="%{x} loops: %{y:.4f} nats<extra>" + html.escape(name) + "</extra>"))
    if reference is not None:
        _reference_line(fig, df["loops"], float(reference), reference_label or "reference")
    lo, hi = float(np.nanmin(df["loops"])), float(np.nanmax(df["loops"]))
    fig.update_xaxes(type="log", tickvals=[2**k for k in range(0, 12) if lo <= 2**k <= hi])
    return _style(fig, "Validation loss versus loops", xaxis_title="loops at inference",
                  yaxis_title="cross-entropy (nats/token)")


def per_loop_figure(summary: pd.DataFrame) -> go.Figure:
    """Two log-scale panels of :func:`drc_core.per_loop_summary`: the successive KL (and, dashed, the KL to the
    deepest output) and the relative state change, with bootstrap bands; NaN and non-positive values left out."""
    _need_columns(summary, ("loop", "kl", "state_delta"),
                  "the output of drc_core.analysis.measure.per_loop_summary")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("successive KL(p_l ‖ p_{l−1})", "relative state change ‖Δs‖/‖s‖"))
    panels = [("kl", "KL(p_l ‖ p_{l−1})", 1, 0, "solid"), ("kl_final", "KL(p_L ‖ p_l)", 1, 2, "dash"),
              ("state_delta", "‖s_l − s_{l−1}‖ / ‖s_l‖", 2, 1, "solid")]
    s = summary.sort_values("loop")
    for col, name, panel, color_i, dash in panels:
        if col not in s.columns:
            continue
        y = _floats(s[col])
        ok = np.isfinite(y) & (y > 0)
        if not ok.any():
            continue
        color = _PALETTE[color_i]
        if f"{col}_ci_low" in s.columns and f"{col}_ci_high" in s.columns:
            _band(fig, s["loop"][ok], s[f"{col}_ci_low"][ok], s[f"{col}_ci_high"][ok], color, name, log=True,
                  row=1, col=panel)
        fig.add_trace(go.Scatter(x=s["loop"][ok], y=y[ok], mode="lines+markers", name=name, legendgroup=name,
                                 line={"color": color, "dash": dash}, marker={"size": 5},
                                 hovertemplate="loop %{x}: %{y:.3g}<extra>" + html.escape(name) + "</extra>"),
                      row=1, col=panel)
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_yaxes(title_text="mean over tokens (nats)", row=1, col=1)
    fig.update_yaxes(title_text="mean over tokens (relative)", row=1, col=2)
    fig.update_xaxes(title_text="loop l")
    return _style(fig, "Convergence per loop (95% bootstrap intervals over documents)",
                  legend={"orientation": "h", "y": -0.2})


def depth_histogram(depths: pd.DataFrame) -> go.Figure:
    """Share of tokens per convergence depth (those that never settled apart) and the cumulative share converged,
    from :func:`drc_core.convergence_depth`."""
    _need_columns(depths, ("depth",), "the output of drc_core.analysis.measure.convergence_depth")
    d = depths["depth"].to_numpy(np.int64)
    conv = depths["converged"].to_numpy(bool) if "converged" in depths.columns else np.ones(len(d), bool)
    n_loops = int(max(depths.attrs.get("max_loops", 0), d.max()))
    loops = np.arange(1, n_loops + 1)
    n = len(d)
    settled = np.bincount(d[conv], minlength=n_loops + 1)[1:]
    never = np.bincount(d[~conv], minlength=n_loops + 1)[1:]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=loops, y=settled / n, name="converged at this depth", marker_color=_PALETTE[0],
                         customdata=settled,
                         hovertemplate="depth %{x}: %{y:.1%} (%{customdata} tokens)<extra></extra>"),
                  secondary_y=False)
    if never.any():
        fig.add_trace(go.Bar(x=loops, y=never / n, name="never settled (depth = L)", marker_color=_PALETTE[1],
                             customdata=never, hovertemplate="%{y:.1%} never settled (%{customdata} tokens)"
                             "<extra></extra>"), secondary_y=False)
    fig.add_trace(go.Scatter(x=loops, y=np.cumsum(settled) / n, mode="lines+markers", name="converged by loop l",
                             line={"color": "black"}, marker={"size": 4},
                             hovertemplate="by loop %{x}: %{y:.1%}<extra></extra>"), secondary_y=True)
    eps = depths.attrs.get("eps")
    fig.update_layout(barmode="stack", bargap=0.1, legend={"orientation": "h", "y": -0.2})
    fig.update_xaxes(title_text="convergence depth (loops)", dtick=1 if n_loops <= 16 else 2)
    fig.update_yaxes(title_text="share of tokens", tickformat=".0%", secondary_y=False)
    fig.update_yaxes(title_text="cumulative share converged", tickformat=".0%", range=[0, 1.02], secondary_y=True,
                     showgrid=False, tickvals=[0, 0.25, 0.5, 0.75, 1])
    title = "Per-token convergence depth" + (f" (ε = {eps:g})" if eps is not None else "") + f", {n:,} tokens"
    return _style(fig, title)


def class_depth_bars(by_class: pd.DataFrame) -> go.Figure:
    """Mean convergence depth per token class with its interval, shallowest first, from ``class_depth_summary``."""
    _need_columns(by_class, ("class", "mean_depth"), "the output of drc_core.analysis.tokens.class_depth_summary")
    df = by_class.sort_values("mean_depth", kind="stable")
    mean = _floats(df["mean_depth"])
    error = _error(mean, df["ci_low"], df["ci_high"]) if {"ci_low", "ci_high"} <= set(df.columns) else None
    share = _floats(df["share"]) if "share" in df.columns else np.full(len(df), math.nan)
    count = df["count"].to_numpy() if "count" in df.columns else np.full(len(df), math.nan)
    fig = go.Figure(go.Bar(
        x=df["class"].astype(str), y=mean, error_y=error, marker_color=_PALETTE[0],
        text=[f"{s:.0%}" if np.isfinite(s) else "" for s in share], textposition="inside",
        customdata=np.column_stack([share, count]),
        hovertemplate="%{x}: mean depth %{y:.2f} loops<br>%{customdata[0]:.1%} of tokens (%{customdata[1]:,})"
                      "<extra></extra>"))
    return _style(fig, "Mean convergence depth by token class (95% bootstrap intervals; labels: share of tokens)",
                  xaxis_title="token class (shallow → deep)", yaxis_title="mean convergence depth (loops)")


def quality_vs_depth(df: pd.DataFrame, reference: float | None = None, quality_label: str = "quality",
                     log_y: bool = False, reference_label: str = "reference") -> go.Figure:
    """Quality against average exit loop, one line per ``rule`` (uniform black, the oracle dashed grey), error bars
    from ``quality_lo``/``quality_hi``, a dashed ``reference`` line, a log axis with ``log_y``."""
    _need_columns(df, ("rule", "param", "avg_depth", "quality"),
                  "a drc_core.halting.sweep.summarize table with columns rule, param, avg_depth, quality")
    rule = df["rule"]
    if isinstance(rule, pd.DataFrame):  # two (``family`` renamed onto ``rule``): the one with fewer distinct values
        rule = min((rule.iloc[:, j] for j in range(rule.shape[1])), key=lambda s: s.nunique())
    rule = rule.astype(str)
    names = sorted(set(rule), key=lambda r: (r != "uniform", r == "oracle", r))
    fig = go.Figure()
    color_i = 0
    for name in names:
        g = df[(rule == name).to_numpy()].sort_values("avg_depth")
        q = _floats(g["quality"])
        if name == "uniform":
            line, marker = {"color": "black", "width": 2.5}, {"size": 7, "symbol": "square"}
        elif name == "oracle":
            line, marker = {"color": "grey", "dash": "dash"}, {"size": 6, "symbol": "diamond"}
        else:
            line, marker = {"color": _color(color_i)}, {"size": 6}
            color_i += 1
        error = (_error(q, g["quality_lo"], g["quality_hi"], thickness=1, width=0)
                 if {"quality_lo", "quality_hi"} <= set(g.columns) else None)
        params = [f"{p:g}" if isinstance(p, int | float | np.number) else str(p) for p in g["param"]]
        fig.add_trace(go.Scatter(
            x=g["avg_depth"], y=q, mode="lines+markers", name=name, line=line, marker=marker, error_y=error,
            customdata=params,
            hovertemplate="param %{customdata}<br>avg depth %{x:.2f} loops<br>quality %{y:.4g}<extra>"
                          + html.escape(name) + "</extra>"))
    if reference is not None:
        _reference_line(fig, df["avg_depth"], float(reference), reference_label)
    if log_y:
        fig.update_yaxes(type="log", exponentformat="power")
    return _style(fig, f"{quality_label} versus average depth (lower left is better)",
                  xaxis_title="average exit loop (loops per token)", yaxis_title=quality_label, height=450)


def speedup_bars(table: pd.DataFrame) -> go.Figure:
    """FLOP-proxy and wall-clock speed-ups per (``setting``, ``rule``), a marker at 0.9 x the proxy, a line at 1."""
    _need_columns(table, ("setting", "rule", "avg_loops", "proxy_speedup", "wallclock_speedup"),
                  "a table with columns setting, rule, avg_loops, proxy_speedup, wallclock_speedup")
    x = [table["setting"].astype(str).tolist(), table["rule"].astype(str).tolist()]
    proxy, wall = _floats(table["proxy_speedup"]), _floats(table["wallclock_speedup"])
    loops = _floats(table["avg_loops"])
    hover = "%{x}<br>%{y:.2f}x<br>avg loops %{customdata:.2f}<extra>%{fullData.name}</extra>"
    fig = go.Figure([
        go.Bar(x=x, y=proxy, name="FLOP proxy", marker_color=_PALETTE[0], customdata=loops, hovertemplate=hover,
               offsetgroup="proxy", text=[f"{v:.2f}x" for v in proxy], textposition="outside"),
        go.Bar(x=x, y=wall, name="wall-clock", marker_color=_PALETTE[1], customdata=loops, hovertemplate=hover,
               offsetgroup="wall", text=[f"{v:.2f}x" if np.isfinite(v) else "" for v in wall], textposition="inside"),
        go.Scatter(x=x, y=0.9 * proxy, mode="markers", name="0.9 x proxy", customdata=loops, hovertemplate=hover,
                   offsetgroup="wall", marker={"symbol": "line-ew-open", "size": 28, "color": "black",
                                               "line": {"width": 2}}),
    ])
    fig.add_hline(y=1, line_dash="dot", line_color="grey")
    return _style(fig, "Speed-up over uniform depth: FLOP proxy vs wall-clock", barmode="group", scattermode="group",
                  xaxis_title="setting / rule", yaxis_title="speed-up (x)", legend={"orientation": "h", "y": -0.25})


def commit_vs_convergence(commit, depth, max_loops: int) -> go.Figure:
    """The joint histogram of the tokens' commit loop and convergence depth (share per cell, log colour)."""
    c, d = np.asarray(commit, dtype=np.int64).reshape(-1), np.asarray(depth, dtype=np.int64).reshape(-1)
    if len(c) != len(d) or len(c) == 0:
        raise DrcError(f"commit and depth must be per token and aligned; got {len(c)} and {len(d)} values")
    need_int("max_loops", max_loops, 1)
    counts = np.zeros((max_loops, max_loops))
    np.add.at(counts, (np.clip(c, 1, max_loops) - 1, np.clip(d, 1, max_loops) - 1), 1)
    share = counts / counts.sum()
    loops = np.arange(1, max_loops + 1)
    with np.errstate(divide="ignore"):
        z = np.where(share > 0, np.log10(share), np.nan)
    fig = go.Figure(go.Heatmap(x=loops, y=loops, z=z, customdata=share, colorscale=plotting.SEQ_SCALE,
                               colorbar={"title": {"text": "log10 share"}},
                               hovertemplate="convergence depth %{x}<br>commit loop %{y}<br>%{customdata:.3%} of "
                                             "tokens<extra></extra>"))
    fig.add_trace(go.Scatter(x=[1, max_loops], y=[1, max_loops], mode="lines", name="commit = convergence",
                             line={"color": "grey", "dash": "dash"}))
    fig.update_xaxes(title_text="convergence depth (successive KL < eps from here on)")
    fig.update_yaxes(title_text="commit loop (argmax fixed from here on)")
    return _style(fig, "When the prediction commits vs when the output converges (share of tokens)",
                  height=HEIGHT + 60, legend={"orientation": "h", "y": -0.2})


def norm_by_loop(percentiles: pd.DataFrame) -> go.Figure:
    """The state norm's percentiles over tokens (columns ``p<q>``) against the ``loop``."""
    _need_columns(percentiles, ("loop",), "norm_percentiles(...)")
    cols = [c for c in percentiles.columns if c.startswith("p") and c[1:].replace(".", "").isdigit()]
    fig = go.Figure([go.Scatter(x=percentiles["loop"], y=percentiles[c], mode="lines+markers", name=c,
                                line={"color": _color(i)}) for i, c in enumerate(cols)])
    fig.update_xaxes(title_text="loop l")
    fig.update_yaxes(title_text="‖s_l‖", type="log")
    return _style(fig, "State norm per loop: percentiles over tokens")


def risk_validity(summary: pd.DataFrame) -> go.Figure:
    """Per family against ``alpha`` (:func:`drc_core.validity_summary`): the share of splits whose test risk exceeds
    alpha beside ``delta``, and the loops saved against the certified uniform depth."""
    _need_columns(summary, ("family", "alpha", "violation", "violation_lo", "violation_hi", "delta", "saved_frac",
                            "certified"), "validity_summary(...) rows")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("splits whose test risk exceeds alpha", "loops saved vs certified uniform"))
    alphas = sorted(summary["alpha"].unique())
    for i, (fam, g) in enumerate(summary.groupby("family", sort=False)):
        color = _color(i)
        x = [f"{a:g}" for a in g["alpha"]]
        v = _floats(g["violation"])
        err = _error(v, g["violation_lo"], g["violation_hi"], symmetric=False)
        hover = "alpha %{x}<br>%{y:.3f}<br>certified in %{customdata:.0%} of splits<extra>" + html.escape(fam) + \
            "</extra>"
        fig.add_trace(go.Scatter(x=x, y=v, error_y=err, mode="markers+lines", name=fam, legendgroup=fam,
                                 marker_color=color, customdata=_floats(g["certified"]), hovertemplate=hover),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=_floats(g["saved_frac"]), mode="markers+lines", name=fam, legendgroup=fam,
                                 showlegend=False, marker_color=color, customdata=_floats(g["certified"]),
                                 hovertemplate=hover.replace("%{y:.3f}", "%{y:.1%} fewer loops")), row=1, col=2)
    delta = float(summary["delta"].iloc[0])
    fig.add_trace(go.Scatter(x=[f"{a:g}" for a in alphas], y=[delta] * len(alphas), mode="lines",
                             name=f"delta = {delta:g}", line={"color": "grey", "dash": "dash"}), row=1, col=1)
    fig.update_xaxes(title_text="alpha (risk level)", type="category")
    fig.update_yaxes(title_text="share of splits", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="share of loops saved", tickformat=".0%", row=1, col=2)
    return _style(fig, "Is the guarantee kept? Random halvings of the documents", height=HEIGHT + 40)


def accuracy_heatmap(acc: pd.DataFrame, value: str = "acc", title: str = "") -> go.Figure:
    """The answers' ``value`` (``acc`` or ``ce``) by ``k`` and loop, from :func:`drc_book.known_depth.accuracy_by_k`."""
    _need_columns(acc, ("k", "loop", value, f"{value}_lo", f"{value}_hi", "n"),
                  "the output of drc_book.known_depth.accuracy_by_k")
    grid = acc.pivot(index="k", columns="loop", values=value)
    custom = np.stack([acc.pivot(index="k", columns="loop", values=v).to_numpy()
                       for v in (f"{value}_lo", f"{value}_hi", "n")], axis=-1)
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


def depth_by_k_figure(table: pd.DataFrame, title: str = "", y_title: str = "loops") -> go.Figure:
    """A loop count per ``k``, one line per ``series`` with its ``lo``/``hi`` band, beside ``loops = k`` (drawn only
    for ``y_title`` "loops": another quantity by ``k``, e.g. accuracy, gets its lines alone)."""
    _need_columns(table, ("series", "k", "value", "lo", "hi"), "a table with series, k, value, lo, hi")
    fig = go.Figure()
    ks = np.sort(table["k"].unique()).astype(float)
    if y_title == "loops":
        fig.add_trace(go.Scatter(x=ks, y=ks, mode="lines", name="loops = k", line={"color": "grey", "dash": "dot"}))
    for i, (name, g) in enumerate(table.groupby("series", sort=False)):
        g = g.sort_values("k")
        color = _color(i)
        _band(fig, g["k"], g["lo"], g["hi"], color, str(name))
        fig.add_trace(go.Scatter(x=g["k"], y=g["value"], mode="lines+markers", name=str(name),
                                 line={"color": color}, legendgroup=str(name)))
    fig.update_xaxes(title_text="lookups needed (k)", dtick=1)
    fig.update_yaxes(title_text=y_title)
    return _style(fig, title or "Depth by k")


def decoder_bars(table: pd.DataFrame) -> go.Figure:
    """Speed-up over the dense decoder per (batch, rule) and path of a :func:`~drc_book.speed.time_decoders` table,
    a marker at the honest-FLOP speed-up."""
    _need_columns(table, ("batch", "rule", "path", "x_dense", "flop_speedup", "avg_loops", "tokens_per_s"),
                  "the output of drc_book.speed.time_decoders")
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

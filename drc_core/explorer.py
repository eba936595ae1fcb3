"""The per-token depth explorer for one window of a :class:`~drc_core.analysis.measure.Measurement` (or a
:class:`~drc_core.api.Trace`): :func:`depth_slider_figure` (plotly frames and a slider, works in static HTML),
:func:`token_strip_html` (the passage as coloured spans at one loop) and :class:`DepthExplorer` (live, ipywidgets).

Colours are fixed across a passage's loops. The successive KL is coloured by log10 on a diverging scale whose yellow
middle is ``eps``; values undefined at a loop (KL and state change at loop 1) are grey, values below
:data:`~drc_core.plotting.LOG_FLOOR` drawn at the floor. "Converged at loop l": the token's
:func:`~drc_core.analysis.measure.convergence_depth` is <= l and it settled within the measured loops.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import plotly.colors as pcolors
import plotly.graph_objects as go

from drc_core.analysis.measure import DEFAULT_EPS, Measurement, convergence_depth
from drc_core.analysis.tokens import token_texts
from drc_core.errors import DrcError, need_eps, need_int
from drc_core.plotting import CONVERGED_COLOR, KL_SCALE, LOG_FLOOR, NAN_COLOR, PALETTE, SEQ_SCALE, UPDATING_COLOR, style

_LINE_CHARS = 72  # characters per row of the passage layout
_TRAJECTORY_HEIGHT = 340  # px, the live explorer's trajectory figure

__all__ = ["CLASS_COLORS", "DepthExplorer", "depth_slider_figure", "token_strip_html"]


class _Mode(NamedTuple):
    key: str
    button: str  # its colour-by option in the live explorer
    column: str | None  # statistic coloured (None: by category, not on a scale)
    label: str
    unit: str = ""
    log: bool = False
    needs: str | None = None  # what only a drc_core.trace has (its per-token dynamics)


_MODES = {m.key: m for m in (
    _Mode("kl", "KL", "kl", "KL(p_l ‖ p_{l−1})", "nats", True),
    _Mode("state", "state change", "state_delta", "state change ‖s_l − s_{l−1}‖/‖s_l‖", "relative", True),
    _Mode("entropy", "entropy", "entropy", "entropy H(p_l)", "nats"),
    _Mode("contraction", "contraction", "contraction", "contraction ‖s_l − s_{l−1}‖/‖s_{l−1} − s_{l−2}‖", "ratio",
          True, "contraction"),
    _Mode("commit", "commit loop", "commit_loop", "commit loop (the argmax no longer changes from it on)", "loop",
          needs="commit_loop"),
    _Mode("class", "class", None, "dynamics class (settled / oscillating / contracting / drifting)", needs="dyn_class"),
    _Mode("converged", "converged?", None, "converged / still updating"),
)}
_ALIASES = {"kl_prev": "kl", "state_delta": "state", "commit_loop": "commit", "dyn_class": "class"}
CLASS_COLORS = {"settled": "#1a9850", "contracting": "#a6d96a", "oscillating": "#8073ac", "drifting": "#d73027"}


def _mode(mode: str, allow_converged: bool = True) -> _Mode:
    key = _ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    options = [k for k, m in _MODES.items() if allow_converged or m.column is not None]
    if key not in options:
        raise DrcError(f"unknown metric/mode {mode!r}; use one of {options} (or 'state_delta')")
    return _MODES[key]


def _need_mode(p: _Passage, mode: _Mode) -> None:
    if not p.offers(mode):
        raise DrcError(f"colour by {mode.key!r} needs {mode.needs!r}: trace with drc_core.trace "
                       "(it keeps the per-token dynamics)")


def _visible(text: str) -> str:
    """Whitespace that would vanish made visible (newline ↵, tab ⇥, carriage return ␍)."""
    return text.replace("\r", "␍").replace("\t", "⇥").replace("\n", "↵")


def _wrap(texts: Sequence[str], line_chars: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay tokens out like wrapped text: per token its row, first character column and width (characters of
    its visible text, at least 1). A token that does not fit starts a new row; a row ends after a newline."""
    laid = []
    row = col = 0
    for text in texts:
        width = max(1, len(_visible(text)))
        if col > 0 and col + width > line_chars:
            row, col = row + 1, 0
        laid.append((row, col, width))
        col += width
        if "\n" in text:
            row, col = row + 1, 0
    rows, starts, widths = (np.asarray(a) for a in zip(*laid, strict=True))
    return rows, starts, widths


@dataclass(frozen=True)
class _Passage:
    """One window's first tokens, as (tokens, loops) matrices."""

    window: int
    eps: float
    pos: np.ndarray  # (n,)
    texts: list[str]  # decoded text per token
    loops: np.ndarray  # (L,) sorted
    values: dict[str, np.ndarray]  # column -> (n, L)
    depth: np.ndarray  # (n,) convergence depth
    settled: np.ndarray  # (n,) converged within the measured loops
    classes: np.ndarray | None = None  # (n,) dynamics class, where measured (``dyn_class``)

    def loop_index(self, loop: object) -> int:
        if isinstance(loop, bool) or not isinstance(loop, int | np.integer) or int(loop) not in self.loops:
            raise DrcError(f"loop={loop!r} is out of range; window {self.window} has loops "
                           f"{int(self.loops[0])}..{int(self.loops[-1])}")
        return int(loop) - 1  # loops are 1..L

    def converged_at(self, loop: int) -> np.ndarray:
        return self.settled & (self.depth <= loop)

    def offers(self, mode: _Mode) -> bool:
        return mode.needs is None or mode.needs in self.values or (mode.key == "class" and self.classes is not None)


def _passage(m: Measurement, window: object, tokenizer, eps: float, max_tokens: object) -> _Passage:
    if not isinstance(m, Measurement) or not {"kl", "state_delta", "entropy"} <= set(m.stats):
        raise DrcError("expected a Measurement from drc_core.measure_windows or drc_core.trace")
    need_int("max_tokens", max_tokens, 1)
    need_eps(eps)
    windows = m.meta["window"].to_numpy()
    if isinstance(window, bool) or not isinstance(window, int | np.integer) or not (windows == window).any():
        raise DrcError(f"window={window!r} is not measured; the measurement has windows {int(windows.min())}.."
                       f"{int(windows.max())}")
    sub = m.select(np.flatnonzero(windows == window)[: int(max_tokens)])  # tokens in pos order
    n_loops = sub.max_loops
    values = {c: sub.matrix(c) for c in ("kl", "state_delta", "entropy", "kl_final", "contraction") if c in sub.stats}
    if "commit_loop" in sub.meta.columns:  # per token: the same at every loop
        values["commit_loop"] = np.repeat(sub.meta["commit_loop"].to_numpy(float)[:, None], n_loops, axis=1)
    classes = sub.meta["dyn_class"].to_numpy(object) if "dyn_class" in sub.meta.columns else None
    depths = convergence_depth(sub, float(eps))
    return _Passage(int(window), float(eps), sub.meta["pos"].to_numpy(), token_texts(tokenizer, sub.meta["token"]),
                    np.arange(1, n_loops + 1), values, depths["depth"].to_numpy(np.int64),
                    depths["converged"].to_numpy(bool), classes)


def _color_range(p: _Passage, mode: _Mode) -> tuple[np.ndarray, float, float, list[list]]:
    """The colour value of every (token, loop) (log10 for log metrics, clipped at LOG_FLOOR; NaN stays NaN),
    the fixed range over the passage, and the colour scale. The KL scale is diverging around log10(eps)."""
    raw = p.values[mode.column]
    with np.errstate(invalid="ignore", divide="ignore"):
        v = np.log10(np.maximum(raw, LOG_FLOOR)) if mode.log else raw.copy()
    finite = v[np.isfinite(v)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if mode.key in ("kl", "contraction"):  # diverging: around eps (KL), around 1 (contraction: shrinking steps)
        mid = math.log10(p.eps) if mode.key == "kl" else 0.0
        lo, hi = min(lo, mid - 1), max(hi, mid + 1)
        f = (mid - lo) / (hi - lo)
        scale = [[0.0, KL_SCALE[0]], [f, KL_SCALE[1]], [1.0, KL_SCALE[2]]]
    else:
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        scale = [list(x) for x in pcolors.get_colorscale(SEQ_SCALE)]
    return v, lo, hi, scale


def _css_colors(values: np.ndarray, lo: float, hi: float, scale: list[list]) -> list[str]:
    """``rgb(...)`` colours of ``values`` on ``scale`` over [lo, hi]; NAN_COLOR where a value is NaN."""
    frac = np.clip((values - lo) / (hi - lo), 0.0, 1.0)
    ok = np.isfinite(frac)
    sampled = iter(pcolors.sample_colorscale(scale, frac[ok].tolist()) if ok.any() else [])
    return [next(sampled) if good else NAN_COLOR for good in ok]


def _ink(background: str) -> str:
    """Black or white text, whichever reads better on ``background``."""
    r, g, b = pcolors.hex_to_rgb(background) if background.startswith("#") else pcolors.unlabel_rgb(background)
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def _fmt(v: float) -> str:
    return f"{v:.2g}" if np.isfinite(v) else "n/a"


def _strip_parts(p: _Passage, loop: int, mode: _Mode) -> tuple[str, list[str], list[str]]:
    """The passage at ``loop`` in ``mode``: the header line (window, loop, colour legend) as HTML, and per token
    its background colour and its hover text (values at that loop, depth, status)."""
    j = p.loop_index(loop)
    _need_mode(p, mode)
    kl, sd, ent = p.values["kl"][:, j], p.values["state_delta"][:, j], p.values["entropy"][:, j]
    conv = p.converged_at(int(loop))
    if mode.key == "class":
        colors = [CLASS_COLORS.get(c, NAN_COLOR) for c in p.classes]
        legend = " ".join(f"<span style='background:{c};color:{_ink(c)}'>&nbsp;{k}&nbsp;</span>"
                          for k, c in CLASS_COLORS.items()) + " (over the traced loops; grey: too few loops)"
    elif mode.column is None:
        colors = [CONVERGED_COLOR if c else UPDATING_COLOR for c in conv]
        legend = (f"<span style='background:{CONVERGED_COLOR}'>&nbsp;converged&nbsp;</span> "
                  f"<span style='background:{UPDATING_COLOR}'>&nbsp;still updating&nbsp;</span> "
                  f"(convergence depth ≤ {int(loop)}, ε = {p.eps:g})")
    else:
        v, lo, hi, scale = _color_range(p, mode)
        colors = _css_colors(v[:, j], lo, hi, scale)
        ends = f"{10**lo:.0e} … {10**hi:.0e}" if mode.log else f"{lo:.2f} … {hi:.2f}"
        low, high = _css_colors(np.array([lo, hi]), lo, hi, scale)
        legend = (f"colour: {html.escape(mode.label)} ({mode.unit}), "
                  f"<span style='background:{low};color:{_ink(low)}'>&nbsp;low&nbsp;</span>"
                  f"<span style='background:{high};color:{_ink(high)}'>&nbsp;high&nbsp;</span> {ends}"
                  + (f", yellow = ε = {p.eps:g}" if mode.key == "kl" else "")
                  + (f"; values below {LOG_FLOOR:g} drawn at {LOG_FLOOR:g}" if mode.log else "")
                  + "; grey: undefined at this loop")
    titles = []
    for i, text in enumerate(p.texts):
        dyn = "".join(f", {what} {_fmt(p.values[k][i, j])}" for k, what in
                      (("contraction", "contraction"), ("commit_loop", "commits at loop")) if k in p.values)
        dyn += "" if p.classes is None else f", {p.classes[i]}"
        titles.append(f"pos {int(p.pos[i])} {text!r}: KL {_fmt(kl[i])} nats, state change {_fmt(sd[i])}, "
                      f"entropy {_fmt(ent[i])} nats, depth {int(p.depth[i])}, "
                      f"{'converged' if conv[i] else 'still updating'}{dyn}")
    header = (f"<div style='font-size:90%;margin-bottom:4px'>window {p.window}, loop {int(loop)} of "
              f"{int(p.loops[-1])}: {legend}</div>")
    return header, colors, titles


def token_strip_html(m: Measurement, window: int, loop: int, tokenizer, eps: float = DEFAULT_EPS,
                     mode: str = "kl", max_tokens: int = 96) -> str:
    """The first ``max_tokens`` tokens of ``window`` as HTML, one ``<span>`` per token coloured at ``loop`` (its values
    in the ``title``). ``mode``: ``"kl"``, ``"state"``, ``"entropy"``, ``"converged"``, and for a :func:`drc_core.trace`
    the dynamics ``"contraction"`` (yellow at 1), ``"commit"`` and ``"class"`` (:data:`CLASS_COLORS`)."""
    p = _passage(m, window, tokenizer, eps, max_tokens)
    header, colors, titles = _strip_parts(p, loop, _mode(mode))
    spans = []
    for text, color, title in zip(p.texts, colors, titles, strict=True):
        body = html.escape(text.replace("\r", "␍").replace("\t", "⇥")).replace("\n", "↵<br>")
        spans.append(f"<span title=\"{html.escape(title, quote=True)}\" style=\"background:{color};"
                     f"color:{_ink(color)};border-radius:2px;padding:0 1px\">{body}</span>")
    return (f"<div class='drc-token-strip'>{header}<div style='font-family:monospace;white-space:pre-wrap;"
            f"line-height:1.7'>{''.join(spans)}</div></div>")


def depth_slider_figure(m: Measurement, window: int, tokenizer, eps: float = DEFAULT_EPS, max_tokens: int = 96,
                        metric: str = "kl", line_chars: int = _LINE_CHARS) -> go.Figure:
    """The first ``max_tokens`` tokens of ``window`` as wrapped text, each a box coloured by ``metric`` (a
    :func:`token_strip_html` mode but ``converged`` and ``class``) at loop l, with a slider over loops and a play
    button. It opens at the first loop with a value; frame ``str(l)`` holds ``marker.color`` (values rounded to 3
    decimals, or NAN_COLOR) and ``customdata`` (KL, state change, status)."""
    mode = _mode(metric, allow_converged=False)
    need_int("line_chars", line_chars, 8)
    p = _passage(m, window, tokenizer, eps, max_tokens)
    _need_mode(p, mode)
    v, lo, hi, scale = _color_range(p, mode)
    rows, starts, widths = _wrap(p.texts, line_chars)
    n_rows = int(rows.max()) + 1
    kl, sd = p.values["kl"], p.values["state_delta"]

    def colors(j: int) -> list:
        return [round(float(x), 3) if np.isfinite(x) else NAN_COLOR for x in v[:, j]]

    def custom(j: int) -> list[list[str]]:
        conv = p.converged_at(int(p.loops[j]))
        return [[_fmt(kl[i, j]), _fmt(sd[i, j]), "converged" if conv[i] else "still updating"]
                for i in range(len(p.pos))]

    start = int(np.argmax(np.isfinite(v).any(axis=0)))  # the first loop with a value (index 0 if none has)
    colorbar = {"title": {"text": f"{mode.key} ({mode.unit})"}}
    if mode.log:
        ticks = list(range(math.ceil(lo), math.floor(hi) + 1))
        colorbar |= {"tickvals": ticks, "ticktext": [f"1e{k}" for k in ticks]}
    marker = {"color": colors(start), "colorscale": scale, "cmin": lo, "cmax": hi, "showscale": True,
              "colorbar": colorbar, "line": {"width": 1, "color": "white"}}
    hover = [f"pos {int(q)}: {t!r}" for q, t in zip(p.pos, p.texts, strict=True)]
    fig = go.Figure(go.Bar(
        orientation="h", y=rows, x=widths, base=starts, width=0.8, marker=marker, customdata=custom(start),
        text=[_visible(t) for t in p.texts], textposition="inside", insidetextanchor="middle", textangle=0,
        textfont={"family": "monospace", "size": 13}, hovertext=hover,
        hovertemplate="%{hovertext}<br>KL(p_l ‖ p_{l−1}) %{customdata[0]} nats<br>state change %{customdata[1]}"
                      "<br>%{customdata[2]}<extra></extra>"))
    fig.frames = [go.Frame(name=str(int(lp)), data=[go.Bar(marker={"color": colors(j)}, customdata=custom(j))])
                  for j, lp in enumerate(p.loops)]
    step_args = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    slider = {"active": start, "currentvalue": {"prefix": "loop "}, "pad": {"t": 30}, "len": 0.9, "x": 0.1,
              "steps": [{"label": str(int(lp)), "method": "animate", "args": [[str(int(lp))], step_args]}
                        for lp in p.loops]}
    play = {"type": "buttons", "direction": "left", "showactive": False, "x": 0.0, "y": 0, "xanchor": "left",
            "yanchor": "top", "pad": {"t": 42},
            "buttons": [{"label": "▶", "method": "animate",
                         "args": [None, {"frame": {"duration": 500, "redraw": True}, "fromcurrent": True,
                                         "transition": {"duration": 0}}]},
                        {"label": "❚❚", "method": "animate", "args": [[None], step_args]}]}
    fig.update_xaxes(visible=False, range=[-0.5, line_chars + 0.5])
    fig.update_yaxes(visible=False, autorange="reversed")
    return style(fig, f"Window {p.window}: {mode.label} per token at loop l (ε = {p.eps:g}; grey: undefined)",
                 height=max(300, 170 + 26 * n_rows), sliders=[slider], updatemenus=[play], barmode="overlay",
                 uniformtext={"minsize": 11, "mode": "show"}, plot_bgcolor="white", showlegend=False,
                 margin={"l": 20, "r": 20, "t": 60, "b": 20})


class DepthExplorer:
    """The live per-token depth explorer (JupyterLab), ``explorer.widget``: with a ``tracer`` (text -> its
    :class:`~drc_core.api.Trace`) an ``input`` box and ``trace_button`` (:meth:`show_text`; ``text=`` at once); a loop
    ``slider`` and a colour-by ``metric`` (the :func:`token_strip_html` modes the measurement has), which redraw the
    ``text`` header and recolour ``token_buttons`` (one per token of the passage; clicking one selects it); the
    selected ``token``, whose ``trajectory`` figure (successive KL, KL to the deepest output, state change; log
    scale) is rendered into ``output`` under a kernel. Setting any widget's value from code updates the rest."""

    def __init__(self, m: Measurement, tokenizer, window: int = 0, eps: float = DEFAULT_EPS,
                 max_tokens: int = 96, *, tracer=None, text: str | None = None) -> None:
        import ipywidgets as widgets

        self.tokenizer, self.eps, self.max_tokens, self.tracer = tokenizer, eps, max_tokens, tracer
        if text is not None and tracer is None:
            raise DrcError("text= needs tracer=: a function from a text to its Trace (drc_core.trace)")
        # "auto" in the explorer's column stretches a row to the output's width (100% plus margins overflowed)
        def full() -> object:
            return widgets.Layout(width="auto")

        self.passage = _passage(m, window, tokenizer, eps, max_tokens)
        self.slider = widgets.IntSlider(value=1, min=1, max=2, step=1, description="loop", continuous_update=True,
                                        layout=full(), style={"description_width": "initial"})
        self.metric = widgets.ToggleButtons(options=self._metric_options(self.passage), value="kl",
                                            description="colour")
        self.text = widgets.HTML(layout=full())
        self.text.add_class("drc-explorer-header")
        self.tokens = widgets.Box(layout=widgets.Layout(display="flex", flex_flow="row wrap", width="100%",
                                                        align_items="center"))
        self.tokens.add_class("drc-explorer-tokens")
        self.token_buttons: list = []
        self._quiet = False  # True while the explorer sets its own widgets (their observers then do nothing)
        self.token = widgets.BoundedIntText(value=0, min=0, max=0, description="token", layout={"width": "180px"})
        self.selected = widgets.HTML()
        self.output = widgets.Output(layout=full())
        self.trajectory = go.Figure()
        rows = []
        if tracer is not None:
            self.input = widgets.Text(placeholder="type any text and press Enter (or 'trace') to trace it",
                                      description="text", continuous_update=False, layout=widgets.Layout(
                                          width="auto", flex="1 1 auto"))
            self.trace_button = widgets.Button(description="trace", button_style="primary",
                                               tooltip="trace this text through the model")
            self.status = widgets.HTML()
            self.input.observe(self._on_input, names="value")
            self.trace_button.on_click(lambda _b: self.show_text(self.input.value))
            rows += [widgets.HBox([self.input, self.trace_button], layout=full()), self.status]
        # JupyterLab's plotly renderer leaves the trajectory's output 0 px high after its tab was hidden (another
        # tab in front, then back): a fixed height for the figure's box keeps it drawn
        self._css = widgets.HTML(f"<style>.drc-depth-explorer .widget-output .jp-RenderedPlotly "
                                 f"{{height: {_TRAJECTORY_HEIGHT}px;}}</style>", layout={"height": "0px"})
        rows += [self.slider, self.metric, self.text, self.tokens, widgets.HBox([self.token, self.selected]),
                 self.output, self._css]
        self.widget = widgets.VBox(rows, layout=full())
        self.widget.add_class("drc-depth-explorer")
        for widget, redraw in ((self.slider, self._redraw_loop), (self.metric, self.update_text),
                               (self.token, self.update_trajectory)):
            widget.observe(lambda _change, redraw=redraw: None if self._quiet else redraw(), names="value")
        self._show(self.passage)
        if text is not None:
            self.show_text(text)

    # the passage ---------------------------------------------------------------------------------------
    def show_text(self, text: str) -> None:
        """Trace ``text`` with the explorer's ``tracer`` and show it (all its tokens, up to ``max_tokens``) in place of
        the current passage. An empty text or a failing trace leaves the passage and says why in ``status``."""
        if self.tracer is None:
            raise DrcError("this explorer has no tracer: pass tracer= (a function from a text to its Trace)")
        if not str(text).strip():
            self.status.value = "<span style='color:#b00'>type a text first</span>"
            return
        self.status.value = "tracing …"
        try:
            passage = _passage(self.tracer(str(text)), 0, self.tokenizer, self.eps, self.max_tokens)
        except DrcError as exc:
            self.status.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            return
        with self._quietly():
            self.input.value = text
        self.status.value = f"traced {len(passage.pos)} token(s) of your text through {int(passage.loops[-1])} loops"
        self._show(passage)

    @staticmethod
    def _metric_options(p: _Passage) -> list[tuple[str, str]]:
        return [(m.button, m.key) for m in _MODES.values() if p.offers(m)]

    def _show(self, passage: _Passage) -> None:
        """Make ``passage`` the explorer's: slider range, one button per token, first token selected, redraw."""
        import ipywidgets as widgets

        self.passage = p = passage
        options = self._metric_options(p)
        with self._quietly():
            if list(self.metric.options) != options:
                value = self.metric.value if self.metric.value in dict(options).values() else "kl"
                self.metric.options = options
                self.metric.value = value
            for w, lo, hi, value in ((self.slider, p.loops[0], p.loops[-1], p.loops[min(1, len(p.loops) - 1)]),
                                     (self.token, p.pos[0], p.pos[-1], p.pos[0])):
                w.max = max(int(hi), w.min)  # never below min on the way
                w.min, w.max, w.value = int(lo), int(hi), int(value)
        children = []
        for q, text in zip(p.pos, p.texts, strict=True):
            label = _visible(text).replace(" ", "\u00a0") or "\u00a0"
            b = widgets.Button(description=label, layout=widgets.Layout(width="auto", height="26px", margin="1px",
                                                                         padding="0 3px"),
                               style={"font_family": "monospace"})
            b.add_class("drc-token")
            b.on_click(lambda _b, q=int(q): setattr(self.token, "value", q))
            children.append(b)
            if "\n" in text:  # a line break in the passage: the next token starts a new row
                children.append(widgets.Box(layout=widgets.Layout(width="100%", height="0px")))
        self.token_buttons = [b for b in children if isinstance(b, widgets.Button)]
        self.tokens.children = children
        self.update_text()
        self.update_trajectory()

    # callbacks (the widgets' observers) ----------------------------------------------------------------
    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        """While the explorer sets its own widgets, their observers do nothing."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def _on_input(self, change) -> None:
        if not self._quiet and change["new"].strip():
            self.show_text(change["new"])

    def _redraw_loop(self) -> None:
        self.update_text()
        self._mark_loop()
        self._render()

    # updates, also callable directly ------------------------------------------------------------------
    def update_text(self) -> None:
        """Redraw the header and recolour the passage's tokens for the slider's loop and the selected metric."""
        header, colors, titles = _strip_parts(self.passage, int(self.slider.value), _mode(self.metric.value))
        self.text.value = header
        for b, color, title in zip(self.token_buttons, colors, titles, strict=True):
            b.style.button_color = color
            b.style.text_color = _ink(color)
            b.tooltip = title

    def update_trajectory(self) -> None:
        """Rebuild the selected token's trajectory figure, mark its button, and render it."""
        p = self.passage
        i = int(np.searchsorted(p.pos, int(self.token.value)))
        if i >= len(p.pos) or int(p.pos[i]) != int(self.token.value):
            raise DrcError(f"token={self.token.value} is not a position of the passage ({int(p.pos[0])}.."
                           f"{int(p.pos[-1])})")
        for k, b in enumerate(self.token_buttons):
            b.layout.border = "2px solid #000" if k == i else ""
            b.style.font_weight = "bold" if k == i else ""
        fig = go.Figure()
        series = [("kl", "KL(p_l ‖ p_{l−1}) (nats)", "solid"), ("kl_final", "KL(p_L ‖ p_l) (nats)", "dash"),
                  ("state_delta", "state change (relative)", "solid")]
        for k, (col, name, dash) in enumerate(series):
            if col in p.values and (col != "kl_final" or np.isfinite(p.values[col][i]).any()):
                y = p.values[col][i]
                with np.errstate(invalid="ignore"):
                    shown = np.where(np.isfinite(y), np.maximum(y, LOG_FLOOR), np.nan)  # float noise < 0 included
                fig.add_trace(go.Scatter(x=p.loops, y=shown, mode="lines+markers", name=name, customdata=y,
                                         line={"color": PALETTE[k], "dash": dash}, marker={"size": 5},
                                         hovertemplate="loop %{x}: %{customdata:.3g}<extra>" + html.escape(name)
                                                       + "</extra>"))
        for y, name, line in ((p.eps, f"ε = {p.eps:g}", {"color": "grey", "dash": "dot"}),
                              (LOG_FLOOR, f"floor {LOG_FLOOR:g}: values below drawn here",
                               {"color": "#999", "dash": "dashdot", "width": 1})):
            fig.add_trace(go.Scatter(x=[p.loops[0], p.loops[-1]], y=[y, y], mode="lines", name=name, line=line))
        status = f"converged at depth {p.depth[i]}" if p.settled[i] else "never settled"
        fig.update_yaxes(type="log", exponentformat="power", title_text="value (log scale)")
        fig.update_xaxes(title_text="loop l")
        style(fig, f"pos {int(p.pos[i])} {p.texts[i]!r}: {status}", height=_TRAJECTORY_HEIGHT,
              legend={"orientation": "h", "y": -0.3}, autosize=True)
        self.selected.value = (f"selected: <b>{html.escape(repr(p.texts[i]))}</b> (pos {int(p.pos[i])}), "
                               f"{status}; click a token to select it")
        self.trajectory = fig
        self._mark_loop()
        self._render()

    def _mark_loop(self) -> None:
        self.trajectory.layout.shapes = ()
        self.trajectory.add_vline(x=int(self.slider.value), line_color="black", line_width=1, opacity=0.4)

    def _render(self) -> None:
        from IPython import get_ipython
        from IPython.display import clear_output, display

        if get_ipython() is None:  # headless (tests, scripts): keep the figure, draw nothing
            return
        with self.output:
            clear_output(wait=True)
            display({"application/vnd.plotly.v1+json": {**json.loads(self.trajectory.to_json()),
                                                         "config": {"responsive": True}},
                     "text/plain": f"trajectory of token {int(self.token.value)}"}, raw=True)

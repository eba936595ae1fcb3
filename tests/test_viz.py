"""Figures and the per-token depth explorer (drc_book.viz), on a real measurement of the tiny model and a tiny BPE."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

import drc_core
from drc_book import viz
from drc_core import explorer, plotting
from drc_core.analysis.measure import Measurement, convergence_depth, measure_windows, per_loop_summary
from drc_core.analysis.tokens import class_depth_summary, token_texts
from drc_core.data.tokenizer import train_bpe
from drc_core.errors import DrcError

T, L, EPS = 24, 6, 1e-3
TEXT = ("a < b & c > d. The cat sat on the mat.\nThe dog ran after the cat, and the cat ran up the tree.\n"
        "In 1790 the first address was given; the second followed in 1791.\n")


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    yield


@pytest.fixture(scope="module")
def tok():
    return train_bpe([TEXT] * 3 + ["the cat and the dog, a mat and a tree."] * 3, 300)


@pytest.fixture(scope="module")
def frame(tok, tiny_model_factory) -> Measurement:
    ids = tok.encode(TEXT * 3).ids
    windows = torch.tensor([ids[i * T : i * T + T + 1] for i in range(3)])
    model = tiny_model_factory(tok.get_vocab_size(), core_scale=1.0)  # depths 3..5 at eps 1e-3: some converge, some not
    return measure_windows(model, windows, L, doc_ids=torch.tensor([0, 0, 1]), batch_size=4)


def token_rows(m: Measurement, window: int, col: str) -> np.ndarray:
    """(n_pos, L) matrix of ``col`` for one window (tokens in window, pos order)."""
    return m.matrix(col)[m.meta.window.to_numpy() == window]


def synthetic_frame(n_pos: int, n_loops: int, vocab: int, seed: int = 0) -> Measurement:
    """A measurement with measure_windows' statistics: KL falling geometrically per token at its own rate."""
    rng = np.random.default_rng(seed)
    pos, loop = np.meshgrid(np.arange(n_pos), np.arange(1, n_loops + 1), indexing="ij")
    rate = rng.uniform(0.5, 3.0, size=(n_pos, 1))
    kl = 10.0 ** (-rate * (loop - 1)) * rng.uniform(0.5, 2, size=loop.shape)
    kl[:, 0] = np.nan
    tokens = np.broadcast_to(rng.integers(0, vocab, size=(n_pos, 1)), loop.shape)
    df = pd.DataFrame({
        "window": 0, "pos": pos.ravel(), "loop": loop.ravel(), "token": tokens.ravel(), "target": 0,
        "kl": kl.ravel(), "kl_final": kl.ravel() / 2, "state_delta": np.sqrt(kl).ravel(),
        "entropy": rng.uniform(1, 5, loop.size), "argmax": 0, "ce": rng.uniform(1, 5, loop.size),
    })
    return Measurement.from_frame(df.astype({c: np.float32 for c in ("kl", "kl_final", "state_delta", "entropy",
                                                                     "ce")}))


def lines(fig: go.Figure) -> list:
    """The traces that carry data (not the invisible band edges)."""
    return [t for t in fig.data if t.showlegend is not False]


# ------------------------------------------------------------------------------------------------ curves


def test_loss_curves_train_and_one_val_line_per_depth():
    train = pd.DataFrame({"kind": "train", "step": np.arange(10, 510, 10), "loss": np.linspace(8, 4.5, 50),
                          "lr": 1e-3, "loops": 6, "tokens": 0, "seconds": 1.0})
    evals = pd.DataFrame([{"kind": "eval", "step": s, "loops": lp, "loss": 5 - 0.01 * lp - s / 1000}
                          for s in (250, 500) for lp in (1, 2, 4, 8)])
    fig = viz.loss_curves(pd.concat([train, evals], ignore_index=True))
    assert isinstance(fig, go.Figure) and fig.layout.template.layout.paper_bgcolor is not None
    assert len(fig.data) == 2 + 4
    raw, smooth = fig.data[0], fig.data[1]
    np.testing.assert_allclose(raw.y, train.loss)
    assert smooth.y[-1] == pytest.approx(train.loss.tail(5).mean())  # 50 logs -> a mean of 5
    assert [t.name for t in fig.data[2:]] == ["val, 1 loop", "val, 2 loops", "val, 4 loops", "val, 8 loops"]
    assert list(fig.data[3].x) == [250, 500] and list(fig.data[3].y) == [4.73, 4.48]
    with pytest.raises(DrcError, match="lacks column 'loss'"):
        viz.loss_curves(pd.DataFrame({"step": [1]}))


def test_loss_vs_depth_series_band_and_reference():
    loops = [1, 2, 4, 8, 16]
    table = pd.concat([pd.DataFrame({"loops": loops, "loss": np.linspace(5, 4, 5) + k, "series": s,
                                     "lo": np.linspace(5, 4, 5) + k - 0.1, "hi": np.linspace(5, 4, 5) + k + 0.1})
                       for k, s in enumerate(["all", "wikipedia"])])
    fig = viz.loss_vs_depth(table, reference=6.75, reference_label="unigram entropy")
    named = lines(fig)
    assert [t.name for t in named] == ["all", "wikipedia", "unigram entropy (6.75)"]
    assert all(list(t.x) == loops for t in named[:2])
    assert list(named[2].y) == [6.75, 6.75] and list(named[2].x) == [1, 16]
    assert len(fig.data) == 2 * 3 + 1  # per series: band upper, band lower, line
    assert fig.layout.xaxis.type == "log"
    plain = viz.loss_vs_depth(table[table.series == "all"][["loops", "loss"]])
    assert len(plain.data) == 1 and list(plain.data[0].x) == loops


def test_per_loop_figure_skips_nan_and_zero(frame):
    summary = per_loop_summary(frame, n_boot=50)
    fig = viz.per_loop_figure(summary)
    named = {t.name: t for t in lines(fig)}
    kl, state, final = named["KL(p_l ‖ p_{l−1})"], named["‖s_l − s_{l−1}‖ / ‖s_l‖"], named["KL(p_L ‖ p_l)"]
    assert list(kl.x) == list(range(2, L + 1)) and list(state.x) == list(range(2, L + 1))
    assert list(final.x) == list(range(1, L))  # KL(p_L || p_L) = 0 has no place on a log axis
    np.testing.assert_allclose(kl.y, summary.kl.iloc[1:])
    assert kl.xaxis == "x" and state.xaxis == "x2"
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    bands = [t for t in fig.data if t.fill == "tonexty"]
    assert len(bands) == 3


def test_depth_histogram_shares_and_cumulative(frame):
    depths = convergence_depth(frame, EPS)
    fig = viz.depth_histogram(depths)
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    cum = [t for t in fig.data if isinstance(t, go.Scatter)][0]
    assert all(list(b.x) == list(range(1, L + 1)) for b in bars)
    assert sum(float(np.sum(b.y)) for b in bars) == pytest.approx(1.0)
    assert np.all(np.diff(cum.y) >= 0)
    assert cum.y[-1] == pytest.approx(depths.converged.mean())
    counts = np.bincount(depths.depth[depths.converged], minlength=L + 1)[1:]
    np.testing.assert_array_equal(bars[0].customdata, counts)


def test_class_depth_bars_order_and_intervals():
    rng = np.random.default_rng(0)
    classes = rng.choice(["content", "function", "whitespace"], 300)
    depth = np.where(classes == "content", 6, np.where(classes == "function", 4, 2)) + rng.integers(0, 3, 300)
    by_class = class_depth_summary(classes, depth, n_boot=100)
    fig = viz.class_depth_bars(by_class.sample(frac=1, random_state=1))  # order restored by mean depth
    bar = fig.data[0]
    assert list(bar.x) == ["whitespace", "function", "content"]
    b = by_class.set_index("class").loc[list(bar.x)]
    np.testing.assert_allclose(bar.y, b.mean_depth)
    np.testing.assert_allclose(np.asarray(bar.y) + bar.error_y.array, b.ci_high)
    np.testing.assert_allclose(np.asarray(bar.y) - bar.error_y.arrayminus, b.ci_low)


def test_quality_vs_depth_families_and_the_notebook_rename():
    rows = [("uniform", float(d), f"uniform({d})", d, 5 - 0.1 * math.log2(d)) for d in (8, 1, 2, 4)]
    rows += [("kl", p, f"kl({p:g})", 6 - p * 1e3, 4.75 + p * 10) for p in (1e-3, 1e-4)]
    rows += [("oracle", p, f"oracle({p:g})", 2 + p * 100, 4.71) for p in (1e-2, 1e-3)]
    held = pd.DataFrame(rows, columns=["family", "param", "rule", "avg_depth", "ce"])
    held["ce_lo"], held["ce_hi"] = held.ce - 0.01, held.ce + 0.02
    # exactly the notebook's call: family -> rule_family -> rule, next to summarize's own "rule" column
    plot = held.rename(columns={"family": "rule_family"})
    df = plot.rename(columns={"rule_family": "rule", "ce": "quality", "ce_lo": "quality_lo", "ce_hi": "quality_hi"})
    fig = viz.quality_vs_depth(df, reference=4.7, quality_label="validation cross-entropy (nats)")
    named = lines(fig)
    assert [t.name for t in named] == ["uniform", "kl", "oracle", "reference (4.7)"]
    uni, kl, oracle = named[:3]
    assert list(uni.x) == [1, 2, 4, 8] and uni.line.color == "black"
    assert list(uni.customdata) == ["1", "2", "4", "8"]
    assert oracle.line.dash == "dash"
    assert list(kl.x) == sorted(kl.x) and list(kl.customdata) == ["0.001", "0.0001"]
    np.testing.assert_allclose(kl.error_y.array, [0.02, 0.02])
    assert viz.quality_vs_depth(df, log_y=True).layout.yaxis.type == "log"


def test_speedup_bars_grouped():
    table = pd.DataFrame({"setting": ["batched eval", "batched eval", "generation"], "rule": ["kl", "oracle", "kl"],
                          "avg_loops": [5.0, 3.0, 5.5], "proxy_speedup": [1.5, 2.4, 1.4],
                          "wallclock_speedup": [1.3, np.nan, 1.1]})
    fig = viz.speedup_bars(table)
    proxy, wall, target = fig.data
    assert [list(v) for v in proxy.x] == [list(table.setting), list(table.rule)]
    np.testing.assert_allclose(proxy.y, table.proxy_speedup)
    np.testing.assert_allclose(target.y, 0.9 * table.proxy_speedup)
    assert math.isnan(wall.y[1]) and fig.layout.barmode == "group"
    with pytest.raises(DrcError, match="wallclock_speedup"):
        viz.speedup_bars(table.drop(columns="wallclock_speedup"))


# ------------------------------------------------------------------------------------ the depth explorer


def test_token_texts_decode_each_id(tok):
    ids = tok.encode(TEXT).ids
    texts = token_texts(tok, ids)
    assert texts == [tok.decode([i]) for i in ids]
    assert "".join(texts) == TEXT
    assert token_texts(None, [3, 17]) == ["#3", "#17"]


def test_slider_figure_one_frame_per_loop_coloured_by_log_kl(frame, tok):
    fig = drc_core.depth_slider_figure(frame, 1, tok, eps=EPS, max_tokens=20)
    assert [f.name for f in fig.frames] == [str(lp) for lp in range(1, L + 1)]
    assert len(fig.layout.sliders[0].steps) == L and fig.layout.sliders[0].active == 1  # opens at loop 2
    kl = token_rows(frame, 1, "kl")[:20]
    assert all(c == plotting.NAN_COLOR for c in fig.frames[0].data[0].marker.color)  # no KL at loop 1
    for lp in range(2, L + 1):
        expected = np.round(np.log10(np.maximum(kl[:, lp - 1], plotting.LOG_FLOOR)), 3)
        np.testing.assert_allclose(fig.frames[lp - 1].data[0].marker.color, expected, atol=1e-9)
    np.testing.assert_allclose(fig.data[0].marker.color, fig.frames[1].data[0].marker.color)
    bar = fig.data[0]
    assert len(bar.x) == 20 and bar.marker.cmin < math.log10(EPS) < bar.marker.cmax
    ids = frame.meta[frame.meta.window == 1].token.to_numpy()[:20]
    assert list(bar.text) == [tok.decode([int(i)]).replace("\n", "↵") for i in ids]
    # the layout reads like wrapped text: within a row tokens follow each other without overlap
    rows, starts, widths = np.asarray(bar.y), np.asarray(bar.base), np.asarray(bar.x)
    for r in np.unique(rows):
        s, w = starts[rows == r], widths[rows == r]
        assert s[0] == 0 and np.all(s[1:] == s[:-1] + w[:-1])
    status = {c[2] for f in fig.frames for c in f.data[0].customdata}
    assert status <= {"converged", "still updating"}
    entropy = drc_core.depth_slider_figure(frame, 1, tok, metric="entropy", max_tokens=20)
    np.testing.assert_allclose(entropy.frames[0].data[0].marker.color,
                               np.round(token_rows(frame, 1, "entropy")[:20, 0], 3), atol=1e-9)


def test_slider_figure_stays_small(tok):
    big = synthetic_frame(n_pos=120, n_loops=32, vocab=tok.get_vocab_size())
    fig = drc_core.depth_slider_figure(big, 0, tok, max_tokens=96)
    assert len(fig.frames) == 32 and len(fig.data[0].x) == 96
    size = len(fig.to_json())
    assert size < 300_000, f"{size} bytes"
    json.loads(fig.to_json())  # NaN-free, plain JSON


def test_token_strip_html_escapes_and_follows_the_loop(frame, tok):
    html2 = drc_core.token_strip_html(frame, 0, 2, tok, eps=EPS, max_tokens=T)
    html_last = drc_core.token_strip_html(frame, 0, L, tok, eps=EPS, max_tokens=T)
    assert html2 != html_last
    text_nodes = re.sub(r"<[^>]*>", "", html2)  # attribute values are escaped too, so tags end at their own >
    assert "<" not in text_nodes and ">" not in text_nodes
    assert "a &lt; b &amp; c &gt; d" in text_nodes
    assert html2.count("<span title=") == T
    assert "↵<br>" in html2  # the first line of TEXT ends at token 22 of window 0
    assert plotting.NAN_COLOR in drc_core.token_strip_html(frame, 0, 1, tok, eps=EPS, max_tokens=T)


def test_token_strip_html_converged_mode_matches_convergence_depth(frame, tok):
    depths = convergence_depth(frame, EPS)
    d0 = depths[depths.window == 0].head(20)
    for lp in (2, 4, L):
        out = drc_core.token_strip_html(frame, 0, lp, tok, eps=EPS, mode="converged", max_tokens=20)
        n_green = out.count(f"background:{plotting.CONVERGED_COLOR};")
        assert n_green == int((d0.converged & (d0.depth <= lp)).sum())
        assert out.count(f"background:{plotting.UPDATING_COLOR};") == 20 - n_green


def span_colors(strip_html: str) -> list[str]:
    """The background colour of every token span of a token_strip_html passage, in order."""
    return re.findall(r'<span title="[^"]*" style="background:([^;]+);', strip_html)


def test_depth_explorer_headless(frame, tok):
    ex = drc_core.DepthExplorer(frame, tok, window=2, eps=EPS, max_tokens=16)
    assert ex.slider.min == 1 and ex.slider.max == L and ex.slider.value == 2
    assert ex.slider.layout.width == "auto"  # stretched to the output: wide enough to hit every loop
    assert len(ex.token_buttons) == 16

    def shown_colors() -> list[str]:
        return [b.style.button_color for b in ex.token_buttons]

    # the passage is the token buttons, coloured as token_strip_html colours its spans; the header is its first line
    strip = drc_core.token_strip_html(frame, 2, 2, tok, eps=EPS, max_tokens=16)
    assert shown_colors() == span_colors(strip) and "loop 2 of 6" in ex.text.value and ex.text.value in strip
    ex.slider.value = 5
    assert shown_colors() == span_colors(drc_core.token_strip_html(frame, 2, 5, tok, eps=EPS, max_tokens=16))
    assert shown_colors() != span_colors(strip)
    ex.metric.value = "state"
    assert shown_colors() == span_colors(drc_core.token_strip_html(frame, 2, 5, tok, eps=EPS, mode="state",
                                                              max_tokens=16))
    ex.metric.value = "converged"
    assert shown_colors() == span_colors(drc_core.token_strip_html(frame, 2, 5, tok, eps=EPS, mode="converged",
                                                              max_tokens=16))
    texts = token_texts(tok, frame.meta[frame.meta.window == 2].token.to_numpy()[:16])
    assert [b.description for b in ex.token_buttons] == [t.replace("\n", "↵").replace(" ", "\u00a0") or "\u00a0"
                                                         for t in texts]
    assert "depth" in ex.token_buttons[3].tooltip and "KL" in ex.token_buttons[3].tooltip
    kl = token_rows(frame, 2, "kl")
    sd = token_rows(frame, 2, "state_delta")
    ex.token_buttons[7].click()  # clicking a token selects it
    assert ex.token.value == 7 and ex.token_buttons[7].layout.border and not ex.token_buttons[6].layout.border
    traj = ex.trajectory
    assert list(traj.data[0].x) == list(range(1, L + 1))
    np.testing.assert_allclose(traj.data[0].y, np.maximum(kl[7], plotting.LOG_FLOOR), equal_nan=True)
    state = [t for t in traj.data if t.name.startswith("state")][0]
    np.testing.assert_allclose(state.y, np.maximum(sd[7], plotting.LOG_FLOOR), equal_nan=True)
    assert traj.layout.yaxis.type == "log"
    assert traj.layout.shapes[0].x0 == 5  # the current loop
    ex.slider.value = 3
    assert ex.trajectory.layout.shapes[0].x0 == 3
    ex.token.value = 2  # also settable from code
    assert ex.trajectory.layout.title.text.startswith("pos 2 ")
    assert ex.widget.children[2] is ex.text and ex.widget.children[3] is ex.tokens


def test_explorer_kl_floor_on_log_axes(frame, tok):
    """Slightly negative KL (float noise) and zeros are drawn at the stated floor, the figure shows the floor,
    and hover keeps the measured value."""
    noisy = Measurement({**frame.stats, "kl": frame.stats["kl"].copy()}, frame.meta)
    noisy.stats["kl"][0, 2] = -1.5e-7  # window 0, pos 0 at loop 3
    noisy.stats["kl"][0, 3] = 0.0
    ex = drc_core.DepthExplorer(noisy, tok, window=0, eps=EPS, max_tokens=4)
    kl = ex.trajectory.data[0]
    assert kl.y[2] == plotting.LOG_FLOOR and kl.y[3] == plotting.LOG_FLOOR and math.isnan(kl.y[0])
    assert kl.customdata[2] == pytest.approx(-1.5e-7)
    floor = [t for t in ex.trajectory.data if t.name.startswith("floor")]
    assert len(floor) == 1 and list(floor[0].y) == [plotting.LOG_FLOOR] * 2 and "values below" in floor[0].name
    assert f"values below {plotting.LOG_FLOOR:g} drawn at" in ex.text.value


def test_explorer_traces_any_text(frame, tok, tiny_model_factory):
    """A text box and show_text(): the text goes through drc_core.trace and replaces the passage in the same
    explorer (slider range, one button per token, trajectory); a bad text says why and keeps the passage."""
    import drc_core

    model = tiny_model_factory(tok.get_vocab_size(), core_scale=1.0)
    calls = []

    def tracer(text: str) -> drc_core.Trace:
        calls.append(text)
        return drc_core.trace(model, text, 8, tokenizer=tok)

    with pytest.raises(DrcError, match="needs tracer"):
        drc_core.DepthExplorer(frame, tok, text="x")
    ex = drc_core.DepthExplorer(frame, tok, window=1, eps=EPS, max_tokens=32, tracer=tracer)
    assert ex.widget.children[0].children == (ex.input, ex.trace_button)
    sentence = "The dog ran up the tree."
    ex.input.value = sentence  # what pressing Enter in the text box does
    want = drc_core.trace(model, sentence, 8, tokenizer=tok)
    assert calls == [sentence] and ex.passage.window == 0
    assert [b.description.replace("\u00a0", " ") for b in ex.token_buttons] == want.tokens
    assert ex.slider.max == 8 and ex.slider.value == 2 and ex.token.value == 0
    depth = want.convergence_depth(EPS)
    assert ex.passage.depth.tolist() == depth["depth"].tolist()
    ex.token_buttons[-1].click()
    np.testing.assert_allclose(ex.trajectory.data[0].y, np.maximum(want.matrix("kl")[-1], plotting.LOG_FLOOR),
                               equal_nan=True)
    ex.show_text("The cat sat.")  # the function argument, and the button
    assert calls[-1] == "The cat sat." and ex.input.value == "The cat sat." and len(calls) == 2
    ex.trace_button.click()
    assert len(calls) == 3
    before = ex.passage
    ex.show_text("   ")
    assert ex.passage is before and "type a text" in ex.status.value
    ex2 = drc_core.DepthExplorer(frame, tok, eps=EPS, tracer=tracer, text="a mat")
    assert calls[-1] == "a mat" and "".join(ex2.passage.texts) == "a mat"


@pytest.mark.parametrize(("call", "message"), [
    (lambda f, t: drc_core.token_strip_html(f, 99, 2, t), "window=99 is not measured"),
    (lambda f, t: drc_core.token_strip_html(f, 0, L + 1, t), f"loop={L + 1} is out of range"),
    (lambda f, t: drc_core.token_strip_html(f, 0, 2, t, mode="rainbow"), "unknown metric/mode 'rainbow'"),
    (lambda f, t: drc_core.depth_slider_figure(f, 0, t, metric="converged"), "unknown metric/mode 'converged'"),
    (lambda f, t: drc_core.depth_slider_figure(f, 0, t, max_tokens=0), "max_tokens=0 is invalid"),
    (lambda f, t: drc_core.DepthExplorer(Measurement({"entropy": f.stats["entropy"]}, f.meta), t),
     "expected a Measurement from drc_core.measure_windows or drc_core.trace"),
    (lambda f, t: drc_core.DepthExplorer(f.to_frame(), t), "expected a Measurement"),
    (lambda f, t: drc_core.DepthExplorer(f, t, eps=0), "eps=0 is invalid"),
])
def test_bad_input_is_one_clear_line(frame, tok, call, message):
    with pytest.raises(DrcError, match=message) as err:
        call(frame, tok)
    assert "\n" not in str(err.value)


def test_number_table_keeps_small_kl_values_readable():
    df = pd.DataFrame({"d": [256, 128], "CE@8": [3.74961, 4.2933], "KL@16": [5.92e-5, 2.79e-5], "name": ["a", "b"]})
    html = viz.number_table(df).to_html()
    assert "5.92e-05" in html and "2.79e-05" in html  # DataFrame.round(4) would show 0.0001 and 0.0000
    assert ">256<" in html and "3.750" in html and ">a<" in html


def test_explorer_colours_by_the_per_token_dynamics(tok, tiny_model_factory, frame):
    """A drc_core.trace carries contraction, commit loop and class: the explorer offers them as colour-by
    options, colours as token_strip_html does, and names them in each token's tooltip; a measure_windows
    measurement has no such options, and asking for one is a one-line error."""
    import drc_core

    model = tiny_model_factory(tok.get_vocab_size(), core_scale=3.0)
    tr = drc_core.trace(model, "The dog ran after the cat, and the cat ran up the tree.", 12, tokenizer=tok)
    ex = drc_core.DepthExplorer(tr, tok, eps=EPS)
    values = [v for _, v in ex.metric.options]
    assert values == ["kl", "state", "entropy", "contraction", "commit", "class", "converged"]
    per_token = tr.dynamics()
    ex.metric.value = "class"
    colours = [b.style.button_color for b in ex.token_buttons]
    assert colours == [explorer.CLASS_COLORS[c] for c in per_token["dyn_class"]]
    assert colours == span_colors(drc_core.token_strip_html(tr, 0, 2, tok, eps=EPS, mode="class"))
    assert "oscillating" in ex.text.value and per_token["dyn_class"][0] in ex.token_buttons[0].tooltip
    for mode in ("commit", "contraction"):
        ex.metric.value = mode
        ex.slider.value = 6
        assert [b.style.button_color for b in ex.token_buttons] == span_colors(
            drc_core.token_strip_html(tr, 0, 6, tok, eps=EPS, mode=mode))
    commit = per_token["commit_loop"].to_numpy()
    ex.metric.value = "commit"
    first = [b.style.button_color for b, c in zip(ex.token_buttons, commit, strict=True) if c == commit.min()]
    assert len(set(first)) == 1  # one commit loop, one colour
    assert f"commits at loop {commit[0]}" in ex.token_buttons[0].tooltip
    fig = drc_core.depth_slider_figure(tr, 0, tok, eps=EPS, metric="contraction")
    assert len(fig.frames) == 12
    # the measurement has none of these: the options stay the statistics, a request is refused
    plain = drc_core.DepthExplorer(frame, tok, window=0, eps=EPS, max_tokens=8)
    assert [v for _, v in plain.metric.options] == ["kl", "state", "entropy", "converged"]
    with pytest.raises(DrcError, match="needs 'dyn_class': trace with drc_core.trace"):
        drc_core.token_strip_html(frame, 0, 2, tok, mode="class")
    with pytest.raises(DrcError, match="unknown metric/mode 'class'"):
        drc_core.depth_slider_figure(tr, 0, tok, metric="class")


def test_commit_vs_convergence_and_norm_figures():
    fig = viz.commit_vs_convergence([1, 1, 2, 4], [1, 3, 3, 4], max_loops=4)
    heat = fig.data[0]
    share = np.asarray(heat.customdata)
    assert share.shape == (4, 4) and share.sum() == pytest.approx(1.0)
    assert share[0, 0] == 0.25 and share[0, 2] == 0.25 and share[1, 2] == 0.25 and share[3, 3] == 0.25
    with pytest.raises(DrcError):
        viz.commit_vs_convergence([1, 2], [1], max_loops=4)
    pct = pd.DataFrame({"loop": [1, 2, 3], "p50": [1.0, 2.0, 3.0], "p95": [2.0, 3.0, 4.0], "median_growth": 1.0})
    fig = viz.norm_by_loop(pct)
    assert [t.name for t in fig.data] == ["p50", "p95"]


def test_decoder_bars_one_bar_per_path_and_a_flop_marker():
    from drc_book.viz import decoder_bars

    table = pd.DataFrame([
        {"batch": b, "rule": rule, "path": path, "x_dense": x, "flop_speedup": f, "avg_loops": 4.0,
         "tokens_per_s": 100.0}
        for b in (1, 8) for rule, f in (("uniform=8", 1.0), ("dstate<0.1", 1.6))
        for path, x in (("dense decode", 1.0), ("generate", 0.9), ("continuous", 1.3))])
    fig = decoder_bars(table)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["generate", "continuous"] and all(len(t.y) == 4 for t in bars)
    marks = [t for t in fig.data if t.type == "scatter"]
    assert len(marks) == 2 and list(marks[0].y) == [1.0, 1.6, 1.0, 1.6]
    with pytest.raises(DrcError, match="time_decoders"):
        decoder_bars(table.drop(columns="flop_speedup"))

import math

import numpy as np
import pandas as pd
import pytest
import torch

from drc_core.analysis.intervals import bootstrap_ci
from drc_core.analysis.measure import (
    FRAME_COLUMNS,
    Measurement,
    convergence_depth,
    depth_summary,
    eps_sensitivity,
    measure_windows,
    oscillating_tokens,
    per_loop_summary,
    val_windows_with_docs,
)
from drc_core.data.sampler import Corpus
from drc_core.errors import DrcError
from drc_core.model.lm import DepthRecurrentLM, iterate
from drc_core.model.passes import EVAL_STATE_SEED
from drc_core.training.evaluate import loss_by_depth, mean_successive_kl

V, T, N, L = 64, 12, 5, 6


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> DepthRecurrentLM:
    return tiny_model_factory(V, core_scale=8.0)


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, V, (N, T + 1), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def meas(model, windows) -> Measurement:
    docs = torch.tensor([0, 0, 1, 2, 2])
    return measure_windows(model, windows, L, doc_ids=docs, batch_size=2)


@pytest.fixture(scope="module")
def frame(meas) -> pd.DataFrame:
    return meas.to_frame()


def reference(model, windows, batch_size=2):
    """Naive per-loop log-probs and states, stacked: (N, L, T, V) and (N, L, T, d)."""
    gen = torch.Generator().manual_seed(EVAL_STATE_SEED)
    logps, states = [], []
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            x = windows[start : start + batch_size, :-1]
            outs = list(iterate(model, x, L, generator=gen, readout="log_probs"))
            logps.append(torch.stack([o.out for o in outs], dim=1))
            states.append(torch.stack([o.state for o in outs], dim=1))
    return torch.cat(logps), torch.cat(states)


def column(df: pd.DataFrame, name: str) -> np.ndarray:
    """(N, T, L) array of a column (the frame is sorted by window, pos, loop)."""
    return df[name].to_numpy().reshape(N, T, L)


def test_frame_layout(meas, frame, windows):
    assert list(meas.stats) == list(FRAME_COLUMNS[5:]) and list(meas.meta.columns) == [*FRAME_COLUMNS[:2],
                                                                                      *FRAME_COLUMNS[3:5], "doc"]
    assert all(a.shape == (N * T, L) for a in meas.stats.values()) and len(meas) == N * T and meas.max_loops == L
    assert meas.stats["kl"].dtype == np.float32 and meas.stats["argmax"].dtype == np.int8
    assert list(frame.columns) == [*FRAME_COLUMNS, "doc"]
    assert len(frame) == N * T * L
    assert frame.loop.dtype == np.int8 and frame.pos.dtype == np.int8 and frame.kl.dtype == np.float32
    assert (column(frame, "window")[:, 0, 0] == np.arange(N)).all()
    assert (column(frame, "loop")[0, 0] == np.arange(1, L + 1)).all()
    assert (column(frame, "token")[..., 0] == windows[:, :-1].numpy()).all()
    assert (column(frame, "target")[..., 0] == windows[:, 1:].numpy()).all()
    assert (column(frame, "doc")[:, 0, 0] == [0, 0, 1, 2, 2]).all()
    assert frame[frame.loop == 1][["kl", "state_delta"]].isna().all().all()
    assert frame[frame.loop > 1][["kl", "state_delta", "kl_final"]].notna().all().all()


def test_matches_naive_reference(model, windows, frame):
    logp, state = reference(model, windows)  # (N, L, T, V), (N, L, T, d)
    p = logp.exp()
    y = windows[:, 1:]
    kl_prev = (p[:, 1:] * (logp[:, 1:] - logp[:, :-1])).sum(-1)  # KL(p_l || p_{l-1}), l = 2..L
    final = logp[:, -1:]
    kl_final = (final.exp() * (final - logp)).sum(-1)  # KL(p_L || p_l)
    entropy = -(p * logp).sum(-1)
    delta = (state[:, 1:] - state[:, :-1]).norm(dim=-1) / state[:, 1:].norm(dim=-1)
    ce = -logp.gather(-1, y[:, None, :, None].expand(N, L, T, 1)).squeeze(-1)
    argmax = logp.argmax(-1)

    def tl(x):  # (N, L', T) -> (N, T, L')
        return x.permute(0, 2, 1).numpy()

    kw = {"rtol": 1e-4, "atol": 1e-6}
    np.testing.assert_allclose(column(frame, "kl")[..., 1:], tl(kl_prev), **kw)
    np.testing.assert_allclose(column(frame, "state_delta")[..., 1:], tl(delta), **kw)
    np.testing.assert_allclose(column(frame, "kl_final"), tl(kl_final), **kw)
    np.testing.assert_allclose(column(frame, "entropy"), tl(entropy), **kw)
    np.testing.assert_allclose(column(frame, "ce"), tl(ce), **kw)
    assert (column(frame, "argmax") == tl(argmax)).all()
    assert np.abs(column(frame, "kl_final")[..., -1]).max() < 1e-6
    assert float(kl_prev.mean()) > 1e-3  # the test model's outputs actually move


def test_ce_equals_loss_by_depth_and_mean_kl(model, windows, meas):
    losses = loss_by_depth(model, windows, list(range(1, L + 1)), batch_size=2)
    summary = per_loop_summary(meas, n_boot=50)
    np.testing.assert_allclose(summary.ce.to_numpy(), [losses[n] for n in range(1, L + 1)], rtol=1e-5)
    kl = mean_successive_kl(model, windows, L, batch_size=2)
    np.testing.assert_allclose(summary.kl.to_numpy()[1:], [kl[n] for n in range(2, L + 1)], rtol=1e-4)
    assert math.isnan(summary.kl[0]) and summary.n_tokens.tolist() == [N * T] * L


def test_no_final_pass_and_mode_restored(model, windows, frame):
    model.train()
    df = measure_windows(model, windows, L, batch_size=2, kl_to_final=False).to_frame()
    assert model.training
    model.eval()
    assert df.kl_final.isna().all() and "doc" not in df.columns
    np.testing.assert_array_equal(df.kl.to_numpy(), frame.kl.to_numpy())


def test_positions_give_the_full_frames_rows_of_those_tokens(model, windows, meas, frame):
    """A mask of tokens (a window with none of them, a batch with none, a window with all) gives exactly the
    full frame's rows of those tokens, with every column, the doc ids included."""
    mask = torch.rand(N, T, generator=torch.Generator().manual_seed(3)) < 0.3
    mask[1] = False
    mask[4] = False  # the last batch (batch_size 2) is window 4 alone
    mask[3] = True
    docs = torch.tensor([0, 0, 1, 2, 2])
    part = measure_windows(model, windows, L, doc_ids=docs, batch_size=2, positions=mask).to_frame()
    w, p = np.nonzero(mask.numpy())
    full = frame.set_index(["window", "pos"]).loc[list(zip(w, p, strict=True))].reset_index()
    assert len(part) == int(mask.sum()) * L
    pd.testing.assert_frame_equal(part[full.columns].reset_index(drop=True), full, check_dtype=False, atol=2e-5)
    chosen = meas.select(mask.numpy().reshape(-1)).to_frame()  # the same tokens chosen from the full measurement
    pd.testing.assert_frame_equal(part, chosen, atol=2e-5)
    with pytest.raises(DrcError, match="positions must be a bool mask"):
        measure_windows(model, windows, L, positions=mask[:, :-1])


def test_one_pass_and_two_passes_give_the_same_frame(model, windows, frame, monkeypatch):
    """Log-probs of every loop kept (small batches, e.g. a task's answers) or a first pass to the deepest output
    (the default above a size): the same frame, and only the second makes the extra pass."""
    from drc_core.analysis import measure as m

    calls = []
    real = m.logits_at
    monkeypatch.setattr(m, "logits_at", lambda *a, **k: calls.append(1) or real(*a, **k))
    docs = torch.tensor([0, 0, 1, 2, 2])
    mask = torch.rand(N, T, generator=torch.Generator().manual_seed(5)) < 0.3
    one = [measure_windows(model, windows, L, doc_ids=docs, batch_size=2, positions=pos).to_frame()
           for pos in (None, mask)]
    assert not calls  # these batches fit ONE_PASS_BYTES
    monkeypatch.setattr(m, "ONE_PASS_BYTES", 0)
    two = [measure_windows(model, windows, L, doc_ids=docs, batch_size=2, positions=pos).to_frame()
           for pos in (None, mask)]
    assert len(calls) == 2 * 3  # a first pass per batch of 2 of the 5 windows, twice
    for a, b in zip(one, two, strict=True):
        pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(one[0], frame)


def test_the_arrays_and_the_long_frame_say_the_same(meas, frame):
    """The long frame goes back to the same arrays, and the summaries that read the arrays give what the long frame
    gives (the way they were computed from it: one group per loop, one per token)."""
    back = Measurement.from_frame(frame)
    assert list(back.stats) == list(meas.stats) and back.attrs == meas.attrs
    for k, v in meas.stats.items():
        assert back.stats[k].dtype == v.dtype
        np.testing.assert_array_equal(back.stats[k], v)
    pd.testing.assert_frame_equal(back.meta, meas.meta)
    metrics = ["kl", "state_delta", "entropy", "ce", "kl_final"]
    by_loop = frame.astype({m: float for m in metrics}).groupby("loop")[metrics].mean()
    summary = per_loop_summary(meas, n_boot=10).set_index("loop")
    np.testing.assert_allclose(summary[metrics].to_numpy(), by_loop.to_numpy(), rtol=1e-9)
    for eps in (1e-1, 1e-3):
        last = frame[(frame.loop >= 2) & ~(frame.kl.astype(float) < eps)].groupby(["window", "pos"]).loop.max()
        keys = zip(meas.meta.window, meas.meta.pos, strict=True)
        assert convergence_depth(meas, eps).depth.tolist() == [int(last.get(k, 1)) for k in keys]


def test_per_loop_summary_cis(meas):
    s = per_loop_summary(meas, n_boot=200, seed=3)
    for m in ("kl", "state_delta", "ce", "kl_final", "entropy"):
        ok = s[m].notna()
        assert (s.loc[ok, f"{m}_ci_low"] <= s.loc[ok, m] + 1e-12).all()
        assert (s.loc[ok, m] <= s.loc[ok, f"{m}_ci_high"] + 1e-12).all()
    pd.testing.assert_frame_equal(s, per_loop_summary(meas, n_boot=200, seed=3))


def trajectories(rows: dict[int, list[float]]) -> Measurement:
    """A hand-made measurement: token pos=k has kl = rows[k] at loops 2..L (NaN at loop 1)."""
    kl = np.array([[math.nan, *kls] for kls in rows.values()], dtype=np.float32)
    return Measurement({"kl": kl}, pd.DataFrame({"window": 0, "pos": list(rows), "doc": [p % 2 for p in rows]}))


def test_convergence_depth_definition():
    eps = 1e-3
    df = trajectories({
        0: [0.5, 1e-2, 1e-4, 1e-5, 1e-6],  # monotone: last KL >= eps at loop 3
        1: [1e-4, 1e-5, 1e-6, 1e-7, 1e-8],  # already settled: depth 1
        2: [0.5, 1e-4, 0.2, 1e-4, 1e-5],  # dips below eps at loop 3, rises at loop 4: depth 4
        3: [0.5, 0.4, 0.3, 0.2, 0.1],  # never settles: depth L=6, not converged
        4: [0.5, 0.4, 0.3, 0.2, 1e-4],  # settles only at the last loop: depth 5
        5: [0.5, 1e-3, 1e-4, 1e-4, 1e-4],  # exactly eps is not below: depth 3
    })
    d = convergence_depth(df, eps)
    assert d.depth.tolist() == [3, 1, 4, 6, 5, 3]
    assert d.converged.tolist() == [True, True, True, False, True, True]
    assert d.doc.tolist() == [0, 1, 0, 1, 0, 1]
    assert convergence_depth(df, 1.0).depth.tolist() == [1] * 6
    shuffled = Measurement.from_frame(df.to_frame().sample(frac=1, random_state=0))  # a long frame in any order
    assert convergence_depth(shuffled, eps).depth.tolist() == [3, 1, 4, 6, 5, 3]


def test_depth_summary_and_eps_sensitivity(meas):
    d = convergence_depth(meas, 1e-3)
    s = depth_summary(d, train_mean_depth=3, n_boot=300, seed=1).set_index("stat")
    depth = d.depth.to_numpy()
    assert s.loc["median_depth", "value"] == np.sort(depth)[(len(depth) + 1) // 2 - 1]
    assert s.loc["mean_depth", "value"] == pytest.approx(depth.mean())
    assert s.loc["frac_updating", "value"] == pytest.approx((depth > 3).mean())
    assert s.loc["frac_unconverged", "value"] == pytest.approx((~d.converged).mean())
    assert (s.ci_low <= s.value).all() and (s.value <= s.ci_high).all()
    assert (s.n_clusters == 3).all() and (s.n_tokens == N * T).all()
    sens = eps_sensitivity(meas, (1e-1, 1e-3, 1e-5), train_mean_depth=3, n_boot=50)
    assert sens.eps.unique().tolist() == [1e-1, 1e-3, 1e-5]
    mean = sens[sens.stat == "mean_depth"].value.to_numpy()
    assert (np.diff(mean) >= 0).all()  # a smaller eps never gives an earlier depth


def test_bootstrap_helper():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 2))
    docs = np.repeat(np.arange(30), 10)
    point, lo, hi = bootstrap_ci(x, docs, n_boot=400, seed=5)
    np.testing.assert_allclose(point, x.mean(0))
    assert (lo <= point).all() and (point <= hi).all()
    again = bootstrap_ci(x, docs, n_boot=400, seed=5)
    for a, b in zip((point, lo, hi), again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(lo, bootstrap_ci(x, docs, n_boot=400, seed=6)[1])
    med = bootstrap_ci(np.arange(10.0), None, stat="median", n_boot=200, seed=0)
    assert med[0][0] == 4.0 and med[1][0] <= 4.0 <= med[2][0]
    # one cluster: every replicate is the full sample, so the CI collapses onto the point
    p, lo, hi = bootstrap_ci(np.arange(6.0), np.zeros(6), n_boot=20)
    assert p[0] == lo[0] == hi[0] == 2.5


def test_parquet_round_trip(meas, frame, tmp_path):
    path = meas.save(tmp_path / "sub" / "measure.parquet")
    back = Measurement.load(path)
    pd.testing.assert_frame_equal(back.to_frame(), frame, check_exact=True)
    assert back.attrs["max_loops"] == L and back.attrs["kl_final"] == "KL(p_L || p_l)"
    assert list(back.stats) == list(meas.stats) and back.meta.dtypes.equals(meas.meta.dtypes)
    frame.to_parquet(tmp_path / "old.parquet", index=False)  # a long frame written before the stats were recorded
    pd.testing.assert_frame_equal(Measurement.load(tmp_path / "old.parquet").to_frame(), frame, check_exact=True)
    with pytest.raises(ValueError, match="not found"):
        Measurement.load(tmp_path / "missing.parquet")


def test_a_frame_made_from_something_else_is_refused(meas, tmp_path):
    path = meas.save(tmp_path / "f.parquet", made_with={"corpus": "abc", "windows": 8})
    assert Measurement.load(path, expect={"corpus": "abc", "windows": 8}).attrs["made_with"]["windows"] == 8
    with pytest.raises(DrcError, match="was made with corpus='abc', not 'xyz'"):
        Measurement.load(path, expect={"corpus": "xyz"})
    with pytest.raises(DrcError, match="does not record its tokenizer"):
        Measurement.load(path, expect={"tokenizer": "t"})
    assert "made_with" not in meas.attrs  # saving records it in the file, not in the caller's measurement


def test_val_windows_with_docs(tmp_path):
    toks = np.arange(40, dtype=np.uint16) % V
    toks.tofile(tmp_path / "val.bin")
    docs = pd.DataFrame({
        "split": ["train", "val", "val", "val"],
        "source": ["a", "a", "b", "a"],
        "doc_id": ["t0", "v0", "v1", "v2"],
        "tok_start": [0, 0, 7, 20],
        "tok_end": [50, 7, 20, 40],
    })
    docs.to_parquet(tmp_path / "docs.parquet")
    corpus = Corpus(tmp_path, {"dtype": "uint16", "vocab_size": V})  # a hand-made split: not a full corpus to open
    w, doc = val_windows_with_docs(corpus, 8, 3, spread=False)
    assert w.shape == (3, 9) and doc.shape == (3, 8)
    flat = doc.reshape(-1).tolist()
    assert flat == [1] * 7 + [2] * 13 + [3] * 4
    assert (w[:, :-1].reshape(-1).numpy() == toks[:24]).all()
    # spread (the default): 3 of the 4 slots evenly over the split, 0, 2 and 3
    w, doc = val_windows_with_docs(corpus, 8, 3)
    assert (w.numpy() == np.stack([toks[s * 8:s * 8 + 9] for s in (0, 2, 3)])).all()
    assert doc.reshape(-1).tolist() == [1] * 7 + [2] + [2] * 4 + [3] * 4 + [3] * 8
    assert val_windows_with_docs(corpus, 8)[0].shape == (4, 9)  # all slots: spread or not, the same


def test_bad_inputs(model, windows, meas, frame):
    cases = [
        (lambda: convergence_depth(meas, 0.0), "eps"),
        (lambda: convergence_depth(meas, -1e-3), "eps"),
        (lambda: eps_sensitivity(meas, (1e-3, 0)), "eps"),
        (lambda: measure_windows(model, windows, 1), "max_loops"),
        (lambda: measure_windows(model, windows[0], 4), "windows must be"),
        (lambda: measure_windows(model, windows[:, :1], 4), "windows must be"),
        (lambda: measure_windows(model, windows.float(), 4), "integer token ids"),
        (lambda: measure_windows(model, windows + V, 4), "vocabulary"),
        (lambda: measure_windows(model, windows, 4, doc_ids=torch.zeros(2)), "doc_ids"),
        (lambda: measure_windows(model, windows, 4, batch_size=0), "batch_size"),
        (lambda: Measurement.from_frame(frame[frame.loop != 3]), "lacks loops"),
        (lambda: Measurement.from_frame(pd.concat([frame, frame.iloc[:1]])), "repeated"),
        (lambda: convergence_depth(frame, 1e-3), "expected a non-empty Measurement"),
        (lambda: convergence_depth(meas.select([]), 1e-3), "expected a non-empty Measurement"),
        (lambda: Measurement({"kl": np.zeros((3, 2))}, pd.DataFrame({"pos": [0, 1]})), "one meta row per token"),
        (lambda: bootstrap_ci(np.zeros(3), n_boot=0), "n_boot"),
        (lambda: bootstrap_ci(np.zeros(3), stat="mode"), "stat"),
        (lambda: depth_summary(convergence_depth(meas), train_mean_depth=0), "train_mean_depth"),
        (lambda: meas.matrix("nothing"), "not a statistic"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            fn()
        assert "\n" not in str(err.value)


def test_kl_concentration_on_a_hand_made_frame():
    from drc_core.analysis.measure import kl_concentration

    kl = np.full(1000, 1e-8)
    kl[:2] = 1e-2  # two tokens in a cycle carry the mean
    all_loops = np.full((1000, 16), np.nan, np.float32)
    all_loops[:, 15] = kl
    df = Measurement({"kl": all_loops}, pd.DataFrame({"window": 0, "pos": np.arange(1000)}))
    row = kl_concentration(df, [16]).iloc[0]
    assert row["mean"] == pytest.approx(kl.mean()) and row["median"] == pytest.approx(1e-8)
    assert row["top_0.1%"] == pytest.approx(1e-2 / kl.sum())  # the single largest token
    assert row["top_1%"] == pytest.approx((2e-2 + 8e-8) / kl.sum())
    assert row["mean_without_top_1%"] == pytest.approx(1e-8)
    with pytest.raises(ValueError, match="no successive KL at loop 3"):
        kl_concentration(df, [3])


def _tokens_frame(kl_final: dict[int, list[float]]) -> Measurement:
    """A frame of 4 loops for tokens 0..n-1 of window 0: ``kl_final[pos]`` = KL(p_4 || p_l) at l = 1..4, the
    successive KL at loop 4 equal to KL(p_4 || p_3) as it is in a measured frame."""
    rows = []
    for pos, kf in kl_final.items():
        for loop in range(1, 5):
            rows.append({"window": 0, "pos": pos, "loop": loop, "token": 100 + pos, "doc": 7,
                         "kl_final": kf[loop - 1], "kl": kf[2] if loop == 4 else 1e-2 / loop})
    return Measurement.from_frame(pd.DataFrame(rows))


def test_oscillating_tokens_are_the_2_cycles_not_the_slow_or_the_settled():
    frame = _tokens_frame({0: [1.0, 1e-6, 1e-3, 0.0],    # p_4 = p_2, far from p_3: a 2-cycle
                           1: [1.0, 4e-7, 1e-7, 0.0],    # settled
                           2: [1.0, 3e-4, 1e-4, 0.0]})   # still decaying: KL(p_4||p_2) > KL(p_4||p_3)/10
    tokens, shares = oscillating_tokens(frame, share_at=[4])
    assert tokens[["pos", "token", "doc"]].values.tolist() == [[0, 100, 7]]
    assert tokens.kl_other.iloc[0] == 1e-3 and tokens.kl_same.iloc[0] == 1e-6
    assert shares == {4: pytest.approx(1e-3 / (1e-3 + 1e-7 + 1e-4))}
    assert oscillating_tokens(frame, min_kl=1e-2)[0].empty  # below the floor of interest: none


def test_oscillating_tokens_name_what_is_missing():
    frame = _tokens_frame({0: [1.0, 1e-6, 1e-3, 0.0]})
    with pytest.raises(DrcError, match="no kl_final values; measure with kl_to_final=True"):
        oscillating_tokens(Measurement({**frame.stats, "kl_final": frame.stats["kl_final"] * np.nan}, frame.meta))
    with pytest.raises(DrcError, match="share_at loop 9 is outside 2..4"):
        oscillating_tokens(frame, share_at=[9])
    with pytest.raises(DrcError, match="2 loops; a 2-cycle needs at least 3"):
        oscillating_tokens(Measurement({k: v[:, :2] for k, v in frame.stats.items()}, frame.meta))


@pytest.mark.parametrize("one_pass", [True, False])
def test_one_run_of_the_core_loops_for_every_token_and_the_rules(model, windows, monkeypatch, one_pass):
    """Notebook 2's shared pass: every token measured with its dynamics and documents, and the rules replayed
    offline, from one run of the core loops: the same bits as the measurement and the offline pass alone."""
    from drc_core.analysis import measure as m
    from drc_core.halting import sweep as s

    if not one_pass:
        monkeypatch.setattr(m, "ONE_PASS_BYTES", 0)
        monkeypatch.setattr(s, "ONE_PASS_BYTES", 0)
    docs = torch.tensor([0, 0, 1, 2, 2])
    specs = s.default_rules(4)
    passed, shared = s.offline_pass_and_measure(model, windows, specs, reference_loops=3, max_loops=L,
                                                doc_ids=docs, dynamics=True, batch_size=2)
    alone = measure_windows(model, windows, L, doc_ids=docs, dynamics=True, batch_size=2)
    pd.testing.assert_frame_equal(shared.to_frame(), alone.to_frame())
    exits = s.token_exits(model, windows, specs, reference_loops=3, batch_size=2)
    assert list(passed.token_exits()) == list(exits)
    for name, ex in exits.items():
        np.testing.assert_array_equal(passed.token_exits()[name], ex)

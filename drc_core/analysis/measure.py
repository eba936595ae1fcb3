"""Per-token, per-loop convergence measurements and their summaries.

Direction conventions, used everywhere in this project:

- the *successive-output KL* at loop l is ``KL(p_l || p_{l-1}) = sum_v p_l(v) (log p_l(v) - log p_{l-1}(v))``,
  the new output measured against the previous one; it is defined for l >= 2 (NaN at loop 1 in the frames);
- the *KL to the deepest output* at loop l is ``KL(p_L || p_l)``, the deepest output p_L (L = ``max_loops``)
  measured against loop l's output -- the same direction as the oracle of :func:`drc_core.halting.reference.oracle_exit`
  (reference first); it is 0 at loop L.

The relative state change is ``||s_l - s_{l-1}|| / ||s_l||`` (L2 over the model dimension; NaN at loop 1),
the entropy ``H(p_l)`` in nats, ``ce`` the next-token cross-entropy ``-log p_l(target)`` in nats (its mean at
loop l is the validation loss at uniform depth l). All per-loop statistics come from
:func:`drc_core.analysis.loops.loop_stats`, the same code the halting rules see.

Measurement (:func:`measure_windows`). For each batch of windows the main pass is ONE ``iterate`` pass of
``max_loops`` loops (prelude once, core L times, coda + head + log-softmax at every loop). Per batch it keeps
the (B, T) statistics of every loop (O(L*T) floats per window) and at most two loops' (B, T, V) log-probs
(the current and the previous loop); the L x T x V log-probs are never stored. ``kl_to_final=True`` needs
p_L before loop 1's statistics can be compared with it. Where a batch's L loops of log-probs at the measured
positions fit in :data:`ONE_PASS_BYTES` (a few positions per window, e.g. a task's answers: ``positions``), they
are kept and compared with the last loop's after the one pass. Otherwise (every position of a batch of windows)
a first, cheaper pass per batch (prelude + L core loops + one readout, i.e. about one depth-L ``forward``) gives
p_L, kept during the main pass: the core-loop compute doubles (the main pass, which reads out every loop, grows
less: +7% wall time on one CPU thread for d=256, V=8192, T=128, L=32), and three (B, T, V) tensors are held
(previous, current, deepest). Both passes start from the same initial state s_0 (the generator's state is
replayed), so the deepest output is exactly loop L's output of the main pass, and both ways give the same numbers.
With ``kl_to_final=False`` the column is NaN and the cost is one pass.

Summaries (:func:`per_loop_summary`, :func:`convergence_depth`, :func:`depth_summary`,
:func:`eps_sensitivity`) carry percentile bootstrap CIs from one helper,
:func:`drc_core.analysis.intervals.bootstrap_ci`, which resamples
*clusters* with replacement: documents when the frame has a ``doc`` column, else windows. Every replicate of a
pooled mean is the ratio of the drawn clusters' sums; all summaries are deterministic for a given ``seed``
and, for the same clusters and seed, use the same resamples.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from drc_core.analysis.intervals import bootstrap_ci
from drc_core.analysis.loops import BUILTIN_STATISTICS, STATISTICS, frame_statistics, iterate_stats
from drc_core.data.sampler import Corpus, eval_windows, window_slots
from drc_core.errors import DrcError, need_eps, need_float, need_int
from drc_core.model.checks import check_token_ids
from drc_core.model.lm import RecurrentModel, logits_at
from drc_core.model.passes import EVAL_STATE_SEED, eval_batches, kl_successive

__all__ = [
    "DEFAULT_EPS",
    "ONE_PASS_BYTES",
    "DYNAMICS_COLUMNS",
    "FRAME_COLUMNS",
    "convergence_depth",
    "depth_from_successive_kl",
    "depth_summary",
    "eps_sensitivity",
    "kl_concentration",
    "load_frame",
    "oscillating_tokens",
    "measure_windows",
    "per_loop_summary",
    "save_frame",
    "val_windows_with_docs",
]

ONE_PASS_BYTES = 512 * 2**20  # a batch's log-probs over every loop kept (one pass) up to this size, else two passes

DEFAULT_EPS = 1e-3  # the default convergence threshold on KL(p_l || p_{l-1}); see eps_sensitivity
FRAME_COLUMNS = (
    "window", "pos", "loop", "token", "target", "kl", "kl_final", "state_delta", "entropy", "argmax", "ce",
)  # and every registered statistic with frame=True (drc_core.analysis.loops.frame_statistics), after ``ce``
_METRICS = ("kl", "state_delta", "entropy", "ce", "kl_final")
DYNAMICS_COLUMNS = ("state_norm", "state_step2")  # measure_windows(dynamics=True), after the statistics
LEGACY_COLUMNS = {"kl_prev": "kl"}  # frames saved before the statistics had one name each


# ----------------------------------------------------------------------------------------------------------
# Validation helpers


def _int_dtype(max_value: int) -> np.dtype:
    """The smallest signed integer dtype that holds 0..max_value."""
    for dt in (np.int8, np.int16, np.int32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


# ----------------------------------------------------------------------------------------------------------
# Measurement


@torch.no_grad()
def measure_windows(
    model: RecurrentModel,
    windows: torch.Tensor,
    max_loops: int = 32,
    *,
    doc_ids: torch.Tensor | np.ndarray | None = None,
    batch_size: int = 16,
    seed: int = EVAL_STATE_SEED,
    kl_to_final: bool = True,
    positions: torch.Tensor | np.ndarray | None = None,
    dynamics: bool = False,
    progress: bool = False,
) -> pd.DataFrame:
    """Per-token, per-loop statistics of ``model`` on ``windows`` (N, T+1): a tidy frame, one row per
    (window, pos, loop), sorted by window, pos, loop.

    Inputs are ``windows[:, :-1]`` and targets ``windows[:, 1:]``. Columns: ``window``, ``pos`` (0..T-1),
    ``loop`` (1..max_loops), ``token`` (input id at pos), ``target`` (next id), ``kl`` = KL(p_l || p_{l-1})
    (NaN at loop 1), ``kl_final`` = KL(p_L || p_l) (NaN when ``kl_to_final=False``), ``state_delta`` =
    ||s_l - s_{l-1}|| / ||s_l|| (NaN at loop 1), ``entropy`` (nats), ``argmax``, ``ce`` = -log p_l(target);
    plus ``doc`` when ``doc_ids`` is given, either one id per window (N,) or one per input position (N, T)
    (as :func:`val_windows_with_docs` returns); plus one column per statistic registered with ``frame=True``
    (:func:`~drc_core.analysis.loops.register_statistic`; NaN at loop 1 where it compares with the previous
    loop). The columns are the statistics' names in :data:`~drc_core.analysis.loops.STATISTICS`. Floats are
    float32, ids small signed integers.

    ``dynamics=True`` adds ``state_norm`` = ||s_l|| and ``state_step2`` = ||s_l - s_{l-2}|| (NaN at loops 1-2),
    what :meth:`drc_core.analysis.dynamics.Dynamics.from_frame` reads with ``state_delta`` and ``argmax``.
    ``positions``: an (N, T) bool mask; the frame then has the rows of those tokens only (the same values as
    the full frame's rows: every token still runs through core and coda, only the head and the statistics are
    limited to them), e.g. the answers of a task.

    The initial latent state of batch k is the k-th draw of a generator seeded with ``seed``, as in
    :func:`drc_core.training.evaluate.loss_by_depth` (same ``batch_size`` -> same states, so the mean ``ce`` at loop l
    equals its loss at depth l). Runs under ``torch.no_grad()`` in eval mode and restores the model's mode.
    Memory and cost: see the module docstring (one pass, or about two with ``kl_to_final``).

    Long because the frame's columns are gathered in one pass per batch of windows.
    """
    windows = check_token_ids(model, windows)
    max_loops = need_int("max_loops", max_loops, 2)
    batch_size = need_int("batch_size", batch_size, 1)
    n, t_len = windows.shape[0], windows.shape[1] - 1
    vocab = model.vocab_size
    docs = None
    if doc_ids is not None:
        docs = torch.as_tensor(np.asarray(doc_ids)).long()
        if docs.shape == (n,):
            docs = docs[:, None].expand(n, t_len)
        elif docs.shape != (n, t_len):
            raise DrcError(f"doc_ids must be (N,) or (N, T) = ({n},) or ({n}, {t_len}); got {tuple(docs.shape)}")
    keep = None
    if positions is not None:
        keep = torch.as_tensor(np.asarray(positions))
        if keep.dtype != torch.bool or tuple(keep.shape) != (n, t_len):
            raise DrcError(f"positions must be a bool mask (N, T) = ({n}, {t_len}); got {keep.dtype} "
                           f"{tuple(keep.shape)}")

    extras = [STATISTICS[name] for name in frame_statistics() if name not in BUILTIN_STATISTICS]
    stat_names = ("kl", "kl_final", "state_delta", "entropy", "ce", *(x.name for x in extras),
                  *(DYNAMICS_COLUMNS if dynamics else ()))
    floats: dict[str, list[np.ndarray]] = {k: [] for k in stat_names}
    reads = {"kl", "state_delta", "entropy", "argmax", *(x.name for x in extras),
             *(("state_step",) if dynamics else ())}  # what the frame's columns are made of
    argmaxes: list[np.ndarray] = []
    for b, batch in enumerate(eval_batches(model, windows, batch_size, seed)):
        x, y, gen = batch.x, batch.y, batch.generator
        where = None if keep is None else keep[batch.start : batch.start + len(x)].to(x.device)
        if where is not None:
            y = y[where][None]  # (1, n): the statistics come shaped so
        final = p_final = None
        one_pass = kl_to_final and y.numel() * vocab * max_loops * 4 <= ONE_PASS_BYTES
        kept: list[torch.Tensor] = []  # one pass: every loop's log-probs, compared with the last one's at the end
        if kl_to_final and not one_pass:
            replay = gen.get_state()
            logits = logits_at(model, x, max_loops, generator=gen, positions=where)
            final = torch.log_softmax(logits.float() if where is None else logits.float()[None], dim=-1)
            p_final = final.exp()  # once per batch, not once per loop
            gen.set_state(replay)
        per_loop: dict[str, list[torch.Tensor]] = {k: [] for k in (*stat_names, "argmax")}
        prev_step = None
        for st in iterate_stats(model, x, max_loops, generator=gen, where=where, only=reads):
            nan = torch.full_like(st.entropy, math.nan)
            first = st.loop == 1
            if dynamics:  # state_step = s_l - s_{l-1} (zero at loop 1): two of them span s_l - s_{l-2}
                per_loop["state_norm"].append(st.state.float().norm(dim=-1))
                per_loop["state_step2"].append(nan if st.loop < 3 else (st.state_step + prev_step).norm(dim=-1))
                prev_step = st.state_step
            per_loop["kl"].append(nan if first else st.kl)
            per_loop["state_delta"].append(nan if first else st.state_delta)
            for x_stat in extras:
                value = st.extra[x_stat.name].float()
                per_loop[x_stat.name].append(nan if first and x_stat.first is not None else value)
            per_loop["entropy"].append(st.entropy)
            per_loop["argmax"].append(st.argmax)
            per_loop["ce"].append(-st.log_probs.gather(-1, y[..., None]).squeeze(-1))
            if one_pass:
                kept.append(st.log_probs)
            else:
                per_loop["kl_final"].append(nan if final is None else kl_successive(final, st.log_probs, p_final))
        if one_pass:
            final = kept[-1]
            p_final = final.exp()
            per_loop["kl_final"] = [kl_successive(final, lp, p_final) for lp in kept]
        del final, p_final, st, kept  # free this batch's (B, T, V) tensors before the next one
        for k in stat_names:  # (L, B, T) -> (B, T, L) -> flat in (window, pos, loop) order
            floats[k].append(torch.stack(per_loop[k]).permute(1, 2, 0).reshape(-1).float().cpu().numpy())
        argmaxes.append(torch.stack(per_loop["argmax"]).permute(1, 2, 0).reshape(-1).cpu().numpy())
        if progress:
            print(f"measure: batch {b + 1}/{math.ceil(n / batch_size)} ({min(batch.start + batch_size, n)}/{n} "
                  "windows)", file=sys.stderr, flush=True)

    id_dtype = _int_dtype(max(vocab - 1, 1))
    mask = np.ones((n, t_len), dtype=bool) if keep is None else keep.cpu().numpy()
    w_idx, p_idx = np.nonzero(mask)  # row-major: the statistics' (window, pos) order

    def per_row(values: np.ndarray) -> np.ndarray:  # (N, T) -> one value per frame row
        return np.repeat(values[w_idx, p_idx], max_loops)

    frame = {
        "window": np.repeat(w_idx, max_loops).astype(_int_dtype(n)),
        "pos": np.repeat(p_idx, max_loops).astype(_int_dtype(t_len)),
        "loop": np.tile(np.arange(1, max_loops + 1), len(w_idx)).astype(_int_dtype(max_loops)),
        "token": per_row(windows[:, :-1].cpu().numpy()).astype(id_dtype),
        "target": per_row(windows[:, 1:].cpu().numpy()).astype(id_dtype),
    }
    for k in ("kl", "kl_final", "state_delta", "entropy"):
        frame[k] = np.concatenate(floats[k]).astype(np.float32)
    frame["argmax"] = np.concatenate(argmaxes).astype(id_dtype)
    frame["ce"] = np.concatenate(floats["ce"]).astype(np.float32)
    for name in (*(x.name for x in extras), *(DYNAMICS_COLUMNS if dynamics else ())):
        frame[name] = np.concatenate(floats[name]).astype(np.float32)
    if docs is not None:
        d = docs.cpu().numpy()
        frame["doc"] = per_row(d).astype(_int_dtype(max(int(d.max()), 0)))
    df = pd.DataFrame(frame)
    df.attrs.update({"max_loops": max_loops, "seed": int(seed), "kl_to_final": bool(kl_to_final),
                     "kl": "KL(p_l || p_{l-1})", "kl_final": "KL(p_L || p_l)"})
    return df


def val_windows_with_docs(corpus: Corpus, seq_len: int, max_windows: int | None = None,
                          spread: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation windows of :func:`drc_core.data.sampler.eval_windows` (N, seq_len+1) and, for every
    input position, the row number in ``corpus.docs`` of the document that holds that token (N, seq_len);
    -1 where a token lies in no validation document. With ``spread`` (the default) the ``max_windows``
    windows are evenly spaced over the whole validation split, so that they sample every source and many
    documents (the first windows of the split lie in its first few documents); window i covers val tokens
    slot_i*seq_len .. slot_i*seq_len+seq_len, and ``docs.tok_start``/``tok_end`` are offsets into the val
    split, so the lookup is a sorted search.
    """
    seq_len = need_int("seq_len", seq_len, 1)
    if max_windows is not None:
        max_windows = need_int("max_windows", max_windows, 1)
    val = corpus.tokens("val")
    slots = window_slots(len(val), seq_len, max_windows, spread)
    windows = eval_windows(val, seq_len, max_windows, spread)
    docs = corpus.docs[corpus.docs.split == "val"].sort_values("tok_start")
    starts, ends = docs.tok_start.to_numpy(np.int64), docs.tok_end.to_numpy(np.int64)
    rows = docs.index.to_numpy(np.int64)
    pos = slots[:, None] * seq_len + np.arange(seq_len)[None, :]
    k = np.searchsorted(starts, pos, side="right") - 1
    inside = (k >= 0) & (pos < ends[np.clip(k, 0, None)])
    doc = np.where(inside, rows[np.clip(k, 0, None)], -1)
    return windows, torch.from_numpy(doc)


def save_frame(df: pd.DataFrame, path: str | Path, made_with: Mapping[str, object] | None = None) -> Path:
    """Write a measurement frame to parquet (parent directories created); returns the path. ``made_with``: what
    the frame was computed from (e.g. the corpus's fingerprint, the number of windows), kept in the file, so that
    a reader can refuse a frame made from something else (:func:`load_frame`'s ``expect``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    out = df.copy(deep=False)
    out.attrs = {**df.attrs, "made_with": dict(made_with or {})}
    out.to_parquet(p, index=False)
    return p


def load_frame(path: str | Path, expect: Mapping[str, object] | None = None) -> pd.DataFrame:
    """Read a frame written by :func:`save_frame` (a column of an older frame gets its current name). Each key of
    ``expect`` must be in the frame's ``made_with`` record with that value; else a one-line :class:`DrcError`
    (the frame was made from something else: re-run what writes it)."""
    p = Path(path)
    if not p.is_file():
        raise DrcError(f"{p} not found; pass a parquet file written by save_frame")
    df = pd.read_parquet(p).rename(columns=LEGACY_COLUMNS)
    made = df.attrs.get("made_with", {})
    for key, want in (expect or {}).items():
        if key not in made:
            raise DrcError(f"{p} does not record its {key} (written before frames recorded what they were made "
                           "from): re-run the notebook that writes it")
        if made[key] != want:
            raise DrcError(f"{p} was made with {key}={str(made[key])[:16]!r}, not {str(want)[:16]!r}: re-run the "
                           "notebook that writes it with the same parameters")
    return df


# ----------------------------------------------------------------------------------------------------------
# Summaries


def _check_frame(df: pd.DataFrame, needed: Sequence[str]) -> None:
    if not isinstance(df, pd.DataFrame) or len(df) == 0:
        raise DrcError("expected a non-empty measurement frame from measure_windows")
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise DrcError(f"the frame lacks column {missing[0]!r}; pass a frame from measure_windows")


def _cluster_column(df: pd.DataFrame) -> str:
    """Bootstrap clusters: documents when the frame has them, else windows."""
    return "doc" if "doc" in df.columns else "window"


def _token_matrix(df: pd.DataFrame, columns: Sequence[str]) -> tuple[pd.DataFrame, dict[str, np.ndarray], int]:
    """Pivot a tidy frame to one (n_tokens, L) float matrix per column (NaN where a loop is missing).

    Returns the tokens (window, pos and the cluster column, one row each, in matrix order), the matrices
    (plus ``_present``, a bool matrix of the (token, loop) rows that exist) and L.
    """
    _check_frame(df, ("window", "pos", "loop", *columns))
    loops = df["loop"].to_numpy(np.int64)
    if loops.min() < 1:
        raise DrcError(f"the frame has loop {int(loops.min())}; loops are 1-based")
    n_loops = int(loops.max())
    key = df["window"].to_numpy(np.int64) * (int(df["pos"].max()) + 1) + df["pos"].to_numpy(np.int64)
    uniq, first, tok = np.unique(key, return_index=True, return_inverse=True)
    cell = tok * n_loops + loops - 1
    if len(np.unique(cell)) != len(df):
        raise DrcError("the frame has repeated (window, pos, loop) rows; pass one row per token and loop")
    cluster = _cluster_column(df)
    tokens = df.iloc[first][list(dict.fromkeys(["window", "pos", cluster]))].reset_index(drop=True)
    mats = {}
    for c in columns:
        m = np.full((len(uniq), n_loops), math.nan)
        m[tok, loops - 1] = df[c].to_numpy(float)
        mats[c] = m
    present = np.zeros((len(uniq), n_loops), dtype=bool)
    present[tok, loops - 1] = True
    mats["_present"] = present
    return tokens, mats, n_loops


def per_loop_summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
    """Per loop: the mean over tokens of ``kl`` (KL(p_l || p_{l-1})), ``state_delta``, ``entropy``,
    ``ce`` (= the validation loss at uniform depth l) and ``kl_final`` (KL(p_L || p_l)), each with a
    bootstrap CI over documents (windows without a ``doc`` column): columns ``loop``, ``n_tokens``, and for
    each metric m ``m``, ``m_ci_low``, ``m_ci_high``. Metrics absent from the frame, or all NaN, are NaN.
    """
    metrics = [m for m in _METRICS if m in df.columns]
    tokens, mats, n_loops = _token_matrix(df, metrics)
    stacked = np.concatenate([mats[m] for m in metrics], axis=1)
    point, lo, hi = bootstrap_ci(stacked, tokens[_cluster_column(df)].to_numpy(), n_boot=n_boot, seed=seed,
                                 level=level)
    out = pd.DataFrame({"loop": np.arange(1, n_loops + 1),
                        "n_tokens": mats["_present"].sum(axis=0)})
    for m in _METRICS:
        if m in metrics:
            j = metrics.index(m)
            sl = slice(j * n_loops, (j + 1) * n_loops)
            out[m], out[f"{m}_ci_low"], out[f"{m}_ci_high"] = point[sl], lo[sl], hi[sl]
        else:
            out[m] = out[f"{m}_ci_low"] = out[f"{m}_ci_high"] = math.nan
    return out


def depth_from_successive_kl(kl: np.ndarray, eps: float) -> np.ndarray:
    """Convergence depth from the successive KL of loops 2..L along the last axis of ``kl`` (..., L-1): the
    last loop l >= 2 whose ``KL(p_l || p_{l-1})`` is not below ``eps`` (NaN counts as not below), or 1 if there
    is none; int64 of shape ``kl.shape[:-1]``. Compared in float64 (a float32 KL against a float64 eps), as
    :func:`convergence_depth` defines it."""
    above = ~(np.asarray(kl, dtype=np.float64) < eps)
    last = (above.shape[-1] - 1) - np.argmax(above[..., ::-1], axis=-1)  # index into loops 2..L
    return np.where(above.any(axis=-1), last + 2, 1)


def convergence_depth(df: pd.DataFrame, eps: float = DEFAULT_EPS) -> pd.DataFrame:
    """Per token, the first loop after which the successive KL stays below ``eps``.

    Definition: with L the deepest loop in the frame, a token's depth is the smallest l >= 1 such that
    ``KL(p_{l'} || p_{l'-1}) < eps`` (strict, as :class:`drc_core.halting.rules.KLThreshold`) for every l' in
    l+1..L. Equivalently it is the last loop l' >= 2 whose KL is >= eps (NaN counts as >= eps), or 1 if there
    is none: a KL that dips below ``eps`` and rises again does not count, only the last rise does. A token
    whose KL at loop L is still >= eps never settled; it gets depth L and ``converged=False`` (every
    converged token has depth <= L-1). Every token needs all loops 2..L.

    Returns one row per token: ``window``, ``pos`` (and ``doc`` when the frame has it), ``depth`` (int16)
    and ``converged`` (bool), sorted by window and pos.
    """
    eps = need_eps(eps)
    tokens, mats, n_loops = _token_matrix(df, ("kl",))
    if n_loops < 2:
        raise DrcError("the frame has only loop 1; convergence depth needs loops 1..L with L >= 2")
    if not mats["_present"][:, 1:].all():
        raise DrcError(f"the frame lacks loops for some tokens; every token needs loops 2..{n_loops}")
    depth = depth_from_successive_kl(mats["kl"][:, 1:], eps)  # loops 2..L
    out = tokens.copy()
    out["depth"] = depth.astype(np.int16)
    out["converged"] = depth < n_loops
    out.attrs.update({"eps": eps, "max_loops": n_loops})
    return out


def depth_summary(depths: pd.DataFrame, train_mean_depth: float = 8, *, n_boot: int = 1000, seed: int = 0,
                  level: float = 0.95) -> pd.DataFrame:
    """Headline numbers of a :func:`convergence_depth` frame, with bootstrap CIs over documents (windows
    without a ``doc`` column): ``median_depth`` (lower median), ``mean_depth``, ``frac_updating`` (the
    fraction of tokens with depth > ``train_mean_depth``, i.e. still updating at the training-mean depth) and
    ``frac_unconverged`` (never settled within L). Returns rows ``stat``, ``value``, ``ci_low``, ``ci_high``,
    plus ``n_tokens`` and ``n_clusters``.
    """
    _check_frame(depths, ("depth", "converged"))
    need_float("train_mean_depth", train_mean_depth, 1.0)
    cluster = depths["doc"] if "doc" in depths.columns else depths.get("window")
    clusters = None if cluster is None else cluster.to_numpy()
    d = depths["depth"].to_numpy(float)
    kw = {"n_boot": n_boot, "seed": seed, "level": level}
    med = bootstrap_ci(d, clusters, stat="median", **kw)
    means = bootstrap_ci(np.column_stack([d, d > train_mean_depth, ~depths["converged"].to_numpy(bool)]),
                         clusters, **kw)
    rows = [("median_depth", med[0][0], med[1][0], med[2][0])]
    for j, name in enumerate(("mean_depth", "frac_updating", "frac_unconverged")):
        rows.append((name, means[0][j], means[1][j], means[2][j]))
    out = pd.DataFrame(rows, columns=["stat", "value", "ci_low", "ci_high"])
    out["n_tokens"] = len(d)
    out["n_clusters"] = len(d) if clusters is None else len(np.unique(clusters))
    out.attrs.update({"train_mean_depth": float(train_mean_depth), **depths.attrs})
    return out


def kl_concentration(df: pd.DataFrame, loops: Sequence[int], shares: Sequence[float] = (0.01, 0.001)) -> pd.DataFrame:
    """How the mean successive KL at each of ``loops`` is made up: its mean and median over tokens, the 99th
    percentile, the share of the mean carried by the top ``shares`` fraction of tokens (``top_1%``, ...), and
    the mean without the top 1%. A mean far above the median, carried by a handful of tokens, is a few tokens
    that never settle (e.g. a 2-cycle), not a slow common decay."""
    _check_frame(df, ("loop", "kl"))
    rows = []
    for loop in loops:
        kl = np.sort(df.loc[df.loop == loop, "kl"].dropna().to_numpy(float))[::-1]
        if kl.size == 0:
            raise DrcError(f"no successive KL at loop {loop}: the frame has loops 2..{int(df.loop.max())}")
        total = kl.sum()
        row = {"loop": int(loop), "n_tokens": kl.size, "mean": kl.mean(), "median": float(np.median(kl)),
               "p99": float(np.quantile(kl, 0.99))}
        for s in shares:
            k = max(1, int(round(s * kl.size)))
            row[f"top_{s:.1%}".replace(".0%", "%")] = float(kl[:k].sum() / total) if total > 0 else math.nan
        row["mean_without_top_1%"] = float(kl[max(1, int(round(0.01 * kl.size))):].mean()) if kl.size > 1 else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def oscillating_tokens(df: pd.DataFrame, *, min_kl: float = 1e-6, ratio: float = 10.0,
                       share_at: Sequence[int] = ()) -> tuple[pd.DataFrame, dict[int, float]]:
    """The tokens caught in a 2-cycle at the deepest loop L instead of at a fixed point: their output at L is far
    from the one a loop earlier but close to the one two loops earlier -- ``KL(p_L || p_{L-1}) >= min_kl`` and
    ``>= ratio * KL(p_L || p_{L-2})`` (the frame's ``kl_final``; needs L >= 3 and ``kl_to_final=True``).

    Returns the tokens (``window``, ``pos``, the cluster column, ``token``, ``kl_other`` = KL(p_L || p_{L-1}),
    ``kl_same`` = KL(p_L || p_{L-2}); largest ``kl_other`` first) and, for each loop l of ``share_at``, the share
    of the mean successive KL at l that these tokens carry (how much of a KL floor the cycle explains)."""
    tokens, mats, n_loops = _token_matrix(df, ("kl_final", "kl", "token"))
    if n_loops < 3:
        raise DrcError(f"the frame has {n_loops} loops; a 2-cycle needs at least 3 (measure to max_loops >= 3)")
    other, same = mats["kl_final"][:, n_loops - 2], mats["kl_final"][:, n_loops - 3]
    if np.isnan(other).all():
        raise DrcError("the frame has no kl_final values; measure with kl_to_final=True")
    hit = (other >= need_float("min_kl", min_kl, 0.0)) & (other >= need_float("ratio", ratio, 1.0) * same)
    out = tokens[hit].assign(token=mats["token"][hit, 0].astype(np.int64), kl_other=other[hit], kl_same=same[hit])
    shares = {}
    for loop in share_at:
        if not 2 <= loop <= n_loops:
            raise DrcError(f"share_at loop {loop} is outside 2..{n_loops}, the loops with a successive KL")
        kl = mats["kl"][:, loop - 1]
        total = float(np.nansum(kl))
        shares[int(loop)] = float(np.nansum(kl[hit]) / total) if total > 0 else math.nan
    return out.sort_values("kl_other", ascending=False).reset_index(drop=True), shares


def eps_sensitivity(df: pd.DataFrame, eps_grid: Sequence[float] = (1e-2, 1e-3, 1e-4, 1e-5),
                    train_mean_depth: float = 8, *, n_boot: int = 1000, seed: int = 0,
                    level: float = 0.95) -> pd.DataFrame:
    """:func:`depth_summary` of :func:`convergence_depth` for every ``eps`` in ``eps_grid``, stacked: the
    columns of :func:`depth_summary` with ``eps`` first."""
    grid = [need_eps(e) for e in eps_grid]
    if not grid:
        raise DrcError("eps_grid is empty; pass at least one eps > 0")
    parts = []
    for eps in grid:
        part = depth_summary(convergence_depth(df, eps), train_mean_depth, n_boot=n_boot, seed=seed, level=level)
        part.insert(0, "eps", eps)
        parts.append(part)
    return pd.concat(parts, ignore_index=True)

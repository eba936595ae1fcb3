"""Per-token, per-loop convergence measurements and their summaries.

Conventions used everywhere in this project: the *successive KL* at loop l is ``KL(p_l || p_{l-1})`` (NaN at
loop 1); the *KL to the deepest output* is ``KL(p_L || p_l)`` (L = ``max_loops``, reference first as in
:func:`drc_core.halting.reference.oracle_exit`; 0 at loop L); the relative state change is
``||s_l - s_{l-1}|| / ||s_l||`` (NaN at loop 1); ``entropy`` and ``ce`` (``-log p_l(target)``) are in nats. All come
from :func:`drc_core.analysis.loops.loop_stats`, the code the halting rules see. :func:`measure_windows` never keeps
more than two loops' (B, T, V) log-probs, unless every loop's fit in :data:`ONE_PASS_BYTES` (``kl_to_final``; else a
cheaper first pass from the same initial state gives p_L, with the same numbers). The summaries carry cluster
(document, else window) bootstrap CIs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from drc_core.analysis.intervals import bootstrap_ci
from drc_core.analysis.loops import BUILTIN_STATISTICS, STATISTICS, frame_statistics, iterate_stats
from drc_core.data.sampler import Corpus, eval_windows, window_slots
from drc_core.errors import DrcError, need_eps, need_float, need_int
from drc_core.model.checks import check_token_ids
from drc_core.model.lm import LoopOutput, RecurrentModel, logits_at
from drc_core.model.passes import EVAL_STATE_SEED, Batch, eval_batches, kl_successive

__all__ = ["DEFAULT_EPS", "DYNAMICS_COLUMNS", "FRAME_COLUMNS", "ONE_PASS_BYTES", "Measurement", "convergence_depth",
           "depth_from_successive_kl", "depth_summary", "eps_sensitivity", "kl_concentration", "measure_windows",
           "oscillating_tokens", "per_loop_summary", "val_windows_with_docs"]

ONE_PASS_BYTES = 512 * 2**20  # a batch's log-probs over every loop kept (one pass) up to this size, else two passes

DEFAULT_EPS = 1e-3  # the default convergence threshold on KL(p_l || p_{l-1}); see eps_sensitivity
FRAME_COLUMNS = (
    "window", "pos", "loop", "token", "target", "kl", "kl_final", "state_delta", "entropy", "argmax", "ce",
)  # and every registered statistic with frame=True (drc_core.analysis.loops.frame_statistics), after ``ce``
_METRICS = ("kl", "state_delta", "entropy", "ce", "kl_final")
DYNAMICS_COLUMNS = ("state_norm", "state_step1", "state_step2")  # measure_windows(dynamics=True), after the statistics
LEGACY_COLUMNS = {"kl_prev": "kl"}  # frames saved before the statistics had one name each


def _int_dtype(max_value: int) -> np.dtype:
    """The smallest signed integer dtype that holds 0..max_value."""
    return next(np.dtype(dt) for dt in (np.int8, np.int16, np.int32, np.int64) if max_value <= np.iinfo(dt).max)


@dataclass
class Measurement:
    """Per-token, per-loop statistics: ``stats`` maps a statistic's name to an (n, L) array (row = token, column =
    loop - 1), in :data:`FRAME_COLUMNS` order; ``meta`` one row per token (``window``, ``pos``, ``token``,
    ``target``, ``doc`` where measured, and what a caller adds); ``attrs`` what it was measured with. The long table
    is made only at the edge: :meth:`to_frame`, :meth:`save`."""

    stats: dict[str, np.ndarray]
    meta: pd.DataFrame
    attrs: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shapes = {a.shape for a in self.stats.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[0] != len(self.meta):
            raise DrcError(f"a Measurement needs (tokens, loops) statistics of one shape with one meta row per "
                           f"token; got {sorted(shapes)} and {len(self.meta)} meta rows")
        self.meta = self.meta.reset_index(drop=True)

    def __len__(self) -> int:
        return len(self.meta)

    @property
    def max_loops(self) -> int:
        return next(iter(self.stats.values())).shape[1]

    def clusters(self) -> np.ndarray:
        """The bootstrap clusters of the tokens: documents where measured, else windows."""
        return self.meta["doc" if "doc" in self.meta.columns else "window"].to_numpy()

    def matrix(self, name: str) -> np.ndarray:
        """Statistic ``name`` as a (tokens, L) float64 array."""
        if name not in self.stats:
            raise DrcError(f"column={name!r} is not a statistic of this measurement; use {', '.join(self.stats)}")
        return self.stats[name].astype(np.float64)

    def select(self, rows: np.ndarray | Sequence[int]) -> Measurement:
        """The tokens ``rows`` (a bool mask or indices), statistics and meta alike."""
        rows = np.asarray(rows)
        rows = np.flatnonzero(rows) if rows.dtype == bool else rows.astype(np.int64)
        return Measurement({k: v[rows] for k, v in self.stats.items()}, self.meta.iloc[rows], dict(self.attrs))

    def to_frame(self) -> pd.DataFrame:
        """The long table, one row per (token, loop) in (window, pos, loop) order: ``window``, ``pos``, ``loop``,
        ``token``, ``target``, the statistics, then the rest of ``meta`` (``doc``, ...); ``attrs`` as ``.attrs``."""
        n_loops, meta = self.max_loops, self.meta
        cols = {c: np.repeat(meta[c].to_numpy(), n_loops) for c in ("window", "pos") if c in meta.columns}
        cols["loop"] = np.tile(np.arange(1, n_loops + 1), len(meta)).astype(_int_dtype(n_loops))
        cols |= {c: np.repeat(meta[c].to_numpy(), n_loops) for c in ("token", "target") if c in meta.columns}
        cols |= {k: v.reshape(-1) for k, v in self.stats.items()}
        cols |= {c: np.repeat(meta[c].to_numpy(), n_loops) for c in meta.columns if c not in cols}
        df = pd.DataFrame(cols)
        df.attrs.update(self.attrs)
        return df

    @classmethod
    def from_frame(cls, df: pd.DataFrame, stats: Sequence[str] | None = None) -> Measurement:
        """A long table back to arrays (the inverse of :meth:`to_frame`; rows in any order, every token with loops
        1..L once). ``stats``: the per-loop columns (default: the frame's ``stats`` record, else all but the per-token
        ones)."""
        if not isinstance(df, pd.DataFrame) or len(df) == 0 or "loop" not in df.columns:
            raise DrcError("expected a non-empty long frame with a loop column (Measurement.to_frame)")
        keys = [c for c in ("window", "pos") if c in df.columns]
        df = df.sort_values([*keys, "loop"], kind="stable")
        loops = df["loop"].to_numpy(np.int64)
        n_loops = int(loops.max())
        if len(df) % n_loops or (loops.reshape(-1, n_loops) != np.arange(1, n_loops + 1)).any():
            raise DrcError(f"the frame lacks loops or has repeated rows; every token needs loops 1..{n_loops} once")
        per_token = ("window", "pos", "loop", "token", "target", "doc")  # in a saved frame without a "stats" record
        names = list(stats or df.attrs.get("stats") or [c for c in df.columns if c not in per_token])
        attrs = {k: v for k, v in df.attrs.items() if k != "stats"}
        meta = df.iloc[::n_loops][[c for c in df.columns if c not in (*names, "loop")]]
        return cls({k: df[k].to_numpy().reshape(-1, n_loops) for k in names}, meta, attrs)

    def save(self, path: str | Path, made_with: Mapping[str, object] | None = None) -> Path:
        """Write :meth:`to_frame` to parquet; returns the path. ``made_with`` (what it was computed from) is kept in
        the file, so that :meth:`load` can refuse a measurement made from something else."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        df = self.to_frame()
        df.attrs.update({"stats": list(self.stats), "made_with": dict(made_with or {})})
        df.to_parquet(p, index=False)
        return p

    @classmethod
    def load(cls, path: str | Path, expect: Mapping[str, object] | None = None) -> Measurement:
        """Read a file of :meth:`save`; each key of ``expect`` must be in its ``made_with`` record with that value."""
        p = Path(path)
        if not p.is_file():
            raise DrcError(f"{p} not found; pass a parquet file written by Measurement.save")
        df = pd.read_parquet(p).rename(columns=LEGACY_COLUMNS)
        made = df.attrs.get("made_with", {})
        for key, want in (expect or {}).items():
            if key not in made:
                raise DrcError(f"{p} does not record its {key} (written before frames recorded what they were made "
                               "from): re-run the notebook that writes it")
            if made[key] != want:
                raise DrcError(f"{p} was made with {key}={str(made[key])[:16]!r}, not {str(want)[:16]!r}: re-run the "
                               "notebook that writes it with the same parameters")
        return cls.from_frame(df)


@torch.no_grad()
def measure_windows(model: RecurrentModel, windows: torch.Tensor, max_loops: int = 32, *,
                    doc_ids: torch.Tensor | np.ndarray | None = None, batch_size: int = 16,
                    seed: int = EVAL_STATE_SEED, kl_to_final: bool = True,
                    positions: torch.Tensor | np.ndarray | None = None, dynamics: bool = False,
                    progress: bool = False) -> Measurement:
    """Per-token, per-loop statistics of ``model`` on ``windows`` (N, T+1; inputs ``[:, :-1]``, targets ``[:, 1:]``),
    tokens in (window, pos) order.

    Meta: ``window``, ``pos``, ``token``, ``target``, and ``doc`` from ``doc_ids`` ((N,) or (N, T)). Statistics:
    ``kl``, ``kl_final`` (NaN when ``kl_to_final=False``), ``state_delta``, ``entropy``, ``argmax``, ``ce`` and
    every statistic registered with ``frame=True``; float32, ids small signed integers. ``dynamics=True`` adds
    ``state_norm`` = ||s_l||, ``state_step1`` = ||s_l - s_{l-1}|| (NaN at loop 1) and ``state_step2`` =
    ||s_l - s_{l-2}|| (NaN at loops 1-2). ``positions``: an (N, T) bool mask of the tokens to keep (same values as
    the full measurement). Batch k starts from the k-th draw of a generator seeded with ``seed``, as
    :func:`drc_core.training.evaluate.loss_by_depth` does.
    """
    run = WindowMeasure(model, windows, max_loops, doc_ids=doc_ids, seed=seed, kl_to_final=kl_to_final,
                        positions=positions, dynamics=dynamics)
    batch_size = need_int("batch_size", batch_size, 1)
    n = len(run.windows)
    for b, batch in enumerate(eval_batches(model, run.windows, batch_size, seed)):
        run.add(batch)
        if progress:
            print(f"measure: batch {b + 1}/{math.ceil(n / batch_size)} ({min(batch.start + batch_size, n)}/{n} "
                  "windows)", file=sys.stderr, flush=True)
    return run.result()


class WindowMeasure:
    """:func:`measure_windows` one batch at a time (its arguments, checked): :meth:`add` each batch of
    :func:`~drc_core.model.passes.eval_batches` in order, then :meth:`result`. A pass that shares its core loops
    with another one hands them to :meth:`add`."""

    def __init__(self, model: RecurrentModel, windows: torch.Tensor, max_loops: int = 32, *,
                 doc_ids: torch.Tensor | np.ndarray | None = None, seed: int = EVAL_STATE_SEED,
                 kl_to_final: bool = True, positions: torch.Tensor | np.ndarray | None = None,
                 dynamics: bool = False) -> None:
        self.model, self.windows = model, check_token_ids(model, windows)
        self.max_loops = need_int("max_loops", max_loops, 2)
        self.seed, self.kl_to_final, self.dynamics = seed, kl_to_final, dynamics
        n, t_len = self.windows.shape[0], self.windows.shape[1] - 1
        self.docs = None
        if doc_ids is not None:
            docs = torch.as_tensor(np.asarray(doc_ids)).long()
            if docs.shape == (n,):
                docs = docs[:, None].expand(n, t_len)
            elif docs.shape != (n, t_len):
                raise DrcError(f"doc_ids must be (N,) or (N, T) = ({n},) or ({n}, {t_len}); got {tuple(docs.shape)}")
            self.docs = docs
        self.keep = None
        if positions is not None:
            self.keep = torch.as_tensor(np.asarray(positions))
            if self.keep.dtype != torch.bool or tuple(self.keep.shape) != (n, t_len):
                raise DrcError(f"positions must be a bool mask (N, T) = ({n}, {t_len}); got {self.keep.dtype} "
                               f"{tuple(self.keep.shape)}")
        self.frame = frame_statistics()  # kl, state_delta, entropy, argmax and the registered ones
        self.names = (*FRAME_COLUMNS[FRAME_COLUMNS.index("kl") :],  # then the registered ones, the dynamics
                      *(k for k in self.frame if k not in BUILTIN_STATISTICS), *(DYNAMICS_COLUMNS if dynamics else ()))
        self.reads = {*self.frame, *(("state_step",) if dynamics else ())}  # what the statistics are made of
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in self.names}

    def add(self, batch: Batch, state: torch.Tensor | None = None, core: Iterable[LoopOutput] | None = None) -> None:
        """Measure the next batch: its loops run here from the batch's generator, or, given its s_0 ``state`` and
        ``core`` (``iterate(model, batch.x, >= max_loops, state=state, readout=None)``), read out from ``core``."""
        model, max_loops, frame, names = self.model, self.max_loops, self.frame, self.names
        x, y, gen = batch.x, batch.y, batch.generator
        where = None if self.keep is None else self.keep[batch.start : batch.start + len(x)].to(x.device)
        if where is not None:
            y = y[where][None]  # (1, n): the statistics come shaped so
        final = p_final = None
        one_pass = self.kl_to_final and y.numel() * model.vocab_size * max_loops * 4 <= ONE_PASS_BYTES
        kept: list[torch.Tensor] = []  # one pass: every loop's log-probs, compared with the last one's at the end
        if self.kl_to_final and not one_pass:  # p_L first, from the batch's initial state (gen replayed after)
            replay = gen.get_state()
            logits = logits_at(model, x, max_loops, generator=gen, state=state, positions=where)
            gen.set_state(replay)
            final = torch.log_softmax(logits.float() if where is None else logits.float()[None], dim=-1)
            p_final = final.exp()  # once per batch, not once per loop
        per_loop: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        prev_step = None
        for st in iterate_stats(model, x, max_loops, generator=gen, where=where, only=self.reads, core=core):
            nan = torch.full_like(st.entropy, math.nan)
            first = st.loop == 1
            if self.dynamics:  # state_step = s_l - s_{l-1} (zero at loop 1): two of them span s_l - s_{l-2}
                per_loop["state_norm"].append(st.state.float().norm(dim=-1))
                per_loop["state_step1"].append(nan if first else st.state_step.norm(dim=-1))
                per_loop["state_step2"].append(nan if st.loop < 3 else (st.state_step + prev_step).norm(dim=-1))
                prev_step = st.state_step
            for k in frame:  # NaN at loop 1 where a statistic compares with the previous loop
                value = getattr(st, k) if k == "argmax" else getattr(st, k).float()
                per_loop[k].append(nan if first and STATISTICS[k].first is not None else value)
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
        for k in names:  # (L, B, T) -> (B, T, L) -> (tokens, L) in (window, pos) order
            v = torch.stack(per_loop[k]).permute(1, 2, 0).reshape(-1, max_loops)
            self.parts[k].append((v if k == "argmax" else v.float()).cpu().numpy())

    def result(self) -> Measurement:
        """The :class:`Measurement` of every batch added."""
        windows, max_loops = self.windows, self.max_loops
        n, t_len = windows.shape[0], windows.shape[1] - 1
        id_dtype = _int_dtype(max(self.model.vocab_size - 1, 1))
        stats = {k: np.concatenate(self.parts[k]).astype(id_dtype if k == "argmax" else np.float32) for k in self.names}
        mask = np.ones((n, t_len), dtype=bool) if self.keep is None else self.keep.cpu().numpy()
        w_idx, p_idx = np.nonzero(mask)  # row-major: the statistics' (window, pos) order
        meta = {"window": w_idx.astype(_int_dtype(n)), "pos": p_idx.astype(_int_dtype(t_len)),
                "token": windows[:, :-1].cpu().numpy()[w_idx, p_idx].astype(id_dtype),
                "target": windows[:, 1:].cpu().numpy()[w_idx, p_idx].astype(id_dtype)}
        if self.docs is not None:
            d = self.docs.cpu().numpy()
            meta["doc"] = d[w_idx, p_idx].astype(_int_dtype(max(int(d.max()), 0)))
        return Measurement(stats, pd.DataFrame(meta), {"max_loops": max_loops, "seed": int(self.seed),
                                                       "kl_to_final": bool(self.kl_to_final),
                                                       "kl": "KL(p_l || p_{l-1})", "kl_final": "KL(p_L || p_l)"})


def val_windows_with_docs(corpus: Corpus, seq_len: int, max_windows: int | None = None,
                          spread: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation windows of :func:`drc_core.data.sampler.eval_windows` (N, seq_len+1) and, per input
    position, the row in ``corpus.docs`` of the document holding that token (N, seq_len; -1 for none). ``spread``:
    the windows are evenly spaced over the validation split, so they sample every source and many documents."""
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


# ----------------------------------------------------------------------------------------------------------
# Summaries


def _need(m: Measurement, needed: Sequence[str] = ()) -> Measurement:
    if not isinstance(m, Measurement) or len(m) == 0:
        raise DrcError("expected a non-empty Measurement from measure_windows (Measurement.from_frame for a frame)")
    missing = [c for c in needed if c not in m.stats]
    if missing:
        raise DrcError(f"the measurement lacks statistic {missing[0]!r}; pass one from measure_windows")
    return m


def _tokens(m: Measurement) -> pd.DataFrame:
    """Each token's ``window``, ``pos`` and cluster (``doc`` where measured), one row per token."""
    return m.meta[[c for c in ("window", "pos", "doc") if c in m.meta.columns]].copy()


def per_loop_summary(m: Measurement, *, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
    """Per loop: the mean over tokens of ``kl``, ``state_delta``, ``entropy``, ``ce`` (the loss at uniform depth l)
    and ``kl_final``, each with a bootstrap CI over documents: columns ``loop``, ``n_tokens``, and per metric m
    ``m``, ``m_ci_low``, ``m_ci_high`` (NaN where not measured)."""
    metrics = [k for k in _METRICS if k in _need(m).stats]
    n_loops = m.max_loops
    stacked = np.concatenate([m.matrix(k) for k in metrics], axis=1)
    ci = [a.reshape(len(metrics), n_loops) for a in bootstrap_ci(stacked, m.clusters(), n_boot=n_boot, seed=seed,
                                                                  level=level)]  # point, low, high per metric
    out = pd.DataFrame({"loop": np.arange(1, n_loops + 1), "n_tokens": np.full(n_loops, len(m))})
    for k in _METRICS:
        j = metrics.index(k) if k in metrics else None
        out[k], out[f"{k}_ci_low"], out[f"{k}_ci_high"] = (math.nan,) * 3 if j is None else (a[j] for a in ci)
    return out


def depth_from_successive_kl(kl: np.ndarray, eps: float) -> np.ndarray:
    """Convergence depth (:func:`convergence_depth`, int64) from the successive KL of loops 2..L along the last axis
    of ``kl`` (..., L-1), compared with ``eps`` in float64."""
    above = ~(np.asarray(kl, dtype=np.float64) < eps)
    last = (above.shape[-1] - 1) - np.argmax(above[..., ::-1], axis=-1)  # index into loops 2..L
    return np.where(above.any(axis=-1), last + 2, 1)


def convergence_depth(m: Measurement, eps: float = DEFAULT_EPS) -> pd.DataFrame:
    """Per token, the smallest loop l such that ``KL(p_{l'} || p_{l'-1}) < eps`` (strict; NaN counts as not below)
    for every l' in l+1..L: the last loop whose KL is >= eps, or 1. A token still >= eps at loop L gets depth L and
    ``converged=False``. Rows: ``window``, ``pos`` (``doc`` where measured), ``depth`` (int16), ``converged``."""
    eps = need_eps(eps)
    n_loops = _need(m, ("kl",)).max_loops
    if n_loops < 2:
        raise DrcError("the measurement has only loop 1; convergence depth needs loops 1..L with L >= 2")
    depth = depth_from_successive_kl(m.stats["kl"][:, 1:], eps)  # loops 2..L
    out = _tokens(m)
    out["depth"] = depth.astype(np.int16)
    out["converged"] = depth < n_loops
    out.attrs.update({**m.attrs, "eps": eps, "max_loops": n_loops})
    return out


def depth_summary(depths: pd.DataFrame, train_mean_depth: float = 8, *, n_boot: int = 1000, seed: int = 0,
                  level: float = 0.95) -> pd.DataFrame:
    """Headline numbers of a :func:`convergence_depth` frame with bootstrap CIs over documents: ``median_depth``
    (lower median), ``mean_depth``, ``frac_updating`` (depth > ``train_mean_depth``) and ``frac_unconverged``;
    columns ``stat``, ``value``, ``ci_low``, ``ci_high``, ``n_tokens``, ``n_clusters``."""
    if not isinstance(depths, pd.DataFrame) or len(depths) == 0 or not {"depth", "converged"} <= set(depths.columns):
        raise DrcError("expected a non-empty convergence_depth table (columns depth, converged)")
    need_float("train_mean_depth", train_mean_depth, 1.0)
    cluster = depths["doc"] if "doc" in depths.columns else depths.get("window")
    clusters = None if cluster is None else cluster.to_numpy()
    d = depths["depth"].to_numpy(float)
    kw = {"n_boot": n_boot, "seed": seed, "level": level}
    med = bootstrap_ci(d, clusters, stat="median", **kw)
    means = bootstrap_ci(np.column_stack([d, d > train_mean_depth, ~depths["converged"].to_numpy(bool)]),
                         clusters, **kw)
    value, low, high = (np.concatenate(parts) for parts in zip(med, means, strict=True))
    out = pd.DataFrame({"stat": ["median_depth", "mean_depth", "frac_updating", "frac_unconverged"], "value": value,
                        "ci_low": low, "ci_high": high, "n_tokens": len(d),
                        "n_clusters": len(d) if clusters is None else len(np.unique(clusters))})
    out.attrs.update({"train_mean_depth": float(train_mean_depth), **depths.attrs})
    return out


def kl_concentration(m: Measurement, loops: Sequence[int], shares: Sequence[float] = (0.01, 0.001)) -> pd.DataFrame:
    """How the mean successive KL at each of ``loops`` is made up: mean, median, 99th percentile, the share carried
    by the top ``shares`` fraction of tokens (``top_1%``, ...) and the mean without the top 1%."""
    all_kl = _need(m, ("kl",)).matrix("kl")
    rows = []
    for loop in loops:
        kl = all_kl[:, loop - 1] if 1 <= loop <= m.max_loops else np.empty(0)
        kl = np.sort(kl[~np.isnan(kl)])[::-1]
        if kl.size == 0:
            raise DrcError(f"no successive KL at loop {loop}: the measurement has loops 2..{m.max_loops}")
        total = kl.sum()
        row = {"loop": int(loop), "n_tokens": kl.size, "mean": kl.mean(), "median": float(np.median(kl)),
               "p99": float(np.quantile(kl, 0.99))}
        for s in shares:
            k = max(1, int(round(s * kl.size)))
            row[f"top_{s:.1%}".replace(".0%", "%")] = float(kl[:k].sum() / total) if total > 0 else math.nan
        row["mean_without_top_1%"] = float(kl[max(1, int(round(0.01 * kl.size))):].mean()) if kl.size > 1 else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def oscillating_tokens(m: Measurement, *, min_kl: float = 1e-6, ratio: float = 10.0,
                       share_at: Sequence[int] = ()) -> tuple[pd.DataFrame, dict[int, float]]:
    """The tokens in a 2-cycle at the deepest loop L: ``kl_other`` = KL(p_L || p_{L-1}) >= ``min_kl`` and >= ``ratio``
    * ``kl_same`` = KL(p_L || p_{L-2}) (needs L >= 3 and ``kl_final``), largest ``kl_other`` first; and per loop of
    ``share_at`` the share of the mean successive KL these tokens carry."""
    n_loops = _need(m, ("kl_final", "kl")).max_loops
    if n_loops < 3:
        raise DrcError(f"the measurement has {n_loops} loops; a 2-cycle needs at least 3 (measure to max_loops >= 3)")
    kl_final = m.matrix("kl_final")
    other, same = kl_final[:, n_loops - 2], kl_final[:, n_loops - 3]
    if np.isnan(other).all():
        raise DrcError("the measurement has no kl_final values; measure with kl_to_final=True")
    hit = (other >= need_float("min_kl", min_kl, 0.0)) & (other >= need_float("ratio", ratio, 1.0) * same)
    out = _tokens(m)[hit].assign(token=m.meta["token"].to_numpy(np.int64)[hit], kl_other=other[hit], kl_same=same[hit])
    shares = {}
    for loop in share_at:
        if not 2 <= loop <= n_loops:
            raise DrcError(f"share_at loop {loop} is outside 2..{n_loops}, the loops with a successive KL")
        kl = m.matrix("kl")[:, loop - 1]
        total = float(np.nansum(kl))
        shares[int(loop)] = float(np.nansum(kl[hit]) / total) if total > 0 else math.nan
    return out.sort_values("kl_other", ascending=False).reset_index(drop=True), shares


def eps_sensitivity(m: Measurement, eps_grid: Sequence[float] = (1e-2, 1e-3, 1e-4, 1e-5),
                    train_mean_depth: float = 8, *, n_boot: int = 1000, seed: int = 0,
                    level: float = 0.95) -> pd.DataFrame:
    """:func:`depth_summary` of :func:`convergence_depth` for every ``eps`` in ``eps_grid``, stacked, ``eps`` first."""
    grid = [need_eps(e) for e in eps_grid]
    if not grid:
        raise DrcError("eps_grid is empty; pass at least one eps > 0")
    parts = []
    for eps in grid:
        part = depth_summary(convergence_depth(m, eps), train_mean_depth, n_boot=n_boot, seed=seed, level=level)
        part.insert(0, "eps", eps)
        parts.append(part)
    return pd.concat(parts, ignore_index=True)

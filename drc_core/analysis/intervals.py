"""Percentile bootstrap intervals over clusters (documents or windows): the one bootstrap every summary uses."""

from __future__ import annotations

import math

import numpy as np

from drc_core.errors import DrcError, need_int, need_level

__all__ = ["bootstrap_ci", "cluster_codes", "cluster_draws", "percentile_interval"]


def percentile_interval(boot: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """The central ``level`` percentile interval of each column of bootstrap replicates ``boot`` (n_boot, k),
    NaN replicates ignored; a column with no value at all (e.g. ``kl`` at loop 1) gives NaN."""
    alpha = (1.0 - level) / 2.0
    k = boot.shape[1]
    lo, hi = np.full(k, math.nan), np.full(k, math.nan)
    some = ~np.isnan(boot).all(axis=0)
    if some.any():
        lo[some], hi[some] = np.nanquantile(boot[:, some], [alpha, 1.0 - alpha], axis=0)
    return lo, hi



def cluster_codes(clusters, n: int) -> tuple[np.ndarray, int]:
    """``(codes, n_clusters)``: each of the ``n`` rows' cluster as 0..n_clusters-1 (``clusters`` None: every row
    is its own cluster)."""
    if clusters is None:
        return np.arange(n), n
    c = np.asarray(clusters).reshape(-1)
    if c.size != n:
        raise DrcError(f"clusters has {c.size} entries but values has {n} rows; pass one cluster per row")
    _, codes = np.unique(c, return_inverse=True)
    return codes, int(codes.max()) + 1


def cluster_draws(n_clusters: int, n_boot: int, seed: int, chunk: int):
    """The bootstrap's resamples: blocks of at most ``chunk`` rows of (m, n_clusters) float counts, how often each
    cluster is drawn when ``n_clusters`` are drawn with replacement; ``n_boot`` rows in all, the same sequence
    for the same ``seed``."""
    rng = np.random.default_rng(seed)
    for b in range(0, n_boot, chunk):
        yield rng.multinomial(n_clusters, np.full(n_clusters, 1.0 / n_clusters),
                              size=min(chunk, n_boot - b)).astype(float)


def _weighted_lower_median(sorted_x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per row of ``weights`` (m, n) over ``sorted_x`` (n,): the smallest x whose cumulative weight reaches
    half the total (the lower median; with unit weights ``sorted_x[ceil(n/2) - 1]``)."""
    cum = np.cumsum(weights, axis=1)
    idx = (cum < cum[:, -1:] / 2.0).sum(axis=1)
    return sorted_x[np.minimum(idx, len(sorted_x) - 1)]


def bootstrap_ci(values, clusters=None, *, stat: str = "mean", n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point estimate and percentile bootstrap CI of each column of ``values`` (n,) or (n, k).

    The bootstrap resamples *clusters* with replacement: ``clusters`` (n,) gives each row's cluster (e.g. its
    document); None makes every row its own cluster. A replicate draws as many clusters as there are, and all
    k columns use the same draws. ``stat``: "mean" -- the pooled mean over the drawn rows (the ratio of the
    drawn clusters' sums to their counts; NaN values are ignored) -- or "median" -- the lower weighted median
    (each row weighted by how often its cluster was drawn; the point estimate is the plain lower median).
    Returns ``(point, low, high)``, arrays of shape (k,) (or (1,) for 1-D input). Deterministic by ``seed``.
    """
    x = np.asarray(values, dtype=float)
    if x.ndim not in (1, 2) or x.shape[0] == 0:
        raise DrcError(f"values must be a non-empty (n,) or (n, k) array; got shape {x.shape}")
    x = x.reshape(x.shape[0], -1)
    n, k = x.shape
    if stat not in ("mean", "median"):
        raise DrcError(f"stat={stat!r} is not supported; use 'mean' or 'median'")
    n_boot = need_int("n_boot", n_boot, 1)
    level = need_level(level)
    codes, n_c = cluster_codes(clusters, n)
    chunk = max(1, 4_000_000 // n)  # replicates per block of cluster counts, so a block stays ~32 MB

    def draws():  # the same sequence of (m, n_clusters) count blocks for every column and both statistics
        return cluster_draws(n_c, n_boot, seed, chunk)

    boot = np.empty((n_boot, k))
    with np.errstate(invalid="ignore", divide="ignore"):
        if stat == "mean":
            ok = ~np.isnan(x)
            xz = np.where(ok, x, 0.0)
            sums = np.stack([np.bincount(codes, weights=xz[:, j], minlength=n_c) for j in range(k)], axis=1)
            cnts = np.stack([np.bincount(codes, weights=ok[:, j], minlength=n_c) for j in range(k)], axis=1)
            point = sums.sum(0) / cnts.sum(0)
            row = 0
            for w in draws():
                boot[row : row + len(w)] = (w @ sums) / (w @ cnts)
                row += len(w)
        else:
            point = np.full(k, math.nan)
            for j in range(k):
                valid = ~np.isnan(x[:, j])
                if not valid.any():
                    boot[:, j] = math.nan
                    continue
                order = np.argsort(x[valid, j], kind="stable")
                xs, cs = x[valid, j][order], codes[valid][order]
                point[j] = xs[(len(xs) + 1) // 2 - 1]
                row = 0
                for w in draws():
                    boot[row : row + len(w), j] = _weighted_lower_median(xs, w[:, cs])
                    row += len(w)
    lo, hi = percentile_interval(boot, level)
    return point, lo, hi

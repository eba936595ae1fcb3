"""Percentile bootstrap intervals over clusters (documents or windows): the one bootstrap every summary uses."""

from __future__ import annotations

import math
import warnings

import numpy as np

from drc_core.errors import DrcError, need_int, need_level

__all__ = ["bootstrap_ci", "cluster_codes", "cluster_draws", "percentile_interval"]


def percentile_interval(boot: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """The central ``level`` percentile interval of each column of bootstrap replicates ``boot`` (n_boot, k),
    NaN replicates ignored; a column with no value at all (e.g. ``kl`` at loop 1) gives NaN."""
    alpha = (1.0 - level) / 2.0
    with warnings.catch_warnings():  # an all-NaN column
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, hi = np.nanquantile(boot, [alpha, 1.0 - alpha], axis=0)
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


def bootstrap_ci(values, clusters=None, *, stat: str = "mean", n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point estimate and percentile bootstrap CI ``(point, low, high)`` of each column of ``values`` (n,) or (n, k).

    A replicate draws as many ``clusters`` (one per row; None: each row its own) as there are, with replacement, the
    same draws for every column. ``stat``: "mean", the pooled mean over the drawn rows (NaN ignored), or "median",
    the lower median with each row weighted by its cluster's draws. Deterministic by ``seed``.
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
    with np.errstate(invalid="ignore", divide="ignore"):
        if stat == "mean":
            ok = ~np.isnan(x)
            xz = np.where(ok, x, 0.0)
            sums = np.stack([np.bincount(codes, weights=xz[:, j], minlength=n_c) for j in range(k)], axis=1)
            cnts = np.stack([np.bincount(codes, weights=ok[:, j], minlength=n_c) for j in range(k)], axis=1)
            point = sums.sum(0) / cnts.sum(0)
            boot = np.concatenate([(w @ sums) / (w @ cnts) for w in cluster_draws(n_c, n_boot, seed, chunk)])
        else:
            point, boot = np.full(k, math.nan), np.empty((n_boot, k))
            for j in range(k):
                valid = ~np.isnan(x[:, j])
                if not valid.any():
                    boot[:, j] = math.nan
                    continue
                order = np.argsort(x[valid, j], kind="stable")
                xs, cs = x[valid, j][order], codes[valid][order]
                point[j] = xs[(len(xs) + 1) // 2 - 1]
                medians = []
                for w in cluster_draws(n_c, n_boot, seed, chunk):  # the smallest x whose cumulative weight is half
                    cum = np.cumsum(w[:, cs], axis=1)
                    medians.append(xs[np.minimum((cum < cum[:, -1:] / 2.0).sum(axis=1), len(xs) - 1)])
                boot[:, j] = np.concatenate(medians)
    lo, hi = percentile_interval(boot, level)
    return point, lo, hi

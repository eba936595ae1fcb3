"""What each token's latent state does on its way to the fixed point, from one uniform-depth pass
(:func:`token_dynamics`, or a measurement: :meth:`Dynamics.of`): the contraction factor
``rho_l = ||s_{l+1} - s_l|| / ||s_l - s_{l-1}||``, a class per token (:func:`classify`), the commit loop (the first
loop from which the argmax never changes again) and overthinking (right at some loop, wrong at a later one).

:func:`classify`, at the last loop L: ``settled`` when ``||s_L - s_{L-1}|| / ||s_L|| < tol``; else ``oscillating``
(a 2-cycle) when ``||s_L - s_{L-2}|| < cycle_ratio * ||s_L - s_{L-1}||``; else ``contracting`` when the
geometric-mean contraction factor over the last ``tail`` loops is below ``rho_max``; else ``drifting``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from drc_core.analysis.intervals import bootstrap_ci
from drc_core.analysis.measure import DYNAMICS_COLUMNS, Measurement, measure_windows
from drc_core.errors import DrcError, need_int
from drc_core.model.lm import RecurrentModel
from drc_core.model.passes import EVAL_STATE_SEED

__all__ = ["CLASSES", "Dynamics", "class_shares", "classify", "commit_loop", "group_shares", "norm_percentiles",
           "overthinks", "token_dynamics"]

CLASSES = ("settled", "oscillating", "contracting", "drifting")


def commit_loop(argmax: np.ndarray) -> np.ndarray:
    """Per row of ``argmax`` (n, L): the first loop (1-based) from which the argmax stays at its value at loop L."""
    a = np.asarray(argmax)
    if a.ndim != 2 or a.shape[1] < 1:
        raise DrcError(f"argmax must be (tokens, loops); got shape {a.shape}")
    differs = a != a[:, -1:]  # the last loop that differs from loop L, or 0
    return np.where(differs.any(1), a.shape[1] - np.argmax(differs[:, ::-1], axis=1), 0) + 1


def overthinks(correct: np.ndarray) -> np.ndarray:
    """Per row of ``correct`` (n, L) bool: right at some loop and wrong at a later one."""
    c = np.asarray(correct, dtype=bool)
    ever = np.maximum.accumulate(c, axis=1)
    return (ever[:, :-1] & ~c[:, 1:]).any(1)


@dataclass
class Dynamics:
    """Per token (N, T) and loop 1..L: ``norm`` = ||s_l||, ``step`` = ||s_l - s_{l-1}|| (NaN at loop 1), ``step2`` =
    ||s_l - s_{l-2}|| (NaN at loops 1-2), ``argmax``; float32 / int64 arrays of shape (N, T, L)."""

    norm: np.ndarray
    step: np.ndarray
    step2: np.ndarray
    argmax: np.ndarray

    @classmethod
    def of(cls, m: Measurement) -> Dynamics:
        """The dynamics of a measurement's tokens, arrays (n, L) in its token order, from its ``state_norm``,
        ``state_step1``, ``state_step2`` and ``argmax`` (:func:`~drc_core.analysis.measure.measure_windows` with
        ``dynamics=True``)."""
        missing = [c for c in (*DYNAMICS_COLUMNS, "argmax") if c not in m.stats]
        if missing:
            raise DrcError(f"the measurement has no {', '.join(missing)}: measure it with "
                           "measure_windows(..., dynamics=True)")
        return cls(norm=m.stats["state_norm"].astype(np.float32), step=m.stats["state_step1"].astype(np.float32),
                   step2=m.stats["state_step2"].astype(np.float32), argmax=m.stats["argmax"].astype(np.int64))

    @property
    def max_loops(self) -> int:
        return self.norm.shape[-1]

    def contraction(self) -> np.ndarray:
        """rho_l = step_{l+1} / step_l for l = 2..L-1, as (N, T, L-2) (column j is l = j + 2)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.step[..., 2:] / self.step[..., 1:-1]


def token_dynamics(model: RecurrentModel, windows: torch.Tensor, max_loops: int = 32, *, batch_size: int = 16,
                   seed: int = EVAL_STATE_SEED, positions: torch.Tensor | np.ndarray | None = None) -> Dynamics:
    """The dynamics of one uniform pass over ``windows`` (N, T+1), the measurement pass of
    :func:`~drc_core.analysis.measure.measure_windows` with ``dynamics=True``: arrays (N, T, L), or (n, L) for the
    tokens of ``positions`` ((N, T) bool)."""
    max_loops = need_int("max_loops", max_loops, 3)
    dyn = Dynamics.of(measure_windows(model, windows, max_loops, batch_size=batch_size, seed=seed,
                                      kl_to_final=False, positions=positions, dynamics=True))
    if positions is None:
        n, t_len = windows.shape[0], windows.shape[1] - 1
        dyn = Dynamics(*(a.reshape(n, t_len, max_loops) for a in (dyn.norm, dyn.step, dyn.step2, dyn.argmax)))
    return dyn


def classify(dyn: Dynamics, *, tol: float = 1e-3, cycle_ratio: float = 0.1, rho_max: float = 0.95,
             tail: int = 8) -> np.ndarray:
    """Each token's class (N, T) of :data:`CLASSES` by the rule in the module docstring."""
    if dyn.max_loops < tail + 2:
        raise DrcError(f"classify needs at least tail + 2 = {tail + 2} loops; the pass has {dyn.max_loops}")
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (dyn.step / dyn.norm)[..., -1]
        settled = rel < tol
        cycle = dyn.step2[..., -1] < cycle_ratio * dyn.step[..., -1]
        rho = np.exp(np.nanmean(np.log(dyn.contraction()[..., -tail:]), axis=-1))
    out = np.full(rel.shape, "drifting", dtype=object)
    out[rho < rho_max] = "contracting"
    out[cycle] = "oscillating"
    out[settled] = "settled"
    return out


def group_shares(flags: dict[str, np.ndarray], groups: np.ndarray | None = None, clusters: np.ndarray | None = None,
                 *, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
    """The share of tokens with each flag (``flags``: name -> bool per token), overall (group ``"all"``) and per value
    of ``groups``, with bootstrap intervals over ``clusters`` (the same draws for all). Rows: ``group``, ``flag``,
    ``n_tokens``, ``share``, ``ci_low``, ``ci_high``."""
    names = list(flags)
    if not names:
        raise DrcError("flags is empty: pass at least one name -> per-token bool array")
    x = np.stack([np.asarray(flags[k], dtype=bool).reshape(-1) for k in names], axis=1).astype(float)
    n = x.shape[0]
    g = np.full(n, "all", dtype=object) if groups is None else np.asarray(groups, dtype=object).reshape(-1)
    if len(g) != n or (clusters is not None and np.asarray(clusters).size != n):
        raise DrcError(f"flags, groups and clusters must have one entry per token ({n})")
    levels = ["all", *sorted(set(g.tolist()) - {"all"})]
    cols, meta = [], []
    for level_name in levels:
        inside = np.ones(n, bool) if level_name == "all" else g == level_name
        for j, name in enumerate(names):
            cols.append(np.where(inside, x[:, j], np.nan))
            meta.append((level_name, name, int(inside.sum())))
    point, lo, hi = bootstrap_ci(np.stack(cols, axis=1), clusters, n_boot=n_boot, seed=seed, level=level)
    return pd.DataFrame([{"group": grp, "flag": name, "n_tokens": cnt, "share": point[i], "ci_low": lo[i],
                          "ci_high": hi[i]} for i, (grp, name, cnt) in enumerate(meta)])


def class_shares(classes: np.ndarray, groups: np.ndarray | None = None, clusters: np.ndarray | None = None,
                 **kwargs) -> pd.DataFrame:
    """:func:`group_shares` with one flag per class of :data:`CLASSES` (the column named ``class``)."""
    c = np.asarray(classes, dtype=object).reshape(-1)
    return group_shares({k: c == k for k in CLASSES}, groups, clusters, **kwargs).rename(columns={"flag": "class"})


def norm_percentiles(dyn: Dynamics, q: tuple[float, ...] = (5, 25, 50, 75, 95, 99)) -> pd.DataFrame:
    """Per loop: the ``q`` percentiles of the state norm over tokens (``p5``, ...) and the median norm relative to
    loop 1 (``median_growth``)."""
    norm = dyn.norm.reshape(-1, dyn.max_loops).astype(np.float64)
    pct = np.percentile(norm, q, axis=0)
    out = pd.DataFrame({"loop": np.arange(1, dyn.max_loops + 1)})
    for qi, row in zip(q, pct, strict=True):
        out[f"p{qi:g}"] = row
    with np.errstate(divide="ignore", invalid="ignore"):
        out["median_growth"] = np.nanmedian(norm / norm[:, :1], axis=0)
    return out

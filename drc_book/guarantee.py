"""Halting with a guarantee, as notebooks 04 and 06 run it on a table of per-document losses: certificates, and
whether they hold over random halvings and under a shift of documents; each returns its table and printed lines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from drc_core import validity, validity_summary

__all__ = ["certificates", "held_under_shift", "held_over_splits", "risk_by_group"]


def certificates(tables: Mapping[str, Any], families: Sequence[str], alphas: Sequence[float], delta: float
                 ) -> tuple[pd.DataFrame, str]:
    """Every family and uniform depth certified on all the documents, per risk and level, and the lines."""
    certs, lines = [], []
    for risk_name, table in tables.items():
        for a in alphas:
            row = [table.certify(fam, a, delta) for fam in [*families, "uniform"]]
            certs += row
            lines += [f"[{risk_name}] {cert}" for cert in row if cert.threshold is not None]
            none = [c for c in row if c.threshold is None]
            if none:
                lines.append(f"[{risk_name}] alpha={a:g}: no threshold certified for "
                             f"{', '.join(c.family for c in none)} (e.g. {none[0]})")
    frame = pd.DataFrame([c.__dict__ for c in certs])
    got = frame[frame.threshold.notna()]
    lines.append(f"\n{len(got)} of {len(frame)} (risk, alpha, family) settings certified; smallest alpha certified: "
                 f"{got.alpha.min() if len(got) else 'none'}")
    return frame, "\n".join(lines)


def held_over_splits(table: Any, families: Sequence[str], alphas: Sequence[float], delta: float, *, n_splits: int,
                     seed: int, among: np.ndarray | None = None) -> tuple[pd.DataFrame, str]:
    """Certified on one half of the documents (of ``among``), measured on the other, over ``n_splits`` halvings
    (:func:`drc_core.validity_summary`), and the lines."""
    rows = pd.concat([validity(table, fam, alphas, delta, n_splits=n_splits, seed=seed, among=among)
                      for fam in families])
    valid = validity_summary(rows, delta)
    lines = [f"{len(valid)} (family, alpha) settings over {n_splits} splits ({int(valid.n_calib.iloc[0])} documents "
             f"for calibration): certified in at least one split: {int((valid.certified > 0).sum())}; violation "
             f"rate above delta beyond Monte-Carlo error: {int((~valid.kept).sum())}"]
    for a in alphas:
        g = valid[valid.alpha == a]
        lines.append(f"alpha={a:g}: certified in {g.certified.mean():.0%} of splits (mean over families), highest "
                     f"violation rate {g.violation.max():.3f} (delta {delta:g})")
    return valid, "\n".join(lines)


def held_under_shift(table: Any, families: Sequence[str], alphas: Sequence[float], delta: float,
                     directions: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> tuple[pd.DataFrame, str]:
    """Certified on one set of documents, measured on another, per direction (name -> (calibration, test) indices),
    and the lines."""
    rows, lines = [], []
    for name, (calib, test) in directions.items():
        if len(calib) == 0 or len(test) == 0:
            lines.append(f"{name}: no documents on one side")
            continue
        rows += [validity(table, fam, alphas, delta, calib=calib, test=test).assign(direction=name)
                 for fam in families]
    shift = pd.concat(rows) if rows else pd.DataFrame()
    if len(shift):
        got = shift[shift.certified]
        lines.append(f"{len(got)} of {len(shift)} (direction, family, alpha) settings certified; of those, "
                     f"{int(got.violated.sum())} exceed alpha on the other documents")
        for (d, a), g in got.groupby(["direction", "alpha"]):
            lines.append(f"  {d}, alpha={a:g}: {len(g)} families certified, test risk "
                         f"{g.test_risk.min():.3f}-{g.test_risk.max():.3f}, {int(g.violated.sum())} violate")
    return shift, "\n".join(lines)


def risk_by_group(table: Any, families: Sequence[str], groups: Mapping[str, np.ndarray]) -> pd.DataFrame:
    """Per family and threshold, the mean per-document risk and exit loop over each (non-empty) group of documents."""
    rows = []
    for fam in families:
        for j, spec in enumerate(table.specs[fam]):
            row = {"family": fam, "threshold": spec.param}
            for name, idx in groups.items():
                if len(idx):
                    row[f"risk_{name}"] = float(table.risks[fam][j, idx].mean())
                    row[f"loops_{name}"] = float(table.loops[fam][j, idx].mean())
            rows.append(row)
    return pd.DataFrame(rows)

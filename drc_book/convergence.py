"""Notebook 02's tables that combine library measurements: how the halting rules treat tokens of each dynamics
class, and the commit loop against the convergence depth."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from drc_core import RuleSpec

__all__ = ["commit_stats", "exits_by_class", "exits_by_class_text"]

UNSETTLED = ("oscillating", "contracting", "drifting")  # the dynamics classes compared with the settled tokens


def exits_by_class(exits: dict[str, np.ndarray], specs: Sequence[RuleSpec], dyn_class: np.ndarray,
                   classes: Sequence[str], near: float) -> pd.DataFrame:
    """Per family, the threshold whose mean exit loop (of ``exits``) is nearest ``near``: its mean exit overall, per
    dynamics class, and each unsettled class's against the settled tokens' (``<class>/settled``)."""
    rows = []
    for spec in specs:
        e = exits[str(spec.rule)].reshape(-1)
        rows.append({"family": spec.family, "param": spec.param, "avg": e.mean(),
                     **{c: e[dyn_class == c].mean() if (dyn_class == c).any() else np.nan for c in classes}})
    by_rule = pd.DataFrame(rows)
    near_r = by_rule.loc[(by_rule.avg - near).abs().groupby(by_rule.family).idxmin()].set_index("family")
    for c in UNSETTLED:
        near_r[f"{c}/settled"] = near_r[c] / near_r["settled"]
    return near_r


def exits_by_class_text(near_r: pd.DataFrame, dyn_class: np.ndarray) -> str:
    """One line per unsettled class: how many rules stop its tokens later or earlier than settled ones."""
    lines = []
    for c in UNSETTLED:
        ratio = near_r[f"{c}/settled"].dropna()
        if ratio.empty:
            lines.append(f"{c}: no such tokens (or no settled ones) in these windows")
            continue
        later, earlier = ratio[ratio > 1].index.tolist(), ratio[ratio < 1].index.tolist()
        lines.append(f"{c} tokens ({(dyn_class == c).mean():.1%}): stopped later than settled ones by "
                     f"{len(later)} of {len(ratio)} rules ({', '.join(later) or 'none'}), earlier by {len(earlier)}; "
                     f"ratio {ratio.min():.2f}-{ratio.max():.2f}")
    return "\n".join(lines)


def commit_stats(commit: np.ndarray, depth: np.ndarray) -> dict[str, float]:
    """The share of tokens that commit before / at their convergence depth, and the median commit loop."""
    return {"commit_before_convergence": float(np.mean(commit < depth)),
            "commit_at_convergence": float(np.mean(commit == depth)),
            "commit_loop_median": float(np.median(commit))}

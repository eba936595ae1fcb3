"""Halting thresholds with a stated guarantee: Learn then Test (Angelopoulos et al. 2021, arXiv 2110.01052).

A family's thresholds are tested from the latest-halting to the earliest (an order fixed before any data is seen),
each null "the risk exceeds ``alpha``" by its Hoeffding-Bentkus p-value, rejecting while ``p <= delta``; the most
aggressive rejected threshold holds its risk on new documents at most ``alpha`` with probability ``1 - delta``.
Risks per token against the output at ``reference_loops`` R: ``top1`` (the argmax at the exit differs from depth
R's) and ``ce`` (the CE at the exit exceeds depth R's by more than ``tolerance``). The unit of the test is the
*document* (tokens of one are not independent): its loss is the share of its tokens that violate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy import stats as sps

from drc_core.errors import DrcError, need_float, need_int
from drc_core.halting.rules import RULE_FAMILIES, HaltingRule, Uniform
from drc_core.halting.sweep import OfflinePass, RuleSpec, default_families, offline_pass
from drc_core.model.lm import RecurrentModel
from drc_core.model.passes import EVAL_STATE_SEED

__all__ = ["RISKS", "CalibratedRule", "Certificate", "calibrate", "hb_pvalue", "learn_then_test", "loss_table",
           "loss_tables", "pass_loss_tables", "min_units", "token_losses", "validity", "validity_summary", "unit_risks"]

RISKS = ("top1", "ce")


def hb_pvalue(risk_hat: float, n: int, alpha: float) -> float:
    """The Hoeffding-Bentkus p-value of the null "risk > ``alpha``" from the mean ``risk_hat`` of ``n`` independent
    losses in [0, 1] (LTT, Proposition 3)."""
    n = need_int("n", n, 1)
    if not 0 < alpha < 1:
        raise DrcError(f"alpha={alpha!r} must lie strictly between 0 and 1")
    r = min(max(float(risk_hat), 0.0), 1.0)
    a = min(r, alpha)
    h = (a * math.log(a / alpha) if a > 0 else 0.0) + (1 - a) * math.log((1 - a) / (1 - alpha))
    hoeffding = math.exp(-n * h)
    bentkus = math.e * float(sps.binom.cdf(math.ceil(n * r - 1e-12), n, alpha))
    return min(hoeffding, bentkus, 1.0)


def min_units(alpha: float, delta: float) -> int:
    """The fewest units with which any threshold can be certified at ``alpha``, ``delta``:
    ``ceil(log(delta) / log(1 - alpha))`` (22 at alpha = delta = 0.1, 45 at alpha 0.05)."""
    if not 0 < alpha < 1 or not 0 < delta < 1:
        raise DrcError(f"alpha={alpha!r} and delta={delta!r} must lie strictly between 0 and 1")
    n = max(1, math.ceil(math.log(delta) / math.log1p(-alpha) - 1e-9))
    while hb_pvalue(0.0, n, alpha) > delta:  # guards the rounding of the closed form
        n += 1
    return n


def learn_then_test(unit_losses: np.ndarray, alpha: float, delta: float) -> tuple[int, np.ndarray]:
    """Fixed-sequence testing of ``unit_losses`` (m thresholds from the most conservative, n units) in [0, 1]:
    ``(k, pvalues)``, rows 0..k-1 certified (k = 0: none) and every row's p-value."""
    losses = np.asarray(unit_losses, dtype=float)
    if losses.ndim != 2 or losses.shape[1] < 1:
        raise DrcError(f"unit_losses must be (thresholds, units) with at least one unit; got shape {losses.shape}")
    if np.isnan(losses).any() or (losses < 0).any() or (losses > 1).any():
        raise DrcError("unit losses must lie in [0, 1]: pass per-unit shares of violating tokens")
    need_float("delta", delta, 0.0)
    if not 0 < delta < 1:
        raise DrcError(f"delta={delta!r} must lie strictly between 0 and 1")
    n = losses.shape[1]
    pvalues = np.array([hb_pvalue(r, n, alpha) for r in losses.mean(axis=1)])
    failed = np.flatnonzero(pvalues > delta)
    return (int(failed[0]) if len(failed) else len(pvalues)), pvalues


def token_losses(argmax: np.ndarray, ce: np.ndarray, exits: np.ndarray, reference_loops: int, risk: str,
                 tolerance: float = 0.0) -> np.ndarray:
    """Per-token violations (N, T) of one rule from ``argmax`` and ``ce`` (N, T, L) per loop and ``exits`` (N, T)."""
    _need_risks((risk,))
    idx = (np.asarray(exits, dtype=np.int64) - 1)[..., None]
    ref = reference_loops - 1
    if risk == "top1":
        return np.take_along_axis(argmax, idx, axis=-1)[..., 0] != argmax[..., ref]
    return np.take_along_axis(ce, idx, axis=-1)[..., 0] > ce[..., ref] + tolerance


def unit_risks(losses: np.ndarray, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per unit, the share of its tokens that violate: ``losses`` (..., N, T), ``units`` (N, T) ids (negative:
    ignored) -> ``(risks (..., n_units), unit ids)``."""
    u = np.asarray(units).reshape(-1)
    keep = u >= 0
    ids, codes = np.unique(u[keep], return_inverse=True)
    flat = np.asarray(losses, dtype=float).reshape(*np.shape(losses)[:-2], -1)[..., keep]
    counts = np.bincount(codes, minlength=len(ids))
    sums = np.stack([np.bincount(codes, weights=row, minlength=len(ids)) for row in flat.reshape(-1, flat.shape[-1])])
    return (sums / counts).reshape(*flat.shape[:-1], len(ids)), ids


@dataclass(frozen=True)
class Certificate:
    """What :func:`calibrate` guarantees (``threshold`` None: none could be certified), on what evidence."""

    family: str
    risk: str
    alpha: float
    delta: float
    n_units: int
    threshold: float | None
    calibration_risk: float
    avg_loops: float
    p_value: float
    reference_loops: int
    tested: int

    def __str__(self) -> str:
        what = ("of tokens whose top prediction differs from depth" if self.risk == "top1"
                else "of tokens whose cross-entropy exceeds that of depth")
        if self.threshold is None:
            return (f"{self.family}: no threshold certified at alpha={self.alpha:g}, delta={self.delta:g} with "
                    f"{self.n_units} calibration documents (the most conservative one's p-value is above delta)")
        return (f"{self.family} at {self.threshold:g}: with probability >= {1 - self.delta:.0%} over the "
                f"{self.n_units} calibration documents, the expected per-document share {what} {self.reference_loops} "
                f"is <= {self.alpha:g} (calibration: {self.calibration_risk:.4f} at {self.avg_loops:.2f} loops on "
                f"average; p = {self.p_value:.2g}, {self.tested} thresholds tested)")


@dataclass(frozen=True)
class CalibratedRule:
    """A rule with its certificate (``rule`` is None where no threshold was certified)."""

    rule: HaltingRule | None
    certificate: Certificate

    def __str__(self) -> str:
        return str(self.certificate)


def family_specs(family: str, max_loops: int, reference_loops: int) -> list[RuleSpec]:
    """The family's grid as rules from the latest-halting threshold to the earliest (``uniform``: R down to 1)."""
    if family == "uniform":
        return [RuleSpec("uniform", float(u), Uniform(u)) for u in range(reference_loops, 0, -1)]
    if family not in default_families():
        raise DrcError(f"family {family!r} has no threshold grid; calibrate one of "
                       f"{', '.join(default_families())} or 'uniform'")
    cls = RULE_FAMILIES[family]
    return [RuleSpec(family, float(t), cls(t, max_loops=max_loops)) for t in reversed(cls.grid)]


@dataclass
class LossTable:
    """Per family, ``risks`` and mean exit ``loops`` (thresholds, units), conservative first, ``specs``, unit ids."""

    risks: dict[str, np.ndarray]
    loops: dict[str, np.ndarray]
    specs: dict[str, list[RuleSpec]]
    units: np.ndarray
    risk: str
    reference_loops: int

    def certify(self, family: str, alpha: float, delta: float, subset: np.ndarray | None = None) -> Certificate:
        """Learn then Test on the units ``subset`` (indices into :attr:`units`; all when None)."""
        cols = slice(None) if subset is None else np.asarray(subset)
        losses, loops = self.risks[family][:, cols], self.loops[family][:, cols]
        k, p = learn_then_test(losses, alpha, delta)
        c = max(k - 1, 0)  # the last certified row (k rows are), else the first: its p-value
        return Certificate(family=family, risk=self.risk, alpha=alpha, delta=delta, n_units=losses.shape[1],
                           threshold=self.specs[family][c].param if k else None,
                           calibration_risk=float(losses[c].mean()) if k else math.nan,
                           avg_loops=float(loops[c].mean()) if k else math.nan, p_value=float(p[c]),
                           reference_loops=self.reference_loops, tested=min(k + 1, len(p)))


def check_calibration(family: str, alpha: float, delta: float, risk: str) -> None:
    """The arguments of a calibration, checked before any model pass."""
    for name, value in (("alpha", alpha), ("delta", delta)):
        need_float(name, value, 0.0, 1.0, lo_open=True, hi_open=True)
    _need_risks((risk,))
    family_specs(family, 1, 1)


def _need_risks(risks: Sequence[str]) -> None:
    for r in risks:
        if r not in RISKS:
            raise DrcError(f"risk={r!r} is not supported; use one of {', '.join(RISKS)}")


@torch.no_grad()
def loss_tables(model: RecurrentModel, windows: torch.Tensor, units: np.ndarray, families: Sequence[str], *,
                risks: Sequence[str] = RISKS, tolerance: float = 0.0, reference_loops: int = 8, max_loops: int = 16,
                batch_size: int = 16, seed: int = EVAL_STATE_SEED) -> dict[str, LossTable]:
    """One :class:`LossTable` per risk from one offline pass replaying every threshold of ``families`` (and
    ``uniform``) on ``windows`` (N, T+1); ``units`` (N, T) the document of each input position."""
    reference_loops = need_int("reference_loops", reference_loops, 1)
    max_loops = need_int("max_loops", max(max_loops, reference_loops), 1)
    n, t_len = windows.shape[0], windows.shape[1] - 1
    if np.shape(units) != (n, t_len):
        raise DrcError(f"units must give a document per input position, shape ({n}, {t_len}); got "
                       f"{np.shape(units)}")
    _need_risks(risks)
    flat = [s for f in dict.fromkeys(families) if f != "uniform" for s in family_specs(f, max_loops, reference_loops)]
    passed = offline_pass(model, windows, flat, reference_loops=reference_loops, loops=max_loops,
                          batch_size=batch_size, seed=seed)
    return pass_loss_tables(passed, units, families, risks=risks, tolerance=tolerance)


def pass_loss_tables(passed: OfflinePass, units: np.ndarray, families: Sequence[str], *,
                     risks: Sequence[str] = RISKS, tolerance: float = 0.0) -> dict[str, LossTable]:
    """:func:`loss_tables` from an offline pass already run, which replayed every threshold of ``families``."""
    loops_run, n, t_len = passed.ce.shape
    reference_loops = passed.reference_loops
    units = np.asarray(units)
    if units.shape != (n, t_len):
        raise DrcError(f"units must give a document per input position, shape ({n}, {t_len}); got {units.shape}")
    _need_risks(risks)
    specs = {f: family_specs(f, loops_run, reference_loops) for f in dict.fromkeys([*families, "uniform"])}
    missing = [str(s.rule) for g in specs.values() for s in g if s.family != "uniform" and str(s.rule) not in
               passed.exits]
    if missing:
        raise DrcError(f"the offline pass did not replay {missing[0]} (and {len(missing) - 1} more): run it with "
                       f"every threshold of {', '.join(families)} at max_loops={loops_run}")
    argmax = passed.argmax.permute(1, 2, 0).cpu().numpy()  # (N, T, L), as token_losses reads them
    ce = passed.ce.permute(1, 2, 0).double().cpu().numpy()
    exits = passed.token_exits()
    loops, ids = {}, None
    ex = {fam: [np.full((n, t_len), int(s.param)) if fam == "uniform" else exits[str(s.rule)] for s in group]
          for fam, group in specs.items()}
    for fam in specs:
        loops[fam], ids = unit_risks(np.stack(ex[fam]).astype(float), units)
    out = {}
    for r in risks:
        table = {fam: unit_risks(np.stack([token_losses(argmax, ce, e, reference_loops, r, tolerance)
                                           for e in ex[fam]]), units)[0] for fam in specs}
        out[r] = LossTable(table, loops, specs, ids, r, reference_loops)
    return out


def loss_table(model: RecurrentModel, windows: torch.Tensor, units: np.ndarray, families: Sequence[str], *,
               risk: str = "top1", tolerance: float = 0.0, reference_loops: int = 8, max_loops: int = 16,
               batch_size: int = 16, seed: int = EVAL_STATE_SEED) -> LossTable:
    """:func:`loss_tables` for one ``risk``."""
    return loss_tables(model, windows, units, families, risks=(risk,), tolerance=tolerance,
                       reference_loops=reference_loops, max_loops=max_loops, batch_size=batch_size, seed=seed)[risk]


def calibrate(model: RecurrentModel, windows: torch.Tensor, units: np.ndarray, family: str, *, alpha: float = 0.05,
              delta: float = 0.1, risk: str = "top1", tolerance: float = 0.0, reference_loops: int = 8,
              max_loops: int = 16, seed: int = EVAL_STATE_SEED) -> CalibratedRule:
    """``family``'s threshold whose ``risk`` is at most ``alpha`` with probability ``1 - delta`` over the calibration
    ``windows``' documents ``units``: the rule and its printable :class:`Certificate`."""
    check_calibration(family, alpha, delta, risk)
    need_float("tolerance", tolerance, 0.0)
    need_int("max_loops", max_loops, 1)  # a smaller value would be silently raised to reference_loops
    table = loss_table(model, windows, units, [family], risk=risk, tolerance=tolerance,
                       reference_loops=reference_loops, max_loops=max_loops, seed=seed)
    cert = table.certify(family, alpha, delta)
    rule = None if cert.threshold is None else next(s.rule for s in table.specs[family] if s.param == cert.threshold)
    return CalibratedRule(rule, cert)


def validity(table: LossTable, family: str, alphas: Sequence[float], delta: float, *, n_splits: int = 100,
             seed: int = 0, calib: np.ndarray | None = None, test: np.ndarray | None = None,
             among: np.ndarray | None = None) -> pd.DataFrame:
    """Is the guarantee kept? Per ``alpha`` and split (``n_splits`` random halvings of the units, of ``among`` if
    given, or the one split ``calib``/``test``): certify ``family`` and ``uniform`` on one half, measure the test
    risk, ``violated``, loops and ``saved_frac`` against the certified uniform depth on the other."""
    pool = np.arange(len(table.units)) if among is None else np.asarray(among, dtype=np.int64)
    if pool.ndim != 1 or len(pool) < 2 or pool.min() < 0 or pool.max() >= len(table.units):
        raise DrcError(f"among must be at least 2 unit indices in 0..{len(table.units) - 1}; got {len(pool)} of them")
    rng = np.random.default_rng(seed)
    splits = ([(np.asarray(calib), np.asarray(test))] if calib is not None
              else [np.split(rng.permutation(pool), [len(pool) // 2])
                    for _ in range(need_int("n_splits", n_splits, 1))])
    rows = []
    for alpha in alphas:
        for i, (c, t) in enumerate(splits):
            cert = table.certify(family, alpha, delta, c)
            uni = table.certify("uniform", alpha, delta, c)
            row = {"family": family, "alpha": alpha, "split": i, "n_calib": len(c), "n_test": len(t),
                   "certified": cert.threshold is not None, "threshold": cert.threshold,
                   "uniform_depth": uni.threshold, "test_risk": math.nan, "violated": False, "loops": math.nan,
                   "saved_frac": math.nan}
            if cert.threshold is not None:
                j = [s.param for s in table.specs[family]].index(cert.threshold)
                row["test_risk"] = float(table.risks[family][j, t].mean())
                row["violated"] = row["test_risk"] > alpha
                row["loops"] = float(table.loops[family][j, t].mean())
                if uni.threshold is not None:
                    row["saved_frac"] = 1 - row["loops"] / uni.threshold
            rows.append(row)
    return pd.DataFrame(rows)


def validity_summary(rows: pd.DataFrame, delta: float, level: float = 0.95) -> pd.DataFrame:
    """Per family and ``alpha`` of :func:`validity`'s rows: the shares ``certified`` and ``violation`` of splits, its
    standard error and Clopper-Pearson interval, ``kept`` (its lower end <= ``delta``), means over certified ones."""
    out = []
    for (fam, alpha), g in rows.groupby(["family", "alpha"], sort=False):
        n, k = len(g), int(g.violated.sum())
        lo = 0.0 if k == 0 else float(sps.beta.ppf((1 - level) / 2, k, n - k + 1))
        hi = 1.0 if k == n else float(sps.beta.ppf((1 + level) / 2, k + 1, n - k))
        cert = g[g.certified]
        out.append({"family": fam, "alpha": alpha, "splits": n, "n_calib": int(g.n_calib.iloc[0]),
                    "certified": float(g.certified.mean()), "violation": k / n,
                    "violation_se": math.sqrt(k / n * (1 - k / n) / n), "violation_lo": lo, "violation_hi": hi,
                    "delta": delta, "kept": lo <= delta, "test_risk": float(cert.test_risk.mean()),
                    "loops": float(cert.loops.mean()), "uniform_depth": float(cert.uniform_depth.astype(float).mean()),
                    "saved_frac": float(cert.saved_frac.mean())})
    return pd.DataFrame(out)

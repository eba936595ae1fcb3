"""Quality versus average depth: threshold sweeps over halting rules, matching depths, and calibration.

:func:`sweep` records per validation window, for every rule point, uniform depth and oracle point, the average exit
loop and two qualities: ``ce`` (next-token cross-entropy at the exit, nats) and ``kl_ref`` (``KL(p_ref || p_exit)``
against the uniform reference depth). Rules run online (each its own halting run) or offline (replayed on one
uniform pass). :func:`summarize` adds bootstrap CIs over documents, :func:`matching_depth` finds the lowest depth
matching a target quality, :func:`calibrate` chooses a threshold on one split and checks it on another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import tee

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from scipy import stats as sps
from tqdm.auto import tqdm

from drc_core.analysis.intervals import bootstrap_ci, cluster_codes, cluster_draws, percentile_interval
from drc_core.analysis.loops import iterate_stats
from drc_core.analysis.measure import ONE_PASS_BYTES, Measurement, WindowMeasure
from drc_core.errors import DrcError, need_int, need_level
from drc_core.halting.reference import AdaptiveResult, first_within, masked_forward, offline_exits
from drc_core.halting.rules import RULE_FAMILIES, HaltingRule, statistics_read
from drc_core.model.checks import check_token_ids
from drc_core.model.lm import LoopOutput, RecurrentModel, iterate, logits_at
from drc_core.model.passes import EVAL_STATE_SEED, Batch, eval_batches, kl_successive

__all__ = ["gap_table", "matching_gap", "QUALITIES", "ROUTER_FAMILIES", "Calibration", "OfflinePass", "RuleSpec",
           "calibrate", "calibrated_families", "state_families", "calibration_table", "default_families",
           "default_rules", "matching_depth", "matching_table", "offline_pass", "offline_pass_and_measure",
           "online_vs_offline", "summarize", "sweep", "uniform_ce", "window_clusters"]

QUALITIES = ("ce", "kl_ref")
DEFAULT_ORACLE_EPS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4)  # the oracle's KL thresholds in a sweep
ForwardFn = Callable[..., AdaptiveResult]


@dataclass(frozen=True)
class RuleSpec:
    """One point of a sweep: a rule, the family it belongs to and the swept parameter's value."""

    family: str
    param: float
    rule: HaltingRule


def default_families() -> list[str]:
    """The families :func:`default_rules` sweeps: every registered family with a default grid, in order."""
    return [family for family, cls in RULE_FAMILIES.items() if cls.grid]


def state_families() -> list[str]:
    """The families of :func:`default_families` whose rule reads only the latent state (no per-loop head)."""
    return [f for f in default_families() if not RULE_FAMILIES[f](RULE_FAMILIES[f].grid[0]).needs_log_probs]


def default_rules(max_loops: int = 16, min_loops: int = 1) -> list[RuleSpec]:
    """One :class:`RuleSpec` per point of every :func:`default_families` family's ``grid``."""
    kw = {"min_loops": min_loops, "max_loops": max_loops}
    return [RuleSpec(family, p, RULE_FAMILIES[family](p, **kw)) for family in default_families()
            for p in RULE_FAMILIES[family].grid]


def _rows(family: str, param: float, rule: str, window0: int, depth: torch.Tensor, ce: torch.Tensor,
          kl: torch.Tensor) -> list[dict[str, object]]:
    """Per-window means of (B, T) exit depth, CE and KL; ``ce`` and ``kl`` (L, B, T) per loop are read at the exit."""
    if ce.dim() == 3:
        idx = (depth - 1)[None]
        ce, kl = ce.gather(0, idx)[0], kl.gather(0, idx)[0]
    d, c, k = (t.double().mean(dim=1).tolist() for t in (depth, ce, kl))
    return [
        {"family": family, "param": param, "rule": rule, "window": window0 + i, "avg_depth": d[i], "ce": c[i],
         "kl_ref": k[i]}
        for i in range(depth.shape[0])
    ]


def _checked(model: RecurrentModel, windows: torch.Tensor, rules: Sequence[RuleSpec], reference_loops: int,
             batch_size: int, loops: int | None = None) -> tuple[torch.Tensor, tuple[RuleSpec, ...], int, int, int]:
    """The arguments of a sweep or an offline pass, checked; ``loops`` at least (default: just) the deepest needed."""
    windows = check_token_ids(model, windows)
    reference_loops = need_int("reference_loops", reference_loops, 1)
    batch_size = need_int("batch_size", batch_size, 1)
    rules = tuple(rules)
    for spec in rules:
        if not isinstance(spec, RuleSpec) or not isinstance(spec.rule, HaltingRule):
            raise DrcError(f"rules must be RuleSpec(family, param, HaltingRule); got {spec!r}")
    deepest = max([reference_loops, *(s.rule.max_loops for s in rules)])
    return windows, rules, reference_loops, batch_size, deepest if loops is None else need_int("loops", loops, deepest)


@torch.no_grad()
def sweep(model: RecurrentModel, windows: torch.Tensor, rules: Sequence[RuleSpec], *, reference_loops: int = 8,
          uniform_loops: Iterable[int] | None = None, oracle_eps: Sequence[float] = DEFAULT_ORACLE_EPS,
          batch_size: int = 16, seed: int = EVAL_STATE_SEED, forward_fn: ForwardFn = masked_forward,
          mode: str = "online", progress: bool = False) -> pd.DataFrame:
    """Per-window quality and average depth of every rule, uniform depth and oracle point on ``windows`` (N, T+1):
    columns ``family, param, rule, window, avg_depth, ce, kl_ref``. ``uniform_loops`` default to 1..the deepest
    ``max_loops``; the oracle (param eps) exits each token at its first loop <= ``reference_loops`` with
    ``KL(p_ref || p_l) <= eps``. ``mode="online"`` runs every rule with ``forward_fn``; ``"offline"`` replays them on
    the uniform trajectory (:func:`~drc_core.halting.reference.offline_exits`)."""
    if mode not in ("online", "offline"):
        raise DrcError(f"mode={mode!r} is invalid; pass 'online' (run each rule) or 'offline' (replay)")
    windows, rules, reference_loops, batch_size, deepest = _checked(model, windows, rules, reference_loops,
                                                                   batch_size)
    uniform = sorted(set(range(1, deepest + 1) if uniform_loops is None else uniform_loops))
    if not uniform or uniform[0] < 1:
        raise DrcError(f"uniform_loops={uniform!r} is invalid; pass loop counts >= 1")
    if mode == "offline":
        return offline_pass(model, windows, rules, reference_loops=reference_loops,
                            loops=max(uniform[-1], deepest), batch_size=batch_size, seed=seed,
                            progress=progress).frame(uniform, oracle_eps)
    rows: list[dict[str, object]] = []
    n_batches = (len(windows) + batch_size - 1) // batch_size
    bar = tqdm(total=n_batches * (1 + len(rules)), desc=f"sweep ({mode})", disable=not progress)
    for batch in eval_batches(model, windows, batch_size, seed):
        s0, ref, ce_l, kl_l, _, _ = _trajectory(model, batch, reference_loops, max(uniform[-1], deepest), [])
        rows += _uniform_and_oracle(ce_l, kl_l, batch.start, uniform, reference_loops, oracle_eps)
        bar.update()
        for spec in rules:
            res = forward_fn(model, batch.x, spec.rule, state=s0)
            logp = res.log_probs()
            rows += _rows(spec.family, float(spec.param), str(spec.rule), batch.start, res.exit_loop,
                          -logp.gather(-1, batch.y[..., None]).squeeze(-1), kl_successive(ref, logp))
            bar.update()
    bar.close()
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class OfflinePass:
    """One uniform trajectory per batch with every rule replayed on it (:func:`offline_pass`): per loop every
    token's ``ce``, ``kl_ref`` and ``argmax`` (loops, N, T), and each rule's exit loops (N, T) by ``str(rule)``."""

    ce: torch.Tensor
    kl_ref: torch.Tensor
    argmax: torch.Tensor
    exits: dict[str, torch.Tensor]
    specs: tuple[RuleSpec, ...]
    reference_loops: int
    batch_size: int

    def frame(self, uniform_loops: Iterable[int] | None = None,
              oracle_eps: Sequence[float] = DEFAULT_ORACLE_EPS) -> pd.DataFrame:
        """The offline :func:`sweep`'s frame, rows in its order."""
        loops = self.ce.shape[0]
        uniform = sorted(set(range(1, loops + 1) if uniform_loops is None else uniform_loops))
        if not uniform or uniform[0] < 1 or uniform[-1] > loops:
            raise DrcError(f"uniform_loops={uniform!r} is invalid; pass loop counts 1..{loops} (the pass's loops)")
        rows: list[dict[str, object]] = []
        for b0 in range(0, self.ce.shape[1], self.batch_size):
            sl = slice(b0, b0 + self.batch_size)
            ce_l, kl_l = self.ce[:, sl], self.kl_ref[:, sl]
            rows += _uniform_and_oracle(ce_l, kl_l, b0, uniform, self.reference_loops, oracle_eps)
            for spec in self.specs:
                rows += _rows(spec.family, float(spec.param), str(spec.rule), b0, self.exits[str(spec.rule)][sl],
                              ce_l, kl_l)
        return pd.DataFrame(rows)

    @classmethod
    def cat(cls, passes: Sequence[OfflinePass]) -> OfflinePass:
        """Several passes of the same rules, reference depth and loops as one, their windows in order."""
        first = passes[0]
        for p in passes[1:]:
            if ([str(s.rule) for s in p.specs] != [str(s.rule) for s in first.specs]
                    or p.reference_loops != first.reference_loops or p.ce.shape[0] != first.ce.shape[0]
                    or p.ce.shape[2] != first.ce.shape[2]):
                raise DrcError("offline passes to join must replay the same rules at the same reference depth, "
                               "loops and window length")
        return cls(torch.cat([p.ce for p in passes], 1), torch.cat([p.kl_ref for p in passes], 1),
                   torch.cat([p.argmax for p in passes], 1),
                   {name: torch.cat([p.exits[name] for p in passes]) for name in first.exits}, first.specs,
                   first.reference_loops, first.batch_size)

    def token_exits(self, oracle_eps: Sequence[float] = ()) -> dict[str, np.ndarray]:
        """:func:`token_exits`: each rule's exits (N, T) and ``oracle(kl<=eps)`` for each ``oracle_eps``."""
        out = {name: ex.cpu().numpy() for name, ex in self.exits.items()}
        for e in oracle_eps:
            out[f"oracle(kl<={e:g})"] = first_within(self.kl_ref[: self.reference_loops], e)[0].cpu().numpy()
        return out


@torch.no_grad()
def offline_pass(model: RecurrentModel, windows: torch.Tensor, rules: Sequence[RuleSpec], *,
                 reference_loops: int = 8, loops: int | None = None, batch_size: int = 16,
                 seed: int = EVAL_STATE_SEED, progress: bool = False) -> OfflinePass:
    """The :class:`OfflinePass` of ``rules`` on ``windows``: ``loops`` uniform loops per batch (default the deepest
    needed), the reference output at ``reference_loops`` from the same s_0."""
    windows, rules, reference_loops, batch_size, loops = _checked(model, windows, rules, reference_loops,
                                                                 batch_size, loops)
    n_batches = (len(windows) + batch_size - 1) // batch_size
    parts = [_trajectory(model, batch, reference_loops, loops, rules)[2:]
             for batch in tqdm(eval_batches(model, windows, batch_size, seed), total=n_batches, desc="offline pass",
                               disable=not progress)]
    return _joined(parts, rules, reference_loops, batch_size)


@torch.no_grad()
def offline_pass_and_measure(model: RecurrentModel, windows: torch.Tensor, rules: Sequence[RuleSpec], *,
                             reference_loops: int = 8, loops: int | None = None, max_loops: int = 32,
                             positions: torch.Tensor | np.ndarray | None = None, kl_to_final: bool = True,
                             dynamics: bool = False, doc_ids: torch.Tensor | np.ndarray | None = None,
                             batch_size: int = 16, seed: int = EVAL_STATE_SEED,
                             progress: bool = False) -> tuple[OfflinePass, Measurement]:
    """:func:`offline_pass` (``rules``, ``reference_loops``, ``loops``) and
    :func:`~drc_core.analysis.measure.measure_windows` (``max_loops``, ``positions``, ``kl_to_final``,
    ``dynamics``, ``doc_ids``) of the same ``windows``, bit for bit, from one run of the core loops per batch: each
    reads out the shared states as it would alone."""
    windows, rules, reference_loops, batch_size, loops = _checked(model, windows, rules, reference_loops,
                                                                 batch_size, loops)
    measure = WindowMeasure(model, windows, max_loops, doc_ids=doc_ids, seed=seed, kl_to_final=kl_to_final,
                            positions=positions, dynamics=dynamics)
    parts = []
    n_batches = (len(windows) + batch_size - 1) // batch_size
    for batch in tqdm(eval_batches(model, windows, batch_size, seed), total=n_batches,
                      desc="offline pass and measurement", disable=not progress):
        s0 = batch.initial_state(model)
        # the states wait in the tee for the second reader: at most the offline pass's loops of one batch
        offline_core, measure_core = tee(iterate(model, batch.x, max(loops, measure.max_loops), state=s0,
                                                 readout=None))
        parts.append(_trajectory(model, batch, reference_loops, loops, rules, state=s0, core=offline_core)[2:])
        del offline_core
        measure.add(batch, s0, measure_core)
    return _joined(parts, rules, reference_loops, batch_size), measure.result()


def _joined(parts: Sequence[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]],
            rules: tuple[RuleSpec, ...], reference_loops: int, batch_size: int) -> OfflinePass:
    """The :class:`OfflinePass` of the batches' ``_trajectory`` (ce, kl, exits, argmax) in order."""
    ces, kls, exits, args = zip(*parts, strict=True)
    return OfflinePass(torch.cat(ces, dim=1), torch.cat(kls, dim=1), torch.cat(args, dim=1),
                       {str(spec.rule): torch.cat([ex[i] for ex in exits]) for i, spec in enumerate(rules)}, rules,
                       reference_loops, batch_size)


def token_exits(model: RecurrentModel, windows: torch.Tensor, rules: Sequence[RuleSpec], *, reference_loops: int = 8,
                oracle_eps: Sequence[float] = (), batch_size: int = 16,
                seed: int = EVAL_STATE_SEED) -> dict[str, np.ndarray]:
    """Per-token exit loops (N, T) of each rule replayed offline, keyed by ``str(rule)``, and ``oracle(kl<=eps)``
    for each ``oracle_eps``: :meth:`OfflinePass.token_exits` of :func:`offline_pass`."""
    return offline_pass(model, windows, rules, reference_loops=reference_loops, batch_size=batch_size,
                        seed=seed).token_exits(oracle_eps)


def _trajectory(model: RecurrentModel, batch: Batch, reference_loops: int, loops: int, rules: Sequence[RuleSpec],
                *, state: torch.Tensor | None = None, core: Iterable[LoopOutput] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A batch's s_0, reference log-probs, and from one uniform pass per-loop CE, KL(p_ref || p_l) and argmax
    (loops, B, T), and each rule's exits on it. ``state``, ``core``: the batch's s_0 (else drawn here) and its loops
    already running (:func:`~drc_core.analysis.loops.iterate_stats`)."""
    x, y = batch.x, batch.y
    s0 = batch.initial_state(model) if state is None else state
    # one pass when the loops before the reference fit in memory: their log-probs wait for loop R's (the same
    # numbers as a separate depth-R pass from s_0, which costs R more loops)
    one_pass = loops >= reference_loops and (reference_loops - 1) * x.numel() * model.vocab_size * 4 <= ONE_PASS_BYTES
    ref = None if one_pass else F.log_softmax(logits_at(model, x, reference_loops, state=s0).float(), dim=-1)
    ces, kls, args, early = [], [], [], []
    read = statistics_read(spec.rule for spec in rules)
    only = None if read is None else read | {"argmax"}

    def stats():
        nonlocal ref
        for st in iterate_stats(model, x, loops, state=s0, only=only, core=core):
            if ref is None and st.loop == reference_loops:
                ref = st.log_probs
                kls.extend(kl_successive(ref, lp) for lp in early)
                early.clear()
            ces.append(-st.log_probs.gather(-1, y[..., None]).squeeze(-1))
            args.append(st.argmax)
            if ref is None:
                early.append(st.log_probs)
            else:
                kls.append(kl_successive(ref, st.log_probs))
            yield st

    it = stats()
    exits = offline_exits(it, [spec.rule for spec in rules]) if rules else []
    for _ in it:  # the uniform depths need every loop, even after every rule has halted
        pass
    return s0, ref, torch.stack(ces), torch.stack(kls), exits, torch.stack(args)


def _uniform_and_oracle(ce_l: torch.Tensor, kl_l: torch.Tensor, b0: int, uniform: list[int], reference_loops: int,
                        oracle_eps: Sequence[float]) -> list[dict]:
    """Every uniform depth's rows, and the oracle's (first loop <= reference with KL to it <= eps)."""
    rows: list[dict] = []
    for k in uniform:
        depth = torch.full(ce_l.shape[1:], k, dtype=torch.long, device=ce_l.device)
        rows += _rows("uniform", float(k), f"uniform({k})", b0, depth, ce_l[k - 1], kl_l[k - 1])
    for eps in oracle_eps:
        exit_loop, _ = first_within(kl_l[:reference_loops], eps)
        rows += _rows("oracle", float(eps), f"oracle(kl<={eps:g})", b0, exit_loop, ce_l, kl_l)
    return rows


def window_clusters(doc_ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """Per-window cluster ids for :func:`summarize` from per-position doc ids (N, T): each window's most common."""
    docs = np.asarray(doc_ids)
    if docs.ndim != 2:
        raise DrcError(f"doc_ids must be (N, T) per-position document ids; got shape {docs.shape}")
    return sps.mode(docs, axis=1, keepdims=False).mode.astype(np.int64)  # ties: the smallest id


def summarize(frame: pd.DataFrame, *, windows: Sequence[int] | np.ndarray | None = None,
              clusters: np.ndarray | None = None, n_boot: int = 1000, seed: int = 0,
              level: float = 0.95) -> pd.DataFrame:
    """One row per (family, param, rule): mean ``avg_depth``, ``ce``, ``kl_ref`` with ``_lo``/``_hi`` bootstrap CIs
    over clusters (``clusters``: each window id's; default the windows), on the window ids ``windows`` (all)."""
    needed = {"family", "param", "rule", "window", "avg_depth", *QUALITIES}
    if missing := needed - set(frame.columns):
        raise DrcError(f"the frame lacks columns {sorted(missing)}; pass the output of sweep()")
    if windows is not None:
        frame = frame[frame.window.isin(np.asarray(windows))]
        if frame.empty:
            raise DrcError("no rows left for the given windows; pass window ids that the sweep covered")
    out = []
    for (family, param, rule), g in frame.groupby(["family", "param", "rule"], sort=False):
        g = g.sort_values("window")
        cl = g.window.to_numpy() if clusters is None else np.asarray(clusters)[g.window.to_numpy()]
        cols = ["avg_depth", *QUALITIES]
        point, lo, hi = bootstrap_ci(g[cols].to_numpy(float), cl, n_boot=n_boot, seed=seed, level=level)
        row: dict[str, object] = {"family": family, "param": param, "rule": rule, "n_windows": len(g)}
        for j, c in enumerate(cols):
            row[c], row[f"{c}_lo"], row[f"{c}_hi"] = point[j], lo[j], hi[j]
        out.append(row)
    return pd.DataFrame(out)


def matching_depth(summary: pd.DataFrame, family: str, target: float, *, quality: str = "ce") -> dict[str, float]:
    """The lowest average depth at which ``family`` reaches ``quality <= target``: ``grid`` (the shallowest point
    meeting it, NaN if none) with its ``param`` and ``quality``, and ``interpolated`` (where the curve crosses)."""
    if quality not in QUALITIES:
        raise DrcError(f"quality={quality!r} is not supported; use one of {QUALITIES}")
    g = summary[summary.family == family].sort_values("avg_depth")
    if g.empty:
        raise DrcError(f"family {family!r} is not in the summary; it has {sorted(summary.family.unique())}")
    depth, q = g.avg_depth.to_numpy(float), g[quality].to_numpy(float)
    i, interp = _crossing(depth, q, target)
    if i < 0:
        return {"grid": float("nan"), "interpolated": float("nan"), "param": float("nan"), "quality": float("nan")}
    return {"grid": float(depth[i]), "interpolated": interp, "param": float(g.param.iloc[i]),
            "quality": float(q[i])}


def _crossing(depth: np.ndarray, q: np.ndarray, target: float) -> tuple[int, float]:
    """The index of the first point (sorted by ``depth``) with ``q <= target`` (-1: none) and the interpolated
    depth where the curve crosses ``target`` (NaN: none)."""
    ok = np.flatnonzero(q <= target)
    if not len(ok):
        return -1, float("nan")
    i = int(ok[0])
    interp = depth[i]
    if i > 0 and q[i - 1] > target:
        frac = (q[i - 1] - target) / (q[i - 1] - q[i])
        interp = depth[i - 1] + frac * (depth[i] - depth[i - 1])
    return i, float(interp)


def matching_gap(frame: pd.DataFrame, family: str, *, reference: int, ce_tolerance: float,
                 clusters: np.ndarray | None = None, n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> dict[str, tuple[float, float, float]]:
    """How many loops ``family`` saves against uniform depth at CE <= CE(uniform ``reference``) + ``ce_tolerance``:
    ``(point, lo, hi)`` of ``family_depth``, ``uniform_depth``, ``saved`` and ``saved_frac``, matching depths and
    target recomputed on every cluster resample (one where a family never reaches the target is left out)."""
    level = need_level(level)
    n_boot = need_int("n_boot", n_boot, 1)
    curves = {}
    for fam in ("uniform", family):
        g = frame[frame.family == fam]
        if g.empty:
            raise DrcError(f"family {fam!r} is not in the frame; it has {sorted(frame.family.unique())}")
        curves[fam] = (g.pivot_table(index=["param", "rule"], columns="window", values="avg_depth"),
                       g.pivot_table(index=["param", "rule"], columns="window", values="ce"))
    win = curves["uniform"][0].columns.to_numpy()
    if not np.array_equal(curves[family][0].columns.to_numpy(), win):
        raise DrcError(f"uniform and {family!r} cover different windows; pass one sweep() over the same windows")
    codes, n_c = cluster_codes(None if clusters is None else np.asarray(clusters)[win], len(win))
    onehot = np.zeros((len(win), n_c))
    onehot[np.arange(len(win)), codes] = 1.0  # window -> cluster
    ref_row = list(curves["uniform"][0].index.get_level_values("param")).index(float(reference))

    def depths(w: np.ndarray) -> np.ndarray:
        """(m, 2) matching depths (uniform, family) for cluster weights w (m, n_c)."""
        ww = w @ onehot.T  # (m, windows)
        means = {f: ((ww @ d.to_numpy().T) / ww.sum(1, keepdims=True),
                     (ww @ c.to_numpy().T) / ww.sum(1, keepdims=True)) for f, (d, c) in curves.items()}
        target = means["uniform"][1][:, ref_row] + ce_tolerance
        out = np.full((len(w), 2), np.nan)
        for j, f in enumerate(("uniform", family)):
            d, c = means[f]
            for r in range(len(w)):
                order = np.argsort(d[r], kind="stable")
                out[r, j] = _crossing(d[r][order], c[r][order], float(target[r]))[1]
        return out

    def stats(dd: np.ndarray) -> np.ndarray:
        return np.stack([dd[:, 1], dd[:, 0], dd[:, 0] - dd[:, 1], (dd[:, 0] - dd[:, 1]) / dd[:, 0]], axis=1)

    point = stats(depths(np.ones((1, n_c))))[0]
    boot = np.concatenate([stats(depths(w)) for w in cluster_draws(n_c, n_boot, seed, chunk=256)])
    lo, hi = percentile_interval(boot, level)
    keys = ("family_depth", "uniform_depth", "saved", "saved_frac")
    return {k: (float(point[i]), float(lo[i]), float(hi[i])) for i, k in enumerate(keys)}


@dataclass
class Calibration:
    """What :func:`calibrate` returns: the chosen ``param`` (NaN: none), its depth and quality on both splits."""

    family: str
    quality: str
    target: float
    param: float
    calib_depth: float
    calib_quality: float
    heldout_depth: float
    heldout_quality: float
    heldout_quality_lo: float
    heldout_quality_hi: float
    holds: bool


def calibrate(calib: pd.DataFrame, heldout: pd.DataFrame, family: str, target: float, *,
              quality: str = "ce", heldout_target: float | None = None) -> Calibration:
    """``family``'s shallowest point with ``quality <= target`` on the summary ``calib``, checked on ``heldout``:
    ``holds`` if it meets ``heldout_target`` (default ``target``) there."""
    m = matching_depth(calib, family, target, quality=quality)
    nan = float("nan")
    if np.isnan(m["param"]):
        return Calibration(family, quality, target, nan, nan, nan, nan, nan, nan, nan, False)
    h = heldout[(heldout.family == family) & (heldout.param == m["param"])]
    if len(h) != 1:
        raise DrcError(f"the held-out summary has no single row for {family} param={m['param']:g}")
    r = h.iloc[0]
    return Calibration(family, quality, target, m["param"], m["grid"], m["quality"], float(r.avg_depth),
                       float(r[quality]), float(r[f"{quality}_lo"]), float(r[f"{quality}_hi"]),
                       bool(r[quality] <= (target if heldout_target is None else heldout_target)))


ROUTER_KINDS = ("linear", "mlp")  # drc_core.halting.router's router kinds, trained by trained_router_specs
ROUTER_FAMILIES = tuple(f"router_{kind}" for kind in ROUTER_KINDS)  # the families of their sweep rows


def calibrated_families() -> list[str]:
    """The families notebook 4 calibrates: those of :func:`default_rules` and the two learned routers."""
    return [*default_families(), *ROUTER_FAMILIES]


def uniform_ce(summary: pd.DataFrame, reference: int) -> float:
    """The CE of uniform depth ``reference`` in a :func:`summarize` table."""
    row = summary[(summary.family == "uniform") & (summary.param == reference)]
    if row.empty:
        raise DrcError(f"the summary has no uniform({reference}) row: sweep with uniform_loops reaching {reference}")
    return float(row.ce.iloc[0])


def matching_table(summary: pd.DataFrame, reference: int, ce_tolerance: float, kl_target: float) -> pd.DataFrame:
    """Per family, :func:`matching_depth` for CE <= CE(uniform ``reference``) + ``ce_tolerance`` (``ce_*``) and for
    ``kl_ref <= kl_target`` (``kl_*``), and the cuts 1 - interpolated / reference (``cut_vs_8_ce``, ``_kl``)."""
    ce_target = uniform_ce(summary, reference) + ce_tolerance
    rows = []
    for fam in summary.family.unique():
        m_ce = matching_depth(summary, fam, ce_target, quality="ce")
        m_kl = matching_depth(summary, fam, kl_target, quality="kl_ref")
        rows.append({"family": fam, "ce_depth": m_ce["grid"], "ce_depth_interp": m_ce["interpolated"],
                     "ce_param": m_ce["param"], "kl_depth": m_kl["grid"], "kl_depth_interp": m_kl["interpolated"],
                     "kl_param": m_kl["param"]})
    match = pd.DataFrame(rows).set_index("family")
    match["cut_vs_8_ce"] = 1 - match.ce_depth_interp / reference
    match["cut_vs_8_kl"] = 1 - match.kl_depth_interp / reference
    return match


def gap_table(frame: pd.DataFrame, reference: int, ce_tolerance: float, *, families: Sequence[str] | None = None,
              windows: Sequence[int] | np.ndarray | None = None, clusters: np.ndarray | None = None,
              n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """:func:`matching_gap` of each family (default: all but uniform) on ``windows``, with ``_lo``/``_hi``."""
    if windows is not None:
        frame = frame[frame.window.isin(np.asarray(windows))]
    fams = [f for f in (families or frame.family.unique()) if f != "uniform"]
    rows = []
    for fam in fams:
        gap = matching_gap(frame, fam, reference=reference, ce_tolerance=ce_tolerance, clusters=clusters,
                           n_boot=n_boot, seed=seed)
        row: dict[str, object] = {"family": fam}
        for k, (p, lo, hi) in gap.items():
            row[k], row[f"{k}_lo"], row[f"{k}_hi"] = p, lo, hi
        rows.append(row)
    return pd.DataFrame(rows).set_index("family")


def calibration_table(calib: pd.DataFrame, heldout: pd.DataFrame, reference: int, ce_tolerance: float,
                      kl_target: float, families: Sequence[str] | None = None) -> pd.DataFrame:
    """:func:`calibrate` for each family (default: :func:`calibrated_families`) and both qualities: CE within
    ``ce_tolerance`` of each split's uniform ``reference`` (to choose, to check), ``kl_ref <= kl_target``."""
    families = calibrated_families() if families is None else families
    ce_heldout = uniform_ce(heldout, reference) + ce_tolerance
    ce_calib = uniform_ce(calib, reference) + ce_tolerance
    rows = []
    for fam in families:
        for quality, chosen_at, target in (("ce", ce_calib, ce_heldout), ("kl_ref", kl_target, kl_target)):
            c = calibrate(calib, heldout, fam, chosen_at, quality=quality, heldout_target=target)
            rows.append({**vars(c), "heldout_target": target})
    return pd.DataFrame(rows)


def online_vs_offline(model: RecurrentModel, windows: torch.Tensor, frame: pd.DataFrame, specs: Sequence[RuleSpec],
                      match: pd.DataFrame, subset: Sequence[int] | np.ndarray, reference: int, *, seed: int = 0,
                      n_boot: int = 200) -> pd.DataFrame:
    """Each family's CE-matched point run online on the windows ``subset`` beside its offline replay in ``frame``:
    ``avg_depth``, ``ce``, ``kl_ref`` ``_online``/``_offline``, and ``depth_diff``, ``ce_diff`` (online - offline)."""
    by_param = {(sp.family, float(sp.param)): sp for sp in specs}
    check = [by_param[(fam, float(match.loc[fam, "ce_param"]))] for fam in match.index
             if (fam, float(match.loc[fam, "ce_param"])) in by_param]
    sub = np.asarray(subset)
    on = summarize(sweep(model, windows[sub], check, reference_loops=reference, oracle_eps=(), mode="online"),
                   n_boot=n_boot, seed=seed)
    renumber = {w: i for i, w in enumerate(sub)}
    off = summarize(frame[frame.window.isin(sub)].assign(window=lambda d: d.window.map(renumber)), n_boot=n_boot,
                    seed=seed)
    online = on[on.family != "uniform"].merge(off, on=["family", "param"], suffixes=("_online", "_offline"))
    online["depth_diff"] = online.avg_depth_online - online.avg_depth_offline
    online["ce_diff"] = online.ce_online - online.ce_offline
    return online

"""Notebook 06's measurements: the answers of the ``depth-tasks`` source, each needing ``k`` sequential lookups, read
at every loop (accuracy, CE, convergence depth, commit loop, overthinking, dynamics) and the loop each halting rule
stops them at. Windows start at a document's first token, so every answer sees its whole problem; every interval
resamples documents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy import stats as sps

from drc_core import (
    DEFAULT_EPS,
    DEPTH_TASK_SOURCE,
    Corpus,
    DepthTaskConfig,
    DrcError,
    Dynamics,
    KLThreshold,
    Measurement,
    OfflinePass,
    RecurrentModel,
    RuleSpec,
    bootstrap_ci,
    class_shares,
    classify,
    cluster_draws,
    commit_loop,
    convergence_depth,
    default_families,
    default_rules,
    eot_id,
    gap_table,
    generate_document,
    learn_then_test,
    load,
    logits_at,
    matching_table,
    measure_windows,
    measured_exits,
    need_int,
    offline_pass,
    offline_pass_and_measure,
    overthinks,
    pass_loss_tables,
    read_json,
    read_labels,
    split_windows,
    summarize,
    token_labels,
    unit_risks,
)

__all__ = ["TaskWindows", "accuracy_by_k", "answer_depths", "answer_dynamics", "answer_trajectories", "cell_table",
           "copy_accuracy", "corpus_task_windows", "depth_growth", "depth_law", "law_table", "exits_by_k",
           "generated_task_windows", "halting_against_overthinking", "extrapolation_probe", "lever_records",
           "lever_sentence", "lever_study", "mean_by_k", "risk_units", "savings", "spearman_ci", "sweep_window_sets",
           "task_passes"]


@dataclass
class TaskWindows:
    """Windows (N, T+1) that each start at a depth-task document, and their answers: one row per answer with
    ``window``, ``pos`` (the position whose output predicts the answer), ``k``, ``family``, ``answer``, ``doc``."""

    windows: torch.Tensor
    answers: pd.DataFrame


def corpus_task_windows(corpus: Corpus, seq_len: int, n_docs: int | None = None, split: str = "val",
                        seed: int = 0) -> TaskWindows:
    """One window per depth-task document of ``split`` (``n_docs`` of them, drawn at random with ``seed``; all when
    None), starting at its first token, with the answers that fall inside it."""
    seq_len = need_int("seq_len", seq_len, 1)
    labels = read_labels(corpus.path, split)
    tokens = corpus.tokens(split)
    docs = corpus.docs[(corpus.docs.split == split) & corpus.docs.doc_id.isin(labels.doc_id.unique())]
    docs = docs[docs.tok_start + seq_len + 1 <= len(tokens)]
    if n_docs is not None:
        n_docs = need_int("n_docs", n_docs, 1)
        rng = np.random.default_rng(seed)
        docs = docs.iloc[np.sort(rng.permutation(len(docs))[: min(n_docs, len(docs))])]
    if docs.empty:
        raise DrcError(f"corpus '{corpus.path}' has no depth-task documents in its {split} split")
    idx = docs.tok_start.to_numpy(np.int64)[:, None] + np.arange(seq_len + 1)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    where = pd.Series(np.arange(len(docs)), index=docs.doc_id.to_numpy())
    # an answer counts when its predicting position (pos - 1) lies inside the window
    ans = labels[labels.doc_id.isin(where.index) & (labels.pos >= 1) & (labels.pos - 1 < seq_len)]
    answers = pd.DataFrame({"window": where[ans.doc_id].to_numpy(), "pos": ans.pos.to_numpy() - 1,
                            "k": ans.k.to_numpy(), "family": ans.family.to_numpy(), "answer": ans.answer.to_numpy(),
                            "doc": ans.doc_id.to_numpy()})
    return TaskWindows(windows, answers)


def generated_task_windows(tokenizer, cfg: DepthTaskConfig, seq_len: int, pad_id: int) -> TaskWindows:
    """Windows of freshly generated documents (``k`` beyond the training range, a seed never trained on), tokenized
    with the model's ``tokenizer``, padded with ``pad_id`` or cut to ``seq_len``; answers split into several tokens or
    beyond ``seq_len`` are left out (``answers`` may be empty)."""
    cfg.validate()
    rows, answers = [], []
    for i in range(cfg.docs):
        text, _ = generate_document(cfg, i)
        enc = tokenizer.encode(text)
        ids = enc.ids[: seq_len + 1]
        rows.append(ids + [pad_id] * (seq_len + 1 - len(ids)))
        for pos, a in token_labels(text, enc, strict=False):
            if pos >= 1 and pos - 1 < min(seq_len, len(enc.ids) - 1):
                answers.append({"window": i, "pos": pos - 1, "k": a.k, "family": a.family, "answer": a.word,
                                "doc": f"generated:{cfg.seed}:{i}", "chain": a.chain, "turn": a.turn})
    columns = ["window", "pos", "k", "family", "answer", "doc", "chain", "turn"]  # also when no answer fits
    return TaskWindows(torch.tensor(rows, dtype=torch.long), pd.DataFrame(answers, columns=columns))


def _ci(values: np.ndarray, clusters: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float]:
    point, lo, hi = bootstrap_ci(values, clusters, n_boot=n_boot, seed=seed)
    return float(point[0]), float(lo[0]), float(hi[0])


def copy_accuracy(model: RecurrentModel, tokenizer, loops: Sequence[int], *, docs: int = 64, seed: int = 999,
                  max_len: int | None = None) -> pd.DataFrame:
    """In-context copying: on generated ``repeats`` paragraphs (a random word sequence said twice), per loop the
    share of the second saying's tokens predicted exactly, with a 95% interval over paragraphs. Paragraph i starts
    from an initial state seeded with ``seed + i``, so the table does not depend on the global RNG."""
    cfg = DepthTaskConfig(docs=docs, families=(), repeat_share=1.0, problems=1, seed=seed)
    loops = sorted({need_int("loops", lp, 1) for lp in loops})
    hits: dict[int, list[float]] = {lp: [] for lp in loops}
    with torch.no_grad():
        for i in range(cfg.docs):
            text, _ = generate_document(cfg, i)
            enc = tokenizer.encode(text)
            ids = enc.ids[: max_len or len(enc.ids)]
            second = text.index(" Again:") + len(" Again:")
            start = next(j for j, (a, _) in enumerate(enc.offsets) if a >= second)
            x, target = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
            span = slice(start, len(ids) - 2)  # the repeated words, not the closing " ."
            for lp in loops:
                gen = torch.Generator(device=x.device).manual_seed(seed + i)
                pred = logits_at(model, x, lp, generator=gen)[0].argmax(-1)
                hits[lp].append(float((pred[span] == target[span]).float().mean()))
    rows = []
    for lp, v in hits.items():
        p, lo, hi = _ci(np.asarray(v), np.arange(len(v)), 1000, 0)
        rows.append({"loop": lp, "copy_acc": p, "lo": lo, "hi": hi, "n": len(v)})
    return pd.DataFrame(rows)


def answer_trajectories(model: RecurrentModel, tw: TaskWindows, max_loops: int, *, batch_size: int = 16,
                        progress: bool = False) -> Measurement:
    """Every answer at every loop 1..``max_loops``: :func:`drc_core.measure_windows` at the answers' predicting
    positions only (with the KL to the deepest loop and the dynamics), with ``k``, ``family`` and ``doc`` per
    answer."""
    m = measure_windows(model, tw.windows, max_loops, batch_size=batch_size, kl_to_final=True,
                        positions=_answer_mask(tw), dynamics=True, progress=progress)
    return _with_answers(m, tw)


def task_passes(model: RecurrentModel, tw: TaskWindows, specs: list[RuleSpec], max_loops: int,
                reference_loops: int, *, batch_size: int = 16, progress: bool = False
                ) -> tuple[OfflinePass, Measurement]:
    """The offline pass of ``specs`` on the task windows (:func:`drc_core.offline_pass`) and
    :func:`answer_trajectories`, bit for bit, from one run of the core loops per batch
    (:func:`drc_core.offline_pass_and_measure`)."""
    passed, m = offline_pass_and_measure(model, tw.windows, specs, reference_loops=reference_loops,
                                         max_loops=max_loops, positions=_answer_mask(tw), kl_to_final=True,
                                         dynamics=True, batch_size=batch_size, progress=progress)
    return passed, _with_answers(m, tw)


def _answer_mask(tw: TaskWindows) -> np.ndarray:
    """(N, T) bool: the positions that predict an answer."""
    mask = np.zeros((tw.windows.shape[0], tw.windows.shape[1] - 1), dtype=bool)
    mask[tw.answers["window"].to_numpy(), tw.answers["pos"].to_numpy()] = True
    return mask


def _with_answers(m: Measurement, tw: TaskWindows) -> Measurement:
    """``m`` at the answers with ``k``, ``family``, ``doc`` (and ``chain``, ``turn`` where known) per answer."""
    extra = [c for c in ("chain", "turn") if c in tw.answers]  # generated windows know the chain of each question
    m.meta = m.meta.merge(tw.answers[["window", "pos", "k", "family", "doc", *extra]], on=["window", "pos"],
                          how="left")
    return m


def _correct(traj: Measurement) -> np.ndarray:
    """(answers, loops): the argmax is the answer."""
    return traj.stats["argmax"] == traj.meta["target"].to_numpy()[:, None]


def accuracy_by_k(traj: Measurement, *, by: tuple[str, ...] = ("k",), n_boot: int = 1000,
                  seed: int = 0, loops: Sequence[int] | None = None) -> pd.DataFrame:
    """Answer accuracy and CE per group (``by``, e.g. ``("family", "k")``) and loop (each of ``loops``, default
    every loop measured), with 95% intervals over documents: columns ``*by, loop, n, acc, acc_lo, acc_hi, ce,
    ce_lo, ce_hi``."""
    rows = []
    correct, ce = _correct(traj).astype(float), traj.matrix("ce")
    columns = range(traj.max_loops) if loops is None else sorted(int(lp) - 1 for lp in loops)
    for key, g in traj.meta.groupby(list(by), sort=True):
        docs, idx = g["doc"].to_numpy(), g.index.to_numpy()
        for j in columns:
            vals = np.stack([correct[idx, j], ce[idx, j]], axis=1)
            point, lo, hi = bootstrap_ci(vals, docs, n_boot=n_boot, seed=seed)
            rows.append({**dict(zip([*by, "loop"], (*key, j + 1), strict=True)), "n": len(g), "acc": point[0],
                         "acc_lo": lo[0], "acc_hi": hi[0], "ce": point[1], "ce_lo": lo[1], "ce_hi": hi[1]})
    return pd.DataFrame(rows)


def answer_depths(traj: Measurement, eps: float = DEFAULT_EPS) -> pd.DataFrame:
    """Per answer: ``depth`` and ``converged`` (:func:`drc_core.convergence_depth` at ``eps``), ``commit`` (the loop
    from which the argmax never changes again), ``first_correct`` (0 when never), ``correct_final`` and
    ``overthinks`` (correct at some loop, wrong at a later one)."""
    depth, cor = convergence_depth(traj, eps), _correct(traj)
    keep = ["window", "pos", "k", "family", "doc", *(c for c in ("chain", "turn") if c in traj.meta)]
    return traj.meta[keep].reset_index(drop=True).assign(
        depth=depth["depth"].to_numpy(), converged=depth["converged"].to_numpy(),
        commit=commit_loop(traj.stats["argmax"]), first_correct=np.where(cor.any(1), cor.argmax(1) + 1, 0),
        correct_final=cor[:, -1], overthinks=overthinks(cor))


def spearman_ci(x: np.ndarray, y: np.ndarray, clusters: np.ndarray, *, n_boot: int = 1000, seed: int = 0,
                level: float = 0.95) -> tuple[float, float, float]:
    """Spearman's rank correlation of ``x`` and ``y`` with a percentile interval from resampling ``clusters``
    (documents) with replacement (a resample constant in ``x`` or ``y`` has none and is left out)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    codes = np.unique(np.asarray(clusters), return_inverse=True)[1]
    boot = np.concatenate([_resampled_spearman(x, y, counts[:, codes])
                           for counts in cluster_draws(codes.max() + 1, n_boot, seed, chunk=64)])
    lo, hi = np.nanpercentile(boot, [50 * (1 - level), 50 * (1 + level)])
    return float(sps.spearmanr(x, y).statistic), float(lo), float(hi)


def _resampled_spearman(x: np.ndarray, y: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """(m,) Spearman's correlation of each resample, given as ``draws`` (m, n): how often each of the n pairs is
    in it; the same as ranking each resample's rows (ties at their mean rank), without building them."""
    rx, ry, total = _resampled_ranks(x, draws), _resampled_ranks(y, draws), draws.sum(1, keepdims=True)
    dx = rx - (draws * rx).sum(1, keepdims=True) / total
    dy = ry - (draws * ry).sum(1, keepdims=True) / total
    with np.errstate(invalid="ignore", divide="ignore"):
        return (draws * dx * dy).sum(1) / np.sqrt((draws * dx**2).sum(1) * (draws * dy**2).sum(1))


def _resampled_ranks(v: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """(m, n): the mean rank (from 1) each value of ``v`` takes in each resample of ``draws`` (m, n)."""
    values, inverse = np.unique(v, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(inverse[order]) != 0])
    tied = np.add.reduceat(draws[:, order], starts, axis=1)  # (m, distinct values): copies of each
    return (np.cumsum(tied, axis=1) - tied + (tied + 1) / 2)[:, inverse]


def cell_table(traj: Measurement, depths: pd.DataFrame, reference_loops: int, *, n_boot: int = 1000,
               seed: int = 0) -> pd.DataFrame:
    """Per cell of chain length (``chain``, in links) and question position in its chain (``turn``, 0 = first):
    ``n`` answers, the ``k`` they need, accuracy at ``reference_loops`` loops, and Spearman(k, convergence depth)
    with its interval over documents where the cell has more than one ``k`` (NaN else), so that a reader can
    see whether depth follows ``k`` or the question's order. Answers without a chain (other families) are left
    out."""
    if "chain" not in depths:
        return pd.DataFrame()
    correct = _correct(traj)[:, reference_loops - 1]
    rows = []
    for (chain, turn), g in depths[depths.chain > 0].groupby(["chain", "turn"]):
        idx = g.index.to_numpy()
        rho = ((np.nan,) * 3 if g.k.nunique() < 2 else
               spearman_ci(g.k, g.depth, g.doc, n_boot=n_boot, seed=seed))
        rows.append({"chain": int(chain), "turn": int(turn), "n": len(g), "k_min": int(g.k.min()),
                     "k_max": int(g.k.max()), f"acc_at_{reference_loops}": float(correct[idx].mean()),
                     "mean_depth": float(g.depth.mean()), "spearman": rho[0], "spearman_lo": rho[1],
                     "spearman_hi": rho[2]})
    return pd.DataFrame(rows)


def mean_by_k(depths: pd.DataFrame, columns: list[str], *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Mean of each of ``columns`` of :func:`answer_depths` per ``k`` with a 95% interval over documents, as rows
    ``series, k, value, lo, hi, n`` (``first_correct`` counts only answers that are ever correct)."""
    rows = []
    for col in columns:
        for k, g in depths.groupby("k"):
            g = g[g.first_correct > 0] if col == "first_correct" else g
            if len(g):
                p, lo, hi = _ci(g[col].to_numpy(float), g["doc"].to_numpy(), n_boot, seed)
                rows.append({"series": col, "k": int(k), "value": p, "lo": lo, "hi": hi, "n": len(g)})
    return pd.DataFrame(rows)


def answer_dynamics(traj: Measurement, *, seed: int = 0) -> tuple[pd.DataFrame, pd.Series]:
    """Notebook 2's per-token dynamics of the answers: the class shares per ``k`` with intervals over documents
    (:func:`drc_core.class_shares`) and the median growth of the state norm from loop 1 to the last, per ``k``."""
    dyn, k = Dynamics.of(traj), traj.meta.k.to_numpy()
    shares = class_shares(classify(dyn), k, traj.meta.doc.to_numpy(), seed=seed)
    return shares, pd.Series(dyn.norm[:, -1] / dyn.norm[:, 0]).groupby(k).median()


def _law_fits(k: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, float]]:
    """``(slope, r²)`` of ``y`` fitted by a line in ``k`` (``linear``) and by a line in ``log2 k`` (``log``)."""
    k = np.asarray(k, float)
    fits = {"linear": sps.linregress(k, y), "log": sps.linregress(np.log2(k), y)}
    return {name: (float(fit.slope), float(fit.rvalue**2)) for name, fit in fits.items()}


def depth_growth(acc: pd.DataFrame, level: float = 0.9) -> pd.DataFrame:
    """Per ``k``: ``loops_needed``, the first loop whose accuracy reaches ``level`` (NaN if none); with 3 or more
    such ``k``, the fits of a line in ``k`` and in ``log2 k`` in ``attrs`` (``slope_*``, ``r2_*``)."""
    out = pd.DataFrame([{"k": k, "loops_needed": float(g[g.acc >= level].loop.min())} for k, g in acc.groupby("k")])
    ok = out.dropna()
    if len(ok) >= 3:
        for name, (slope, r2) in _law_fits(ok.k.to_numpy(float), ok.loops_needed.to_numpy(float)).items():
            out.attrs.update({f"r2_{name}": r2, f"slope_{name}": slope})
    return out


def sweep_window_sets(model: RecurrentModel, sets: dict[str, tuple[torch.Tensor, np.ndarray, np.ndarray]],
                      specs: list[RuleSpec], *, reference_loops: int, ce_tolerance: float, seed: int = 0,
                      passed: dict[str, OfflinePass] | None = None
                      ) -> tuple[dict[str, OfflinePass], dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    """Per window set ``name -> (windows, clusters, held-out windows)``: the offline pass of ``specs`` (taken from
    ``passed`` where it has the set, e.g. from :func:`task_passes`), the matching table
    (:func:`drc_core.matching_table`, KL target 0.01) and the loops saved (:func:`drc_core.gap_table`) on the
    held-out windows, as three dicts by name."""
    passes, matches, gaps = {}, {}, {}
    for name, (windows, clusters, held) in sets.items():
        if passed is not None and name in passed:
            given = passed[name]
            if (given.ce.shape[1:] != (windows.shape[0], windows.shape[1] - 1)
                    or [str(s.rule) for s in given.specs] != [str(s.rule) for s in specs]
                    or given.reference_loops != reference_loops):
                raise DrcError(f"the offline pass given for {name!r} is not the pass of these windows, rules and "
                               f"reference depth {reference_loops}: pass offline_pass(model, windows, specs, "
                               "reference_loops=...) of this set")
            passes[name] = given
        else:
            passes[name] = offline_pass(model, windows, specs, reference_loops=reference_loops)
        frame = passes[name].frame()
        summary = summarize(frame, windows=held, clusters=clusters, seed=seed)
        matches[name] = matching_table(summary, reference_loops, ce_tolerance, kl_target=0.01)
        gaps[name] = gap_table(frame, reference_loops, ce_tolerance, windows=held, clusters=clusters, seed=seed)
    return passes, matches, gaps


def exits_by_k(passed: OfflinePass, tw: TaskWindows, specs: list[RuleSpec], *, oracle_eps: tuple[float, ...] = (),
               n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Mean exit loop of the answers of each ``k`` under each rule of ``specs`` (replayed in ``passed``, the
    :func:`drc_core.offline_pass` of ``tw.windows``) and the oracle at each ``oracle_eps``, beside the rule's mean exit
    over every token (``k`` = ``all tokens``); 95% intervals over documents."""
    if passed.ce.shape[1:] != (tw.windows.shape[0], tw.windows.shape[1] - 1):
        raise DrcError(f"the offline pass covers {tuple(passed.ce.shape[1:])} tokens, the task windows "
                       f"{(tw.windows.shape[0], tw.windows.shape[1] - 1)}: pass the offline pass of these windows")
    missing = [str(s.rule) for s in specs if str(s.rule) not in passed.exits]
    if missing:
        raise DrcError(f"the offline pass did not replay {', '.join(missing)}: include these rules in offline_pass")
    every = passed.token_exits(oracle_eps)
    a = tw.answers
    win, pos, ks, docs = a["window"].to_numpy(), a["pos"].to_numpy(), a["k"].to_numpy(), a["doc"].to_numpy()
    rows = []
    for name in [*(str(s.rule) for s in specs), *(f"oracle(kl<={e:g})" for e in oracle_eps)]:
        at = every[name][win, pos].astype(float)
        for k in sorted(a["k"].unique()):
            p, lo, hi = _ci(at[ks == k], docs[ks == k], n_boot, seed)
            rows.append({"rule": name, "k": int(k), "exit": p, "lo": lo, "hi": hi})
        rows.append({"rule": name, "k": "all tokens", "exit": float(every[name].mean()), "lo": np.nan, "hi": np.nan})
    return pd.DataFrame(rows)


def risk_units(passes: dict[str, OfflinePass], tw: TaskWindows, mixed_docs: torch.Tensor,
               corpus: Corpus) -> tuple[Any, np.ndarray, np.ndarray]:
    """The guarantee's units on notebook 06's two offline passes: each task window one document, then the natural-text
    documents of the mixed windows (their task tokens not counted). Returns the top-1 loss table
    (:func:`drc_core.pass_loss_tables`) and the indices of its task and of its natural-text units."""
    docs = mixed_docs.numpy()
    natural = (docs >= 0) & (corpus.docs.source.to_numpy()[docs.clip(0)] != DEPTH_TASK_SOURCE)
    n, t = tw.windows.shape[0], tw.windows.shape[1] - 1
    units = np.concatenate([np.repeat(np.arange(n)[:, None], t, axis=1), np.where(natural, docs + n, -1)])
    top1 = pass_loss_tables(OfflinePass.cat([passes["task documents"], passes["mixed validation"]]), units,
                            default_families())["top1"]
    return top1, np.flatnonzero(top1.units < n), np.flatnonzero(top1.units >= n)


def depth_law(depths: pd.DataFrame, column: str = "depth", *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Which law the per-``k`` mean of ``column`` (of :func:`answer_depths`) follows: a line in ``k`` and a line in
    ``log2 k``, each with its slope and r² and 95% intervals from resampling documents (a draw that loses a ``k`` is
    dropped). Rows ``law, slope, slope_lo, slope_hi, r2, r2_lo, r2_hi, n_k``."""
    k, y, doc = depths["k"].to_numpy(float), depths[column].to_numpy(float), depths["doc"].to_numpy()
    ks = np.unique(k)
    if len(ks) < 3:
        raise DrcError(f"a depth law needs answers of at least 3 values of k; these have {len(ks)}")

    def fits(weights: np.ndarray) -> dict[str, tuple[float, float]] | None:
        means = [np.average(y[k == v], weights=weights[k == v]) if weights[k == v].sum() else np.nan for v in ks]
        return None if np.isnan(means).any() else _law_fits(ks, means)

    point = fits(np.ones_like(y))
    codes = np.unique(doc, return_inverse=True)[1]
    boot = [b for block in cluster_draws(codes.max() + 1, n_boot, seed, chunk=64) for w in block
            if (b := fits(w[codes].astype(float))) is not None]
    rows = []
    for name in point:
        slopes, r2s = np.array([b[name][0] for b in boot]), np.array([b[name][1] for b in boot])
        rows.append({"law": name, "slope": point[name][0], "slope_lo": np.percentile(slopes, 2.5),
                     "slope_hi": np.percentile(slopes, 97.5), "r2": point[name][1], "r2_lo": np.percentile(r2s, 2.5),
                     "r2_hi": np.percentile(r2s, 97.5), "n_k": len(ks)})
    return pd.DataFrame(rows)


def law_table(studies: dict[str, dict[str, Any] | None]) -> pd.DataFrame:
    """Per family (the key) and law (``linear``, ``log``): slope and r² of the mean convergence depth against ``k``
    (with intervals over documents, :func:`depth_law`) and of the loops needed for 90% accuracy (point fits over
    the ``k`` that reach it, :func:`depth_growth`) of each :func:`lever_study` result; skipped studies (None) have
    no rows."""
    rows = []
    for family, study in studies.items():
        if study is None:
            continue
        fits = study["loops_needed_law"]
        for r in study["depth_law"].to_dict("records"):
            rows.append({"family": family, "trained_k": study["trained_k"], **r,
                         "loops_needed_slope": fits.get(f"slope_{r['law']}", np.nan),
                         "loops_needed_r2": fits.get(f"r2_{r['law']}", np.nan)})
    return pd.DataFrame(rows)


def halting_against_overthinking(traj: Measurement, *, reference_loops: int, eps: float, alpha: float,
                                 delta: float, trained_k: int, family: str = "kl", seed: int = 0,
                                 n_boot: int = 1000) -> pd.DataFrame:
    """What stopping each answer early recovers of what more loops destroy. On a random half of the documents Learn
    then Test certifies a threshold of ``family`` (a document's share of answers whose prediction at the exit
    differs from depth ``reference_loops``'s is at most ``alpha``, with probability >= 1 - ``delta``); on the other
    each answer is read at the exit of ``fixed L``, ``fixed reference_loops``, the rule at ``eps``, the certified
    threshold (when one is) and the oracle (the first loop whose prediction is the answer). Rows per way and group
    (``k <= trained_k``, ``k > trained_k``, ``all``): ``mean_exit``, ``acc`` with a 95% interval over documents,
    ``overthought`` (right at some loop, wrong at L), ``recovered`` (the share of those right at the exit),
    ``threshold``, ``n``; the certificate in ``attrs``."""
    loops = traj.max_loops
    specs = [s for s in default_rules(loops) if s.family == family]
    by_param = {float(s.param): i for i, s in enumerate(specs)}
    if eps not in by_param:
        raise DrcError(f"eps={eps:g} is not a threshold of {family!r}'s grid "
                       f"({', '.join(f'{p:g}' for p in by_param) or 'none'})")
    exits = np.stack(measured_exits(traj, [s.rule for s in specs]))  # (thresholds, answers)
    argmax, right = traj.stats["argmax"], _correct(traj)
    rows_ = np.arange(len(traj))
    docs = np.unique(traj.meta["doc"].to_numpy(), return_inverse=True)[1]
    ks = traj.meta["k"].to_numpy()
    calib, test = (np.isin(docs, half) for half in split_windows(docs.max() + 1, 0.5, seed))
    order = sorted(by_param)  # conservative (the smallest threshold: the latest exits) first
    off = np.stack([argmax[rows_, exits[by_param[t]] - 1] != argmax[:, reference_loops - 1] for t in order])
    share, _ = unit_risks(off[:, None, :], np.where(calib, docs, -1)[None, :])  # per calibration document
    certified, _ = learn_then_test(share, alpha, delta)
    ways = {f"fixed {loops}": (np.full(len(traj), loops), np.nan),
            f"fixed {reference_loops}": (np.full(len(traj), reference_loops), np.nan),
            f"{family}({eps:g})": (exits[by_param[eps]], eps)}
    if certified:
        t = order[certified - 1]
        ways[f"calibrated {family} (alpha {alpha:g}, delta {delta:g})"] = (exits[by_param[t]], t)
    ways["oracle (first right loop)"] = (np.where(right.any(1), right.argmax(1) + 1, loops), np.nan)
    over = right.any(1) & ~right[:, -1]
    groups = {f"k <= {trained_k}": ks <= trained_k, f"k > {trained_k}": ks > trained_k, "all": np.ones(len(ks), bool)}
    rows = []
    for way, (exit_loop, threshold) in ways.items():
        ok = right[rows_, np.asarray(exit_loop, int) - 1]
        for group, member in groups.items():
            m = test & member
            if not m.any():
                continue
            p, lo, hi = _ci(ok[m].astype(float), docs[m], n_boot, seed)
            rows.append({"way": way, "group": group, "mean_exit": float(np.mean(exit_loop[m])), "acc": p,
                         "acc_lo": lo, "acc_hi": hi, "overthought": float(over[m].mean()),
                         "recovered": float(ok[m & over].mean()) if (m & over).any() else np.nan,
                         "threshold": threshold, "n": int(m.sum())})
    out = pd.DataFrame(rows)
    out.attrs.update({"certified": bool(certified), "calibration_documents": int(len(np.unique(docs[calib]))),
                      "test_documents": int(len(np.unique(docs[test]))), "alpha": alpha, "delta": delta})
    return out


def savings(passed: OfflinePass, tw: TaskWindows, *, reference_loops: int, ce_tolerance: float,
            seed: int = 0) -> pd.DataFrame:
    """On the task documents of ``passed`` (each window one document), per family replayed there and the oracle:
    the loops saved against the uniform depth of equal CE (:func:`drc_core.gap_table`, intervals over documents),
    the family's CE-matched ``param``, and the answers' accuracy at that point (``answer_acc``) against uniform depth
    ``reference_loops`` (``answer_acc_uniform``; ``acc_lost`` in points, positive when halting loses answers)."""
    frame = passed.frame()
    docs = np.arange(len(tw.windows))
    gaps = gap_table(frame, reference_loops, ce_tolerance, clusters=docs, seed=seed)
    match = matching_table(summarize(frame, clusters=docs, n_boot=200, seed=seed), reference_loops, ce_tolerance,
                           kl_target=0.01)
    win, pos = tw.answers["window"].to_numpy(), tw.answers["pos"].to_numpy()
    target = np.asarray(tw.windows)[win, pos + 1]
    argmax = passed.argmax.cpu().numpy()

    def accuracy(exits: np.ndarray) -> float:  # exits: (answers,) loops
        return float((argmax[exits - 1, win, pos] == target).mean())

    uniform = accuracy(np.full(len(win), reference_loops))
    names = {(sp.family, float(sp.param)): str(sp.rule) for sp in passed.specs}
    rows = []
    for fam in gaps.index:
        param = float(match.loc[fam, "ce_param"])
        acc = np.nan
        if not np.isnan(param):
            name = f"oracle(kl<={param:g})" if fam == "oracle" else names[(fam, param)]
            exits = passed.token_exits(oracle_eps=(param,) if fam == "oracle" else ())[name]
            acc = accuracy(exits[win, pos])
        rows.append({"family": fam, "param": param, **gaps.loc[fam].to_dict(), "answer_acc": acc,
                     "answer_acc_uniform": uniform, "acc_lost": 100 * (uniform - acc)})
    return pd.DataFrame(rows)


def lever_study(checkpoint: str, *, trained_k: int, docs: int, max_loops: int, eps: float, alpha: float,
                delta: float, seed: int = 0, family: str = "links", corpus: str | None = None,
                ce_tolerance: float = 0.005) -> dict[str, Any]:
    """The model at ``checkpoint`` (trained on ``family`` problems of k = 1..``trained_k``) on ``docs`` fresh
    documents of k = 1..2 ``trained_k`` (chains: every object asked, shuffled), at up to ``max_loops`` loops, keyed
    as notebook 06's ``lever`` record (tables as frames): accuracy by ``k``, per ``k`` its ``best`` loop beside the
    training-mean depth and the last loop, :func:`depth_growth` (``loops_needed``, fits in ``loops_needed_law``),
    Spearman(k, convergence depth), :func:`depth_law`, :func:`halting_against_overthinking`, ``trained_range``
    (accuracy and Spearman on chains of at most ``trained_k`` links), :func:`cell_table` and the KL rule's and the
    oracle's :func:`savings` (the offline pass shares the trajectories' core loops)."""
    lm = load(checkpoint, corpus=corpus)  # corpus: where a run's checkpoint finds its tokenizer
    depth = int(round(lm.config.recurrence.mean))  # its training-mean depth
    if max_loops < depth:
        raise DrcError(f"max_loops={max_loops} is below the model's training-mean depth {depth}: raise max_loops")
    tasks = DepthTaskConfig(docs=docs, min_k=1, max_k=2 * trained_k, families=(family,), ask_every=True,
                            ask_order="shuffled", seed=seed + 2000, repeat_share=0.0)
    tw = generated_task_windows(lm.tokenizer, tasks, lm.model.max_seq_len, pad_id=eot_id(lm.tokenizer))
    kl_rules = [sp for sp in default_rules(2 * depth) if sp.family == KLThreshold.family]
    passed, traj = task_passes(lm.model, tw, kl_rules, max_loops, depth)
    acc = accuracy_by_k(traj, seed=seed)
    best = []
    for k, g in acc.groupby("k"):
        top, at = g.loc[g.acc.idxmax()], g.set_index("loop").acc
        best.append({"k": int(k), "beyond": bool(k > trained_k), "best_loop": int(top.loop), "best_acc": top.acc,
                     f"acc_at_{depth}": at.get(depth, np.nan), "acc_at_last": at.iloc[-1]})
    growth = depth_growth(acc)
    depths = answer_depths(traj, eps)
    rho = spearman_ci(depths.k, depths.depth, depths.doc, seed=seed)
    law = depth_law(depths, seed=seed)
    # the training distribution: chains of at most trained_k links (k <= trained_k where there are no chains)
    within = (depths.chain if "chain" in depths and (depths.chain > 0).all() else depths.k) <= trained_k
    right = _correct(traj)[within.to_numpy(), depth - 1]
    trained = {"accuracy_at_depth": pd.Series(right).groupby(depths.k[within].to_numpy()).mean().to_dict(),
               "spearman_depth": list(spearman_ci(depths.k[within], depths.depth[within], depths.doc[within],
                                                  seed=seed))}
    halting = halting_against_overthinking(traj, reference_loops=depth, eps=eps, alpha=alpha, delta=delta,
                                           trained_k=trained_k, seed=seed)
    return {"checkpoint": checkpoint, "family": family, "trained_k": trained_k, "n_answers": len(tw.answers),
            "n_documents": len(tw.windows), "accuracy": acc, "best": pd.DataFrame(best), "loops_needed": growth,
            "loops_needed_law": dict(growth.attrs), "spearman_depth": list(rho),
            "trained_range": trained, "cells": cell_table(traj, depths, depth, seed=seed),
            "depth_law": law, "halting_against_overthinking": halting,
            "overthinking_certificate": dict(halting.attrs),
            "savings": savings(passed, tw, reference_loops=depth, ce_tolerance=ce_tolerance, seed=seed)}


def extrapolation_probe(traj: Measurement, loops: Sequence[int], eps: float = DEFAULT_EPS, *, n_boot: int = 200,
                        seed: int = 0) -> dict[str, Any]:
    """The probe record :func:`lever_records` reads (``scripts/extrapolation_probe.py`` writes it, with where it ran,
    as ``source.json``'s ``extrapolation_probe``): Spearman(k, convergence depth) with its interval over documents,
    and per ``k`` the answers, accuracy at each of ``loops``, the best of them with its interval, the mean
    convergence depth, the share overthought, accuracy at the last loop, and the KL rule at ``eps`` replayed on the
    trajectories (each answer stops at the first loop >= 2 whose successive KL is below ``eps``, else the last)."""
    acc = accuracy_by_k(traj, n_boot=n_boot, seed=seed, loops=loops)
    depths = answer_depths(traj, eps)
    rho = spearman_ci(depths.k.to_numpy(), depths.depth.to_numpy(), depths.doc.to_numpy(), n_boot=n_boot, seed=seed)
    stop = measured_exits(traj, [KLThreshold(eps, max_loops=traj.max_loops)])[0] - 1  # 0-based
    right_at_stop = _correct(traj)[np.arange(len(traj)), stop]
    ks = traj.meta["k"].to_numpy()
    per_k = {}
    for k, g in acc.groupby("k"):
        best, d, mine = g.loc[g.acc.idxmax()], depths[depths.k == k], ks == k
        per_k[int(k)] = {"answers": int(g.n.iloc[0]),
                         "acc_by_loop": dict(zip(g.loop.astype(int).tolist(), g.acc.tolist(), strict=True)),
                         "best_loop": int(best.loop), "best_acc": float(best.acc),
                         "best_ci": [float(best.acc_lo), float(best.acc_hi)], "mean_depth": float(d.depth.mean()),
                         "overthought": float(d.overthinks.mean()), "acc_last": float(d.correct_final.mean()),
                         "kl_rule": {"acc": float(right_at_stop[mine].mean()),
                                     "mean_exit": float(stop[mine].mean() + 1)}}
    return {"loops": sorted(int(lp) for lp in loops), "eps": eps, "spearman_depth": list(rho), "per_k": per_k,
            "table": acc.pivot(index="k", columns="loop", values="acc")}


EXTRAPOLATION_TARGETS = {1: 0.8, 2: 0.5}  # k = K + 1 and K + 2: accuracy at some loop above the training mean
EXTRAPOLATION_SPEARMAN = 0.7  # Spearman(k, convergence depth) over k = 1..2K


def lever_records(models: Mapping[str, str | Path], reference_loops: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each lever's shipped model (label -> its directory) as its ``source.json`` records it (the
    ``extrapolation_probe`` of ``scripts/extrapolation_probe.py``: chains of 1..2K links): per ``k`` the best
    accuracy over loops with its interval, the best above ``reference_loops`` (the training mean) and accuracy there;
    then per lever the depth-extrapolation targets, accuracy >= 80% at k = K + 1 and >= 50% at K + 2 at a loop above
    the training mean (``gain`` over accuracy at the training mean, ``rises`` when positive) and Spearman(k,
    convergence depth) >= 0.7, each with ``met``."""
    rows, targets = [], []
    for label, path in models.items():
        source = read_json(Path(path) / "source.json", "shipped model record",
                           "restore the model directory from the repository")
        probe = source.get("extrapolation_probe", {}).get("this model") if isinstance(source, dict) else None
        if not isinstance(probe, dict):
            raise DrcError(f"'{path}/source.json' has no extrapolation probe of the model: run "
                           "scripts/extrapolation_probe.py on it and record its output there")
        trained_k, mine = int(probe["trained_k"]), []
        for k, r in sorted(probe["per_k"].items(), key=lambda kv: int(kv[0])):
            by_loop = {int(lp): a for lp, a in r["acc_by_loop"].items()}
            above = {lp: a for lp, a in by_loop.items() if lp > reference_loops}
            top = max(above, key=above.get) if above else None
            mine.append({"lever": label, "k": int(k), "beyond": int(k) > trained_k, "best_acc": r["best_acc"],
                         "best_lo": r["best_ci"][0], "best_hi": r["best_ci"][1], "best_loop": r["best_loop"],
                         f"acc_at_{reference_loops}": by_loop.get(reference_loops, np.nan),
                         "best_above": np.nan if top is None else above[top], "loop_above": top,
                         "mean_depth": r["mean_depth"], "overthought": r["overthought"], "answers": r["answers"]})
        rows += mine
        per_k = pd.DataFrame(mine).set_index("k")
        for extra, goal in EXTRAPOLATION_TARGETS.items():
            k = trained_k + extra
            value = per_k.best_above.get(k, np.nan)
            gain = value - per_k[f"acc_at_{reference_loops}"].get(k, np.nan)
            targets.append({"lever": label, "target": f"k = {k}: accuracy >= {goal:g} above loop {reference_loops}",
                            "value": value, "met": bool(value >= goal and gain > 0), "rises": bool(gain > 0),
                            "gain": gain})
        rho, name = probe["spearman_depth"], f"Spearman(k, depth) >= {EXTRAPOLATION_SPEARMAN:g}, k = 1..{2 * trained_k}"
        targets.append({"lever": label, "target": name, "value": rho[0], "lo": rho[1], "hi": rho[2],
                        "met": bool(rho[0] >= EXTRAPOLATION_SPEARMAN)})
    return pd.DataFrame(rows), pd.DataFrame(targets)


def lever_sentence(targets: pd.DataFrame) -> str:
    """Per lever of :func:`lever_records`: how many targets it meets and, for each it misses, the value reached and
    what looping beyond the training mean added to it (near zero: looping more stopped helping, the limit the lever
    hit)."""
    parts = []
    for lever, g in targets.groupby("lever", sort=False):
        gains = g.gain if "gain" in g else pd.Series(np.nan, index=g.index)
        missed = [f"{r.target} reached {r.value:.3f}" + ("" if pd.isna(up) else
                                                         f" ({up:+.3f} over the training mean's loop)")
                  for r, up in zip(g.itertuples(), gains, strict=True) if not r.met]
        parts.append(f"**{lever}** meets {int(g.met.sum())} of {len(g)}" + (f"; {'; '.join(missed)}" if missed else ""))
    return ". ".join(parts) + "." if parts else ""

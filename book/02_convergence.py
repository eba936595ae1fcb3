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
# One pass of `max_loops` loops over validation windows records, for every token and loop, the
# successive-output KL `KL(p_l ‖ p_{l−1})` (the new output measured against the previous one), the KL to
# the deepest output `KL(p_L ‖ p_l)`, the relative state change `‖s_l − s_{l−1}‖ / ‖s_l‖`, the entropy and
# the cross-entropy of the next token (`drc_core.analysis.measure.measure_windows`). Intervals are 95% percentile
# bootstrap intervals over documents.

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

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time
from pathlib import Path

import numpy as np
import pandas as pd

from drc_book import viz
from drc_book.cost import keep_freed_memory
from drc_book.paths import at_root, results_for
from drc_book.workspace import open_study, save_results
from drc_core import (
    Dynamics,
    class_shares,
    classify,
    classify_sequence,
    commit_loop,
    convergence_depth,
    default_rules,
    depth_summary,
    eps_sensitivity,
    group_shares,
    kl_concentration,
    measure_windows,
    norm_percentiles,
    oscillating_tokens,
    overthinks,
    per_loop_summary,
    save_frame,
    token_exits,
)

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/
keep_freed_memory()  # glibc reuses freed buffers: no page faults on fresh vocabulary-sized arrays

# %%
t0 = time.time()
model, cfg, corpus, windows, docs, _ = open_study(work_dir, corpus_dir, n_windows)
# dynamics=True: also the state norms and steps of each loop (the per-token dynamics below)
frame = measure_windows(model, windows, max_loops, doc_ids=docs, dynamics=True)
save_frame(frame, Path(work_dir) / "frame.parquet",
           made_with={"corpus": corpus.fingerprint, "tokenizer": corpus.tokenizer_hash})
train_mean = cfg.recurrence.mean
print(
    f"{len(windows)} windows x {cfg.seq_len} tokens x {max_loops} loops = {len(frame):,} rows "
    f"in {time.time() - t0:.0f} s; {frame['doc'].nunique()} documents"
)

# %% [markdown]
# ## Successive-output KL and state change per loop
# Mean over tokens, log scale. A fixed point shows as a steady fall; a floor shows where float32 noise or
# a residual cycle sets in.

# %%
summary = per_loop_summary(frame, seed=seed)
fig = viz.per_loop_figure(summary)
Path(results_dir).mkdir(parents=True, exist_ok=True)
fig.write_json(
    Path(results_dir) / "02_convergence_per_loop.figure.json"
)  # the README's figure (drc_book figure)
fig

# %%
summary.set_index("loop")[
    ["kl", "kl_ci_low", "kl_ci_high", "state_delta", "ce"]
].map(lambda v: f"{v:.3g}")

# %% [markdown]
# ## What the mean KL is made of
# A mean over tokens can sit far above the typical token. Per loop: the mean and median successive KL, the
# 99th percentile, the share of the mean carried by the top 1% and 0.1% of tokens, and the mean without the
# top 1%. When a few tokens carry nearly all of it, the floor of the mean curve is those tokens (the KL to
# the deepest output alternating between loops is a 2-cycle), not a slow decay of every token.

# %%
concentration = kl_concentration(
    frame, sorted({lp for lp in (2, 4, 8, 12, 16, 24, max_loops) if 2 <= lp <= max_loops})
)
concentration.set_index("loop").map(lambda v: f"{v:.3g}")

# %% [markdown]
# ## The tokens that never settle
# A token in a 2-cycle has its deepest output far from the one a loop earlier but close to the one two loops
# earlier (`oscillating_tokens`: KL(p_L ‖ p_L−1) ≥ 1e-6 and ≥ 10 × KL(p_L ‖ p_L−2)). Their count, the share of
# the mean successive KL at loops 2R and L they carry, and the largest of them with their text.

# %%
R = round(train_mean)
cycling, cycle_share = oscillating_tokens(
    frame, share_at=sorted({lp for lp in (2 * R, max_loops) if 2 <= lp <= max_loops})
)
n_tokens = int((frame.loop == 1).sum())
shares = ", ".join(f"{sh:.0%} of the mean KL at loop {lp}" for lp, sh in cycle_share.items())
print(f"{len(cycling)} of {n_tokens:,} tokens in a 2-cycle at loop {max_loops}; {shares}")
tokenizer = corpus.tokenizer()
cycling.head(12).assign(text=lambda d: [repr(tokenizer.decode([int(t)])) for t in d.token]).drop(
    columns="token"
)

# %% [markdown]
# ## Validation loss versus loops, with intervals
# The mean next-token cross-entropy at uniform depth l is the mean `ce` of loop l.

# %%
ce_table = summary.rename(
    columns={"loop": "loops", "ce": "loss", "ce_ci_low": "lo", "ce_ci_high": "hi"}
)
viz.loss_vs_depth(ce_table[["loops", "loss", "lo", "hi"]])

# %% [markdown]
# ## Per-token convergence depth
# A token's convergence depth is the first loop after which its successive KL stays below ε (it may dip
# below earlier and rise again; only the last rise counts). Tokens that never settle within `max_loops`
# get depth `max_loops`.

# %%
depths = convergence_depth(frame, eps)
viz.depth_histogram(depths)

# %%
headline = depth_summary(depths, train_mean, seed=seed)
headline

# %% [markdown]
# ## Sensitivity to ε
# The depth statistics for ε from 1e-2 to 1e-5: how much of "converged by loop k" is the choice of ε.

# %%
sens = eps_sensitivity(frame, (1e-2, 1e-3, 1e-4, 1e-5), train_mean, seed=seed)
sens.pivot(index="stat", columns="eps", values="value").round(3)


# %% [markdown]
# ## What each token does on its way to the fixed point
# The measurement pass above also kept, per token and loop, the state norm `‖s_l‖`, the step
# `‖s_l − s_{l−1}‖` and the two-loop step `‖s_l − s_{l−2}‖` (`drc_core.analysis.dynamics`). From them: the
# empirical contraction factor `ρ_l = ‖s_{l+1} − s_l‖ / ‖s_l − s_{l−1}‖` and a class per token, read over the
# last 8 loops (`classify`): **settled** (relative step below 1e-3 at loop L), **oscillating** (a 2-cycle: the
# two-loop step below a tenth of the one-loop step), **contracting** (still moving, geometric-mean ρ below 0.95),
# **drifting** (none of these). Shares with 95% intervals over documents, overall and by token type (notebook 3's
# types).

# %%
dyn = Dynamics.from_frame(frame)  # the measurement pass's states
dyn_class = classify(dyn).reshape(-1)
doc_of = docs.numpy().reshape(-1)
token_type = np.asarray(classify_sequence(tokenizer, windows[:, :-1].numpy())).reshape(-1)
shares = class_shares(dyn_class, token_type, doc_of, seed=seed)
overall = shares[shares.group == "all"].set_index("class")
print(
    "overall: "
    + ", ".join(
        f"{c} {r.share:.1%} [{r.ci_low:.1%}, {r.ci_high:.1%}]" for c, r in overall.iterrows()
    )
)
shares.pivot(index="group", columns="class", values="share").round(3)

# %%
shares.assign(
    interval=[f"[{lo:.3f}, {hi:.3f}]" for lo, hi in zip(shares.ci_low, shares.ci_high, strict=True)]
)[["group", "class", "n_tokens", "share", "interval"]].round(3)

# %% [markdown]
# ### Does the state grow?
# Percentiles over tokens of the state norm at each loop, and the median token's norm relative to its loop-1
# norm. An RMSNorm readout hides the norm from the output, so a norm that keeps growing need not show in the KL.

# %%
norms = norm_percentiles(dyn)
growth_last = float(norms.median_growth.iloc[-1])
print(
    f"median norm {norms.p50.iloc[0]:.3g} at loop 1, {norms.p50.iloc[-1]:.3g} at loop {max_loops}; "
    f"the median token's norm is {growth_last:.2f}x its loop-1 norm at loop {max_loops} "
    f"(p99 {norms.p99.iloc[-1]:.3g})"
)
viz.norm_by_loop(norms)

# %% [markdown]
# ### When the prediction commits, against when the output converges
# A token's commit loop is the first loop from which its argmax no longer changes up to `max_loops`; its
# convergence depth (above) is where its successive KL stays below ε. The top prediction can commit long before
# the distribution settles, or (rarely) after.

# %%
commit = commit_loop(dyn.argmax.reshape(-1, max_loops))
conv = depths["depth"].to_numpy()  # ordered by window, pos like the dynamics' tokens
before = float(np.mean(commit < conv))
same = float(np.mean(commit == conv))
print(
    f"commit loop before the convergence depth for {before:.1%} of tokens, at it for {same:.1%}, "
    f"after it for {1 - before - same:.1%}; median commit loop {np.median(commit):.0f}, "
    f"median convergence depth "
    f"{np.median(conv):.0f}"
)
viz.commit_vs_convergence(commit, conv, max_loops)

# %% [markdown]
# ### Overthinking
# A token is *overthought* when its prediction is right (argmax = the next token) at some loop and wrong at a
# later loop ≤ 4R (`overthinks`; R the training mean depth), by token type with 95% intervals over documents.

# %%
horizon = min(4 * R, max_loops)
targets = windows[:, 1:].numpy().reshape(-1, 1)
correct = dyn.argmax.reshape(-1, max_loops)[:, :horizon] == targets
over = overthinks(correct)
ever_right = correct.any(axis=1)
over_shares = group_shares(
    {"overthought": over, "right at some loop": ever_right}, token_type, doc_of, seed=seed
)
o = over_shares[(over_shares.group == "all") & (over_shares.flag == "overthought")].iloc[0]
print(
    f"{o.share:.2%} [{o.ci_low:.2%}, {o.ci_high:.2%}] of tokens are overthought within "
    f"{horizon} loops "
    f"({over.sum() / max(ever_right.sum(), 1):.1%} of the tokens right at some loop)"
)
over_shares.pivot(index="group", columns="flag", values="share").round(4)

# %% [markdown]
# ### Do halting rules stop oscillating or drifting tokens early or late?
# Each training-free rule at the threshold whose mean exit loop on these windows is closest to R, replayed
# offline on the same trajectories (`token_exits`): its mean exit loop per dynamics class, and that of the
# oscillating, contracting and drifting tokens relative to the settled ones (> 1: stopped later).

# %%
specs = default_rules(rule_max_loops)
exits = token_exits(model, windows, specs, reference_loops=R)
rows = []
for spec in specs:
    e = exits[str(spec.rule)].reshape(-1)
    rows.append(
        {
            "family": spec.family,
            "param": spec.param,
            "avg": e.mean(),
            **{
                c: e[dyn_class == c].mean() if (dyn_class == c).any() else np.nan
                for c in overall.index
            },
        }
    )
by_rule = pd.DataFrame(rows)
near_r = by_rule.loc[(by_rule.avg - R).abs().groupby(by_rule.family).idxmin()].set_index("family")
for c in ("oscillating", "contracting", "drifting"):
    near_r[f"{c}/settled"] = near_r[c] / near_r["settled"]
for c in ("oscillating", "contracting", "drifting"):
    ratio = near_r[f"{c}/settled"].dropna()
    if ratio.empty:
        print(f"{c}: no such tokens (or no settled ones) in these windows")
        continue
    later, earlier = ratio[ratio > 1].index.tolist(), ratio[ratio < 1].index.tolist()
    print(
        f"{c} tokens ({(dyn_class == c).mean():.1%}): stopped later than settled ones by "
        f"{len(later)} of {len(ratio)} rules ({', '.join(later) or 'none'}), "
        f"earlier by {len(earlier)}; "
        f"ratio {ratio.min():.2f}-{ratio.max():.2f}"
    )
near_r.round(2).assign(param=near_r.param.map("{:g}".format))


# %%
def at(loop: int) -> dict:
    row = summary.set_index("loop").loc[loop]
    return {"value": row.kl, "lo": row.kl_ci_low, "hi": row.kl_ci_high}


def stat(name: str) -> dict:
    row = headline.set_index("stat").loc[name]
    return {"value": row.value, "lo": row.ci_low, "hi": row.ci_high}


s = summary.set_index("loop")
results = {
    "profile": profile,
    "eps": eps,
    "train_mean_depth": train_mean,
    "n_tokens": int(headline.n_tokens.iloc[0]),
    "n_docs": int(headline.n_clusters.iloc[0]),
    "kl_by_loop": {int(lp): at(lp) for lp in s.index if lp >= 2},
    "state_delta_by_loop": {int(lp): float(s.loc[lp, "state_delta"]) for lp in s.index if lp >= 2},
    "kl_final_by_loop": {int(lp): float(s.loc[lp, "kl_final"]) for lp in s.index if lp < max_loops},
    "ce_by_loop": {
        int(lp): {
            "value": s.loc[lp, "ce"],
            "lo": s.loc[lp, "ce_ci_low"],
            "hi": s.loc[lp, "ce_ci_high"],
        }
        for lp in s.index
    },
    "median_depth": stat("median_depth"),
    "mean_depth": stat("mean_depth"),
    "frac_updating": stat("frac_updating"),
    "frac_unconverged": stat("frac_unconverged"),
    "kl_concentration": concentration.set_index("loop").to_dict("index"),
    "oscillating": {
        "count": len(cycling),
        "share_of_mean_kl": cycle_share,
        "tokens": cycling.head(20).to_dict("records"),
    },
    "eps_sensitivity": {
        f"{e:g}": dict(zip(g.stat, g.value, strict=True)) for e, g in sens.groupby("eps")
    },
    "dynamics": {
        "class_shares": shares.to_dict("records"),
        "norm_percentiles": norms.to_dict("records"),
        "commit_before_convergence": before,
        "commit_at_convergence": same,
        "commit_loop_median": float(np.median(commit)),
        "overthinking_horizon": horizon,
        "overthinking": over_shares.to_dict("records"),
        "exit_by_class": near_r.reset_index().to_dict("records"),
    },
    "notebook_seconds": time.time() - t0,
}
save_results(results_dir, "02_convergence", results)
print(
    f"KL loop 2 {at(2)['value']:.3g}, loop 16 {at(min(16, max_loops))['value']:.3g}; "
    f"median depth {stat('median_depth')['value']:.0f}; "
    f"{stat('frac_updating')['value']:.1%} still updating at loop {train_mean:g}"
)

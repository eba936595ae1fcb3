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

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time
from pathlib import Path

from drc_core.analysis.measure import (
    convergence_depth,
    depth_summary,
    eps_sensitivity,
    kl_concentration,
    measure_windows,
    oscillating_tokens,
    per_loop_summary,
    save_frame,
    val_windows_with_docs,
)
from drc_core.book import viz
from drc_core.book.paths import at_root, results_for
from drc_core.book.workspace import open_model, save_results
from drc_core.data.sampler import Corpus

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/

# %%
t0 = time.time()
model, cfg, _ = open_model(work_dir)
corpus = Corpus.open(corpus_dir)
windows, docs = val_windows_with_docs(corpus, cfg.seq_len, n_windows)
frame = measure_windows(model, windows, max_loops, doc_ids=docs)
save_frame(frame, Path(work_dir) / "frame.parquet")
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
)  # the README's figure (drc_core.book figure)
fig

# %%
summary.set_index("loop")[
    ["kl_prev", "kl_prev_ci_low", "kl_prev_ci_high", "state_delta", "ce"]
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


# %%
def at(loop: int) -> dict:
    row = summary.set_index("loop").loc[loop]
    return {"value": row.kl_prev, "lo": row.kl_prev_ci_low, "hi": row.kl_prev_ci_high}


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
    "notebook_seconds": time.time() - t0,
}
save_results(results_dir, "02_convergence", results)
print(
    f"KL loop 2 {at(2)['value']:.3g}, loop 16 {at(min(16, max_loops))['value']:.3g}; "
    f"median depth {stat('median_depth')['value']:.0f}; "
    f"{stat('frac_updating')['value']:.1%} still updating at loop {train_mean:g}"
)

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
# # 4. Halting each token early: training-free rules vs learned routers
#
# A halting rule looks at a token's statistics after each loop and decides whether it stops there; a
# halted token's state is frozen and later tokens keep attending to it (`drc_core.halting.rules`). For every
# rule over a grid of thresholds, for uniform depths and for the offline oracle, we measure the average
# exit loop (the FLOP proxy: prelude and coda run once) against two qualities: the validation
# cross-entropy at each token's exit, and the mean `KL(p_8 ‖ p_exit)` to the uniform training-mean-depth
# output (`drc_core.halting.sweep`). The validation windows are split in two: routers are trained and thresholds
# calibrated on the first half; every number below is measured on the held-out half.
#
# The full grid is swept *offline*: every rule is replayed on one uniform-depth trajectory per window
# (`sweep(..., mode="offline")`), which is one forward pass for all ~80 rule settings instead of one each.
# Offline replay ignores one effect of real halting: a halted token's frozen state and keys/values change
# what later tokens see. The last section runs the matched points *online* (true per-token halting,
# `drc_core.halting.rules.masked_forward`) and reports the difference.

# %% tags=["parameters"]
profile = "reference"
work_dir = "runs/book/reference"
results_dir = "papermill_runs/reference/results"
corpus_dir = "data/corpus/default"
n_windows = 64
seed = 0
eps = 1e-3  # convergence label of the routers (as in 02)
rule_max_loops = 16  # every rule's max_loops
ce_tolerance = (
    0.005  # "matches uniform depth-8 quality": CE at most CE(uniform 8) plus this, in nats
)
kl_target = 0.01  # the KL quality target: mean KL(p_8 || p_exit) at most this
router_positions = 64  # harvested positions per window (all loops 1..L-1 of each)
online_windows = (
    16  # held-out windows for the online (true per-token halting) check of the matched points
)

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time

from drc_core.analysis.measure import val_windows_with_docs
from drc_core.book import viz
from drc_core.book.paths import at_root, results_for
from drc_core.book.workspace import open_model, save_results
from drc_core.data.sampler import Corpus
from drc_core.halting.router import split_windows, trained_router_specs
from drc_core.halting.sweep import (
    calibration_table,
    default_rules,
    gap_table,
    matching_table,
    online_vs_offline,
    summarize,
    sweep,
    uniform_ce,
    window_clusters,
)

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/

# %%
t0 = time.time()
model, cfg, _ = open_model(work_dir)
corpus = Corpus.open(corpus_dir)
windows, docs = val_windows_with_docs(corpus, cfg.seq_len, n_windows)
reference = int(round(cfg.recurrence.mean))
calib_idx, held_idx = split_windows(len(windows), 0.5, seed=seed)
print(
    f"{len(windows)} windows: {len(calib_idx)} for router training / calibration, "
    f"{len(held_idx)} held out; "
    f"reference depth {reference}"
)

# %% [markdown]
# ## Learned routers
# Labels per token and loop: "has this token converged by loop l" (its convergence depth from notebook 2's
# definition, ε as above). The linear router sees the latent state `s_l` (the paper's router); the MLP sees
# the state, the loop index and five readout statistics -- a stronger baseline.

# %%
router_specs, router_info = trained_router_specs(
    model, windows[calib_idx], rule_max_loops, eps, positions=router_positions, seed=seed
)
for kind, info in router_info.items():
    print(kind, {k: round(v, 3) for k, v in info.items()})

# %%
specs = default_rules(rule_max_loops) + router_specs
frame = sweep(model, windows, specs, reference_loops=reference, mode="offline")
clusters = window_clusters(docs)
held = summarize(frame, windows=held_idx, clusters=clusters, seed=seed)
calib = summarize(frame, windows=calib_idx, clusters=clusters, seed=seed)
print(
    f"{len(specs)} rules + uniform depths + oracle on {len(windows)} windows "
    f"in {time.time() - t0:.0f} s"
)

# %% [markdown]
# ## Quality versus average depth (held-out windows)
# Lower-left is better. Uniform depth is the baseline curve; the oracle (offline, per-token earliest loop
# within ε of the reference output) bounds what any rule could do on these trajectories. The cross-entropy
# varies far more from document to document than from rule to rule, so the first plot shows each point's
# CE minus that of uniform depth `reference` on the same windows (a paired difference; the y axis is cut at
# +0.06 nats, which hides the 1- and 2-loop points); the intervals over documents are in the tables below.

# %%
ce_uniform_ref = uniform_ce(held, reference)
plot = (
    held[held.avg_depth <= rule_max_loops + 0.5]
    .drop(columns="rule")
    .rename(columns={"family": "rule"})
)
excess = plot.assign(quality=plot.ce - ce_uniform_ref)[["rule", "param", "avg_depth", "quality"]]
fig = viz.quality_vs_depth(
    excess,
    reference=ce_tolerance,
    reference_label=f"+{ce_tolerance:g} nats",
    quality_label=f"CE − CE(uniform {reference}) (nats, same windows)",
)
fig.update_yaxes(range=[-0.01, 0.06])

# %%
viz.quality_vs_depth(
    plot.rename(
        columns={"kl_ref": "quality", "kl_ref_lo": "quality_lo", "kl_ref_hi": "quality_hi"}
    ),
    reference=kl_target,
    quality_label=f"mean KL(p_{reference} ‖ p_exit) (nats)",
    log_y=True,
    reference_label=f"target {kl_target:g}",
)

# %% [markdown]
# ## Lowest average depth that matches uniform depth-8 quality
# For each family: the shallowest grid point whose held-out CE is within `ce_tolerance` of uniform depth
# `reference` (and, separately, whose mean KL to the reference output is ≤ `kl_target`), with linear
# interpolation along the family's curve.

# %%
match = matching_table(held, reference, ce_tolerance, kl_target)
match.round(3)

# %% [markdown]
# ## Against the matching uniform depth
# Saving loops against depth 8 is free where uniform depth already matches depth-8 quality at fewer loops.
# The comparison that matters is with *that* uniform depth: per family, the loops it saves against the
# uniform depth of equal quality (both interpolated, as above), with 95% intervals from resampling the
# held-out documents (both curves and the target recomputed on every resample).

# %%
gaps = gap_table(frame, reference, ce_tolerance, windows=held_idx, clusters=clusters, seed=seed)
shown = ["family_depth", "uniform_depth", "saved", "saved_lo", "saved_hi"]
gaps[[*shown, "saved_frac", "saved_frac_lo", "saved_frac_hi"]].round(3)

# %% [markdown]
# ## Calibration
# The threshold is chosen on the calibration half for each target and checked on the held-out half.

# %%
cal = calibration_table(calib, held, reference, ce_tolerance, kl_target)
cal[
    [
        "family",
        "quality",
        "param",
        "calib_depth",
        "heldout_depth",
        "heldout_quality",
        "heldout_target",
        "holds",
    ]
].round(4)

# %% [markdown]
# ## Offline replay versus true per-token halting
# The point of each family that matched the CE target above, rerun online on `online_windows` held-out
# windows: frozen states, exit-loop keys/values offered to later tokens (the semantics of
# `drc_core.iterate`).

# %%
sub = held_idx[:online_windows]
online = online_vs_offline(model, windows, frame, specs, match, sub, reference, seed=seed)
online[
    [
        "family",
        "param",
        "avg_depth_offline",
        "avg_depth_online",
        "depth_diff",
        "ce_offline",
        "ce_online",
        "ce_diff",
    ]
].round(4)

# %%
results = {
    "profile": profile,
    "reference_loops": reference,
    "rule_max_loops": rule_max_loops,
    "ce_tolerance": ce_tolerance,
    "kl_target": kl_target,
    "ce_uniform_ref": ce_uniform_ref,
    "matching": match.reset_index().to_dict("records"),
    "gaps": gaps.reset_index().to_dict("records"),
    "calibration": cal.to_dict("records"),
    "held_out_points": held[["family", "param", "avg_depth", "ce", "kl_ref"]].to_dict("records"),
    "n_windows": {
        "calibration": len(calib_idx),
        "held_out": len(held_idx),
        "online_check": len(sub),
    },
    "online_check": online[
        ["family", "param", "avg_depth_offline", "avg_depth_online", "ce_offline", "ce_online"]
    ].to_dict("records"),
    "notebook_seconds": time.time() - t0,
}
save_results(results_dir, "04_halting_and_routers", results)
for fam in ("uniform", "kl", "router_linear", "router_mlp", "oracle"):
    if fam in match.index:
        r = match.loc[fam]
        print(
            f"{fam:14s} matches CE(uniform {reference}) at {r.ce_depth_interp:.2f} loops "
            f"({r.cut_vs_8_ce:+.0%} vs {reference}); KL<={kl_target:g} at {r.kl_depth_interp:.2f}"
        )

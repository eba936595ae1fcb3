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
# (`sweep(..., mode="offline")`), which is one forward pass for every rule setting of the grid instead of one each.
# Offline replay ignores one effect of real halting: a halted token's frozen state and keys/values change
# what later tokens see. The last section runs the matched points *online* (true per-token halting,
# `drc_core.halting.reference.masked_forward`) and reports the difference.

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
risk_alphas = [0.01, 0.02, 0.05, 0.1, 0.2]  # risk levels (share of tokens off depth `reference`)
risk_delta = 0.1  # the guarantee holds with probability 1 - risk_delta over calibration documents
risk_splits = 100  # random halvings of the documents for the validity check
risk_windows_per_doc = 2  # windows taken from each validation document for the guarantee
risk_max_docs = 0  # at most this many validation documents, evenly spaced (0: all)
risk_ce_tolerance = 0.1  # CE risk: a token's CE exceeds depth `reference`'s by more (nats)
checkpoint = ""  # a checkpoint trained elsewhere (Huginn format) instead of notebook 1's

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time

import numpy as np
import pandas as pd
from IPython.display import display

import drc_core
from drc_book import viz
from drc_book.cost import keep_freed_memory
from drc_book.paths import at_root, results_for
from drc_book.workspace import open_study, save_results
from drc_core import (
    calibration_table,
    default_families,
    default_rules,
    document_windows,
    gap_table,
    loss_tables,
    matching_table,
    min_units,
    online_vs_offline,
    split_windows,
    summarize,
    sweep,
    trained_router_specs,
    uniform_ce,
    validity,
    validity_summary,
    window_clusters,
)

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/
checkpoint = at_root(checkpoint) if checkpoint else ""
keep_freed_memory()  # glibc reuses freed buffers: no page faults on fresh vocabulary-sized arrays

# %%
t0 = time.time()
study = open_study(work_dir, corpus_dir, n_windows, checkpoint)
model, cfg, corpus, windows, docs, reference = study
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
# ## Halting with a stated guarantee
# The calibration above picks a threshold on one split and checks it on the other: no promise beyond that split.
# Learn then Test (Angelopoulos et al. 2021; `drc_core.halting.calibrate`) gives one: for each family it tests the
# grid's thresholds from the one that halts latest to the one that halts earliest, and returns the most aggressive
# threshold whose risk it can certify, such that **with probability ≥ 1 − δ over the calibration documents, the
# expected share of a new document's tokens whose top prediction differs from depth `reference` is ≤ α** (risk
# `top1`; risk `ce`: whose CE exceeds depth `reference`'s by more than `risk_ce_tolerance`). Tokens of one document
# are not independent, so the unit of the test is the document (its share of violating tokens, a number in
# [0, 1], with a Hoeffding–Bentkus p-value): the price is that `n` counts documents, not tokens. Even a threshold
# that never disagrees with depth `reference` is certified only from `min_units(α, δ)` documents on.
#
#
# Every validation document counts here (not only those the windows above reach; at most `risk_max_docs` where
# set): `risk_windows_per_doc` windows spread over each one (`drc_core.api.document_windows`).

# %%
val_docs = corpus.docs[corpus.docs.split == "val"].sort_values("tok_start")
if risk_max_docs and len(val_docs) > risk_max_docs:
    val_docs = val_docs.iloc[np.linspace(0, len(val_docs) - 1, risk_max_docs).round().astype(int)]
val_tokens = corpus.tokens("val")
risk_windows, risk_units = document_windows(
    None,
    [val_tokens[a:b] for a, b in zip(val_docs.tok_start, val_docs.tok_end, strict=True)],
    cfg.seq_len,
    risk_windows_per_doc,
)
risk_families = default_families()
tables = loss_tables(
    model,
    risk_windows,
    risk_units,
    risk_families,
    tolerance=risk_ce_tolerance,
    reference_loops=reference,
    max_loops=rule_max_loops,
)
top1 = tables["top1"]
n_docs = len(top1.units)
doc_source = val_docs.source.to_numpy()[top1.units]
need = {a: min_units(a, risk_delta) for a in risk_alphas}
print(
    f"{n_docs} validation documents ({len(risk_windows)} windows of {cfg.seq_len} tokens; "
    f"{pd.Series(doc_source).value_counts().to_dict()}); "
    f"a half holds {n_docs // 2}"
)
for a, n_min in need.items():
    verdict = "enough" if n_docs >= n_min else "too few: no certificate is possible"
    half = "enough" if n_docs // 2 >= n_min else "too few"
    print(
        f"alpha={a:g}, delta={risk_delta:g}: needs >= {n_min} documents; all {n_docs}: {verdict}; "
        f"a half: {half}"
    )

# %% [markdown]
# ### Certificates on every document
# Each family calibrated on all the documents of these windows, per α (printed as the library prints them).

# %%
certs = []
for risk_name, table in tables.items():
    for a in risk_alphas:
        row = [table.certify(fam, a, risk_delta) for fam in [*risk_families, "uniform"]]
        certs += row
        for cert in row:
            if cert.threshold is not None:
                print(f"[{risk_name}] {cert}")
        none = [c.family for c in row if c.threshold is None]
        if none:
            print(
                f"[{risk_name}] alpha={a:g}: no threshold certified for {', '.join(none)} "
                f"(e.g. {row[[c.family for c in row].index(none[0])]})"
            )
cert_frame = pd.DataFrame([c.__dict__ for c in certs])
certified = cert_frame[cert_frame.threshold.notna()]
print(
    f"\n{len(certified)} of {len(cert_frame)} (risk, alpha, family) settings certified; "
    f"smallest alpha certified: "
    f"{certified.alpha.min() if len(certified) else 'none'}"
)
cert_frame.pivot_table(
    index="family", columns=["risk", "alpha"], values="avg_loops", aggfunc="first", dropna=False
).round(2)

# %% [markdown]
# ### Is the guarantee kept? Random document splits
# `risk_splits` random halvings of the documents: certify on one half (the family and, for comparison, uniform
# depth), measure on the other. A split *violates* when the certified threshold's risk on the test half exceeds α
# (the test half's risk is itself an estimate, so this overstates violations near α); a split without a
# certificate cannot violate. The promise: at most δ of the splits violate, up to the Monte-Carlo error of
# `risk_splits` splits (`violation_lo`–`violation_hi`: Clopper–Pearson 95%). `loops`: the certified rule's mean
# exit loop on the test half; `saved_frac`: the share of loops it saves against the certified uniform depth.

# %%
rows = pd.concat(
    [
        validity(top1, fam, risk_alphas, risk_delta, n_splits=risk_splits, seed=seed)
        for fam in risk_families
    ]
)
valid = validity_summary(rows, risk_delta)
kept = valid[valid.certified > 0]
broken = valid[~valid.kept]
print(
    f"{len(valid)} (family, alpha) settings over {risk_splits} splits of {n_docs} documents "
    f"({int(valid.n_calib.iloc[0])} for calibration): certified in at least one split: "
    f"{len(kept)}; "
    f"violation rate above delta beyond Monte-Carlo error: {len(broken)}"
)
for a in risk_alphas:
    g = valid[valid.alpha == a]
    print(
        f"alpha={a:g}: certified in {g.certified.mean():.0%} of splits (mean over families), "
        f"highest violation rate {g.violation.max():.3f} (delta {risk_delta:g})"
    )
valid[
    [
        "family",
        "alpha",
        "certified",
        "violation",
        "violation_lo",
        "violation_hi",
        "test_risk",
        "loops",
        "uniform_depth",
        "saved_frac",
    ]
].round(3)

# %%
viz.risk_validity(valid)

# %% [markdown]
# ### Under shift: calibrate on Wikipedia, test on State of the Union
# The guarantee assumes new documents come from the calibration documents' distribution. Here the calibration
# documents are the Wikipedia ones and the test documents the State of the Union ones (and the reverse). Whether
# a certificate is possible at all depends on how many documents each source has; the per-source risk of every
# threshold shows the shift whether or not anything is certified.

# %%
wiki = np.flatnonzero(doc_source == "wikipedia")
sotu = np.flatnonzero(doc_source == "sotu")
shift_rows = []
for name, cal_idx, test_idx in (
    ("wikipedia -> sotu", wiki, sotu),
    ("sotu -> wikipedia", sotu, wiki),
):
    if len(cal_idx) == 0 or len(test_idx) == 0:
        print(f"{name}: no documents of one source in these windows")
        continue
    for fam in risk_families:
        r = validity(top1, fam, risk_alphas, risk_delta, calib=cal_idx, test=test_idx)
        shift_rows.append(r.assign(direction=name))
shift = pd.concat(shift_rows) if shift_rows else pd.DataFrame()
if len(shift):
    got = shift[shift.certified]
    print(
        f"{len(got)} of {len(shift)} (direction, family, alpha) settings certified; of those, "
        f"{int(got.violated.sum())} exceed alpha on the other source"
    )
    for (d, a), g in got.groupby(["direction", "alpha"]):
        print(
            f"  {d}, alpha={a:g}: {len(g)} families certified, test risk "
            f"{g.test_risk.min():.3f}-{g.test_risk.max():.3f}, {int(g.violated.sum())} violate"
        )
    display(
        got[
            [
                "direction",
                "family",
                "alpha",
                "n_calib",
                "n_test",
                "threshold",
                "test_risk",
                "violated",
                "loops",
            ]
        ].round(4)
    )

# %%
# each threshold's mean per-document risk on each source (all documents; KL and state change)
by_source = []
kl_and_state = (drc_core.KLThreshold.family, drc_core.StateDelta.family)
for fam in [f for f in kl_and_state if f in risk_families]:
    for j, spec in enumerate(top1.specs[fam]):
        row = {"family": fam, "threshold": spec.param}
        for src, idx in (("wikipedia", wiki), ("sotu", sotu)):
            if len(idx):
                row[f"risk_{src}"] = float(top1.risks[fam][j, idx].mean())
                row[f"loops_{src}"] = float(top1.loops[fam][j, idx].mean())
        by_source.append(row)
by_source = pd.DataFrame(by_source)
by_source.round(4)

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
    "risk_control": {
        "delta": risk_delta,
        "alphas": risk_alphas,
        "n_documents": n_docs,
        "min_documents": {f"{a:g}": n for a, n in need.items()},
        "certificates": cert_frame.to_dict("records"),
        "validity": valid.to_dict("records"),
        "shift": [] if not len(shift) else shift.to_dict("records"),
    },
    "notebook_seconds": time.time() - t0,
}
save_results(results_dir, "04_halting_and_routers", results)
for fam, r in match.iterrows():
    print(
        f"{fam:16s} matches CE(uniform {reference}) at {r.ce_depth_interp:.2f} loops "
        f"({r.cut_vs_8_ce:+.0%} vs {reference}); KL<={kl_target:g} at {r.kl_depth_interp:.2f}"
    )

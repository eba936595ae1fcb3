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
# # 5. Compute: FLOP proxy versus wall-clock
#
# **The question.** Notebook 4 found rules that keep depth-8 quality at fewer loops on average. Does that make the
# model faster on the clock, in batched evaluation and in generation, and where it does not, what does the time go
# to: the work the rule itself asks for, or the implementation?
#
# **How.** Notebook 4 counted a halting rule's savings as the *FLOP proxy* `r / a`: uniform depth `r` against the
# rule's average exit loop `a`, counting only the core (prelude and coda run once). Here we measure what
# that becomes on the clock, at matched quality, on the same validation windows and in the same process
# (`drc_book.speed`):
#
# - **batched evaluation**: `model(x, r)` (uniform depth, one readout) against
#   `drc_core.skip_forward`, which really skips the halted tokens: at loop `l` the core runs only
#   on the tokens still active;
# - **generation**: the KV-cached decoder `drc_core.generate_ids` with `Uniform(r)` against the same
#   decoder with the rule, same prompt, same number of greedy tokens;
# - **the measurement pass** of notebook 2 (`measure_windows`, 32 loops) against one depth-32 forward.
#
# ## The cost model
# Matmul FLOPs per token (`block` one transformer block, `core = R·block + adapter`, `head = 2dV`; P, R, C
# prelude/core/coda blocks; `drc_book.cost.matmul_flops_per_token`):
#
# | path | FLOPs per token |
# |---|---|
# | uniform depth `r` (`forward`) | `(P + C)·block + r·core + head` |
# | `skip_forward`, rule on log-probs (KL, entropy) | `P·block + a·(core + C·block + head)` + V-sized softmax/loop |
# | `skip_forward`, rule on states (StateDelta, cosine) | `P·block + a·core + C·block + head` |
#
# The FLOP proxy counts only the core, so only a state-based rule can realise it. A rule that reads the
# output needs the coda and the vocabulary head at every loop of every active token; on a small model with
# a large vocabulary that readout costs about as much as a core loop (the table below gives the ratio for
# this model), so such a rule can be *slower* than uniform depth however early its tokens halt. What
# separates a state-based rule from its proxy is the work that does not shrink with depth (prelude, coda,
# head: the "rule on states" column below) and the cost of skipping itself (keeping the active tokens
# compacted, rebuilding their attention layout when some halt; the row "uniform via skip_forward" measures
# it at equal depth).
#
# Times are medians over interleaved rounds (the order rotates each round), so load on a shared machine slows
# every variant alike. Each timing decides its own number of rounds, as `timeit`'s autorange and `pyperf` do: at
# least `rounds`, then more until every variant's median is known to within `rel` (a distribution-free 95% interval
# from the rounds' order statistics, `drc_book.cost.median_interval`) or the timing has used `budget_s` seconds,
# and at most `max_rounds`; the tables give each median's interval (`seconds_lo`, `seconds_hi`, or `ms_lo`,
# `ms_hi` for a decode step) and its rounds. Before the rounds, an untimed warm-up: for batched evaluation a full
# pass, which also gives the quality numbers; for the decoders one decode step each (their tokens, exit loops and
# work are read from the first timed round). Whether the warm-up was enough is checked, not assumed (the last table
# before the findings).

# %% tags=["parameters"]
profile = "reference"
work_dir = "runs/book/reference"
results_dir = "papermill_runs/reference/results"
corpus_dir = "data/corpus/default"
n_windows = 64
rounds = 3  # timed, interleaved rounds: the least of them
max_rounds = 12  # the most: more than `rounds` only while a median's interval is wider than rel
rel = 0.03  # stop once every median's 95% interval is within this share of it
budget_s = 30.0  # or once a timing has taken this many seconds
rule_max_loops = 16  # every rule's max_loops (as in notebook 4)
ce_tolerance = 0.005  # matched quality: CE at most this above uniform depth r, in nats
families = []  # families of sweep.default_rules to time (empty: all of default_families())
new_tokens = 64  # greedy tokens per timed generation
prompt_len = 32  # the prompt: the first tokens of the first validation window
max_loops = 32  # depth of the measurement pass (as in notebook 2)
measure_windows = 8  # windows for the measurement-pass comparison
threads = 0  # torch threads; 0 keeps torch's default
gen_batches = [1, 8]  # generation batch sizes (rows decoded together)
decode_rows = [1, 2, 4, 8]  # active rows at which one decode loop is timed (at most n_windows)
decoder_batches = [1, 8, 32]  # batch sizes of the three-decoder comparison
decoder_families = []  # families the continuous decoder runs too (empty: KL and the state families)
serving_slots = 8  # slots of the serving comparison, 0 skips it
fused = True  # readout statistics through the compiled kernel (loopstats.fused_stats_kernel)
clock = "wall"  # "wall" or "cpu" (process time; robust to other jobs with one thread)
keep_freed = True  # glibc keeps freed memory while timing (cost.keep_freed_memory)
presets = True  # also time Huginn's presets
bf16_compare = True  # compare fp32 with bf16 autocast where the device does bf16 fast
anderson_windows = 16  # windows for the Anderson-acceleration section (0: skip it)
anderson_evals = 16  # core evaluations per method there

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time

import torch
from IPython.display import Markdown, display

import drc_core
from drc_book import speed, speed_checks, viz
from drc_book.cost import flop_summary, keep_freed_memory, speedup_model
from drc_book.handoff import Compute
from drc_book.paths import at_root, results_for
from drc_book.speed import decode_loop_cost, decode_prediction, time_decoder_sets
from drc_book.workspace import open_study
from drc_core import bf16_support, default_families, val_windows_with_docs

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/
if keep_freed:
    keep_freed_memory()  # glibc reuses freed buffers (the timings' own setting, for every cell)

# %%
t0 = time.time()
if threads:
    torch.set_num_threads(threads)
model, cfg, corpus, windows, _, reference = open_study(work_dir, corpus_dir, n_windows)
prompt_len = min(prompt_len, cfg.seq_len, model.cfg.max_seq_len - new_tokens)
timing = speed.SpeedConfig(
    reference_loops=reference, rule_max_loops=rule_max_loops, ce_tolerance=ce_tolerance,
    families=tuple(families or default_families()), rounds=rounds, max_rounds=max_rounds, rel=rel,
    budget_s=budget_s, new_tokens=new_tokens,
    prompt_len=prompt_len, measure_loops=max_loops, measure_windows=measure_windows, fused=fused,
    clock=clock, keep_freed=keep_freed)
c = model.cfg
print(f"{len(windows)} windows x {cfg.seq_len} tokens; uniform depth r = {reference}; "
      f"d={c.d_model}, P/R/C={c.n_prelude}/{c.n_core}/{c.n_coda}, V={c.vocab_size}; "
      f"{torch.get_num_threads()} torch threads")

# %% [markdown]
# ### The cost model on this model
# FLOPs per token of each part (`drc_book.cost.flop_parts`), then the matmul speed-up over
# uniform depth `r` at a few average depths `a`: the readout term is what keeps a log-prob rule's
# realisable speed-up small.

# %%
print(flop_summary(model, cfg.seq_len))
speedup_model(model, reference, cfg.seq_len).round(2)

# %% [markdown]
# ## Matched quality
# For each rule family, the lowest-average-depth point of its threshold grid (`drc_core.default_rules`)
# whose validation cross-entropy on these windows is within `ce_tolerance` of uniform depth `r`. The grid is
# swept offline (one uniform pass for every threshold, as in notebook 4); the chosen point is rerun online with
# `skip_forward` -- the path that is timed -- and a stricter point is taken if it misses the target there.

# %%
matched = speed.matched_rules(model, windows, timing)
matched.table[["family", "rule", "avg_loops_offline", "ce_offline", "avg_loops", "ce", "ce_target",
               "within_tolerance", "note"]].round(4)

# %% [markdown]
# ## Batched evaluation
# All windows, batches of 16, the same initial latent state for every variant: the matched rules, then
# Huginn's exit criteria at its default thresholds (family `huginn`, not matched: their CE gap shows what
# its settings give on our model). `ce` is the cross-entropy of exactly the outputs that were timed;
# `honest_flops` the FLOPs per token of the work each run really did (core for the active tokens, the
# readouts it performed, its vocabulary-sized statistics; `drc_book.cost.honest_flops`), beside
# the loop proxy `r / a`.

# %%
extra = speed.preset_specs(timing, matched.specs) if presets else []
batched = speed.time_batched(model, windows, [*matched.specs, *extra], timing)
batched[["family", "rule", "avg_loops", "ce_gap", "seconds", "seconds_lo", "seconds_hi", "rounds",
         "page_faults_per_batch",
         "proxy_speedup", "honest_flops", "honest_speedup", "wallclock_speedup", "wall_over_proxy",
         "wall_over_honest"]].round(3)

# %% [markdown]
# ## Generation
# One prompt (batch 1, the setting Huginn measures) and eight prompts decoded together; `new_tokens` greedy
# tokens; time per step = (time of n tokens − time of 1) / (n − 1), so the prompt pass drops out. The
# baseline is `generate_fixed`, the KV-cached decoder at fixed depth with no halting machinery at all; the
# `Uniform(r)` row is `generate` at the same depth (the machinery's own overhead).
# Matched quality is an average over tokens, not identical output: `first_divergence` is the index of the
# first greedy token that differs from the baseline's (after it the contexts differ, so `same_tokens`, the
# position-by-position agreement, falls). The prompts are the first tokens of evenly spaced validation windows,
# the same as in the continuous-batching section below: one interleaved timing per batch size gives both
# sections' tables (`time_decoding`), so no decoder is timed twice.

# %%
decoder_families = decoder_families or [drc_core.KLThreshold.family, *drc_core.state_families()]
kl_and_state = (drc_core.KLThreshold.family, drc_core.StateDelta.family)  # paper's rule, state rule
decoder_rules = [sp for sp in matched.specs if sp.family in decoder_families]
prompts, _ = val_windows_with_docs(corpus, cfg.seq_len, max([*gen_batches, *decoder_batches]))
prompts = prompts[:, :prompt_len]
decoding = time_decoder_sets(model, prompts, matched.specs, timing, gen_batches=gen_batches,
                             decoder_batches=decoder_batches, continuous=decoder_families)
generation = decoding.generation
generation[["rows", "rule", "avg_loops", "loops_run", "first_divergence", "same_tokens",
            "ms_per_token", "ms_lo", "ms_hi", "rounds", "tokens_per_s", "proxy_speedup",
            "honest_speedup", "wallclock_speedup", "wall_over_proxy", "wall_over_honest"]].round(3)

# %% [markdown]
# ### What a decode loop costs with fewer rows active
# A decode step of B rows runs each loop on B tokens (B × d inputs against d × d weights): latency-bound, not
# FLOP-bound. Below, one core loop of `generate_fixed` timed with B rows active (step at depth r minus step at
# depth 1, over r − 1), and the least-squares line loop = `fixed_ms` + `per_row_ms` × B. When a rule lets some
# rows of a step exit, the loop still costs `fixed_ms`, and the step runs until its deepest row exits
# (`loops_run`, the mean over steps of the deepest exit among the rows). `loop_cost_speedup` is the core-loop
# speed-up this cost predicts, r (f + pB) / (f · loops_run + p · B · avg_loops) (`decode_prediction`; the
# readouts a KL-type rule does per loop come on top, so for those it is an upper bound): the honest-FLOP
# speed-up assumes every FLOP costs the same, which a loop over a handful of tokens does not do.

# %%
rows_here = [b for b in decode_rows if b <= len(windows)]
decode_cost = decode_loop_cost(model, windows[:, :prompt_len], timing, rows=rows_here)
display(decode_cost.round(3))
prediction = decode_prediction(generation, decode_cost)
display(prediction.round(3))

# %% [markdown]
# ## Continuous depth batching: every row at its own loop
# The step-synchronous decoder above runs each decode step to its deepest row. `generate_continuous`
# schedules single loop iterations instead: every core step runs one loop of every row's current token at
# that token's own loop index; a row whose token exits reads out, chooses its next token, and that token joins
# the next core step at loop 1 while the other rows keep looping. Greedy outputs equal decoding each row alone
# (`same_as_generate`). Three decoders side by side for each batch size: the dense decoder at depth r,
# `generate` and `generate_continuous`, for uniform depth r (the machinery's cost at equal depth) and the
# matched KL, state-change, cosine and acceleration rules. `realization` is the wall-clock speed-up over the
# dense decoder divided by the honest-FLOP speed-up (the work the path really did, counted op by op). The
# generation batch sizes' rows come from the generation section's timing (the same calls).

# %%
decoders = decoding.decoders
display(decoders[["batch", "rule", "path", "avg_loops", "ms_per_step", "ms_lo", "ms_hi",
                  "tokens_per_s", "x_dense", "x_dense_lo", "x_dense_hi", "flop_speedup",
                  "realization",
                  "same_as_generate"]].round(3))
checked = [b for b in decoder_batches if 1 < b <= len(prompts)]
viz.decoder_bars(decoders)

# %% [markdown]
# Beside the times, what bounds a decoder at small batches, counted rather than timed (so the machine's load
# does not move it): aten operator calls per generated token of `generate` and `generate_continuous` with the
# KL and state-change rules (`speed_checks.decode_op_calls`; `ratio` = continuous / generate, target ≤ 1.2).

# %%
counted = [sp for sp in matched.specs if sp.family in kl_and_state]
op_calls = speed_checks.decode_op_calls(model, prompts, counted, timing, batches=checked)
display(op_calls.round(2))

# %% [markdown]
# ### Serving: requests behind a fixed number of slots
# Every prompt above becomes a request (a quarter of them ask for `new_tokens` / 4 tokens, the rest for
# `new_tokens`), all arriving at once, served `serving_slots` at a time by the state-change rule. Continuous
# depth batching gives a finished row's slot to the next request at once; the step-synchronous decoder runs
# batch after batch, each as long as its longest request. Latency: seconds from arrival to a request's last token.

# %%
state_rule = [sp.rule for sp in decoder_rules if sp.family == "state_delta"]
serving = None
if serving_slots and state_rule and len(prompts) > serving_slots:
    asks = (max(1, new_tokens // 4), new_tokens, new_tokens, new_tokens)
    serving = speed.serving_latency(model, prompts, state_rule[0], slots=serving_slots,
                                    new_tokens=asks, cfg=timing)
    display(serving.round(3))

# %% [markdown]
# The decoders' targets: with the KL rule and the state-change rule, the continuous decoder at least as fast as the
# dense decoder at batch 8 and 1.2× as fast at batch 32, realizing at least 0.7 of its honest-FLOP speed-up; at
# equal depth within 1.05× of the dense decoder; in serving, a median latency below `generate`'s. `value` is the
# ratio of the medians and `met` judges it; `lo`–`hi` is the interval of the median of the ratio paired round by
# round (its coverage is `x_dense_coverage` in the decoders' table: only 0.75 with three rounds), and `verdict`
# says met or missed only when that whole interval is on one side of the target, else unresolved. `ceiling` is
# what a speed-up would be were the clock to follow the honest FLOPs (a rule that reads the output pays the coda
# and the head at every loop), so a target whose ceiling misses it (`reachable` false) is bound by the work the
# rule asks for, and one within reach by the implementation.

# %%
decoder_checks = speed.decoder_targets(decoders, kl_and_state, batches=checked, serving=serving)
display(decoder_checks.round(3))
unmet = decoder_checks[decoder_checks.verdict != "met"]
out_of_reach = (~unmet.reachable.astype(bool)).sum()
print(f"{len(decoder_checks) - len(unmet)} of {len(decoder_checks)} met; of the {len(unmet)} "
      f"others, {out_of_reach} are out of reach at any implementation")

# %% [markdown]
# ## FLOP proxy versus wall-clock
# Bars: the proxy `r / a` and the measured wall-clock speed-up over uniform depth `r`; the marker is
# 0.9 × the proxy (the target), the dotted line no speed-up.

# %%
table = speed.speedup_table(batched[batched.family != "huginn"],
                            generation[generation.rows == gen_batches[0]])
viz.speedup_bars(table)

# %%
table.round(3)

# %% [markdown]
# ## Speed targets at matched quality
# At matched quality: the skipping path at equal depth within 1.05× the dense time, every training-free
# rule faster than uniform depth `r`, wall-clock ≥ 0.9× the honest-FLOP speed-up for every rule, the
# state-change rule ≥ 0.9× its loop proxy, the KL rule ≥ 1.5× in batched evaluation. `ceiling` is the value
# each quantity would take if the clock followed the honest FLOPs exactly (the best any implementation of
# the same work can do); `reachable` says whether that ceiling meets the target. A target missed but
# reachable is bound by the implementation; one that is not reachable, by the work the rule asks for.
# Each speed-up has the interval of its median over the timed rounds, each round's ratio taken between
# calls of that round (`lo`, `hi`); the `verdict` is "met" or "missed" only when the whole interval is on
# one side of the threshold, else "unresolved": a second run can move a median across a threshold, but
# rarely an interval.

# %%
targets = speed.speed_targets(batched[batched.family != "huginn"], generation)
display(targets.round(3))
said = targets.verdict.value_counts()
short = targets[targets.verdict != "met"]
print(f"of {len(targets)}: {said.get('met', 0)} met, {said.get('missed', 0)} missed, "
      f"{said.get('unresolved', 0)} unresolved; of those not met, {(~short.reachable).sum()} "
      "are out of reach of any implementation (ceiling short of the threshold)")

# %% [markdown]
# ## Where the time goes
# `torch.profiler` over one batch (16 windows × 256 tokens), self CPU time by kind of op (the table below this
# text). What bounds each path (the implementation's history, with the timings that led to each choice, is in
# the commit log of `drc_core.halting.skipping`):
#
# - **Equal depth**: the skipping path's loops while every token is active run in the dense forward's own
#   layout and defer their key/value cache writes until the active set first shrinks (with `Uniform(r)` it
#   never does), so its `Uniform(r)` row does the dense forward's work; that row is one comparison among many
#   variants and carries the machine's round-to-round noise (the `spread` column).
# - **The allocator**: temporaries of changing shapes (the active set shrinks) can land in fresh pages that
#   fault on first touch; `keep_freed_memory()` (glibc `mallopt`) runs before every timing, and the
#   `page_faults_per_batch` column shows what remains. A program that imports `drc_core` gets the same by
#   calling it once.
# - **Rules that read the output** (KL, entropy change, argmax patience, confidence, min-p KL): per active token
#   and loop they need the coda, the head (2dV) and a softmax over V, which on a small model costs about one
#   core loop (the cost table above). At matched quality their honest FLOPs therefore stay close to uniform
#   depth's, and the `ceiling` column of the targets is the best any implementation of the same work reaches.
# - **Rules on the states**: they pay the core per active token and one readout at the end; the prelude, the
#   coda and the head run once whatever the depth, which bounds wall / proxy (`ceiling` again).
# - **Work that does not shrink with the active set**: every loop pays dozens of small ops on (N, d) tensors
#   (RMSNorm, RoPE, the MLP activation) and one host sync to learn which tokens halted; active queries still
#   attend to all frozen keys of their row; matmuls on fewer rows run at a lower rate. This is what keeps
#   wall / honest below 1 in batched evaluation.
# - **Generation with several rows**: a step runs until its deepest row exits (`loops_run` against `avg_loops`
#   in the generation table), one loop over several rows costs about what it costs over one (the decode-loop
#   cost table: a pass over the weights), and generation writes the coda's keys/values at every loop a row is
#   active. So `loop_cost_speedup` is an upper bound, and closing the gap needs rows whose exits do not wait
#   for each other (continuous batching, the section below), not a faster loop.
# - **Continuous batching** (the `continuous` rows of the generation profile with several rows): each core
#   step runs one loop of every row at its own depth, but the rows whose tokens exit at that step run the
#   coda, the head and the next token's prelude on their own, so per new token it makes more calls of small
#   ops than the dense decoder (the `ops` column), each costing a few microseconds whatever its rows; once
#   rows leave lockstep, attention gathers every item's keys/values and an exiting token's keys/values are
#   copied into every later loop's slab (`gather / scatter`).
# - **Noise**: on a 2-core machine single runs vary from round to round, so ratios near a threshold are within
#   noise; the tables report medians over each timing's interleaved rounds, with their intervals and `spread`.
# - **bf16**: the section below measures it on this machine; the rules' readout statistics stay fp32, and the
#   successive KL moves under bf16 far more than the CE does, which matters for the tiniest thresholds.

# %%
if not profile.startswith("smoke"):
    named = [spec for spec in matched.specs if spec.family in kl_and_state]
    kinds, ops = speed_checks.profile_batched(model, windows, named, timing)
    display(speed_checks.by_kind(kinds))
    display(ops.round(3))
    for rows in gen_batches:
        gen_kinds, _ = speed_checks.profile_generation(
            model, windows[:rows, :prompt_len], named, timing, continuous=rows > 1)
        print(f"generation, {rows} row(s), {new_tokens} new tokens:")
        display(speed_checks.by_kind(gen_kinds))

# %% [markdown]
# ## bf16 where the CPU does it fast
# The dense forward and the skipping path under `torch.autocast(bfloat16)` against fp32 (where
# `drc_core.bf16_support` finds AMX / AVX-512 bf16): time, CE, the share of tokens with the same
# exit loop, and how far the successive KL the rule thresholds moves (relative difference per token).

# %%
fast_bf16 = bf16_support(next(model.parameters()).device)
print(fast_bf16 or "no fast bf16 on this device: skipped")
if bf16_compare and fast_bf16:
    named = [spec for spec in matched.specs if spec.family in kl_and_state]
    bf16_frame, bf16_kl = speed_checks.bf16_check(model, windows, named, timing)
    display(bf16_frame.round(4))
    display(bf16_kl.round(5))

# %% [markdown]
# ## Anderson acceleration: fewer core evaluations to the fixed point?
# The state converges to a per-token fixed point, so Anderson acceleration (the deep-equilibrium solver;
# `drc_core.anderson_iterate`) may reach it in fewer core evaluations than plain iteration: per sequence,
# window m = 2, 3, 5, damping 0.7. Beside it, damped plain iteration `s' = 0.85 f(s) + 0.15 s` (m = 0): the
# same fixed points, no mixing, and a period-2 oscillation (notebook 2's 2-cycle tokens) becomes a
# contraction. Per method: mean evaluations per token until the successive KL stays below 1e-3 and 1e-5,
# CE and KL to plain iteration's 32-loop output after 8 evaluations (for a 2-cycle token that output is one of
# its two points, so a method that converges instead sits a little further from it), and the time per
# evaluation (the mixing costs something).

# %%
if anderson_windows:
    anderson = speed_checks.anderson_table(
        model, windows[:anderson_windows], speed_checks.anderson_configs(),
        max_evals=anderson_evals, time_rounds=rounds)
    display(anderson.round(6))

# %% [markdown]
# What this says, computed from the table (time to a fixed point = evaluations × seconds per evaluation):

# %%
if anderson_windows:
    print(speed_checks.anderson_summary(anderson))

# %% [markdown]
# The line above compares the methods: fewer evaluations to a tight fixed point (1e-5), each costing more than
# a plain one (the least-squares mixing over the sequence; how much depends on the machine). At the depths
# where the matched rules stop, the output has saturated, so neither Anderson nor damping buys CE there, and
# neither is wired into the skipping path.

# %% [markdown]
# ## What the measurement pass costs
# Per-token, per-loop statistics (notebook 2) need every loop's output distribution: the coda, the head and
# a log-softmax at each of the 32 loops, where a forward reads out once. So the target "measurement pass ≤
# 1.2 × one depth-32 forward" cannot hold as worded; the bare every-loop readout pass is the floor of any
# such measurement, and the measurement's own overhead is its time over that floor. `kl_to_final=True`
# (notebook 2's setting) adds a first pass to get the deepest output and a KL to it at every loop.

# %%
measurement = speed_checks.measurement_cost(model, windows, timing)
measurement[["pass", "seconds", "spread", "x_forward", "x_readout_pass"]].round(3)

# %% [markdown]
# ## How the timings ended
# One row per interleaved timing above: its variants, its rounds and why it stopped (`interval`: every median
# within `rel`; `budget`: `budget_s` spent; `rounds`: `max_rounds` reached), the seconds it took, and the warm-up
# check. Were the warm-up too short, the first timed round would be each variant's slowest more often than the
# 1-in-`rounds` chance; `warmup_p` is the one-sided binomial test of that across the timing's variants, and
# `warmup_ok` says it is not significant at 5%. Where it was significant when the rounds could have stopped, the
# first round was dropped as part of the warm-up (`dropped`) and the rounds went on; the check is then repeated on
# the rounds kept.

# %%
timing_checks = speed.timing_checks(batched, decoding.generation, decoders, decode_cost, serving,
                                    measurement)
timing_checks.round(3)

# %% [markdown]
# ## What this notebook found
#
# The record (`drc_book.handoff.Compute`) holds every table above and is what the README's speed rows read; the
# paragraph is built from it.

# %%
record = Compute.build(
    profile=profile, reference_loops=reference, rule_max_loops=rule_max_loops,
    ce_tolerance=ce_tolerance, n_windows=len(windows), seq_len=cfg.seq_len, rounds=rounds,
    threads=torch.get_num_threads(), matched=matched.table, batched=batched, generation=generation,
    measurement=measurement, table=table, skip_overhead_at_equal_depth=speed.skip_overhead(batched),
    speed_targets=targets, anderson=anderson if anderson_windows else None,
    decode_loop_cost=decode_cost, decode_prediction=prediction, decoders=decoders,
    decoder_targets=decoder_checks, serving=serving, decode_op_calls=op_calls,
    bf16=bf16_frame if bf16_compare and fast_bf16 else None, timing_checks=timing_checks,
    **speed_checks.measurement_summary(measurement), notebook_seconds=time.time() - t0)
record.save(results_dir)
display(Markdown(record.findings()))

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
# # 1. Training: one checkpoint, every depth
#
# **The question.** A depth-recurrent model runs one weight-tied core block *r* times between a prelude and a
# coda, re-injecting the prelude's output at every loop. Can one checkpoint be run at *any* depth, and how much
# does each extra loop buy? Everything later in the book (convergence, halting, compute) rests on the answer.
#
# **How.** The model is trained with a random number of loops per step: Poisson-lognormal with mean
# `recurrence.mean`, gradients through the last `recurrence.backprop_loops` loops only. This notebook prepares the
# corpus, trains the profile's preset (or loads the shipped checkpoint, `drc_core.open_run`), and reads the
# training curves. Then it runs the same checkpoint at uniform depths from 1 to `max_loops` loops on held-out
# windows: one deep pass, each depth's loss read at its loop (`drc_core.loss_by_depth`, per source with
# `drc_core.loss_by_source`).

# %% [markdown]
# **Parameters** (papermill sets them from `book/profiles.toml`, or `python -m drc_book run --set key=value`).
# `checkpoint` names a shipped or earlier run to reuse; an empty `checkpoint` (or `retrain = True`) trains the
# `preset` here on the corpus of `source` (`max_docs` documents per source, 0 for all), with `train_overrides`
# as `key=value` strings on top of the preset (for example `"recurrence.mean=12"`). The training run is
# resumable: a killed notebook picks it up from its last checkpoint in `work_dir`. `n_windows` validation
# windows and depths up to `max_loops` set what the loss-by-depth curve costs.

# %% tags=["parameters"]
profile = "reference"
work_dir = "runs/book/reference"
results_dir = "papermill_runs/reference/results"
corpus_dir = "data/corpus/default"
source = "wikipedia+sotu"
vocab_size = 4096
max_docs = 0  # per source; 0 means all (fineweb-edu needs a number)
data_files: list[str] = []  # fineweb-edu: local parquet shards instead of the Hub's stream (CI)
preset = "cpu"
train_overrides: list[str] = []
checkpoint = "data/reference"  # empty: train here
retrain = False
n_windows = 64
max_loops = 32
seed = 0

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time

import pandas as pd
from IPython.display import Markdown, display

from drc_book import viz
from drc_book.cost import keep_freed_memory
from drc_book.handoff import Training
from drc_book.paths import at_root, results_for
from drc_book.workspace import ensure_corpus, open_model, provide_model
from drc_core import (
    depth_gain_by_step,
    loss_by_depth,
    loss_by_source,
    unigram_loss,
    val_windows_with_docs,
)

work_dir, corpus_dir, checkpoint = at_root(work_dir, corpus_dir, checkpoint)
data_files = [at_root(f) for f in data_files]
keep_freed_memory()  # glibc reuses freed buffers: no page faults on fresh vocabulary-sized arrays
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/

# %%
t0 = time.time()
corpus = ensure_corpus(corpus_dir, source, vocab_size, max_docs=max_docs or None,
                       data_files=data_files, progress=False)
info = provide_model(work_dir, corpus, preset_name=preset, overrides=train_overrides,
                     checkpoint=checkpoint, retrain=retrain, progress=False)
model, cfg, metrics = open_model(work_dir)
tokens, m = corpus.meta["tokens"], cfg.model
print(f"corpus {corpus.path}: {tokens['train']:,} train / {tokens['val']:,} val tokens")
print(f"model from {info['kind']} {info['path']}: {model.num_params():,} parameters, "
      f"d={m.d_model}, prelude/core/coda {m.n_prelude}/{m.n_core}/{m.n_coda}, "
      f"mean depth {cfg.recurrence.mean:g}, backprop {cfg.recurrence.backprop_loops} loops, "
      f"{cfg.max_steps} steps x {cfg.batch_size} x {cfg.seq_len}")

# %% [markdown]
# ## Training curves
# The training loss is noisy by construction: each step runs at its own sampled depth, and a shallow step has
# a higher loss. The validation loss is measured at fixed depths during training, so its curves compare like
# with like: the gap between them is what depth buys at that point of training. The run's `metrics.jsonl`
# holds every row of these curves. A resumed run continues the same file at the step it stopped, with the same
# data order and random state, so a restart does not show in the curves: exact resume is tested, not assumed.
# The light line is the raw training loss, the dark one its running mean.

# %%
viz.loss_curves(metrics)

# %% [markdown]
# ## How much depth buys, as training goes on
# The validation loss at 1 and at 8 loops at every evaluation during training, and the gain from depth
# (loss at 1 loop − loss at 8 loops, nats). A gain that still grows at the last step says that a longer
# run would use depth more. Early in training the gain is small because the core has not yet learned a useful
# update; a gain that rises and then shrinks would say the prelude and coda learned to do without the loops.

# %%
gain = depth_gain_by_step(metrics, 1, 8)
gain.round(4)

# %% [markdown]
# ## Validation loss versus loops
# Now the finished checkpoint at uniform depths 1..`max_loops` on `n_windows` validation windows, overall and
# per source (the corpus mixes Wikipedia with State of the Union addresses, whose styles differ). Each depth's
# loss is read at that loop of one deep pass, so the curve costs one forward pass, not one per depth. The
# unigram entropy of the corpus is drawn for scale: a model that ignored context would sit there.
#
# Two things to read off the figure. Where the curve flattens is the depth beyond which loops stop paying on
# average. And whether it stays flat out to `max_loops`, several times the training mean, says whether the
# iteration is stable past the depths it was trained at: a curve that rose again would mean the state drifts
# away from where the coda can read it.

# %%
windows, docs = val_windows_with_docs(corpus, cfg.seq_len, n_windows)
loops = sorted({1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, max_loops} & set(range(1, max_loops + 1)))
overall = loss_by_depth(model, windows, loops)
by_source = loss_by_source(model, corpus, cfg.seq_len, tuple(loops), max_windows=n_windows)
every = pd.DataFrame({"loops": loops, "loss": [overall[lp] for lp in loops], "source": "all"})
table = pd.concat([every, by_source[["loops", "loss", "source"]]])
table = table.rename(columns={"source": "series"})
unigram = unigram_loss(corpus)
viz.loss_vs_depth(table, reference=unigram, reference_label="unigram entropy")

# %% [markdown]
# The same numbers as a table, one column per source: where the columns stop changing, depth stops paying.
# A source whose column keeps falling longer is one whose text needs more loops on average.

# %%
table.pivot(index="loops", columns="series", values="loss").round(4)

# %% [markdown]
# ## What this notebook found
#
# The record is what later notebooks read (`drc_book.handoff.Training`), written once; the sentence below is
# built from it. If the loss stops falling after a few loops, the extra loops are where a halting rule can save
# compute without losing quality: notebook 2 asks whether each token's state has then reached a fixed point.
# The record lands in `results_dir` as `01_training.json`; the README's headline table is generated from it.

# %%
record = Training.build(profile=profile, model_source=info, n_params=model.num_params(), cfg=cfg,
                        metrics=metrics, ce_by_loops=overall, by_source=by_source, unigram=unigram,
                        n_windows=len(windows), gain=gain, seconds=time.time() - t0)
record.save(results_dir)
display(Markdown(record.findings()))

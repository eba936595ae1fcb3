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
# The model is trained with a randomised number of core loops per step (Poisson-lognormal with mean
# `recurrence.mean`, truncated backprop through the last `recurrence.backprop_loops` loops), so that one
# checkpoint can be run at any depth. This notebook prepares the corpus, trains the profile's preset (or
# loads the shipped checkpoint), and shows the training curves and the validation loss as a function of the
# number of loops at inference.

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

from drc_book import viz
from drc_book.cost import keep_freed_memory
from drc_book.paths import at_root, results_for
from drc_book.workspace import ensure_corpus, open_model, provide_model, save_results
from drc_core import (
    depth_gain_by_step,
    loss_by_depth,
    loss_by_source,
    unigram_loss,
    val_windows_with_docs,
)

work_dir, corpus_dir, checkpoint = at_root(work_dir, corpus_dir, checkpoint)
data_files = [at_root(f) for f in data_files]
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/
keep_freed_memory()  # glibc reuses freed buffers: no page faults on fresh vocabulary-sized arrays

# %%
t0 = time.time()
corpus = ensure_corpus(
    corpus_dir, source, vocab_size, max_docs=max_docs or None, data_files=data_files, progress=False
)
info = provide_model(
    work_dir,
    corpus,
    preset_name=preset,
    overrides=train_overrides,
    checkpoint=checkpoint,
    retrain=retrain,
    progress=False,
)
model, cfg, metrics = open_model(work_dir)
tokens = corpus.meta["tokens"]
print(f"corpus {corpus.path}: {tokens['train']:,} train / {tokens['val']:,} val tokens")
print(f"model from {info['kind']} {info['path']}: {model.num_params():,} parameters")
print(
    f"d={cfg.model.d_model}, heads={cfg.model.n_heads}, prelude/core/coda = "
    f"{cfg.model.n_prelude}/{cfg.model.n_core}/{cfg.model.n_coda}, "
    f"mean depth {cfg.recurrence.mean:g}, "
    f"backprop through the last {cfg.recurrence.backprop_loops} loops, {cfg.max_steps} steps x "
    f"{cfg.batch_size} x {cfg.seq_len} tokens"
)

# %% [markdown]
# ## Training curves
# Training loss (each step at its own sampled depth) and the validation loss at fixed depths during training.

# %%
viz.loss_curves(metrics)

# %% [markdown]
# ## How much depth buys, as training goes on
# The validation loss at 1 and at 8 loops at every evaluation during training, and the gain from depth
# (loss at 1 loop − loss at 8 loops, nats). A gain that still grows at the last step says that a longer
# run would use depth more.

# %%
gain = depth_gain_by_step(metrics, 1, 8)
gain.round(4)

# %% [markdown]
# ## Validation loss versus loops
# The same checkpoint at uniform depths 1..`max_loops` on validation windows (each depth's loss read at
# that loop of one deep pass), per source, with the unigram entropy of the corpus as a floor-free baseline.

# %%
windows, docs = val_windows_with_docs(corpus, cfg.seq_len, n_windows)
loops = sorted({1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, max_loops} & set(range(1, max_loops + 1)))
overall = loss_by_depth(model, windows, loops)
by_source = loss_by_source(model, corpus, cfg.seq_len, tuple(loops), max_windows=n_windows)
table = pd.concat(
    [
        pd.DataFrame({"loops": loops, "loss": [overall[lp] for lp in loops], "series": "all"}),
        by_source.rename(columns={"source": "series"})[["loops", "loss", "series"]],
    ]
)
unigram = unigram_loss(corpus)
viz.loss_vs_depth(table, reference=unigram, reference_label="unigram entropy")

# %%
pivot = table.pivot(index="loops", columns="series", values="loss").round(4)
pivot

# %%
seconds = float(metrics["seconds"].dropna().max())
ce = {int(lp): float(overall[lp]) for lp in loops}
results = {
    "profile": profile,
    "model_source": info,
    "n_params": model.num_params(),
    "train_minutes": seconds / 60,
    "train_tokens": cfg.max_steps * cfg.batch_size * cfg.seq_len,
    "ce_by_loops": ce,
    "unigram": unigram,
    "n_windows": len(windows),
    "ce_by_source": {
        src: dict(zip(g.loops, g.loss, strict=True)) for src, g in by_source.groupby("source")
    },
    "ce_gain_1_to_8": ce.get(1, float("nan")) - ce.get(8, float("nan")),
    "gain_by_step": dict(zip(gain.step.astype(int), gain.gain, strict=True)),
    "notebook_seconds": time.time() - t0,
}
save_results(results_dir, "01_training", results)
headline = {
    "parameters": f"{results['n_params']:,}",
    "training minutes": f"{results['train_minutes']:.1f}",
    "CE(1 loop) − CE(8 loops), nats": f"{results['ce_gain_1_to_8']:.4f}",
    **{f"CE at {k} loop{'s' if k > 1 else ''}, nats": f"{v:.4f}" for k, v in ce.items()},
}
pd.Series(headline, name="value").to_frame()

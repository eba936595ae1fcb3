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
# # 3. Which tokens converge late?
#
# **The question.** Notebook 2 found that tokens reach their fixed point at different loops. Is that spread
# random, or does it follow what a token *is*? The paper reports an order by kind of token: whitespace settles
# first, content words last. If that holds here, a halting rule has something to exploit: the cheap tokens
# are recognisable.
#
# **How.** We reuse notebook 2's measurement (every validation token at every loop, saved as a frame) and read
# each token's convergence depth at the profile's `eps`: the loop after which its successive KL stays below
# `eps` (`drc_core.convergence_depth`). Each token gets a class from its decoded text
# (`drc_core.classify_sequence`): whitespace or newline, punctuation, number, function word (a closed list),
# content word, or a word-continuation piece (no leading space). `drc_core.class_depth_summary` gives each
# class's mean depth with a 95% bootstrap interval that resamples *documents*, the unit whose tokens are not
# independent.
#
# With `checkpoint` set (the `huginn` profile), the classes describe a model trained elsewhere, on notebook 2's
# measurement of it.

# %% tags=["parameters"]
profile = "reference"
work_dir = "runs/book/reference"
results_dir = "papermill_runs/reference/results"
corpus_dir = "data/corpus/default"
seed = 0
eps = 1e-3
explorer_window = 0
explorer_tokens = 96
checkpoint = ""  # a checkpoint trained elsewhere (Huginn format) instead of notebook 1's
# the ipywidgets explorer; the profiles turn it off for papermill runs (a book page has no kernel)
live_explorer = True

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time
from pathlib import Path

import numpy as np
from IPython.display import HTML, Markdown, display

import drc_core
from drc_book import viz
from drc_book.handoff import TokenTypes
from drc_book.paths import at_root, results_for
from drc_book.workspace import open_model
from drc_core import Corpus, Measurement, class_depth_summary, classify_sequence, convergence_depth

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/
checkpoint = at_root(checkpoint) if checkpoint else ""

# %% [markdown]
# The measurement from notebook 2 is refused if it was made on another corpus or tokenizer, so the classes
# below always describe the tokens that were measured. A different `eps` (a parameter) moves every class's
# depth; the order between classes is what this notebook is about.

# %%
t0 = time.time()
corpus = Corpus.open(corpus_dir)
meas = Measurement.load(Path(work_dir) / "frame.parquet",
                        expect={"corpus": corpus.fingerprint, "tokenizer": corpus.tokenizer_hash})
tokenizer = corpus.tokenizer()
depths = convergence_depth(meas, eps)  # one row per token, in (window, pos) order
ids = meas.meta.pivot(index="window", columns="pos", values="token").to_numpy()
classes = np.asarray(classify_sequence(tokenizer, ids)).reshape(-1)
depth, doc = depths.depth.to_numpy(float), depths["doc"].to_numpy()
by_class = class_depth_summary(classes, depth, doc, seed=seed)
by_class

# %% [markdown]
# The table is sorted from the shallowest class to the deepest; `share` is the class's share of the tokens.
# The bars show the same with the intervals: classes whose intervals do not overlap converge at different
# depths on these documents.

# %%
viz.class_depth_bars(by_class)

# %% [markdown]
# ## The per-token depth explorer
#
# A class mean hides the tokens. The explorer shows one validation passage token by token: each token is
# coloured by its successive KL at loop *l*, green below `eps` (settled at that loop), yellow near it, red
# above (still changing). Drag the slider or press play and watch where the red lingers: on the class table's
# deep classes, or somewhere else? The figure is plain plotly, so it works in the static book without a
# kernel (`drc_core.depth_slider_figure`).

# %%
drc_core.depth_slider_figure(meas, explorer_window, tokenizer, eps=eps, max_tokens=explorer_tokens)

# %% [markdown]
# The same passage at one loop as coloured text (converged tokens green, still updating red), at the
# training-mean depth:

# %%
model, cfg, _ = open_model(work_dir, checkpoint)
R = int(cfg.recurrence.mean)  # the training-mean depth
HTML(drc_core.token_strip_html(meas, explorer_window, R, tokenizer, eps=eps, mode="converged",
                               max_tokens=explorer_tokens))

# %% [markdown]
# In JupyterLab the explorer is live (`drc_core.DepthExplorer`): a text box traces any text of your own through
# the model (`drc_core.trace`), and besides the loop slider it has a metric toggle (KL, state change, entropy,
# contraction, commit loop, dynamics class, converged or still updating), the passage as clickable tokens, and
# the selected token's trajectory over the loops. In the rendered book there is no kernel, so the cell below
# only says where to find it.

# %%
if live_explorer:  # live in JupyterLab; the static book has the slider figure above

    def trace_text(text: str):
        """Any text through the studied model (drc_core.trace)."""
        return drc_core.trace(model, text, meas.max_loops, tokenizer=tokenizer)

    explorer = drc_core.DepthExplorer(meas, tokenizer, window=explorer_window, eps=eps,
                                      tracer=trace_text)
    display(explorer.widget)  # explorer.show_text("Your sentence.") traces it from code
else:
    print("The live explorer needs a running kernel: open book/03_token_types.py in JupyterLab.")

# %% [markdown]
# ## What this notebook found
#
# The record below is what later notebooks read (`drc_book.handoff.TokenTypes`): written once, and the sentence
# is built from it, so no number here is typed by hand. What it means for halting: a rule that reads the output
# (notebook 4) stops each token where its own distribution settles, so it gains most where classes differ most;
# when the classes' intervals overlap, uniform depth loses little against it.

# %%
record = TokenTypes.from_table(by_class, profile=profile, eps=eps, seconds=time.time() - t0)
record.save(results_dir)
display(Markdown(record.findings()))

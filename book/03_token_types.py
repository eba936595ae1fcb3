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
# Each token is classified from its decoded text (`drc_core.analysis.tokens`): whitespace/newline, punctuation,
# number, function word (a fixed closed-class list), content word, or word-continuation piece (no leading
# space). The paper's claim: whitespace converges first, content words last. Below: mean convergence depth
# per class with bootstrap intervals over documents, then the per-token depth explorer.

# %% tags=["parameters"]
profile = "reference"
work_dir = "runs/book/reference"
results_dir = "papermill_runs/reference/results"
corpus_dir = "data/corpus/default"
seed = 0
eps = 1e-3
explorer_window = 0
explorer_tokens = 96
# the ipywidgets explorer; the profiles turn it off for papermill runs (a book page has no kernel)
live_explorer = True

# %% tags=["hide-input"]
# imports; the parameters' paths resolved against the repository root (any working directory)
import time
from pathlib import Path

import numpy as np

import drc_core
from drc_book import viz
from drc_book.paths import at_root, results_for
from drc_book.workspace import save_results
from drc_core import Corpus, class_depth_summary, classify_sequence, convergence_depth, load_frame

work_dir, corpus_dir = at_root(work_dir, corpus_dir)
results_dir = results_for(results_dir)  # interactive runs write under runs/lab/

# %%
t0 = time.time()
corpus = Corpus.open(corpus_dir)
# refused when notebook 02 measured another corpus
frame = load_frame(Path(work_dir) / "frame.parquet",
                   expect={"corpus": corpus.fingerprint, "tokenizer": corpus.tokenizer_hash})
tokenizer = corpus.tokenizer()
depths = convergence_depth(frame, eps)
first = frame[frame.loop == 1].sort_values(["window", "pos"])
ids = first.pivot(index="window", columns="pos", values="token").to_numpy()
classes = np.asarray(classify_sequence(tokenizer, ids)).reshape(-1)
by_class = class_depth_summary(
    classes, depths.depth.to_numpy(float), depths["doc"].to_numpy(), seed=seed
)
by_class

# %%
viz.class_depth_bars(by_class)

# %% [markdown]
# ## The per-token depth explorer
# Each token of a validation passage coloured by its successive KL at loop *l* (drag the slider; press
# play). In JupyterLab, `drc_core.DepthExplorer(frame, tokenizer).widget` gives the live version: a text box to
# trace any text of your own, a loop slider, a metric toggle (KL, state change, entropy, converged / still
# updating), the passage as clickable tokens and the selected token's trajectory.

# %%
drc_core.depth_slider_figure(
    frame, explorer_window, tokenizer, eps=eps, max_tokens=explorer_tokens
)

# %% [markdown]
# The same passage at one loop as coloured text (converged tokens green, still updating red), at the
# training-mean depth:

# %%
from IPython.display import HTML, display  # noqa: E402

from drc_book.workspace import open_model  # noqa: E402

model, cfg, _ = open_model(work_dir)
HTML(
    drc_core.token_strip_html(
        frame,
        explorer_window,
        int(cfg.recurrence.mean),
        tokenizer,
        eps=eps,
        mode="converged",
        max_tokens=explorer_tokens,
    )
)

# %%
if live_explorer:  # live in JupyterLab; the static book has the slider figure above
    import drc_core

    def trace_text(text: str):
        """Any text through the studied model: its token x loop frame (drc_core.trace)."""
        return drc_core.trace(model, text, int(frame.loop.max()), tokenizer=tokenizer).frame

    explorer = drc_core.DepthExplorer(
        frame, tokenizer, window=explorer_window, eps=eps, tracer=trace_text
    )
    display(explorer.widget)
    # explorer.show_text("Any sentence of your own.") traces it from code, as the text box does
else:
    print(
        "The live explorer (your own text, loop slider, metric toggle, clickable tokens, per-token "
        "trajectory) needs a running kernel: open book/03_token_types.py in JupyterLab "
        "(live_explorer = True)."
    )

# %%
order = by_class["class"].tolist()
results = {
    "profile": profile,
    "eps": eps,
    "order_shallow_to_deep": order,
    "by_class": {
        r["class"]: {
            "mean_depth": r["mean_depth"],
            "lo": r["ci_low"],
            "hi": r["ci_high"],
            "share": r["share"],
        }
        for r in by_class.to_dict("records")
    },
    "notebook_seconds": time.time() - t0,
}
save_results(results_dir, "03_token_types", results)
print("shallow -> deep:", " < ".join(order))

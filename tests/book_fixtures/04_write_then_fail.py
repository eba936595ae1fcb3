# %% [markdown]
# # Write, then fail
# Rewrites a result of an earlier notebook, adds one of its own and a frame in its work_dir, then raises (or, with
# `sleep_s`, waits first, for the Ctrl-C test): the runner must undo every change.

# %% tags=["parameters"]
profile = "unset"
results_dir = "results"
work_dir = "work"
sleep_s = 0.0

# %%
import time
from pathlib import Path

Path(results_dir).mkdir(parents=True, exist_ok=True)
Path(work_dir).mkdir(parents=True, exist_ok=True)
Path(results_dir, "01_pass.json").write_text('{"rewritten": true}')
Path(results_dir, "04_write_then_fail.json").write_text("{}")
Path(work_dir, "frame.parquet").write_text("fewer windows")
print("wrote", flush=True)
if sleep_s:
    Path(work_dir, "sleeping").write_text("")  # the Ctrl-C test interrupts from here on (undone like the rest)
time.sleep(sleep_s)

# %%
raise ValueError("fixture failure after writing")

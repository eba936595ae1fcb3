# %% [markdown]
# # Passing fixture
# A notebook that declares some of the profile's parameters and writes a results file.

# %% tags=["parameters"]
profile = "unset"
results_dir = "results"
n_windows = 1
label = "default"

# %%
import json
import os
from pathlib import Path

Path(results_dir).mkdir(parents=True, exist_ok=True)
Path(results_dir, "01_pass.json").write_text(json.dumps({"profile": profile, "n_windows": n_windows,
                                                        "run": os.environ.get("DRC_BOOK_RUN")}))
print(f"profile={profile} n_windows={n_windows} label={label}")

"""Tabulate the runs of scripts/cpu_candidates.sh: loss by depth, depth gain, successive KL, bits per byte."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd


def summarize(root: Path) -> pd.DataFrame:
    rows = []
    for f in sorted(root.glob("*/eval.json")):
        r = json.loads(f.read_text())
        loss = {int(k): v for k, v in r["loss_all"].items()}
        kl = {int(k): v for k, v in r["successive_kl"].items()}
        by = pd.DataFrame(r["by_source"])
        cfg = json.loads((f.parent / "config.json").read_text())
        metrics = pd.read_json(f.parent / "metrics.jsonl", lines=True)
        train = metrics[metrics.kind == "train"]
        row = {
            "run": f.parent.name,
            "params_M": r["params"] / 1e6,
            "tokens_M": cfg["max_steps"] * cfg["batch_size"] * cfg["seq_len"] / 1e6,
            "minutes": train.seconds.max() / 60,
            "CE@1": loss[1], "CE@8": loss[8], "CE@32": loss[32], "CE1-CE8": loss[1] - loss[8],
            "KL@2": kl[2], "KL@8": kl[8], "KL@16": kl[16],
        }
        for src, g in by[by.loops == 8].groupby("source"):
            row[f"bpb@8 {src}"] = float(g.bits_per_byte.iloc[0])
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/candidates")
    with pd.option_context("display.width", 200, "display.float_format", "{:.4g}".format):
        print(summarize(root).to_string())

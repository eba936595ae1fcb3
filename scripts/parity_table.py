"""The loss parity table: fp32 eager vs bf16 + compile, small preset, seeds 0-2.

    .venv/bin/python scripts/parity_table.py

fp32: the shipped ``data/experiments/small-mean8-seed{0,1,2}`` (autocast=none, compile=false); bf16 + compile:
``data/parity/small-bf16-seed{0,1,2}`` (``scripts/parity.sh``). Both evaluated in fp32 by ``drc_core.training.evaluate``
on the same validation windows. The verdict asks whether each bf16 mean lies within the fp32 seeds' range.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEEDS = (0, 1, 2)
ARMS = {"fp32 eager": "data/experiments/small-mean8-seed{}", "bf16 + compile": "data/parity/small-bf16-seed{}"}
COLUMNS = ("1", "8", "32")


def load(pattern: str) -> list[dict[str, float]]:
    rows = []
    for seed in SEEDS:
        path = ROOT / pattern.format(seed) / "eval.json"
        if not path.exists():
            raise SystemExit(f"error: {path} is missing: run scripts/parity.sh (bf16) or scripts/small_experiments.sh")
        ce = json.loads(path.read_text())["loss_all"]
        row = {c: ce[c] for c in COLUMNS}
        row["gain"] = ce["1"] - ce["8"]
        rows.append(row)
    return rows


def main() -> int:
    arms = {name: load(pattern) for name, pattern in ARMS.items()}
    keys = (*COLUMNS, "gain")
    print("| arm | " + " | ".join(f"CE@{k}" if k != "gain" else "CE(1)-CE(8)" for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, rows in arms.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rows]
            cells.append(f"{statistics.mean(vals):.4f} [{min(vals):.4f}, {max(vals):.4f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    fp32, bf16 = arms["fp32 eager"], arms["bf16 + compile"]
    print("\n(mean [min, max] over seeds 0, 1, 2)")
    inside = True
    for k in keys:
        lo, hi = min(r[k] for r in fp32), max(r[k] for r in fp32)
        m = statistics.mean(r[k] for r in bf16)
        diff = m - statistics.mean(r[k] for r in fp32)
        ok = lo <= m <= hi
        inside &= ok
        print(f"{k:>5}: bf16 mean {m:.4f} {'inside' if ok else 'OUTSIDE'} the fp32 range [{lo:.4f}, {hi:.4f}]; "
              f"bf16 - fp32 = {diff:+.4f}")
    print("verdict: " + ("parity (every bf16 mean inside the fp32 seeds' range)" if inside else
                         "NOT within the fp32 spread on every column (see above)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

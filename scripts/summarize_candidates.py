"""Tabulate training runs (scripts/cpu_candidates.sh, scripts/depth_levers.sh): loss by depth, depth gain,
successive KL, bits per byte. ``python scripts/summarize_candidates.py runs/candidates``."""

from __future__ import annotations

import sys

import pandas as pd

from drc_book.report import runs_table

if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "runs/candidates"
    with pd.option_context("display.width", 200, "display.float_format", "{:.4g}".format):
        print(runs_table(root).to_string())

#!/usr/bin/env bash
# Loss parity: the small preset, seeds 0-2, on the fast path (bf16 autocast + compiled blocks, the
# default on a bf16 CPU) against the shipped fp32-eager runs of the same preset and seeds
# (data/experiments/small-mean8-seed*, made by scripts/small_experiments.sh with autocast=none compile=false).
# Sequential, resumable (a finished run is skipped). Evaluations (fp32, same windows) and metrics go to
# data/parity/<name>/; `python scripts/parity_table.py` prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/parity}
DATA=${DATA:-data/corpus/default}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$OUT" data/parity
source scripts/lib.sh
$PY -m drc_core.data prepare --quiet --out "$DATA"
for seed in 0 1 2; do
  name=small-bf16-seed$seed
  train_and_eval small "$OUT" "$name" seed=$seed autocast=bf16 compile=true
  mkdir -p "data/parity/$name"
  cp "$OUT/$name/config.json" "$OUT/$name/metrics.jsonl" "$OUT/$name/eval.json" "data/parity/$name/"
done

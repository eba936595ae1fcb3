#!/usr/bin/env bash
# Which lever makes the model use depth? The small preset (d=64, P/R/C 1/2/1, 1200 steps x 16 x 128 tokens,
# mean depth 8, backprop through the last 4 loops) against one change at a time: a deeper training-mean depth
# (16, 24; the shipped mean-4 and mean-12 runs already show the trend), twice the steps (data and schedule), a
# 4-layer core, and backprop through 8 loops. The baseline is the shipped
# data/experiments/small-mean8-seed0 (same config and seed). Two lanes of one thread each; resumable (a
# finished run is skipped). Evaluation (loss by depth, successive KL) and metrics, without weights, are copied to
# data/levers/<name>/ for the book (notebook 07 tabulates them with drc_book.report.runs_table).
# Shipped (2026-12-03, all runs below finished): base, mean-4, mean-12 (copies), mean-16, mean-24, steps-2x,
# core-4, backprop-8.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/levers}
DATA=${DATA:-data/corpus/default}
export OMP_NUM_THREADS=1
mkdir -p "$OUT" data/levers
source scripts/lib.sh
run() {  # name overrides...
  local name=$1; shift
  train_and_eval small "$OUT" "$name" "$@"
  mkdir -p "data/levers/$name"
  cp "$OUT/$name/config.json" "$OUT/$name/metrics.jsonl" "$OUT/$name/eval.json" "data/levers/$name/"
}
$PY -m drc_core.data prepare --quiet --out "$DATA"
mkdir -p data/levers/base
cp data/experiments/small-mean8-seed0/train_config.json data/levers/base/
cp data/experiments/small-mean8-seed0/metrics.jsonl data/experiments/small-mean8-seed0/eval.json data/levers/base/
for m in 4 12; do  # shipped runs of the same preset at other mean depths
  mkdir -p "data/levers/mean-$m"
  cp "data/experiments/small-mean$m-seed0/train_config.json" "data/experiments/small-mean$m-seed0/metrics.jsonl" \
     "data/experiments/small-mean$m-seed0/eval.json" "data/levers/mean-$m/"
done
( run mean-16 recurrence.mean=16; run steps-2x max_steps=2400 ) &
lane=$!
run mean-24 recurrence.mean=24
run core-4 model.n_core=4
run backprop-8 recurrence.backprop_loops=8
wait $lane

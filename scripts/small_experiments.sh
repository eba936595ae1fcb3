#!/usr/bin/env bash
# The small-preset experiments: 3 seeds at training-mean depth 8, and mean depth 4 and 12 (seed 0).
# One thread, sequential, resumable (--resume; a finished run is skipped). The final weights, config,
# metrics and evaluation are copied to data/experiments/<name>/ so the book reads them without retraining.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/small}
DATA=${DATA:-data/corpus/default}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT" data/experiments
source scripts/lib.sh
run() {  # name overrides...
  local name=$1; shift
  train_and_eval small "$OUT" "$name" "$@"
  local dst=data/experiments/$name
  mkdir -p "$dst"
  cp "$OUT/$name/final/model.safetensors" "$OUT/$name/final/config.json" "$dst/"
  cp "$OUT/$name/config.json" "$dst/train_config.json"
  cp "$OUT/$name/metrics.jsonl" "$OUT/$name/eval.json" "$dst/"
}
$PY -m drc_core.data prepare --quiet --out "$DATA"
run small-mean8-seed0 seed=0
run small-mean8-seed1 seed=1
run small-mean8-seed2 seed=2
run small-mean4-seed0 seed=0 recurrence.mean=4
run small-mean12-seed0 seed=0 recurrence.mean=12

#!/usr/bin/env bash
# The measurements behind the `cpu` preset and the default corpus mix (see the book, docs/training.md
# "How the `cpu` preset was chosen" and docs/data.md "Which corpus mix").
# Sequential on purpose: two cores, one run at a time. Budgeted by steps, so load elsewhere only slows it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/candidates}
mkdir -p "$OUT"
run() {  # name data overrides...
  local name=$1 data=$2; shift 2
  local sets=(); for kv in "$@"; do sets+=(--set "$kv"); done
  if [ ! -f "$OUT/$name/final/model.safetensors" ]; then
    $PY -m drc_core.training.train --preset cpu --data "$data" --out "$OUT/$name" --resume --quiet "${sets[@]}"
  fi
  $PY -m drc_core.training.evaluate --run "$OUT/$name" --data "$data" --json "$OUT/$name/eval.json"
}
$PY -m drc_core.data prepare --quiet
$PY -m drc_core.data prepare --quiet --source wikipedia --out data/corpus/wikipedia
SMALL=(model.d_model=128 model.n_heads=4 batch_size=16 warmup_steps=50)
# 1. corpus mix: the same small model on Wikipedia alone and on Wikipedia + SOTU (300 steps = 1.2 M tokens)
run mix-wikipedia data/corpus/wikipedia "${SMALL[@]}" max_steps=300 eval_every=300 ckpt_every=100
run mix-both data/corpus/default "${SMALL[@]}" max_steps=300 eval_every=300 ckpt_every=100
# 2. cpu preset candidates, 500 steps x 16 x 256 tokens each
C=("${SMALL[@]}" max_steps=500 eval_every=250 ckpt_every=250)
run c1-r2-k4 data/corpus/default "${C[@]}" recurrence.backprop_loops=4
run c2-r2-k8 data/corpus/default "${C[@]}" recurrence.backprop_loops=8
run c3-r1-k8 data/corpus/default "${C[@]}" model.n_core=1 recurrence.backprop_loops=8
# Not run yet (time): the mix at a longer budget, where Wikipedia alone repeats its 0.85 M tokens ~5 times
# L=("${SMALL[@]}" max_steps=1000 eval_every=250 ckpt_every=250)
# run mix-wikipedia-long data/corpus/wikipedia "${L[@]}"
# run mix-both-long data/corpus/default "${L[@]}"
echo "all candidates done"

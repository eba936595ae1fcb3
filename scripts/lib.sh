# Shared by the experiment scripts (source it): train a preset run and evaluate it.
# train_and_eval PRESET OUT NAME [KEY=VALUE ...]: trains $OUT/$NAME with `drc_core.training.train --preset PRESET` on
# $DATA (skipped when its final weights exist, resumed when it has checkpoints), then writes
# $OUT/$NAME/eval.json with `drc_core.training.evaluate`. Needs PY and DATA set.
train_and_eval() {
  local preset=$1 out=$2 name=$3; shift 3
  local sets=(); for kv in "$@"; do sets+=(--set "$kv"); done
  if [ ! -f "$out/$name/final/model.safetensors" ]; then
    $PY -m drc_core.training.train --preset "$preset" --data "$DATA" --out "$out/$name" --resume --quiet "${sets[@]}"
  fi
  $PY -m drc_core.training.evaluate --run "$out/$name" --data "$DATA" --json "$out/$name/eval.json"
}

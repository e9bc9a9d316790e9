#!/usr/bin/env bash
# The 8B restore toward the floor in two commands, after the carry (README steps 1-2):
#   bash benchmarks/gpu/floor.sh setup     # install the plugin and vLLM, make the 8B model, capture it with n610
#   PATHS=n610:native:cold bash benchmarks/gpu/floor.sh smoke   # each path restored once, no vanilla: does it work
#   SAMPLES=3 PATHS=n610:native:nofill,n610:native bash benchmarks/gpu/floor.sh samples
# The same setup in less device time, split around the carry calls: `begin` in the call that
# carries the plugin and CRIU (the model is made in the background while vLLM's pieces travel),
# `rest` in the call that carries the engine's wheels (the engine installed, the capture).
# Each step ends well inside the ten minutes one command may take on the GPU machine.
set -euo pipefail
export PYTHONUNBUFFERED=1
WORK=${COLDSNAP_GPU_WORK:-/root/coldsnap-gpu}
source benchmarks/gpu/steps.sh
STEPS=${OUT:-/tmp}/floor-steps.tsv
Q() { python3 benchmarks/gpu/qualify.py "$@" --work "$WORK/q8" --engine-site "$WORK/engine-site"; }
# The model `begin` makes in the background: done when its description is written, failed when
# its maker is gone without one.
wait_for_model() {
  while [ ! -s "$WORK/q8/model.json" ]; do
    if ! kill -0 "$(cat "$WORK/model.pid" 2>/dev/null || echo 0)" 2>/dev/null && [ ! -s "$WORK/q8/model.json" ]; then
      tail -n 20 "$WORK/model.log"; echo "the model was not made" >&2; return 1
    fi
    sleep 1
  done
  cat "$WORK/q8/model.json"
}

case "${1:-}" in
  setup)
    bash benchmarks/gpu/device.sh stash > /dev/null
    step plugin bash benchmarks/gpu/device.sh plugin
    step engine bash benchmarks/gpu/device.sh engine
    eval "$(bash benchmarks/gpu/device.sh env)"
    step model Q model --shape 8b
    step capture Q capture --drivers n610
    ;;
  begin)
    bash benchmarks/gpu/device.sh stash > /dev/null
    step plugin bash benchmarks/gpu/device.sh plugin
    eval "$(bash benchmarks/gpu/device.sh env)"
    mkdir -p "$WORK/q8"
    # A session of its own: it outlives this command while the next calls carry vLLM's pieces.
    setsid bash -c 'echo $$ > "$0/model.pid"; exec python3 benchmarks/gpu/qualify.py model --shape 8b --work "$0/q8" --engine-site "$0/engine-site"' "$WORK" > "$WORK/model.log" 2>&1 < /dev/null &
    echo "making the 8B model in the background (log: $WORK/model.log)"
    ;;
  rest)
    bash benchmarks/gpu/device.sh stash > /dev/null
    step engine bash benchmarks/gpu/device.sh engine
    eval "$(bash benchmarks/gpu/device.sh env)"
    step model wait_for_model
    step capture Q capture --drivers n610
    ;;
  smoke)
    eval "$(bash benchmarks/gpu/device.sh env)"
    step smoke Q smoke --paths "${PATHS:-n610:native:cold}" --smoke-samples "${SAMPLES:-1}"
    ;;
  samples)
    eval "$(bash benchmarks/gpu/device.sh env)"
    step samples Q samples --paths "${PATHS:-n610:native:nofill,n610:native}" --samples "${SAMPLES:-3}"
    ;;
  *) echo "usage: $0 setup|begin|rest|smoke|samples" >&2; exit 2 ;;
esac
cat "$STEPS"

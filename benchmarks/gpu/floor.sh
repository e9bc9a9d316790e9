#!/usr/bin/env bash
# The 8B restore toward the floor in two commands, after the carry (README steps 1-2):
#   bash benchmarks/gpu/floor.sh setup     # install the plugin and vLLM, make the 8B model, capture it with n610
#   PATHS=n610:native:cold bash benchmarks/gpu/floor.sh smoke   # each path restored once, no vanilla: does it work
#   SAMPLES=3 PATHS=n610:native:nofill,n610:native bash benchmarks/gpu/floor.sh samples
# Each step ends well inside the ten minutes one command may take on the GPU machine.
set -euo pipefail
export PYTHONUNBUFFERED=1
WORK=${COLDSNAP_GPU_WORK:-/root/coldsnap-gpu}
source benchmarks/gpu/steps.sh
STEPS=${OUT:-/tmp}/floor-steps.tsv
Q() { python3 benchmarks/gpu/qualify.py "$@" --work "$WORK/q8" --engine-site "$WORK/engine-site"; }

case "${1:-}" in
  setup)
    bash benchmarks/gpu/device.sh stash > /dev/null
    step plugin bash benchmarks/gpu/device.sh plugin
    step engine bash benchmarks/gpu/device.sh engine
    eval "$(bash benchmarks/gpu/device.sh env)"
    step model Q model --shape 8b
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
  *) echo "usage: $0 setup|smoke|samples" >&2; exit 2 ;;
esac
cat "$STEPS"

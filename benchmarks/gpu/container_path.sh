#!/usr/bin/env bash
# The GPU engine in sparkrun's Docker containers, through sparkrun's own CLI, in the shape users'
# recipes have: `executor: docker`, `container:` an image, `command: vllm serve {model} ...`, the
# model's revision pinned, a `coldsnap:` block (driver n610). One mode a command (each ends well
# inside the ten minutes a command may take there):
#   bash benchmarks/gpu/container_path.sh setup     # the plugin through sparkrun (sparkrun_setup.sh), the docker executor on, the image, the recipes
#   bash benchmarks/gpu/container_path.sh recipe    # only write the two recipes
#   bash benchmarks/gpu/container_path.sh capture   # sparkrun coldsnap capture of the container recipe
#   bash benchmarks/gpu/container_path.sh path      # run (restored), status, chat, logs, stop, run, run again (replacement), stop
#   bash benchmarks/gpu/container_path.sh replace   # run (restored), run again while it serves (the replacement), chat, stop
#   bash benchmarks/gpu/container_path.sh bench     # sparkrun coldsnap bench: vanilla container starts and restores alternated
#   bash benchmarks/gpu/container_path.sh host-capture  # the same model as host processes (executor: local): capture
#   bash benchmarks/gpu/container_path.sh host-bench    # ... and its bench, the comparison measured the same day
#   bash benchmarks/gpu/container_path.sh host-restores # ... or only its restores (SAMPLES of them through sparkrun run)
# After `device.sh stash`, `device.sh plugin` and `device.sh engine` (floor.sh begin/rest do
# them), `docker.sh up` and a model (`qualify.py model --shape 8b --work $WORK/q8`).
#
# The GPU without NVIDIA's container toolkit: the machine has none, so `--gpus all` (what a
# machine with the toolkit is given by sparkrun's executor, its prestart hook mounting the
# driver) cannot work there. The plugin's container path never uses it: every container it
# starts, vanilla or restored, gets its GPUs as entries of its own spec, the device nodes
# (`--device /dev/nvidia0`, /dev/nvidiactl, /dev/nvidia-uvm, ...) and the driver's files
# read-only at their own paths (launch/gpu_devices.py), which CRIU can checkpoint and runc
# recreate; the hook's mounts are outside the spec and CRIU refuses them.
#
# Settings (environment):
#   WORK         where device.sh keeps things (default /root/coldsnap-gpu)
#   MODEL_JSON   qualify.py's model.json (default $WORK/q8/model.json): id, revision, path
#   IMAGE        the engine's image (default coldsnap/vllm-gpu:0.26.0, engine_image.sh makes it)
#   SAMPLES      samples of each kind in bench and host (default 3)
#   RESULTS      where logs, tables and bench output go (default $OUT, else .)
#   SKIP_SETUP=1 setup leaves out installing and configuring the plugin (an earlier run did)
set -uo pipefail
MODE=${1:-}
WORK=${WORK:-${COLDSNAP_GPU_WORK:-/root/coldsnap-gpu}}
MODEL_JSON=${MODEL_JSON:-$WORK/q8/model.json}
IMAGE=${IMAGE:-coldsnap/vllm-gpu:0.26.0}
ENGINE_SITE=${ENGINE_SITE:-$WORK/engine-site}
SITE=${SITE:-$WORK/user-site}
PY=${PY:-python3}
SAMPLES=${SAMPLES:-3}
RESULTS=${RESULTS:-${OUT:-.}}
PORT=${PORT:-8000}
# The private CRIU and the capsule store live here (device.sh env names the same): every mode
# must see the one `device.sh plugin` and `docker.sh up` set up.
export COLDSNAP_HOME=${COLDSNAP_HOME:-$WORK/coldsnap-home}
DOCKER_RECIPE=$WORK/recipes/coldsnap-gpu-vllm-docker.yaml
HOST_RECIPE=$WORK/recipes/coldsnap-gpu-vllm-host.yaml
mkdir -p "$RESULTS" "$WORK/recipes"
STEPS="$RESULTS/container-path-$MODE-steps.tsv"
: > "$STEPS"
# now, step NAME CMD..., gpu_mib, wait_gpu_released, validation_block
. "$(dirname "$0")/steps.sh"
HERE=$(cd "$(dirname "$0")/../.." && pwd)

# The same engine arguments for both recipes: the comparison is the container, nothing else.
ENGINE_ARGS="{model} --revision {model_revision} --port {port} --gpu-memory-utilization 0.3 --max-model-len 2048 --disable-custom-all-reduce"

write_recipes() {
  local model_id revision hf_home
  read -r model_id revision hf_home < <("$PY" - "$MODEL_JSON" <<'EOF'
import json, sys
from pathlib import Path
m = json.loads(Path(sys.argv[1]).read_text())
print(m["model_id"], m["revision"], Path(m["path"]).parents[3])
EOF
)
  [ -n "$revision" ] || { echo "no model in $MODEL_JSON: run qualify.py model first" >&2; return 1; }
  echo "HF_HOME=$hf_home" > "$WORK/recipes/hf_home"
  # sparkrun mounts the Hugging Face cache (HF_HOME here) at /cache/huggingface in the container
  # and points the engine there; `vllm` is the console script of the image's engine packages.
  cat > "$DOCKER_RECIPE" <<EOF
recipe_version: "2"
description: $model_id on vLLM 0.26.0 in a Docker container, one GPU, restored from a ColdSnap capsule
model: $model_id
model_revision: $revision
runtime: vllm
container: $IMAGE
executor: docker
defaults:
  port: $PORT
env:
  HF_HUB_OFFLINE: "1"
  VLLM_USE_FLASHINFER_SAMPLER: "0"
command: vllm serve $ENGINE_ARGS
coldsnap:
  driver: n610
$(validation_block)
EOF
  # The host-process twin: the same engine from the same packages, run by the local executor.
  cat > "$HOST_RECIPE" <<EOF
recipe_version: "2"
description: $model_id on vLLM 0.26.0 as host processes, one GPU, restored from a ColdSnap capsule
model: $model_id
model_revision: $revision
runtime: vllm
executor: local
defaults:
  port: $PORT
env:
  PYTHONPATH: $ENGINE_SITE
  HF_HUB_OFFLINE: "1"
  VLLM_USE_FLASHINFER_SAMPLER: "0"
command: $ENGINE_SITE/bin/vllm serve $ENGINE_ARGS
coldsnap:
  driver: n610
$(validation_block)
EOF
  for r in "$DOCKER_RECIPE" "$HOST_RECIPE"; do echo "--- $r"; cat "$r"; done
}

# The model floor.sh begin makes in the background: done when its description is written,
# failed when its maker is gone without one.
# shellcheck disable=SC2317  # run by step
wait_for_model() {
  while [ ! -s "$MODEL_JSON" ]; do
    if ! kill -0 "$(cat "$WORK/model.pid" 2>/dev/null || echo 0)" 2>/dev/null && [ ! -s "$MODEL_JSON" ]; then
      tail -n 20 "$WORK/model.log" 2>/dev/null; echo "no model at $MODEL_JSON and none being made" >&2; return 1
    fi
    sleep 1
  done
}

# The plugin as sparkrun_setup.sh installed it; HF_HOME where the model is.
use_plugin() {
  export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  [ -s "$WORK/recipes/hf_home" ] && export "$(cat "$WORK/recipes/hf_home")"
  eval "$(bash "$HERE/benchmarks/gpu/docker.sh" env)"
  # sparkrun enables the plugin by its feature flag where `plugins enable` refused (sparkrun_setup.sh)
  sparkrun plugins list 2>/dev/null | grep -q "coldsnap.*enabled" || export SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1
}

# shellcheck disable=SC2317  # run by step
chat() {
  "$PY" "$HERE/benchmarks/gpu/chat.py" "http://127.0.0.1:$PORT" "$1"
}

# restored STEP RECIPE: `sparkrun run`, which must restore the capsule and validate it.
restored() {
  local log
  log=$RESULTS/container-$(echo "$1" | tr -c 'a-z0-9\n' '-').log
  step "$1" sparkrun run "$2" --no-follow | tee "$log" || FAILED=1
  if grep -q "reply matches capture" "$log"; then echo "restored and validated"; else echo "sparkrun run did not restore a validated capsule"; FAILED=1; fi
  docker ps --format '{{.Names}} {{.Image}} {{.Status}}'
  echo "GPU memory used while serving: $(gpu_mib) MiB"
}

# restores LABEL RECIPE: SAMPLES restores through `sparkrun run`, the page cache dropped before
# each and the workload stopped after it; each validated, its receipt kept. No vanilla start
# beside them: this is the comparison for the other recipe's bench, not a bench of its own.
restores() {
  local label=$1 recipe=$2 i log
  for i in $(seq "$SAMPLES"); do
    sync && echo 3 > /proc/sys/vm/drop_caches
    log=$RESULTS/$label-$i.log
    step "$label $i" sparkrun run "$recipe" --no-follow > "$log" 2>&1 || FAILED=1
    grep -o "first token [0-9.]* s after the restore began, reply matches capture" "$log" || { echo "sample $i: no validated restore"; tail -n 20 "$log"; FAILED=1; }
    cp "$(find "$COLDSNAP_HOME/store/receipts" -name '*.json' -printf '%T@ %p\n' | sort -n | tail -n 1 | cut -d' ' -f2-)" "$RESULTS/$label-$i-receipt.json"
    step "stop $i" sparkrun stop "$recipe" > /dev/null || FAILED=1
    wait_gpu_released
  done
  grep -ho "first token [0-9.]*" "$RESULTS/$label"-*.log | awk '{print $3}' | sort -n |
    awk -v l="$label" '{a[NR] = $1} END {if (NR) printf "%s: first token median %.2f s (min %.2f, max %.2f, n=%d)\n", l, a[int((NR + 1) / 2)], a[1], a[NR], NR}'
}

FAILED=0
case "$MODE" in
  setup)
    echo "container path setup, $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
    . "$HERE/benchmarks/gpu/sparkrun_setup.sh" || exit 1
    # setup --sparkrun turns the docker executor off where no daemon answered; docker.sh up ran first.
    step "docker executor on" sparkrun setup features enable executor.docker || FAILED=1
    step image bash "$HERE/benchmarks/gpu/engine_image.sh" || FAILED=1
    step model wait_for_model || FAILED=1
    step recipes write_recipes || FAILED=1
    step doctor sparkrun coldsnap doctor
    ;;
  recipe) write_recipes || FAILED=1 ;;
  capture)
    use_plugin
    step "coldsnap capture" sparkrun coldsnap capture "$DOCKER_RECIPE" || FAILED=1
    echo "GPU memory used after capture: $(gpu_mib) MiB"
    docker ps -a --format '{{.Names}} {{.Status}}'
    ;;
  path)
    use_plugin
    model_id=$(awk '/^model:/ {print $2}' "$DOCKER_RECIPE")
    before=$(gpu_mib)
    restored run "$DOCKER_RECIPE"
    step status sparkrun status | tee "$RESULTS/container-status.log"
    if grep -q "$(basename "$DOCKER_RECIPE" .yaml)\|$model_id" "$RESULTS/container-status.log"; then echo "listed by sparkrun status"; else echo "not listed by sparkrun status"; FAILED=1; fi
    step chat chat "$model_id" || FAILED=1
    step logs sparkrun logs "$DOCKER_RECIPE" -n 20 || FAILED=1
    step stop sparkrun stop "$DOCKER_RECIPE" || FAILED=1
    wait_gpu_released
    if [ -z "$(docker ps -aq)" ]; then echo "no container left"; else echo "containers left after stop:"; docker ps -a; FAILED=1; fi
    echo "GPU memory: $before MiB before the run, $(gpu_mib) MiB after stop"
    # Then a replacement: a second `sparkrun run` while the first serves stages the new
    # container beside the old one and swaps them.
    restored "run again" "$DOCKER_RECIPE"
    restored "run (replacement)" "$DOCKER_RECIPE"
    step chat chat "$model_id" || FAILED=1
    step stop sparkrun stop "$DOCKER_RECIPE" || FAILED=1
    wait_gpu_released
    docker ps -a --format '{{.Names}} {{.Status}}'
    ;;
  replace)
    use_plugin
    model_id=$(awk '/^model:/ {print $2}' "$DOCKER_RECIPE")
    restored run "$DOCKER_RECIPE"
    first=$(docker ps -q)
    restored "run (replacement)" "$DOCKER_RECIPE"
    if [ -n "$(docker ps -q)" ] && [ "$(docker ps -q)" != "$first" ] && [ "$(docker ps -q | wc -l)" = 1 ]; then echo "replaced: one container serves, a new one"; else echo "not replaced"; docker ps -a; FAILED=1; fi
    step chat chat "$model_id" || FAILED=1
    step stop sparkrun stop "$DOCKER_RECIPE" || FAILED=1
    wait_gpu_released
    if [ -z "$(docker ps -aq)" ]; then echo "no container left"; else docker ps -a; FAILED=1; fi
    ;;
  bench)
    use_plugin
    step "bench container" sparkrun coldsnap bench "$DOCKER_RECIPE" --samples "$SAMPLES" --out "$RESULTS/bench-container" || FAILED=1
    ;;
  host-capture)
    use_plugin
    step "coldsnap capture (host)" sparkrun coldsnap capture "$HOST_RECIPE" || FAILED=1
    ;;
  host-bench)
    use_plugin
    step "bench host" sparkrun coldsnap bench "$HOST_RECIPE" --samples "$SAMPLES" --out "$RESULTS/bench-host" || FAILED=1
    ;;
  host-restores)
    use_plugin
    restores host-restore "$HOST_RECIPE"
    ;;
  *) echo "usage: $0 setup|recipe|capture|path|replace|bench|host-capture|host-bench|host-restores" >&2; exit 2 ;;
esac
echo
awk -F'\t' '{printf "  %-24s %8.2f s  exit %s  GPU %s MiB\n", $1, $2, $3, $4}' "$STEPS"
[ $FAILED = 0 ] && echo "RESULT: $MODE passed" || echo "RESULT: $MODE FAILED"
exit $FAILED

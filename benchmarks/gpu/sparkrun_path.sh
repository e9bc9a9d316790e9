#!/usr/bin/env bash
# The user's path on the GPU machine, through sparkrun's own CLI, one engine per run:
# install the plugin, enable it, configure sparkrun as docs/user-guide.md says (a local cluster,
# the local executor), write a GPU recipe (the model in the Hugging Face cache, the engine's own
# packages on its PYTHONPATH), then
#   sparkrun coldsnap capture -> sparkrun run (restored, validated) -> sparkrun status (listed)
#   -> a chat request -> sparkrun stop (GPU memory released),
# printing each step's time, and a table of them at the end.
#
#   bash benchmarks/gpu/sparkrun_path.sh vllm|sglang
#
# Run from the repository root after `device.sh stash` (plugin wheels, CRIU packages), `device.sh
# engine` / `device.sh sglang` (the engine's target) and `qualify.py model` (the model). The
# machine reaches no package registry, so the plugin is installed from the carried wheels with
# `pip install --no-deps --no-index --target`, the one way its image allows beside its own packages.
# Settings (environment):
#   WORK         where device.sh keeps things (default /root/coldsnap-gpu)
#   MODEL_JSON   qualify.py's model.json (default $WORK/sgl-1.5b/model.json): id, revision, path
#   ENGINE_SITE  the engine's packages (default $WORK/engine-site for vllm, $WORK/sglang-site for sglang)
#   SITE         where the plugin is installed (default $WORK/user-site)
#   PY           the interpreter of the plugin and of the engine (default python3)
#   RESULTS      where the step table and the log go (default $OUT, else .)
#   SKIP_SETUP=1 leave out installing and configuring (done by an earlier run on this machine)
set -uo pipefail
ENGINE=${1:?usage: $0 vllm|sglang}
WORK=${WORK:-/root/coldsnap-gpu}
MODEL_JSON=${MODEL_JSON:-$WORK/sgl-1.5b/model.json}
SITE=${SITE:-$WORK/user-site}
PY=${PY:-python3}
RESULTS=${RESULTS:-${OUT:-.}}
PORT=${PORT:-8000}
case "$ENGINE" in
  vllm) ENGINE_SITE=${ENGINE_SITE:-$WORK/engine-site} ;;
  sglang) ENGINE_SITE=${ENGINE_SITE:-$WORK/sglang-site} ;;
  *) echo "usage: $0 vllm|sglang" >&2; exit 2 ;;
esac
mkdir -p "$RESULTS" "$WORK/recipes"
STEPS="$RESULTS/sparkrun-path-$ENGINE-steps.tsv"
: > "$STEPS"

# now, step NAME CMD... (prints its output and time, keeps it for the table), gpu_mib
. "$(dirname "$0")/steps.sh"

echo "sparkrun path, $ENGINE, $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"

# 1-3. Install, enable, configure (sparkrun_setup.sh).
. "$(dirname "$0")/sparkrun_setup.sh" || exit 1

# 4. A GPU recipe: the model by id and revision in the Hugging Face cache, the engine's own packages.
eval "$("$PY" - "$MODEL_JSON" <<'EOF'
import json, sys
from pathlib import Path
m = json.loads(Path(sys.argv[1]).read_text())
print("MODEL_ID=%s REVISION=%s HF_HOME=%s" % (m["model_id"], m["revision"], Path(m["path"]).parents[3]))
EOF
)"
export HF_HOME
RECIPE=$WORK/recipes/coldsnap-gpu-$ENGINE.yaml
case "$ENGINE" in
  vllm)
    ENV_LINES="  VLLM_USE_FLASHINFER_SAMPLER: \"0\""
    COMMAND="$PY -m vllm.entrypoints.openai.api_server --model {model} --revision {model_revision} --port {port} --gpu-memory-utilization 0.3 --max-model-len 2048 --disable-custom-all-reduce" ;;
  sglang)
    ENV_LINES=""
    # The PyTorch sampler: flashinfer's would JIT-compile its kernels at the first request.
    COMMAND="$PY -m sglang.launch_server --model-path {model} --revision {model_revision} --port {port} --mem-fraction-static 0.3 --context-length 2048 --disable-custom-all-reduce --sampling-backend pytorch" ;;
esac
cat > "$RECIPE" <<EOF
recipe_version: "2"
description: $MODEL_ID on $ENGINE, one GPU, restored from a ColdSnap capsule
model: $MODEL_ID
model_revision: $REVISION
runtime: $ENGINE
executor: local
defaults:
  port: $PORT
env:
  PYTHONPATH: $ENGINE_SITE
  HF_HUB_OFFLINE: "1"
${ENV_LINES}
command: $COMMAND
coldsnap:
$(validation_block)
EOF
echo "--- $RECIPE"; cat "$RECIPE"; echo "---"

# 5. The user's commands.
FAILED=0
step "coldsnap capture" sparkrun coldsnap capture "$RECIPE" || FAILED=1
echo "GPU memory used after capture: $(gpu_mib) MiB"
if [ $FAILED = 0 ]; then
  RUN_LOG=$RESULTS/run-$ENGINE.log
  step "run (restore)" sparkrun run "$RECIPE" --no-follow | tee "$RUN_LOG" || FAILED=1
  grep -q "reply matches capture" "$RUN_LOG" && echo "restored and validated" || { echo "sparkrun run did not restore a validated capsule"; FAILED=1; }
  echo "GPU memory used while serving: $(gpu_mib) MiB"
  STATUS_LOG=$RESULTS/status-$ENGINE.log
  step status sparkrun status | tee "$STATUS_LOG"
  grep -q "$(basename "$RECIPE" .yaml)\|$MODEL_ID" "$STATUS_LOG" && echo "listed by sparkrun status" || { echo "not listed by sparkrun status"; FAILED=1; }
  step chat "$PY" "$(dirname "$0")/chat.py" "http://127.0.0.1:$PORT" "$MODEL_ID" || FAILED=1
fi
step stop sparkrun stop "$RECIPE" || FAILED=1
wait_gpu_released
[ "$(gpu_mib)" = "?" ] || [ "$(gpu_mib)" -lt 100 ] || { echo "GPU memory was not released"; FAILED=1; }
step "status after stop" sparkrun status

echo
echo "sparkrun path, $ENGINE: step times"
awk -F'\t' '{printf "  %-20s %8.2f s  exit %s\n", $1, $2, $3}' "$STEPS"
[ $FAILED = 0 ] && echo "RESULT: all steps passed" || echo "RESULT: FAILED"
exit $FAILED

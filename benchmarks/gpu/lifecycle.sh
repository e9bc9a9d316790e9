#!/usr/bin/env bash
# Every lifecycle transition on the GPU machine, through sparkrun's own CLI, one engine per run:
#   sparkrun run (restored) -> sleep (level 1) -> wake -> sleep (level 2) -> wake -> hibernate
#   -> wake (restored from the hibernation capsule) -> hibernate -> warm -> sparkrun run (activates)
#   -> stop, with `sparkrun coldsnap status` and the GPU memory in use after each step; then
#   `sparkrun coldsnap bench RECIPE --lifecycle --samples N`: medians of every transition against
#   a vanilla start in the same run.
#
#   bash benchmarks/gpu/lifecycle.sh vllm|sglang [transitions|bench]
#
# With a second argument it runs only that half: `transitions` (the steps up to stop) or `bench`
# (the benchmark), so that each fits in a command of at most ten minutes.
# Run from the repository root after benchmarks/gpu/sparkrun_path.sh for the same engine on this
# machine: it installed and configured the plugin, wrote the recipe and captured its capsule.
# Settings (environment), as sparkrun_path.sh's:
#   WORK     where device.sh keeps things (default /root/coldsnap-gpu)
#   MODEL_JSON  qualify.py's model.json the recipe serves (default $WORK/sgl-1.5b/model.json)
#   SITE     where the plugin is installed (default $WORK/user-site)
#   PY       the interpreter of the plugin and of the engine (default python3)
#   SAMPLES  samples of the benchmark (default 3)
#   RESULTS  where the step table, the logs and the benchmark go (default $OUT, else .)
set -uo pipefail
ENGINE=${1:?usage: $0 vllm|sglang [transitions|bench]}
PART=${2:-all}
case "$PART" in all|transitions|bench) ;; *) echo "usage: $0 vllm|sglang [transitions|bench]" >&2; exit 2 ;; esac
WORK=${WORK:-/root/coldsnap-gpu}
MODEL_JSON=${MODEL_JSON:-$WORK/sgl-1.5b/model.json}
SITE=${SITE:-$WORK/user-site}
PY=${PY:-python3}
SAMPLES=${SAMPLES:-3}
RESULTS=${RESULTS:-${OUT:-.}}
RECIPE=$WORK/recipes/coldsnap-gpu-$ENGINE.yaml
[ -f "$RECIPE" ] || { echo "no $RECIPE: run benchmarks/gpu/sparkrun_path.sh $ENGINE first" >&2; exit 2; }
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Where `sparkrun plugins enable coldsnap` refuses (beside an image's newer packages),
# sparkrun_path.sh enabled the plugin with SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1, which lasts only
# for that script: the same here. Without it sparkrun has no `coldsnap` command and `sparkrun run`
# starts the recipe vanilla, saying nothing.
if ! sparkrun coldsnap --help >/dev/null 2>&1; then
  export SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1
  sparkrun coldsnap --help >/dev/null 2>&1 || { echo "sparkrun has no coldsnap command, even with SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1: is the plugin installed in $SITE?" >&2; exit 2; }
  echo "the plugin is not enabled in sparkrun's settings here; enabled with SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1"
fi
# `sparkrun coldsnap sleep|wake|hibernate|warm RECIPE` find the recipe's workload by the cluster id
# sparkrun plans for it, which stays the same from one command to the next only under a scheduler
# with deterministic placement (greedy). sparkrun 0.4.2 creates clusters with occupancy-sparse, which
# draws a new placement token for every plan: each verb then answered "recipe ... has no workload
# managed here (it would be sparkrun_<intent>_<new token>_solo)" (docs/benchmarks.md, "Lifecycle
# transitions on the H200"). The cluster sparkrun_path.sh made gets the greedy scheduler.
if sparkrun cluster update coldsnap-local --scheduler greedy >/dev/null 2>&1; then
  echo "cluster coldsnap-local: scheduler greedy"
else
  echo "could not set the greedy scheduler on cluster coldsnap-local: the lifecycle verbs may not find the workload" >&2
fi
# The Hugging Face cache the model is in, as sparkrun_path.sh found it.
HF_HOME=$("$PY" -c 'import json, sys; from pathlib import Path; print(Path(json.loads(Path(sys.argv[1]).read_text())["path"]).parents[3])' "$MODEL_JSON") || exit 2
export HF_HOME
mkdir -p "$RESULTS"
STEPS="$RESULTS/lifecycle-$ENGINE-steps.tsv"
[ "$PART" = bench ] || : > "$STEPS"

# now, step NAME CMD..., gpu_mib
. "$(dirname "$0")/steps.sh"
state() { sparkrun coldsnap status "$RECIPE" 2>&1; }

echo "lifecycle, $ENGINE, $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
FAILED=0
if [ "$PART" != bench ]; then
  step "run (restore)" sparkrun run "$RECIPE" --no-follow | tee "$RESULTS/run-$ENGINE.log" || exit 1
  grep -q "reply matches capture" "$RESULTS/run-$ENGINE.log" || { echo "sparkrun run did not restore a validated capsule: the transitions need a workload the plugin manages"; exit 1; }
  state
  if [ "$ENGINE" = vllm ]; then LEVELS="1 2"; else LEVELS="2"; fi
  for level in $LEVELS; do
    step "sleep level $level" sparkrun coldsnap sleep "$RECIPE" --level "$level" || FAILED=1
    state
    step "wake from sleep level $level" sparkrun coldsnap wake "$RECIPE" || FAILED=1
  done
  step hibernate sparkrun coldsnap hibernate "$RECIPE" || FAILED=1
  state
  step "wake from hibernation" sparkrun coldsnap wake "$RECIPE" || FAILED=1
  state
  step "hibernate again" sparkrun coldsnap hibernate "$RECIPE" || FAILED=1
  step warm sparkrun coldsnap warm "$RECIPE" || FAILED=1
  state
  step "run (activate from warm)" sparkrun run "$RECIPE" --no-follow || FAILED=1
  state
  step stop sparkrun stop "$RECIPE" || FAILED=1
  wait_gpu_released
fi
if [ "$PART" != transitions ]; then
  step "bench --lifecycle" sparkrun coldsnap bench "$RECIPE" --lifecycle --samples "$SAMPLES" --out "$RESULTS/lifecycle-$ENGINE" || FAILED=1
fi

echo
echo "lifecycle, $ENGINE: step times (GPU memory in use after each)"
awk -F'\t' '{printf "  %-28s %8.2f s  exit %s  GPU %s MiB\n", $1, $2, $3, $4}' "$STEPS"
[ $FAILED = 0 ] && echo "RESULT: all steps passed" || echo "RESULT: FAILED"
exit $FAILED

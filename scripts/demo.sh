#!/usr/bin/env bash
# The main job on the embedded default: set everything up, then a vanilla start, a capture, a
# second vanilla start and a ColdSnap restore of the same recipe through sparkrun, each start with
# the page cache dropped, and print the times to first token and the restore's ratio to each start.
# The first start may compile (vLLM's compile cache is empty on a first run); the second finds the
# cache the earlier starts filled, as every later vanilla start of the recipe would.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1
RECIPE=${1:-recipes/tiny-vllm-cpu.yaml}
# A store of its own, so the first start really has no capsule.
STORE="$PWD/.work/demo-store"
# The second vanilla start gets a store with no capsule, so the plugin starts the engine the
# ordinary way instead of restoring the capsule the capture made.
VANILLA_STORE="$PWD/.work/demo-store-vanilla"
rm -rf "$STORE" "$VANILLA_STORE"
export COLDSNAP_STORE="$STORE"
SR=.venv/bin/sparkrun
# The local cluster the set-up made (localhost, local executor), whatever the default is.
WHERE="--cluster coldsnap-local"
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }
# vLLM's compile cache (VLLM_CACHE_ROOT, default under the user's cache folder): whether the
# first start found it empty decides what its figure is called.
COMPILE_CACHE="${VLLM_CACHE_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm}/torch_compile_cache"
if [ -n "$(ls -A "$COMPILE_CACHE" 2>/dev/null)" ]; then FIRST_CACHE=filled; else FIRST_CACHE=empty; fi

$SR stop "$RECIPE" $WHERE >/dev/null 2>&1 || true
echo; echo "=== 1/4 vanilla start: no capsule yet, so the plugin starts the engine the ordinary way (compile cache $FIRST_CACHE)"
drop_caches
$SR run "$RECIPE" $WHERE --no-follow
$SR stop "$RECIPE" $WHERE

echo; echo "=== 2/4 capture: start, validate with a real request, checkpoint into a capsule"
$SR coldsnap capture "$RECIPE" $WHERE

echo; echo "=== 3/4 vanilla start again, now with a warm compile cache (a store with no capsule)"
drop_caches
COLDSNAP_STORE="$VANILLA_STORE" $SR run "$RECIPE" $WHERE --no-follow
COLDSNAP_STORE="$VANILLA_STORE" $SR stop "$RECIPE" $WHERE

echo; echo "=== 4/4 restore through sparkrun run"
drop_caches
$SR run "$RECIPE" $WHERE --no-follow
$SR status $WHERE
$SR stop "$RECIPE" $WHERE

.venv/bin/python scripts/demo_summary.py "$STORE" "$VANILLA_STORE" "$FIRST_CACHE"

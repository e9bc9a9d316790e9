#!/usr/bin/env bash
# The main job on the embedded default: set everything up, then one vanilla start and one
# ColdSnap restore of the same recipe through sparkrun, each with the page cache dropped,
# and print both times to first token and their ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1
RECIPE=${1:-recipes/tiny-vllm-cpu.yaml}
# A store of its own, so the first start really has no capsule.
export COLDSNAP_STORE="$PWD/.work/demo-store"
rm -rf "$COLDSNAP_STORE"
SR=.venv/bin/sparkrun
# The local cluster the set-up made (localhost, local executor), whatever the default is.
WHERE="--cluster coldsnap-local"
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }

$SR stop "$RECIPE" $WHERE >/dev/null 2>&1 || true
echo; echo "=== 1/3 vanilla start: no capsule yet, so the plugin starts the engine the ordinary way"
drop_caches
$SR run "$RECIPE" $WHERE --no-follow
$SR stop "$RECIPE" $WHERE

echo; echo "=== 2/3 capture: start, validate with a real request, checkpoint into a capsule"
$SR coldsnap capture "$RECIPE" $WHERE

echo; echo "=== 3/3 restore through sparkrun run"
drop_caches
$SR run "$RECIPE" $WHERE --no-follow
$SR status $WHERE
$SR stop "$RECIPE" $WHERE

.venv/bin/python - "$COLDSNAP_STORE" <<'PY'
import glob, json, sys
def latest(kind):
    paths = sorted(glob.glob("%s/receipts/*/*-%s.json" % (sys.argv[1], kind)))
    return json.load(open(paths[-1]))
start, restore = latest("start"), latest("restore")
v, r = start["validation"]["ttft_seconds"], restore["validation"]["ttft_seconds"]
print()
print("vanilla start -> first token:   %6.2f s" % v)
print("ColdSnap restore -> first token: %6.2f s  (reply identical to capture: %s)" % (r, restore["validation"]["passed"]))
print("ratio: %.1fx faster" % (v / r))
PY

#!/usr/bin/env bash
# A placement manager other than sparkrun, in one screen of shell: it decides where and when,
# and hands ColdSnap request documents; ColdSnap owns capture, admission, restore and receipts.
#
#   bash docs/examples/shell-manager.sh RECIPE STORE OUT
#
# 1. renders the capture and restore request documents from RECIPE once (sparkrun's placement,
#    --dry-run: nothing runs); a manager may as well write them itself against docs/schemas/;
# 2. captures from the capture document alone;
# 3. restores one unit with the barrier protocol: the unit prepares (admission, staging) while
#    the old workload would still serve, says `prepared`, and activates when told;
# 4. asks the restored engine one question, then stops it the way a manager does (its process
#    group: the receipt names the root PID).
# Receipts land in OUT. Exit status: the first failing step's (docs/integrators.md).
set -euo pipefail
RECIPE=$1 STORE=$2 OUT=$3
CS=${COLDSNAP_CLI:-sparkrun-coldsnap}
mkdir -p "$OUT"

sparkrun coldsnap capture "$RECIPE" -H localhost --dry-run > "$OUT/capture-request.json"
# A dry run exits with the status the restore would have: 4 here, the capsule is captured next;
# the document is written all the same.
sparkrun coldsnap restore "$RECIPE" -H localhost --dry-run > "$OUT/restore-request.json" 2> "$OUT/restore-plan.txt" || [ $? -eq 4 ]

$CS capture --request "$OUT/capture-request.json" --store "$STORE" --json > "$OUT/capture-receipt.json"
echo "captured: $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["capsule_ref"], r["state"])' "$OUT/capture-receipt.json")"

coproc UNIT { $CS restore --request "$OUT/restore-request.json" --store "$STORE" --unit solo --wait-for-go; }
read -r prepared <&"${UNIT[0]}"
echo "unit says: $prepared"
# ... here a manager stops whatever the unit replaces: the restore is staged, nothing is lost ...
echo activate >&"${UNIT[1]}"
read -r receipt <&"${UNIT[0]}"
wait "$UNIT_PID"
echo "$receipt" > "$OUT/restore-receipt.json"

python3 - "$OUT/restore-request.json" "$OUT/restore-receipt.json" <<'PY'
import json, sys, urllib.request
req, receipt = (json.load(open(p)) for p in sys.argv[1:3])
body = {"model": req["workload"]["model"]["id"], "messages": [{"role": "user", "content": req["validation"]["prompt"]}],
        "max_tokens": req["validation"]["max_tokens"], "temperature": 0}
call = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % req["workload"]["launch"]["port"], json.dumps(body).encode(),
                              {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(call, timeout=60))["choices"][0]["message"]["content"]
print("restored: %s, first token %.2f s, root pid %d; asked again: %r" % (
    receipt["state"], receipt["validation"]["ttft_seconds"], receipt["details"]["root_pid"], reply))
PY

pid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["details"]["root_pid"])' "$OUT/restore-receipt.json")
kill -TERM -- "-$pid"
for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
kill -KILL -- "-$pid" 2>/dev/null || true
echo "stopped: process group $pid"

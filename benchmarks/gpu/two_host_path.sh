#!/usr/bin/env bash
# The product page's two-host job on the one GPU of this machine, through sparkrun's own CLI:
# two hosts made by scripts/two-hosts.sh (network namespaces, an sshd and a name each, a sparkrun
# cluster `two-node` naming them), vLLM tensor parallel 2 with one rank on each host, the n610
# driver on every host. Both ranks use the one physical GPU: NCCL tells the hosts apart by their
# names and joins the ranks over sockets (P2P, SHM, NVLS and IB off, as the driver launches them).
#
#   bash benchmarks/gpu/two_host_path.sh setup     # net tools, the plugin, sparkrun's settings, the hosts, the recipe
#   bash benchmarks/gpu/two_host_path.sh recipe    # the recipe written again (EXTRA_FLAGS: more flags for vllm serve)
#   bash benchmarks/gpu/two_host_path.sh capture   # sparkrun coldsnap capture RECIPE --cluster two-node
#   bash benchmarks/gpu/two_host_path.sh run       # sparkrun run (restored 2/2), status, a chat request,
#                                                  # then a replacement restore with one host unreachable
#                                                  # (refused, the workload serving on), stop (GPU memory back)
#   bash benchmarks/gpu/two_host_path.sh bench     # sparkrun coldsnap bench RECIPE --cluster two-node --samples $SAMPLES
#   bash benchmarks/gpu/two_host_path.sh fault-checkpoint
#                                                  # a capture whose CUDA checkpoint fails on the second host
#                                                  # (its helper killed): refused, nothing left on either host
#
# Run from the repository root, in that order, after `device.sh stash` of every carried piece,
# `device.sh engine` and `qualify.py model --work $WORK/qual` (the 1.5B model; MODEL_JSON names
# another). Each mode may run in a command of its own (each must end within ten minutes); a long
# one started with BACKGROUND=1 runs on detached, its output in $RESULTS/<mode>.log, and
# `two_host_path.sh wait MODE` follows it in the next command.
# Settings (environment): WORK (default /root/coldsnap-gpu), MODEL_JSON, SITE (the plugin's
# target, default $WORK/user-site), PY (default python3), SAMPLES (default 3), KV_BYTES (each
# rank's KV cache, default 2 GiB), EXTRA_FLAGS (more flags for `vllm serve`), RESULTS (default $OUT, else .), SKIP_SETUP=1 (plugin and
# settings as an earlier run left them), COLDSNAP_COMMUNICATORS=rebuild (the plugin's own setting,
# read by capture: the ranks' NCCL communicators destroyed before the cut and made again after it).
set -uo pipefail
MODE=${1:?usage: $0 setup|capture|run|bench|fault-checkpoint|wait MODE}
WORK=${WORK:-/root/coldsnap-gpu}
MODEL_JSON=${MODEL_JSON:-$WORK/qual/model.json}
SITE=${SITE:-$WORK/user-site}
PY=${PY:-python3}
SAMPLES=${SAMPLES:-3}
KV_BYTES=${KV_BYTES:-2147483648}
RESULTS=${RESULTS:-${OUT:-.}}
RECIPE=$WORK/recipes/coldsnap-gpu-vllm-two-node.yaml
CLUSTER=two-node
HOST_B=198.18.200.2
mkdir -p "$RESULTS" "$WORK/recipes"
STEPS="$RESULTS/two-host-$MODE-steps.tsv"
: > "$STEPS"
. "$(dirname "$0")/steps.sh"

if [ -n "${BACKGROUND:-}" ]; then
  # Its results stay under $WORK until `wait` (a later command, with its own $OUT) copies them.
  rm -rf "$WORK/results/$MODE" && mkdir -p "$WORK/results/$MODE"
  BACKGROUND= RESULTS=$WORK/results/$MODE setsid nohup bash "$0" "$MODE" > "$WORK/results/$MODE/$MODE.log" 2>&1 &
  echo $! > "$WORK/results/$MODE/pid"
  echo "$MODE running detached (pid $!): bash $0 wait $MODE"
  exit 0
fi

export PYTHONPATH=$SITE PATH=$SITE/bin:/usr/local/sbin:/usr/local/bin:$PATH SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
HF_HOME=$("$PY" -c 'import json, sys; from pathlib import Path; print(Path(json.loads(Path(sys.argv[1]).read_text())["path"]).parents[3])' "$MODEL_JSON") || exit 2
export HF_HOME COLDSNAP_HOME=${COLDSNAP_HOME:-$WORK/coldsnap-home}
# Where `sparkrun plugins enable` refused beside the image's newer packages (sparkrun_setup.sh).
sparkrun coldsnap --help >/dev/null 2>&1 || export SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1

header() {
  echo "two-host path, $MODE, $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
}

# Debian's sshd unpacked by `device.sh net` where the image has none, else the system's.
sshd_bin() { [ -x "$WORK/net/usr/sbin/sshd" ] && echo "$WORK/net/usr/sbin/sshd" || echo "${SSHD:-}"; }
hosts_up() {
  env SPARKRUN="$SITE/bin/sparkrun" PYTHON="$PY" SSHD="$(sshd_bin)" HOST_ENV="$(host_env)" \
    COLDSNAP_HOME="$COLDSNAP_HOME" HF_HOME="$HF_HOME" bash scripts/two-hosts.sh up
}

# The hosts' sessions see what the control side sees: the plugin's target and the tools on PATH.
host_env() {
  echo "PYTHONPATH=$SITE PATH=$SITE/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    "SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1${SPARKRUN_FEATURE_PLUGINS_COLDSNAP:+ SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1}"
}

write_recipe() {
  eval "$("$PY" - "$MODEL_JSON" <<'EOF'
import json, sys
from pathlib import Path
m = json.loads(Path(sys.argv[1]).read_text())
print("MODEL_ID=%s REVISION=%s" % (m["model_id"], m["revision"]))
EOF
)"
  # `vllm serve` is what sparkrun's vllm-distributed runtime starts (rank 1 headless): a `vllm`
  # command over the engine's own target.
  mkdir -p "$WORK/engine-bin"
  printf '#!/bin/sh\nexec %s -m vllm.entrypoints.cli.main "$@"\n' "$(command -v "$PY")" > "$WORK/engine-bin/vllm"
  chmod 755 "$WORK/engine-bin/vllm"
  # A fixed KV cache per rank: vLLM's memory profiling measures the free memory of the whole
  # GPU, which the other rank changes while it loads (docs/gpu-ranks.md).
  cat > "$RECIPE" <<EOF
recipe_version: "2"
description: $MODEL_ID on vLLM, tensor parallel 2, one rank on each of two hosts (one GPU between them)
model: $MODEL_ID
model_revision: $REVISION
runtime: vllm-distributed
executor: local
executor_config:
  command_prefix: env PATH="$WORK/engine-bin:\$PATH"
defaults:
  port: 8000
  tensor_parallel: 2
env:
  PYTHONPATH: $WORK/engine-site
  HF_HUB_OFFLINE: "1"
  VLLM_USE_FLASHINFER_SAMPLER: "0"
command: vllm serve {model} --revision {model_revision} --port {port} --tensor-parallel-size {tensor_parallel} --max-model-len 2048 --disable-custom-all-reduce --kv-cache-memory-bytes $KV_BYTES --gpu-memory-utilization 0.4${EXTRA_FLAGS:+ $EXTRA_FLAGS}
coldsnap:
  driver: n610
$(validation_block)
EOF
  echo "--- $RECIPE"; cat "$RECIPE"; echo "---"
}

setup() {
  header
  if ! command -v ip >/dev/null || ! command -v iptables >/dev/null || ! command -v ssh >/dev/null; then
    step "net tools" env COLDSNAP_GPU_WORK="$WORK" bash "$(dirname "$0")/device.sh" net || return 1
  fi
  . "$(dirname "$0")/sparkrun_setup.sh" || return 1
  [ -n "${SPARKRUN_FEATURE_PLUGINS_COLDSNAP:-}" ] || sparkrun coldsnap --help >/dev/null 2>&1 || export SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1
  step "two hosts up" hosts_up || return 1
  step "hosts' names" sh -c "ssh -F /dev/null -i /run/coldsnap-two-hosts/client_ed25519 -o UserKnownHostsFile=/run/coldsnap-two-hosts/known_hosts root@198.18.200.1 'hostname; command -v iptables criu; python3 -c \"import sparkrun_coldsnap\" && echo plugin ok'; ssh -F /dev/null -i /run/coldsnap-two-hosts/client_ed25519 -o UserKnownHostsFile=/run/coldsnap-two-hosts/known_hosts root@$HOST_B hostname" || return 1
  write_recipe
  step "cluster" sparkrun cluster show "$CLUSTER"
}

# Processes of the engine left on each host, and the GPU memory in use.
leftovers() {
  local h
  for h in a b; do
    echo "host $h: $(ip netns pids coldsnap2h-$h | xargs -r ps -o comm= -p | grep -v '^sshd$' | sort | uniq -c | tr '\n' ' ')"
  done
  echo "GPU memory in use: $(gpu_mib) MiB"
}

chat() {
  "$PY" "$(dirname "$0")/chat.py" "http://198.18.200.1:8000" "$1"
}

model_id() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model_id"])' "$MODEL_JSON"; }

capture() {
  header
  step "coldsnap capture" sparkrun coldsnap capture "$RECIPE" --cluster "$CLUSTER" || { leftovers; return 1; }
  leftovers
}

run_path() {
  header
  local failed=0 log=$RESULTS/two-host-run.log
  step "run (restore)" sparkrun run "$RECIPE" --cluster "$CLUSTER" --no-follow | tee "$log" || failed=1
  grep -q "distributed state restored 2/2" "$log" && grep -q "reply matches capture" "$log" \
    && echo "restored 2/2 and validated" || { echo "sparkrun run did not restore and validate both units"; failed=1; }
  echo "GPU memory in use while serving: $(gpu_mib) MiB"
  step status sparkrun status --cluster "$CLUSTER" || failed=1
  step chat chat "$(model_id)" || failed=1
  # One host unreachable while a replacement restore is asked for: its sshd stopped, the ranks
  # already serving there left running. Refused before anything is stopped; the workload serves on.
  kill "$(cat /run/coldsnap-two-hosts/sshd-b.pid)"
  step "run, host b unreachable" sparkrun run "$RECIPE" --cluster "$CLUSTER" --no-follow > "$RESULTS/two-host-unreachable.log" 2>&1 \
    && { echo "a restore with host b unreachable did not fail"; failed=1; }
  grep -i "error" "$RESULTS/two-host-unreachable.log" | tail -3
  step "chat after the refused replacement" chat "$(model_id)" || failed=1
  step "host b back" hosts_up || failed=1
  step stop sparkrun stop "$RECIPE" --cluster "$CLUSTER" || failed=1
  wait_gpu_released
  leftovers
  [ "$(gpu_mib)" -lt 100 ] || { echo "GPU memory was not released"; failed=1; }
  return $failed
}

bench() {
  header
  step "coldsnap bench" sparkrun coldsnap bench "$RECIPE" --cluster "$CLUSTER" --samples "$SAMPLES" --out "$RESULTS/bench-two-host"
  leftovers
}

fault_checkpoint() {
  # The second host's CUDA helper killed as soon as it starts: its checkpoint fails while the first
  # host's ranks may already be locked. The capture must fail in one line and leave nothing.
  header
  # Each device step on a host (lock, checkpoint, put back) runs in an agent with a helper of its
  # own: the NTH helper seen on host b (default 2: the checkpoint's, after the lock's) is killed.
  local nth=${FAULT_NTH:-2}
  ( seen=""
    for _ in $(seq 6000); do
      for pid in $(ip netns pids coldsnap2h-b); do
        case " $seen " in *" $pid "*) continue ;; esac
        if tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -q "cuda/helper.py"; then
          seen="$seen $pid"
          echo "$(date -u +%T.%N | cut -c1-12) host b's CUDA helper $pid started (#$(echo $seen | wc -w))"
          if [ "$(echo $seen | wc -w)" -ge "$nth" ]; then kill -9 "$pid" && echo "killed it"; exit 0; fi
        fi
      done
      sleep 0.05
    done ) &
  local killer=$!
  step "capture, checkpoint failing on host b" sparkrun coldsnap capture "$RECIPE" --cluster "$CLUSTER" --tag fault > "$RESULTS/two-host-fault-checkpoint.log" 2>&1 \
    && echo "the capture did not fail"
  kill $killer 2>/dev/null; wait $killer 2>/dev/null
  tail -5 "$RESULTS/two-host-fault-checkpoint.log"
  sleep 3
  leftovers
  sparkrun coldsnap list 2>&1 | grep -c ":fault" | sed 's/^/capsules tagged fault: /'
}

case "$MODE" in
  setup) setup ;;
  recipe) write_recipe ;;
  capture) capture ;;
  run) run_path ;;
  bench) bench ;;
  fault-checkpoint) fault_checkpoint ;;
  wait)
    # Follows a detached mode for up to WAIT_SECONDS (default 540), then copies what it wrote.
    what=${2:?which mode}
    running() { kill -0 "$(cat "$WORK/results/$what/pid")" 2>/dev/null; }
    for _ in $(seq "${WAIT_SECONDS:-540}"); do running || break; sleep 1; done
    cp -r "$WORK/results/$what/." "$RESULTS/"
    cat "$WORK/results/$what/$what.log"
    if running; then echo "(still running)"; exit 3; fi ;;
  *) echo "usage: $0 setup|capture|run|bench|fault-checkpoint|wait MODE" >&2; exit 2 ;;
esac

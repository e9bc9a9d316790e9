#!/usr/bin/env bash
# Two hosts on one GPU: two network namespaces joined by a veth pair, each rank of a vLLM
# tensor-parallel-2 job in one of them with a host id of its own (NCCL_HOSTID), so NCCL treats
# them as two hosts and talks over sockets (IB, P2P, SHM and NVLS off) while both ranks use the
# one physical GPU. Each rank gets a fixed KV cache: vLLM's memory profiling measures the free
# memory of the whole GPU, which the other rank changes while it loads.
#   bash benchmarks/gpu/two_host_ids.sh hosts      # make the namespaces (idempotent)
#   bash benchmarks/gpu/two_host_ids.sh vanilla    # start both ranks, time the first reply, stop them
#   bash benchmarks/gpu/two_host_ids.sh cut        # the same, then the CUDA half of a cut across the two (lock,
#                                                  # checkpoint, restore, unlock every rank) and a second reply
# After device.sh stash/plugin/engine and `qualify.py model --work $WORK/qual` (MODEL_JSON names another).
set -euo pipefail
WORK=${COLDSNAP_GPU_WORK:-/root/coldsnap-gpu}
MODEL_JSON=${MODEL_JSON:-$WORK/qual/model.json}
RESULTS=${RESULTS:-${OUT:-/tmp}}
A=coldsnap-a B=coldsnap-b ADDR_A=10.99.0.1 ADDR_B=10.99.0.2
KV_BYTES=${KV_BYTES:-2147483648}
PORT=8000 MASTER_PORT=29511

# Without iproute2 (a bare GPU image) both ranks stay in the host's namespace on loopback:
# still two NCCL hosts by their ids, over sockets.
if ! command -v ip >/dev/null; then ADDR_A=127.0.0.1 ADDR_B=127.0.0.1; fi
in_ns() { if command -v ip >/dev/null; then ip netns exec "$@"; else shift; "$@"; fi; }
ifname() { if command -v ip >/dev/null; then echo "$1"; else echo lo; fi; }

hosts() {
  command -v ip >/dev/null || return 0
  ip netns list | grep -q "^$A" && return 0
  ip netns add $A && ip netns add $B
  ip link add va type veth peer name vb
  ip link set va netns $A && ip link set vb netns $B
  ip -n $A addr add $ADDR_A/24 dev va && ip -n $B addr add $ADDR_B/24 dev vb
  for n in $A $B; do ip -n $n link set lo up; done
  ip -n $A link set va up && ip -n $B link set vb up
}

rank_env() {  # rank, address, interface
  echo "PYTHONPATH=$WORK/engine-site HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 CUDA_VISIBLE_DEVICES=0" \
    "NCCL_HOSTID=coldsnap-host-$1 NCCL_SOCKET_IFNAME=$3 GLOO_SOCKET_IFNAME=$3 VLLM_HOST_IP=$2" \
    "NCCL_IB_DISABLE=1 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" \
    "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET"
}

ask() {  # one chat completion through rank 0, its reply printed
  in_ns $A python3 - "$1" <<'PY'
import json, sys, urllib.request
body = json.dumps({"model": sys.argv[1], "messages": [{"role": "user", "content": "Reply with one short sentence: what is a cold start?"}], "max_tokens": 16, "temperature": 0}).encode()
req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", body, {"Content-Type": "application/json"})
print("reply:", repr(json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["message"]["content"]))
PY
}

vanilla() {
  hosts
  path=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['path'])" "$MODEL_JSON")
  name=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['model_id'])" "$MODEL_JSON")
  common="serve $path --served-model-name $name --tensor-parallel-size 2 --nnodes 2 --master-addr $ADDR_A --master-port $MASTER_PORT --max-model-len 2048 --disable-custom-all-reduce --kv-cache-memory-bytes $KV_BYTES --gpu-memory-utilization 0.4"
  before=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)
  t0=$(date +%s.%N)
  in_ns $A env $(rank_env 0 $ADDR_A $(ifname va)) setsid python3 -m vllm.entrypoints.cli.main $common --node-rank 0 --port $PORT > "$RESULTS/rank0.log" 2>&1 &
  roots=$!  # ip netns exec, env and setsid (not a group leader here) each exec the next: the rank's own PID
  in_ns $B env $(rank_env 1 $ADDR_B $(ifname vb)) setsid python3 -m vllm.entrypoints.cli.main $common --node-rank 1 --headless > "$RESULTS/rank1.log" 2>&1 &
  roots="$roots $!"
  ok=""
  for _ in $(seq 1 480); do
    if ask "$name" 2>/dev/null; then ok=1; break; fi
    sleep 0.5
  done
  t1=$(date +%s.%N)
  during=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)
  echo "two-host TP2 vanilla start to first reply: $(python3 -c "print(round($t1-$t0,1))") s, answered: ${ok:-no}; GPU memory used MiB before $before, serving $during"
  grep -h "via NET/Socket\|NCCL WARN\|Duplicate GPU\|Error\|error" "$RESULTS"/rank*.log | sort | uniq -c | sort -rn | head -12 || true
  if [ "${CUT:-}" = 1 ] && [ -n "$ok" ]; then
    echo "CUDA cut across the two ranks (roots $roots):"
    PYTHONPATH=$WORK/plugin-site python3 benchmarks/gpu/cuda_cut_two_hosts.py $roots || ok=""
    ask "$name" || ok=""
  fi
  pkill -f "vllm.entrypoints.cli.main" || true
  for _ in $(seq 1 60); do pgrep -f vllm.entrypoints.cli.main >/dev/null || break; sleep 0.5; done
  sleep 2
  echo "GPU memory used MiB after stop: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"
  [ -n "$ok" ]
}

case "${1:-}" in
  hosts) hosts ;;
  vanilla) vanilla ;;
  cut) CUT=1 vanilla ;;
  *) echo "usage: $0 hosts|vanilla|cut" >&2; exit 2 ;;
esac

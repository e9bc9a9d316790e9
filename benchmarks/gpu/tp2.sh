#!/usr/bin/env bash
# Two tensor-parallel ranks in one unit on a machine with two GPUs, in one command, after the
# carry is installed (README.md steps 1-2: device.sh stash, plugin, engine or sglang):
#
#   bash benchmarks/gpu/tp2.sh vllm|sglang
#
# Makes the 1.5B model if missing, captures it with n610 as one unit of two ranks (GPUs 0 and
# 1), checks from NCCL's log that every channel between the ranks went over sockets, alternates
# vanilla starts and restores (native and recovery weights for vLLM, recovery for SGLang; three
# samples, page cache dropped, every restore validated), then restores onto the GPUs swapped
# (CUDA_VISIBLE_DEVICES=1,0). Results go to $OUT (bench.json, bench.png, ranks.json,
# other-gpu.json, the receipts). Settings: WORK (default /root/coldsnap-gpu), SHAPE (1.5b), SAMPLES (3).
set -euo pipefail
ENGINE=${1:?usage: $0 vllm|sglang}
WORK=${WORK:-/root/coldsnap-gpu}
SHAPE=${SHAPE:-1.5b}
SAMPLES=${SAMPLES:-3}
OUT=${OUT:-out}
case "$ENGINE" in
  vllm) SITE=$WORK/engine-site PATHS=n610:native,n610:recovery ;;
  sglang) SITE=$WORK/sglang-site PATHS=n610 ;;
  *) echo "usage: $0 vllm|sglang" >&2; exit 2 ;;
esac
count=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | wc -l)
[ "$count" -ge 2 ] || { echo "tp2.sh needs two GPUs; this machine has $count" >&2; exit 2; }
mkdir -p "$OUT"
eval "$(bash benchmarks/gpu/device.sh env)"
Q="python3 benchmarks/gpu/qualify.py --work $WORK/tp2-$ENGINE-$SHAPE --engine $ENGINE --engine-site $SITE --tp 2 --out $OUT"
nvidia-smi topo -m | tee "$OUT/topology.txt" || true
$Q model --shape "$SHAPE"
$Q capture --drivers n610
$Q ranks
$Q samples --paths "$PATHS" --samples "$SAMPLES"
$Q other-gpu --paths "${PATHS%%,*}" --restore-gpus 1,0

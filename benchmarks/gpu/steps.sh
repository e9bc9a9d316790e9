# Sourced by the GPU scripts: time each step and keep it for their tables.
# They set STEPS, the table's file (tab-separated: step, seconds, exit status, GPU MiB in use after).

now() { date +%s.%N; }
# step NAME CMD...: run it, print its output and how long it took; keep the time for the table.
step() {
  local name=$1; shift
  echo "==> $name: $*"
  local t0 rc t
  t0=$(now)
  "$@" 2>&1
  rc=$?
  t=$(echo "$(now) $t0" | awk '{printf "%.2f", $1 - $2}')
  echo "<== $name: ${t} s (exit $rc)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$t" "$rc" "$(gpu_mib)" >> "$STEPS"
  return $rc
}
# GPU memory in use, all GPUs together (MiB); "?" where there is no nvidia-smi.
gpu_mib() { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '{s += $1} END {print s + 0}' || echo "?"; }

# Wait up to 30 s for the GPU memory a stopped engine held to come back, then say how much is used.
wait_gpu_released() {
  for _ in $(seq 30); do
    used=$(gpu_mib)
    [ "$used" != "?" ] && [ "$used" -lt 100 ] 2>/dev/null && break
    sleep 1
  done
  echo "GPU memory used after stop: $(gpu_mib) MiB"
}

# The recipes' validation settings under `coldsnap:` (indented for it): a GPU start takes minutes.
validation_block() {
  cat <<'EOF'
  validation:
    prompt: "Reply with one short sentence: what is a cold start?"
    max_tokens: 16
    timeout_seconds: 300
  ready_timeout_seconds: 1200
EOF
}

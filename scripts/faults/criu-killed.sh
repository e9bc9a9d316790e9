#!/bin/sh
# A CRIU that is killed mid-operation, for fault tests: set
#   COLDSNAP_CRIU="sh scripts/faults/criu-killed.sh dump"     (or: ... restore)
# and every `criu dump` is killed with SIGKILL once it has seized the tree
# (the root process shows "tracing stop"), every `criu restore` after
# $CRIU_KILL_AFTER seconds (0.05 by default), mid-way; this wrapper then ends
# by SIGKILL too, as if the kill had hit CRIU itself. Any other CRIU command
# (--version, check, the other operation) runs the real CRIU unchanged.
# The real CRIU is $CRIU_REAL, else the first criu on PATH.
set -u
victim_op=$1
shift
real=${CRIU_REAL:-criu}
[ "${1:-}" = "$victim_op" ] || exec $real "$@"
root=
prev=
for a in "$@"; do
  [ "$prev" = "-t" ] && root=$a
  prev=$a
done
$real "$@" &
criu_pid=$!
i=0
while [ $i -lt 3000 ]; do
  if [ -n "$root" ] && grep -q '^State:.*t (tracing stop)' "/proc/$root/status" 2>/dev/null; then
    break
  fi
  if [ -z "$root" ] && [ "$i" -ge "$(awk "BEGIN{print int(${CRIU_KILL_AFTER:-0.05} * 1000)}")" ]; then
    break
  fi
  kill -0 "$criu_pid" 2>/dev/null || break
  i=$((i + 1))
  sleep 0.001
done
kill -KILL "$criu_pid" 2>/dev/null
wait "$criu_pid" 2>/dev/null
kill -KILL $$

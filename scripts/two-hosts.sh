#!/usr/bin/env bash
# Two hosts on this machine, to try a workload on several hosts without a second machine:
#   scripts/two-hosts.sh up     two network namespaces, each with its own address and sshd, on a
#                               switch this machine is plugged into too, and a sparkrun cluster
#                               `two-node` naming them (sparkrun's SSH key and options set for them)
#   scripts/two-hosts.sh down   all of it removed, sparkrun's SSH settings as they were before `up`
# Both are idempotent. Needs root (namespaces, sshd). The hosts share this machine's files, as a
# cluster on a shared filesystem does: the plugin, COLDSNAP_HOME and the model cache are the same
# on both; each host has a name (hostname), a home, a /dev/shm and sparkrun records of its own.
# NCCL tells hosts apart by their name: ranks on the two hosts talk over sockets, never through
# shared memory or a GPU's peer access, even where both use one GPU of this machine.
#
# The switch is a bridge in a namespace of its own: bridged traffic passes the iptables FORWARD
# chain of the namespace holding the bridge, which dockerd sets to DROP in this one.
# Environment: NET (first three octets of the hosts' /24, default 198.18.200; 198.18.0.0/15 is set
# aside for benchmarks), CLUSTER (default two-node), SPARKRUN (default: .venv/bin/sparkrun here,
# else sparkrun on PATH), PYTHON (sparkrun's interpreter, default the `python` beside it), SSHD
# (the sshd to run, default the system's or Debian's unpacked one), HOST_ENV (more NAME=VALUE
# words every session on the hosts gets, e.g. a PYTHONPATH the plugin is installed on),
# STATE (default /run/coldsnap-two-hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
NET=${NET:-198.18.200}
CLUSTER=${CLUSTER:-two-node}
STATE=${STATE:-/run/coldsnap-two-hosts}
if [ -z "${SPARKRUN:-}" ]; then
  if [ -x .venv/bin/sparkrun ]; then SPARKRUN=$PWD/.venv/bin/sparkrun; else SPARKRUN=$(command -v sparkrun); fi
fi
PYTHON=${PYTHON:-$(dirname "$SPARKRUN")/python}  # sparkrun's own interpreter: it has PyYAML
SW=coldsnap2h-sw
CTL=coldsnap2h
HOSTS=(a b)

ns() { echo "coldsnap2h-$1"; }
address() { [ "$1" = a ] && echo "$NET.1" || echo "$NET.2"; }

# sparkrun's config.yaml `ssh:` block: saved by `up`, put back by `down`.
ssh_settings() {
  "$PYTHON" - "$1" "$STATE" <<'EOF'
import json, sys
from pathlib import Path
import yaml
from sparkrun.core.config import resolve_config_path
path = resolve_config_path()
what, state = sys.argv[1], Path(sys.argv[2])
data = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
saved = state / "ssh-before.json"
if what == "set":
    if not saved.exists():
        saved.write_text(json.dumps(data.get("ssh")))
    opts = ["-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", "UserKnownHostsFile=%s" % (state / "known_hosts"), "-o", "GlobalKnownHostsFile=/dev/null"]
    data["ssh"] = {**(data.get("ssh") or {}), "key": str(state / "client_ed25519"), "options": opts}
elif saved.exists():
    before = json.loads(saved.read_text())
    if before is None:
        data.pop("ssh", None)
    else:
        data["ssh"] = before
else:
    sys.exit(0)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(yaml.safe_dump(data, sort_keys=False))
EOF
}

up() {
  [ "$(id -u)" = 0 ] || { echo "two-hosts.sh up needs root (network namespaces, sshd)" >&2; exit 1; }
  mkdir -p "$STATE"
  if ! ip netns list | grep -qw "$SW"; then
    if ip -4 -o addr show | grep -q "inet $NET\."; then
      echo "$NET.0/24 is in use here: choose another with NET=198.18.N" >&2; exit 1
    fi
    ip netns add "$SW"
    ip -n "$SW" link add br0 type bridge
    ip -n "$SW" link set br0 up
    ip link add "$CTL" type veth peer name port-ctl netns "$SW"
    ip addr add "$NET.254/24" dev "$CTL"
    ip link set "$CTL" up
    ip -n "$SW" link set port-ctl master br0 up
    for h in "${HOSTS[@]}"; do
      ip netns add "$(ns "$h")"
      ip -n "$(ns "$h")" link add eth0 type veth peer name "port-$h" netns "$SW"
      ip -n "$(ns "$h")" addr add "$(address "$h")/24" dev eth0
      ip -n "$(ns "$h")" link set eth0 up
      ip -n "$(ns "$h")" link set lo up
      ip -n "$SW" link set "port-$h" master br0 up
    done
  fi
  # Keys: the client's (sparkrun's), each host's; its known_hosts.
  [ -f "$STATE/client_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C coldsnap-two-hosts -f "$STATE/client_ed25519"
  cp "$STATE/client_ed25519.pub" "$STATE/authorized_keys"
  : > "$STATE/known_hosts"
  sshd=${SSHD:-$(bash scripts/test-sshd.sh)}  # the system's sshd, or Debian's unpacked into .work/openssh
  prefix=$(dirname "$(dirname "$sshd")")  # its /usr, where an unpacked one keeps its libraries
  libs=$prefix/lib/x86_64-linux-gnu:$(dirname "$prefix")/lib/x86_64-linux-gnu
  mkdir -p /run/sshd  # where sshd's privilege separation chroots
  passwd=-
  if ! getent passwd sshd >/dev/null; then  # the account privilege separation needs, in the hosts' mount namespaces only
    passwd=$STATE/passwd
    { cat /etc/passwd; echo "sshd:x:65533:65534::/run/sshd:/usr/sbin/nologin"; } > "$passwd"
  fi
  for h in "${HOSTS[@]}"; do
    [ -f "$STATE/host-$h" ] || ssh-keygen -q -t ed25519 -N "" -C "host-$h" -f "$STATE/host-$h"
    echo "$(address "$h") $(cat "$STATE/host-$h.pub")" >> "$STATE/known_hosts"
    mkdir -p "$STATE/home-$h"
    if [ -f "$STATE/sshd-$h.pid" ] && kill -0 "$(cat "$STATE/sshd-$h.pid")" 2>/dev/null; then continue; fi
    cat > "$STATE/sshd-$h.conf" <<EOF
ListenAddress $(address "$h")
HostKey $STATE/host-$h
PidFile none
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
Subsystem sftp $prefix/lib/openssh/sftp-server
SetEnv HOME=$STATE/home-$h COLDSNAP_HOME=${COLDSNAP_HOME:-$HOME/.local/share/sparkrun-coldsnap} HF_HOME=${HF_HOME:-$HOME/.cache/huggingface} ${HOST_ENV:-}
EOF
    # A /dev/shm of its own, as a machine has (vLLM takes ranks that see each other's shared
    # memory for ranks of one host), and a name of its own (NCCL's host identity).
    LD_LIBRARY_PATH=$libs setsid ip netns exec "$(ns "$h")" unshare --uts sh -c \
      'hostname "$1" && mount -t tmpfs -o mode=1777,size=8g shm /dev/shm && { [ "$0" = - ] || mount --bind "$0" /etc/passwd; } && shift && exec "$@"' \
      "$passwd" "$(ns "$h")" "$sshd" -D -e -f "$STATE/sshd-$h.conf" </dev/null >>"$STATE/sshd-$h.log" 2>&1 &
    echo $! > "$STATE/sshd-$h.pid"
  done
  for h in "${HOSTS[@]}"; do
    for _ in $(seq 100); do
      ssh -i "$STATE/client_ed25519" -o IdentitiesOnly=yes -o UserKnownHostsFile="$STATE/known_hosts" -o BatchMode=yes -F /dev/null "root@$(address "$h")" true 2>/dev/null && break
      sleep 0.1
    done
  done
  ssh_settings set
  "$SPARKRUN" cluster delete "$CLUSTER" --force >/dev/null 2>&1 || true
  "$SPARKRUN" cluster create "$CLUSTER" --hosts "$(address a),$(address b)" --user root >/dev/null
  # The hosts read this machine's model cache: sparkrun does not copy the model to them.
  "$PYTHON" - "$CLUSTER" <<'EOF'
import sys
import yaml
from sparkrun.core.config import get_config_root
path = get_config_root() / "clusters" / ("%s.yaml" % sys.argv[1])
data = yaml.safe_load(path.read_text())
data["distribution"] = {"model": {"enabled": False}}
path.write_text(yaml.safe_dump(data, sort_keys=False))
EOF
  echo "cluster $CLUSTER: $(address a) (rank 0), $(address b); try: sparkrun cluster show $CLUSTER"
}

down() {
  for h in "${HOSTS[@]}"; do
    if ip netns list | grep -qw "$(ns "$h")"; then
      pids=$(ip netns pids "$(ns "$h")")
      [ -z "$pids" ] || kill $pids 2>/dev/null || true
      sleep 0.5
      pids=$(ip netns pids "$(ns "$h")")
      [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
      ip netns delete "$(ns "$h")"
    fi
  done
  ! ip netns list | grep -qw "$SW" || ip netns delete "$SW"
  ! ip link show "$CTL" >/dev/null 2>&1 || ip link delete "$CTL"
  "$SPARKRUN" cluster delete "$CLUSTER" --force >/dev/null 2>&1 || true
  [ ! -d "$STATE" ] || ssh_settings restore
  rm -rf "$STATE"
  echo "two hosts removed"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac

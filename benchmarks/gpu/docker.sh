#!/usr/bin/env bash
# Docker on the GPU machine, which has none (no docker, dockerd, containerd or runc) and reaches no
# registry: Debian 12's packages, prepared by prepare_carry_docker.sh, unpacked (dpkg -x, nothing
# installed) under $WORK/docker and started by hand, the way `sparkrun coldsnap setup --docker`
# configures the daemon on the CPU machine: experimental mode (docker checkpoint), a CRIU >= 4.2
# that runc finds on PATH, runc's CRIU options, the `coldsnap-runc` runtime.
#   bash benchmarks/gpu/docker.sh stash    # keep this call's carried piece (.carry/gpu/docker/partN) in $WORK
#   bash benchmarks/gpu/docker.sh up       # unpack, wrap, configure, start containerd + dockerd
#   bash benchmarks/gpu/docker.sh down     # stop dockerd and containerd (containers first)
#   eval "$(bash benchmarks/gpu/docker.sh env)"   # DOCKER_HOST and PATH for the client
# `up` needs the plugin's target and the private CRIU first (device.sh plugin): the runtime
# wrapper, the criu wrapper and runc's options are written by the plugin's own functions
# (setup/docker_install.py), not copied here. `setup --docker` itself cannot run there: it
# installs docker.io from a registry and builds the CPU engine's image with debootstrap.
#
# Settings (environment):
#   COLDSNAP_GPU_WORK  where things are kept (default /root/coldsnap-gpu)
#   PY                 the plugin's interpreter (default python3 with PYTHONPATH=$WORK/plugin-site)
#   APART=1            a daemon apart from the machine's own, for a rehearsal on a machine that has
#                      Docker: its own socket (/run/coldsnap-gpu-docker.sock), data-root, exec-root,
#                      pidfile, config file, containerd, and wrappers under $WORK/bin (nothing in
#                      /usr/local, /etc/docker or /var/lib/docker is touched). Without it (the GPU
#                      machine) every path is docker's default, so sparkrun and the plugin find the
#                      daemon as they find any other.
set -euo pipefail
WORK=${COLDSNAP_GPU_WORK:-/root/coldsnap-gpu}
ROOT=$WORK/docker
DEBS=$WORK/docker-debs
LOGS=$WORK/docker-logs
if [ "${APART:-0}" = 1 ]; then
  BIN=$WORK/bin SBIN=$WORK/sbin
  SOCK=/run/coldsnap-gpu-docker.sock
  DATA=$WORK/docker-data EXEC=/run/coldsnap-gpu-docker PIDFILE=/run/coldsnap-gpu-docker.pid
  CONFIG=$WORK/daemon.json
  CTR_SOCK=/run/coldsnap-gpu-containerd/containerd.sock CTR_ROOT=$WORK/containerd-data CTR_STATE=/run/coldsnap-gpu-containerd
else
  BIN=/usr/local/bin SBIN=/usr/local/sbin
  SOCK=/var/run/docker.sock
  DATA=/var/lib/docker EXEC=/var/run/docker PIDFILE=/var/run/docker.pid
  CONFIG=/etc/docker/daemon.json
  CTR_SOCK=/run/containerd/containerd.sock CTR_ROOT=/var/lib/containerd CTR_STATE=/run/containerd
fi
CTR_PIDFILE=$CTR_STATE.pid
LIBS=$ROOT/usr/lib/x86_64-linux-gnu:$ROOT/lib/x86_64-linux-gnu
PY=${PY:-python3}
export PYTHONPATH=${PYTHONPATH:-$WORK/plugin-site}
export COLDSNAP_HOME=${COLDSNAP_HOME:-$WORK/coldsnap-home}
# dockerd, containerd and the shim run runc, runc runs criu: all by name from PATH.
DAEMON_PATH=$BIN:$SBIN:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

stash() {
  mkdir -p "$DEBS"
  for part in .carry/gpu/docker/part*; do [ -d "$part" ] && cp "$part"/* "$DEBS/"; done
  ls -l "$DEBS"
}

unpack() {
  # A .deb that was split to travel comes back whole before the checksums are checked.
  (cd "$DEBS" && for first in *.deb.part00; do
    [ -e "$first" ] || continue
    cat "${first%.part00}".part* > "${first%.part00}" && rm -f "${first%.part00}".part*
  done && sha256sum -c --quiet SHA256SUMS)
  rm -rf "$ROOT"
  mkdir -p "$ROOT"
  for f in "$DEBS"/*.deb; do dpkg -x "$f" "$ROOT"; done
}

wrap() {  # wrapper path, real binary: the carried libraries for that binary alone
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$LIBS" "$2" > "$1"
  chmod 755 "$1"
}

install_wrappers() {
  mkdir -p "$BIN" "$SBIN"
  wrap "$BIN/docker" "$ROOT/usr/bin/docker"
  wrap "$BIN/dockerd" "$ROOT/usr/sbin/dockerd"
  wrap "$BIN/docker-proxy" "$ROOT/usr/sbin/docker-proxy"
  wrap "$BIN/containerd" "$ROOT/usr/bin/containerd"
  wrap "$BIN/containerd-shim-runc-v2" "$ROOT/usr/bin/containerd-shim-runc-v2"
  wrap "$BIN/runc" "$ROOT/usr/sbin/runc"
  # tini-static links nothing: `docker run --init` runs it as docker-init.
  ln -sfn "$ROOT/usr/bin/tini-static" "$BIN/docker-init"
  # runc starts a container's first process by running itself again (`runc init`) with an
  # environment of its own, without LD_LIBRARY_PATH: what runc links must be found by the
  # machine's loader. Only libraries the machine lacks are registered, so none of the image's
  # own is shadowed.
  local need=() lib
  for lib in $(LD_LIBRARY_PATH=$LIBS ldd "$ROOT/usr/sbin/runc" | awk '$3 ~ /^\// {print $1}'); do
    ldconfig -p | grep -q "^[[:space:]]*$lib " || need+=("$lib")
  done
  if [ ${#need[@]} -gt 0 ]; then
    [ "${APART:-0}" = 1 ] && { echo "runc's ${need[*]} missing from this machine's loader; a rehearsal registers nothing" >&2; exit 1; }
    mkdir -p "$ROOT/runc-libs"
    for lib in "${need[@]}"; do cp -L "$(LD_LIBRARY_PATH=$LIBS ldd "$ROOT/usr/sbin/runc" | awk -v l="$lib" '$1 == l {print $3}')" "$ROOT/runc-libs/"; done
    echo "$ROOT/runc-libs" > /etc/ld.so.conf.d/coldsnap-docker.conf
    ldconfig
    echo "registered for runc init: ${need[*]}"
  fi
}

configure() {
  # The plugin's own setup steps, each writing only what differs: experimental mode and the
  # coldsnap-runc runtime (running the carried runc) in $CONFIG, and, on the GPU machine, the
  # criu wrapper in /usr/local/sbin and runc's options in /etc/criu/runc.conf. A rehearsal leaves
  # those two host-wide files as the machine's own setup made them and only checks them.
  mkdir -p "$(dirname "$CONFIG")"
  APART=${APART:-0} PATH=$DAEMON_PATH CONFIG=$CONFIG RUNTIME_WRAPPER=$SBIN/coldsnap-runc "$PY" - <<'EOF'
import os
from pathlib import Path

from sparkrun_coldsnap.criu import tool as criu_tool
from sparkrun_coldsnap.launch import docker as docker_unit
from sparkrun_coldsnap.launch import lazy_runtime
from sparkrun_coldsnap.setup import docker_install

def log(message):
    print("  " + message)

docker_install.DAEMON_JSON = Path(os.environ["CONFIG"])
lazy_runtime.WRAPPER = Path(os.environ["RUNTIME_WRAPPER"])
docker_install.configure_daemon(log)
if os.environ.get("APART") != "1":
    docker_install.criu_for_runc(log)
    docker_install.runc_options(log)
docker_install.lazy_runtime_installed(log)
criu = criu_tool.for_runc()
print("  runc runs criu %s (%s)" % (criu.path if criu else "(none)", "usable" if criu and criu.usable else "NOT usable"))
missing = docker_unit.missing_runc_options()
print("  %s: %s" % (docker_unit.RUNC_CRIU_CONF, "missing " + ", ".join(missing) if missing else "complete"))
EOF
  echo "--- $CONFIG"; cat "$CONFIG"
}

# Does the process a pidfile names run? (dockerd removes its file as it exits: no error then.)
live() { local pid; pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }

start() {
  mkdir -p "$LOGS" "$DATA" "$CTR_ROOT"
  if live "$PIDFILE"; then echo "dockerd already runs (pid $(cat "$PIDFILE"))"; return; fi
  # runc puts each container in a cgroup of its own: a machine booted without an init that
  # mounts the cgroup file system gets cgroup v2 mounted here.
  if [ "${APART:-0}" != 1 ] && ! grep -q " /sys/fs/cgroup " /proc/mounts; then
    mount -t cgroup2 none /sys/fs/cgroup && echo "mounted cgroup2 at /sys/fs/cgroup"
  fi
  grep -qw overlay /proc/filesystems || echo "no overlay file system in this kernel: dockerd falls back to vfs (a full copy of the image per container)"
  # containerd of its own, not one dockerd would adopt from the default socket: on a machine
  # with Docker (a rehearsal) that one is the machine's.
  if ! live "$CTR_PIDFILE"; then
    rm -f "$CTR_SOCK"
    PATH=$DAEMON_PATH setsid "$BIN/containerd" --address "$CTR_SOCK" --root "$CTR_ROOT" --state "$CTR_STATE" \
      > "$LOGS/containerd.log" 2>&1 < /dev/null &
    echo $! > "$CTR_PIDFILE"
    for _ in $(seq 100); do [ -S "$CTR_SOCK" ] && break; sleep 0.1; done
    [ -S "$CTR_SOCK" ] || { tail -n 20 "$LOGS/containerd.log"; echo "containerd did not start: see $LOGS/containerd.log" >&2; exit 1; }
  fi
  # Containers use the host's network (sparkrun's default, and the plugin's --network=host):
  # no bridge, so dockerd needs neither iptables nor a bridge device.
  PATH=$DAEMON_PATH setsid "$BIN/dockerd" --config-file "$CONFIG" -H "unix://$SOCK" --containerd "$CTR_SOCK" \
    --data-root "$DATA" --exec-root "$EXEC" --pidfile "$PIDFILE" --bridge none --iptables=false --ip-masq=false \
    > "$LOGS/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 600); do "$BIN/docker" -H "unix://$SOCK" version > /dev/null 2>&1 && break; sleep 0.1; done
  "$BIN/docker" -H "unix://$SOCK" version > /dev/null 2>&1 || { tail -n 30 "$LOGS/dockerd.log"; echo "dockerd did not start within 60 s: see $LOGS/dockerd.log" >&2; exit 1; }
  # shellcheck disable=SC2016  # a Go template, not shell
  "$BIN/docker" -H "unix://$SOCK" info --format 'docker {{.ServerVersion}}, {{.Driver}}, cgroup v{{.CgroupVersion}}, experimental {{.ExperimentalBuild}}, runtimes {{range $k, $v := .Runtimes}}{{$k}} {{end}}'
}

gpu_entries() {
  # What a container of the GPU path gets instead of NVIDIA's hook (launch/gpu_devices.py).
  [ -e /dev/nvidia0 ] || return 0
  "$PY" -c 'from sparkrun_coldsnap.launch import gpu_devices; print("GPU 0 as spec entries:", " ".join(gpu_devices.device_args(["0"])))'
}

down() {
  if live "$PIDFILE"; then
    # Containers first: a container left running keeps its shim and mounts after dockerd goes.
    ids=$("$BIN/docker" -H "unix://$SOCK" ps -aq 2>/dev/null || true)
    # shellcheck disable=SC2086  # one id a word
    [ -z "$ids" ] || "$BIN/docker" -H "unix://$SOCK" rm -f $ids > /dev/null || true
    kill "$(cat "$PIDFILE")"
    for _ in $(seq 300); do live "$PIDFILE" || break; sleep 0.1; done
    if live "$PIDFILE"; then kill -9 "$(cat "$PIDFILE")"; fi
  fi
  if live "$CTR_PIDFILE"; then
    kill "$(cat "$CTR_PIDFILE")"
    for _ in $(seq 100); do live "$CTR_PIDFILE" || break; sleep 0.1; done
    if live "$CTR_PIDFILE"; then kill -9 "$(cat "$CTR_PIDFILE")"; fi
  fi
  rm -f "$PIDFILE" "$CTR_PIDFILE" "$SOCK"
  # dockerd leaves its default network namespace mounted under the exec root, and its overlay
  # mounts under the data root when it is killed hard.
  { grep -oE " ($DATA|$EXEC)/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do umount "${m# }" 2>/dev/null || true; done
  # A rehearsal's state directories are its own: nothing of them is left in /run.
  if [ "${APART:-0}" = 1 ]; then rm -rf "$EXEC" "$CTR_STATE"; fi
  echo "dockerd and containerd stopped"
}

case "${1:-}" in
  stash) stash ;;
  up)
    # Unpacked again only when other packages were carried.
    if ! cmp -s "$ROOT/.unpacked" "$DEBS/SHA256SUMS"; then unpack; cp "$DEBS/SHA256SUMS" "$ROOT/.unpacked"; fi
    install_wrappers
    configure
    start
    gpu_entries
    ;;
  down) down ;;
  env) echo "export DOCKER_HOST=unix://$SOCK PATH=$BIN:$SBIN:\$PATH" ;;
  *) echo "usage: $0 stash|up|down|env  (APART=1: a daemon apart from the machine's own)" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# On the GPU machine, from the repository root. The machine reaches no registry: what
# prepare_carry.sh made travels in pieces (each command carries at most 64 MiB) and is
# assembled under $WORK, outside the work tree, where it stays while the machine is held.
#   bash benchmarks/gpu/device.sh stash      # keep this call's carried pieces in $WORK
#   bash benchmarks/gpu/device.sh plugin     # install the plugin's target, unpack CRIU
#   bash benchmarks/gpu/device.sh engine     # assemble vLLM, install the engine's target
#   bash benchmarks/gpu/device.sh sglang     # assemble SGLang's wheels (prepare_carry_sglang.sh), install its target
#   bash benchmarks/gpu/device.sh net        # unpack iproute2, iptables and openssh (carried .carry/gpu/net), wrap their commands
#   bash benchmarks/gpu/device.sh env        # print the environment lines the other steps use
set -euo pipefail
WORK=${COLDSNAP_GPU_WORK:-/root/coldsnap-gpu}
CARRY=.carry/gpu
mkdir -p "$WORK/pieces" "$WORK/engine-wheels" "$WORK/plugin-wheels" "$WORK/criu-debs" "$WORK/sglang-wheels"

stash() {
  [ -d $CARRY/vllm ] && cp -v $CARRY/vllm/* "$WORK/pieces/" || true
  [ -d $CARRY/engine ] && cp $CARRY/engine/*.whl "$WORK/engine-wheels/" || true
  [ -d $CARRY/plugin ] && cp $CARRY/plugin/*.whl "$WORK/plugin-wheels/" || true
  [ -d $CARRY/criu ] && cp $CARRY/criu/*.deb "$WORK/criu-debs/" || true
  for part in .carry/gpu-sglang/part*; do [ -d "$part" ] && cp "$part"/* "$WORK/sglang-wheels/"; done
  du -sh "$WORK"/*
}

install_plugin() {
  # The plugin and sparkrun with its exact pins, in a target of their own.
  python3 -m pip install --quiet --no-deps --no-index --target "$WORK/plugin-site" "$WORK"/plugin-wheels/*.whl
  export COLDSNAP_HOME="$WORK/coldsnap-home"
  mkdir -p "$COLDSNAP_HOME"
  rm -rf "$COLDSNAP_HOME/criu"
  PYTHONPATH="$WORK/plugin-site" python3 -m sparkrun_coldsnap setup --criu --criu-debs "$WORK/criu-debs"
}

install_engine() {
  name=$(cat "$WORK/pieces/NAME")
  cat "$WORK"/pieces/vllm.whl.part* > "$WORK/$name"
  python3 -m pip install --quiet --no-deps --no-index --target "$WORK/engine-site" "$WORK/$name" "$WORK"/engine-wheels/*.whl
  PYTHONPATH="$WORK/engine-site" python3 -c "import vllm; print('vllm', vllm.__version__)"
}

install_sglang() {
  # SGLang in a target of its own (it pins other transformers, xgrammar and openai releases).
  (cd "$WORK/sglang-wheels" && for n in *.NAME; do cat "${n%.NAME}".part* > "$(cat "$n")"; done && sha256sum -c --quiet SHA256SUMS)
  python3 -m pip install --quiet --no-deps --no-index --no-compile --target "$WORK/sglang-site" "$WORK"/sglang-wheels/*.whl
  PYTHONPATH="$WORK/sglang-site" python3 -c "import sglang, sgl_kernel, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)"
}

install_net() {
  # Unpacked, not installed (dpkg -x, as CRIU is): the image's own packages stay as they are.
  # Each command gets a wrapper in /usr/local/{bin,sbin} that finds the unpacked libraries
  # (LD_LIBRARY_PATH for that command alone: the engine never sees Debian's libraries), so
  # sparkrun's ssh and scp, CRIU's iptables-restore and the hosts' scripts find them on PATH.
  local root=$WORK/net libs
  for f in .carry/gpu/net/*.deb; do dpkg -x "$f" "$root"; done
  libs=$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu
  wrap() {  # wrapper path, real binary, name it runs as (argv[0])
    printf '#!/bin/bash\nLD_LIBRARY_PATH=%s XTABLES_LIBDIR=%s exec -a %s %s "$@"\n' "$libs" "$root/usr/lib/x86_64-linux-gnu/xtables" "$3" "$2" > "$1"
    chmod 755 "$1"
  }
  wrap /usr/local/bin/ip "$root/bin/ip" ip
  for c in ssh scp ssh-keygen; do wrap /usr/local/bin/$c "$root/usr/bin/$c" $c; done
  # scp runs ssh by its compiled-in path
  [ -e /usr/bin/ssh ] || ln -s /usr/local/bin/ssh /usr/bin/ssh
  # iptables' commands are one binary that acts by the name it runs as; its matches and targets
  # (CRIU's connection lock uses `-m mark`) are loaded from XTABLES_LIBDIR
  for c in iptables iptables-restore iptables-save ip6tables ip6tables-restore ip6tables-save; do
    wrap /usr/local/sbin/$c "$root/usr/sbin/xtables-nft-multi" $c
  done
  # sshd re-executes itself by its own path and loads libwrap from the unpacked tree
  # (scripts/two-hosts.sh gives it LD_LIBRARY_PATH from SSHD's prefix)
  ip -V && ssh -V && iptables -V
  echo "SSHD=$root/usr/sbin/sshd"
}

case "${1:-}" in
  stash) stash ;;
  plugin) install_plugin ;;
  engine) install_engine ;;
  sglang) install_sglang ;;
  net) install_net ;;
  env)
    echo "export COLDSNAP_HOME=$WORK/coldsnap-home PYTHONPATH=$WORK/plugin-site PATH=$WORK/plugin-site/bin:\$PATH SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1" ;;
  *) echo "usage: $0 stash|plugin|engine|sglang|net|env" >&2; exit 2 ;;
esac

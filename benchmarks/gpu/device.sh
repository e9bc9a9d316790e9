#!/usr/bin/env bash
# On the GPU machine, from the repository root. The machine reaches no registry: what
# prepare_carry.sh made travels in pieces (each command carries at most 64 MiB) and is
# assembled under $WORK, outside the work tree, where it stays while the machine is held.
#   bash benchmarks/gpu/device.sh stash      # keep this call's carried pieces in $WORK
#   bash benchmarks/gpu/device.sh plugin     # install the plugin's target, unpack CRIU
#   bash benchmarks/gpu/device.sh engine     # assemble vLLM, install the engine's target
#   bash benchmarks/gpu/device.sh sglang     # assemble SGLang's wheels (prepare_carry_sglang.sh), install its target
#   bash benchmarks/gpu/device.sh net        # unpack iproute2, iptables and openssh (carried .carry/gpu/net), link `ip`
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
  for f in .carry/gpu/net/*.deb; do dpkg -x "$f" "$WORK/net"; done
  ln -sf "$WORK/net/bin/ip" /usr/local/bin/ip
  echo "export LD_LIBRARY_PATH=$WORK/net/usr/lib/x86_64-linux-gnu:$WORK/net/lib/x86_64-linux-gnu"
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

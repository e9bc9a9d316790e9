#!/usr/bin/env bash
# Prepare, on the CPU machine, everything the GPU qualification needs on a machine that
# reaches no package registry: wheels for two separate targets (the engine's, the plugin's),
# CRIU's packages, and vLLM's wheel split into pieces small enough to travel.
#   bash benchmarks/gpu/prepare_carry.sh [DIR]      (default .carry/gpu, ignored by git)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.carry/gpu}
mkdir -p "$OUT/engine" "$OUT/plugin" "$OUT/criu" "$OUT/vllm"
source benchmarks/gpu/platform.sh

# vLLM 0.26.0 pins torch 2.11.0 and CUDA 13, like the GPU machine's own torch: only what that
# machine lacks is carried (the set a by-hand run needed), installed with --no-deps.
pip download --quiet --no-deps "${PLAT[@]}" -d "$OUT/engine" \
  annotated-types "apache-tvm-ffi==0.1.10" cachetools cbor2 distro "fastapi==0.136.3" jmespath "llguidance==1.7.6" \
  model-hosting-container-standards msgspec "openai==2.48.0" openai-harmony partial-json-parser \
  prometheus-fastapi-instrumentator pybase64 "pydantic==2.14.4" "pydantic-core==2.50.5" pyzmq sniffio starlette \
  typing-inspection uvicorn watchfiles "xgrammar==0.2.3" jiter jsonschema jsonschema-specifications referencing \
  rpds-py email-validator dnspython pydantic-extra-types python-multipart setproctitle blake3
pip download --quiet --no-deps "${PLAT[@]}" -d "$OUT/vllm-whole" "vllm==0.26.0"
split -b 58m -d "$OUT"/vllm-whole/vllm-0.26.0-*.whl "$OUT/vllm/vllm.whl.part"
ls "$OUT"/vllm-whole/ > "$OUT/vllm/NAME"
rm -rf "$OUT/vllm-whole"

# The plugin with sparkrun's exact pins (its pydantic differs from vLLM's): a target of its own,
# everything the plugin's wheel declares, resolved for the GPU machine's platform. numpy too: the
# image has it only inside its torch environment, and the plugin runs on the system's Python.
.venv/bin/pip wheel --quiet --no-deps -w "$OUT/plugin" .
pip download --quiet "${PLAT[@]}" -d "$OUT/plugin" "$(ls "$OUT"/plugin/sparkrun_coldsnap-*.whl)"

# CRIU 4.2.1 and the libraries it links (the same packages `sparkrun coldsnap setup --criu` unpacks).
.venv/bin/python - "$OUT/criu" <<'PY'
import sys
from pathlib import Path
from sparkrun_coldsnap.setup.criu_install import download_debs
download_debs(Path(sys.argv[1]), log=print)
PY
# iproute2, iptables and openssh with the libraries the GPU image lacks, for two namespaced hosts
# there (device.sh net unpacks them; the image has none of the three).
mkdir -p "$OUT/net"
(cd "$OUT/net" && apt-get download -q iproute2 iptables openssh-server openssh-client openssh-sftp-server libmnl0 libxtables12 libnftnl11 \
  libbpf1 libelf1 libcap2 libcap2-bin libnetfilter-conntrack3 libnfnetlink0 libwrap0 libip4tc2 libip6tc2 libnsl2 libtirpc3 libtirpc-common \
  libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libbsd0 libmd0 >/dev/null)
du -sh "$OUT"/*

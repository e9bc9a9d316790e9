#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real CRIU, the real
# CPU vLLM engine through real sparkrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A real OCI registry (CNCF distribution, Debian's docker-registry) and openssl for its TLS tests.
if ! command -v docker-registry >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1; then
  echo "==> installing docker-registry and openssl for the registry tests"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q docker-registry openssl >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q docker-registry openssl >/dev/null; }
fi
export SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1
# Docker for the container tests: dockerd (experimental, CRIU for runc) and the CPU engine's image.
.venv/bin/sparkrun-coldsnap setup --docker
exec .venv/bin/pytest -q "$@"

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
  # --no-upgrade: install what is missing, never upgrade what the host has (a library
  # upgraded under a capsule makes its restores refuse).
  apt-get install -y -q --no-upgrade docker-registry openssl >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q --no-upgrade docker-registry openssl >/dev/null; }
fi
# A C compiler for the fake CUDA driver library the fake GPU host loads.
if ! command -v cc >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-upgrade gcc libc6-dev >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q --no-upgrade gcc libc6-dev >/dev/null; }
fi
# iptables for CRIU's network lock, which the two-host tests' dumps of connections between
# hosts take (without it: "Iptables configuration failed").
if ! command -v iptables >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-upgrade iptables >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q --no-upgrade iptables >/dev/null; }
fi
# skopeo with sigstore signing and verification for the signature tests: Debian 13's package
# (Debian 12's skopeo has sigstore switched off; scripts/install_skopeo.sh says how it is had there).
COLDSNAP_TEST_SKOPEO="$(bash scripts/install_skopeo.sh)"
export COLDSNAP_TEST_SKOPEO
# qemu's user mode, which runs the arm64 CRIU the installer unpacks (tests/test_criu_install.py).
if ! command -v qemu-aarch64 >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-upgrade qemu-user >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q --no-upgrade qemu-user >/dev/null; }
fi
# An sshd for the two-host tests (each network namespace runs its own).
bash scripts/test-sshd.sh >/dev/null
export SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1
# Docker for the container tests: dockerd (experimental, CRIU for runc) and the CPU engine's image.
.venv/bin/sparkrun-coldsnap setup --docker
# Guardrails first: the linter and the type checker, as configured in pyproject.toml.
echo "==> ruff and mypy"
.venv/bin/ruff check sparkrun_coldsnap tests benchmarks
.venv/bin/mypy
# The 30 slowest tests are printed at the end; `bash scripts/test.sh -m fast` runs the fast tier
# only (tiers: tests/tier_fixtures.py).
exec .venv/bin/pytest -q --durations=30 "$@"

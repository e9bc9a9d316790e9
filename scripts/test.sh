#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real CRIU, the real
# CPU vLLM engine through real sparkrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1
exec .venv/bin/pytest -q "$@"

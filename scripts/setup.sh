#!/usr/bin/env bash
# Set up everything the embedded default needs on a fresh machine, idempotently:
#   - the plugin's own environment (.venv, Python >= 3.12, sparkrun 0.4.2 and this plugin),
#   - CRIU 4.2 (the system's if it is new enough, else a private copy),
#   - the CPU vLLM engine in its own environment (Python 3.11), apart from the plugin's,
#   - the tiny model, made locally,
#   - sparkrun: the coldsnap plugin enabled (installed plugins start disabled), the
#     local executor on, a default cluster on localhost.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  # A pyenv shim exists for every installed version but runs only the selected
  # one, so each candidate must actually start.
  local v p
  for v in 3.13 3.12; do
    for p in "$(command -v "python$v" 2>/dev/null)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/$v.*/bin/python$v; do
      [ -n "$p" ] && [ -x "$p" ] && "$p" -c "import sys" >/dev/null 2>&1 && { echo "$p"; return; }
    done
  done
  echo "no Python >= 3.12 found (sparkrun 0.4.2 needs it): install python3.12" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  echo "==> creating .venv with $PY"
  "$PY" -m venv .venv
fi
echo "==> installing sparkrun-coldsnap and its dependencies into .venv"
.venv/bin/pip install --quiet --disable-pip-version-check '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import sparkrun_coldsnap, sparkrun" || { echo "installation into .venv failed" >&2; exit 1; }

export SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1
echo "==> enabling the coldsnap plugin in sparkrun"
.venv/bin/sparkrun plugins enable coldsnap >/dev/null
.venv/bin/sparkrun coldsnap setup

# The recipe pins the model by a revision derived from its bytes: check they agree.
rev=$(sed -n 's/^model_revision: *//p' recipes/tiny-vllm-cpu.yaml)
snap="${HF_HOME:-$HOME/.cache/huggingface}/hub/models--coldsnap--tiny-qwen2/snapshots/$rev"
if [ ! -d "$snap" ]; then
  echo "the tiny model made here does not have the revision recipes/tiny-vllm-cpu.yaml pins ($rev):" >&2
  echo "its engine environment differs from the pinned one; reinstall it with: rm -rf \"\${COLDSNAP_HOME:-\$HOME/.local/share/sparkrun-coldsnap}/engines/vllm-cpu\" && bash scripts/setup.sh" >&2
  exit 1
fi

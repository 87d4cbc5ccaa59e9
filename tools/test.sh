#!/usr/bin/env bash
# Install everything into .venv, build the simulated NPU, run the whole test suite
# (unit tests and the multi-process end-to-end runs marked e2e).
#   bash tools/test.sh                 # everything
#   bash tools/test.sh -m "not e2e"    # extra pytest arguments replace the default selection
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.14.1" "torchtitan==0.3.0" -e ".[test]"
[ -f tools/sim_npu/build.py ] && "$PY" tools/sim_npu/build.py
export HF_HUB_OFFLINE=1
if [ "$#" -eq 0 ]; then set -- -m "e2e or not e2e"; fi
exec "$PY" -m pytest "$@"

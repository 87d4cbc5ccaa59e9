#!/usr/bin/env bash
# Makes or updates the CANN emulation's environment and builds the emulated CANN libraries.
#   bash verification/cann_emu/setup.sh [VENV]       # default .venv-cann (relative to the repository root)
# Installs torch (tools/pins.txt: 2.14.1, see README.md "torch 2.14.1 under a wheel that pins 2.14.0"),
# the torch_npu 2.14.0 wheel from PyPI unmodified (--no-deps, then its own runtime requirements but torch),
# torchtitan 0.3.0 and this project with its test extra; then builds verification/cann_emu/build/lib*.so.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-cann}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q -r tools/pins.txt -e ".[test]"
# The wheel, from $NPU_INJECT_WHEEL_CACHE (default ~/.cache/npu_inject/wheels), downloaded with pip when absent.
WHEEL=$("$PY" -c 'from verification.sim_npu.torch_npu_wheel import wheel; print(wheel().filename)')
"$PY" -m pip install -q --no-deps "$WHEEL"
# torch_npu's Requires-Dist except torch (which tools/pins.txt gave above).
"$PY" - "$WHEEL" <<'PY' | xargs -r "$PY" -m pip install -q
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.name != "torch" and (req.marker is None or req.marker.evaluate()):
                print(str(req))
PY
"$PY" verification/cann_emu/build.py
echo "cann_emu: ready: eval \"\$($PY verification/cann_emu/env.py)\""

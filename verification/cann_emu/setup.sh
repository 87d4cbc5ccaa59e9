#!/usr/bin/env bash
# Makes or updates the CANN emulation's environment and builds the emulated CANN libraries.
#   bash verification/cann_emu/setup.sh [VENV]              # default .venv-cann (relative to the repository root)
#   bash verification/cann_emu/setup.sh [VENV] --base .venv # layered over the project's venv (what CI does)
# Standalone: installs torch (tools/pins.txt: 2.14.1, see README.md "torch for the emulation"), the
# torch_npu 2.14.0 wheel from PyPI unmodified (--no-deps, then its own runtime requirements but torch),
# torchtitan 0.3.0 and this project with its test extra; then builds verification/cann_emu/build/lib*.so.
# Layered (--base BASE): VENV holds only the torch_npu wheel; a .pth file adds BASE's site-packages
# (with its .pth files: this project's editable install and bootstrap) after VENV's own, so torch,
# torchtitan and this project are BASE's. Seconds instead of minutes and 6 GB; BASE must have the
# torch of tools/pins.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-cann
BASE=
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE=$2; shift 2 ;;
    -*) echo "setup.sh: unknown option $1 (valid: --base VENV)" >&2; exit 2 ;;
    *) VENV=$1; shift ;;
  esac
done
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if [ -n "$BASE" ]; then
  [ -x "$BASE/bin/python" ] || { echo "setup.sh: --base $BASE has no bin/python (make it with bash tools/test.sh)" >&2; exit 2; }
  BASE_SITE=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  OWN_SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # "import" lines of a .pth run at start-up: BASE's directory joins sys.path after VENV's own.
  echo "import site; site.addsitedir('$BASE_SITE')" > "$OWN_SITE/zz_cann_emu_base_venv.pth"
  # torchrun for this interpreter (BASE's script would run BASE's python).
  printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' "$(cd "$(dirname "$PY")" && pwd)/python" > "$VENV/bin/torchrun"
  chmod +x "$VENV/bin/torchrun"
else
  "$PY" -m pip install -q -r tools/pins.txt -e ".[test]"
fi
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

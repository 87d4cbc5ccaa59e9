#!/usr/bin/env bash
# Install everything into .venv, build the simulated NPU and the CANN emulation (.venv-cann, layered over
# .venv), run the whole test suite (unit tests, the multi-process end-to-end runs marked e2e, and the
# real torch_npu wheel on the emulation, marked cann_emu).
#   bash tools/test.sh                 # unit tests + e2e runs (what CI runs)
#   bash tools/test.sh --unit          # unit tests only: pyproject.toml's default marker selection
#   bash tools/test.sh -m parallel     # a long matrix by its marker (pyproject.toml lists them)
#   bash tools/test.sh -m "cann_emu or cann_emu_long"   # everything on the CANN emulation
#   bash tools/test.sh -m e2e_long     # the longer end-to-end runs CI leaves out
#   bash tools/test.sh -m docs         # every command block of README.md and docs/*.md, run as written
# The tests of torchtitan's own integration suite read a torchtitan checkout (release/0.3) from
# TORCHTITAN_SRC and skip, saying so, without it (.ci/run passes CI's copy).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The test extra brings torchvision (qwen3_5's image loader), not transformers (flux's row checks its stop).
"$PY" -m pip install -q -r tools/pins.txt -e ".[test]"
"$PY" verification/sim_npu/build.py
# The real torch_npu wheel on the CANN emulation (tests/cann_emu): a venv layered over $VENV that adds
# only the wheel, and the emulated CANN libraries.
bash verification/cann_emu/setup.sh .venv-cann --base "$VENV"
export HF_HUB_OFFLINE=1
# --unit keeps pyproject.toml's addopts selection: the unit tests, whatever markers join the project.
unit=0 args=()
for arg in "$@"; do
  if [ "$arg" = --unit ]; then unit=1; else args+=("$arg"); fi
done
set -- ${args[@]+"${args[@]}"}
# CI's selection: everything but the long matrices (their one-case-per-dimension members carry e2e too) and the
# docs' command blocks (one of them carries e2e).
case "$unit $* " in
  1*|*" -m "*) ;;
  *) set -- -m "not (models or fused_matrix or compile_long or upstream_suite or cann_emu_long or e2e_long) and (e2e or not (parallel or docs))" "$@" ;;
esac
# Two workers by default (tests/conftest.py groups the tests that share runs); -n 0 runs in one process.
# One OpenMP thread per process, as torchrun sets for multi-rank runs: a 1-rank run's two spinning
# threads beside the other worker's ranks were 4-7x slower (oversubscribed OpenMP barriers).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
case " $* " in
  *" -n "*) ;;
  *) set -- -n "${TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@" ;;
esac
exec "$PY" -m pytest "$@"

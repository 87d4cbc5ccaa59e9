#!/usr/bin/env bash
# Install everything into .venv and run a short llama3 debug training through npu_inject:
# on real NPUs when torch_npu imports, else as the CPU rehearsal (2 CPU ranks, gloo).
#   bash tools/quickstart.sh            # 10 steps
#   NPROC=8 STEPS=20 bash tools/quickstart.sh -- --training.seq_len 2048   # extra torchtitan flags after --
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# Each step says what it waits for: the installs take minutes the first time (torch's wheel is about 5 GB).
echo "quickstart: installing into $VENV: pip, then torch (NPU machines keep theirs), torchtitan and npu-inject"
"$PY" -m pip install -q --upgrade pip
# NPU users bring the torch their torch_npu pairs with; elsewhere take the pinned torch (tools/pins.txt).
"$PY" -c "import torch" 2>/dev/null || {
  echo "quickstart: installing $(grep '^torch==' tools/pins.txt) (a few minutes the first time)"
  "$PY" -m pip install -q "$(grep '^torch==' tools/pins.txt)"; }
"$PY" -m pip install -q "$(grep '^torchtitan==' tools/pins.txt)" -e .

if "$PY" -c "import torch_npu" 2>/dev/null; then
  TARGET=1; NPROC=${NPROC:-$("$PY" -c "import torch, torch_npu; print(torch.npu.device_count())")}
else
  TARGET=cpu; NPROC=${NPROC:-2}
  echo "quickstart: torch_npu does not import here: running the CPU rehearsal (TORCHTITAN_NPU=cpu)"
fi
[ "${1:-}" = "--" ] && shift
# The doctor of the target this run trains on: a patch that would not apply stops here, not mid-run.
TORCHTITAN_NPU=$TARGET "$VENV/bin/npu-inject" doctor || {
  echo "quickstart: npu-inject doctor found problems (above) for TORCHTITAN_NPU=$TARGET; not training" >&2; exit 2; }
DUMP=${DUMP:-outputs/quickstart}
mkdir -p "$DUMP"
# --debug.seed: two quickstart runs train alike, so `npu-inject compare` of two of them holds (upstream seeds nothing).
# As upstream's run_train.sh: every line prefixed [rankN]: (--tee, --role rank). The whole output goes to
# $DUMP/train.log (npu-inject compare reads a dump folder's log, rank 0 by default); the console shows
# rank 0's lines and torchrun's own. torchrun's per-rank copies (--tee needs a log dir) are temporary.
TORCHRUN_LOGS=$(mktemp -d)
trap 'rm -rf "$TORCHRUN_LOGS"' EXIT
status=0
STARTED=$(date +%s.%N)
TORCHTITAN_NPU=$TARGET HF_HUB_OFFLINE=1 "$VENV/bin/torchrun" --nproc_per_node "$NPROC" \
  --role rank --tee 3 --log-dir "$TORCHRUN_LOGS" \
  -m torchtitan.train --module llama3 --config llama3_debugmodel \
  --training.steps "${STEPS:-10}" --training.seq_len 256 --training.local_batch_size 2 --debug.seed 42 \
  --checkpoint.no-enable --validator.no-enable --dump_folder "$DUMP" "$@" 2>&1 \
  | tee "$DUMP/train.log" | { grep --line-buffered -v '^\[rank[1-9][0-9]*\]:' || true; } || status=$?
# How long start-up took: torchrun's start to rank 0's "Training starts" line (torchtitan's own timestamp).
"$PY" - "$DUMP/train.log" "$STARTED" <<'TIMING' || true
import datetime, re, sys
found = re.search(r"^\[rank0\]:\[titan\] (\S+ \S+) - root - INFO - Training starts", open(sys.argv[1]).read(), re.M)
if found:
    began = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    print(f"quickstart: training started {began - float(sys.argv[2]):.1f} s after torchrun did")
TIMING
echo "quickstart: above, rank 0's lines; every rank's in $DUMP/train.log (npu-inject compare $DUMP <another run>" \
  "reads it); per-rank patch reports in $DUMP/npu_inject/"
exit "$status"

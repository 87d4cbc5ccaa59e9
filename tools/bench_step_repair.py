"""Issue 58's figures on the real torch_npu 2.14.0 over the CANN emulation: what step_repair costs, and how long
a repair takes.

1. The cost when nothing fails: upstream llama3 debug on 2 ranks (FSDP, or PP 2 with ``--layout pp``), with
   step_repair (its default) and without (``-step_repair``); per warmed-up step and rank, the host synchronisations
   and store traffic the emulation counts (CANN_EMU_COUNTS), and both runs' wall times.
2. Each repairable fault (``--faults``): the time from the fault to training again, read from torchtitan's own log
   lines: the faulted step's wall time (its metric line's time less the previous step's) less the same step's in
   the run without the fault, and the repair's own part (stop, restart, communicators dropped, every rank's
   report) that step_repair's note states. The stuck collective's includes ``stuck_after`` (10 s here), the time a
   stuck step is given before it is called stuck.

    .venv/bin/python tools/bench_step_repair.py
    .venv/bin/python tools/bench_step_repair.py --faults link_error@3:rank=0
    .venv/bin/python tools/bench_step_repair.py --layout pp   # PP 2 (1F1B): a UCE on either stage, a stuck and a failed send

What it cannot say: a real NPU's stop and restart time, or how long real HCCL takes to make a thousand ranks'
communicators anew (here: 2 ranks on loopback TCP).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.training_runs import clean_env  # noqa: E402
from verification.cann_emu import cann_env  # noqa: E402

PYTHON = REPO / ".venv-cann" / "bin" / "python"
ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
        "--debug.deterministic", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - INFO - .*?step:\s*(\d+)\s.*?loss:\s*([0-9.]+)")
REPAIR_NOTE = re.compile(r"step_repair: step (\d+): rank (\d+)'s (\w+) repaired on every rank .*?, ([0-9.]+) s\)")
STUCK_AFTER = 10
LAYOUTS = {  # name: (torchtitan's arguments, the faults timed by default)
    "fsdp": ([], ["uce_in_forward@3:rank=1", "link_error@3:rank=0", "stuck_collective@3:rank=1"]),
    "pp": (["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", "2"],
           ["uce_in_forward@3:rank=0", "uce_in_forward@3:rank=1", "stuck_collective@3:rank=1", "link_error@3:rank=1"]),
}


def train(folder: Path, steps: int, layout: str, patches: str = "", faults: str = "", counts: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    registry = folder / "registry.json"
    registry.write_text(json.dumps({"patches": {"step_repair": {"options": {"stuck_after": STUCK_AFTER}}}}))
    env = {"TORCHTITAN_NPU_REGISTRY": str(registry)}
    if patches:
        env["TORCHTITAN_NPU_PATCHES"] = patches
    if faults:
        env["TORCHTITAN_NPU_FAULTS"] = faults
    if "link_error" in faults:  # torch_npu's watchdog would end the process on the failed communicator first
        env["TORCH_HCCL_ASYNC_ERROR_HANDLING"] = "0"
    env = cann_env(clean_env(TORCHTITAN_NPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CANN_EMU_ASYNC_STREAMS="1",
                             **env), counts=str(folder / "cann_emu_rank{rank}.json") if counts else None)
    command = [str(PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
               "0", "-m", "torchtitan.train", *ARGS, *LAYOUTS[layout][0], "--training.steps", str(steps),
               "--dump-folder", str(folder)]
    began = time.monotonic()
    run = subprocess.run(command, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=1800)
    if run.returncode != 0:
        sys.exit(f"bench_step_repair: the run in {folder} failed (exit {run.returncode}):\n{run.stdout[-3000:]}")
    return run.stdout, time.monotonic() - began


def step_times(log: str) -> tuple[dict[int, float], dict[int, float]]:
    """step -> its metric line's time (the first of each step with a loss: under PP the last stage's), and
    step -> loss."""
    times, losses = {}, {}
    for stamp, step, loss in STEP_LINE.findall(log):
        times.setdefault(int(step), datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp())
        losses[int(step)] = float(loss)
    return times, losses


def per_step(folder: Path, kind: str) -> dict[str, float]:
    """Rank 0's counts of ``kind`` averaged over the warmed-up steps (the 3rd on)."""
    counts = json.loads((folder / "cann_emu_rank0.json").read_text())["steps"]
    rows = [row[kind] for step, row in counts.items() if step.isdigit() and int(step) >= 3]
    names = sorted({name for row in rows for name in row})
    return {name: sum(row.get(name, 0) for row in rows) / len(rows) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="fsdp", help="2 ranks: FSDP, or PP 2 (1F1B)")
    parser.add_argument("--faults", nargs="*", help="default: the layout's (LAYOUTS)")
    args = parser.parse_args()
    faults_timed = LAYOUTS[args.layout][1] if args.faults is None else args.faults
    if not PYTHON.exists():
        sys.exit(f"bench_step_repair: {PYTHON} is missing: bash verification/cann_emu/setup.sh makes it")
    with tempfile.TemporaryDirectory(prefix="bench_step_repair_") as tmp:
        folder = Path(tmp)
        on_log, on_wall = train(folder / "on", args.steps, args.layout, counts=True)
        off_log, off_wall = train(folder / "off", args.steps, args.layout, patches="-step_repair", counts=True)
        on_times, on_losses = step_times(on_log)
        _, off_losses = step_times(off_log)
        print(f"nothing failing, {args.layout} on 2 ranks, {args.steps} steps (steps 3 on, rank 0, per step):")
        for kind in ("syncs", "hccl"):
            on, off = per_step(folder / "on", kind), per_step(folder / "off", kind)
            changed = {name: round(on.get(name, 0) - off.get(name, 0), 2) for name in sorted({*on, *off})
                       if abs(on.get(name, 0) - off.get(name, 0)) > 1e-9 and name != "HcclGetCommAsyncError"}
            print(f"  {kind}: with step_repair less without: {changed or 'none'}")
        print(f"  wall: {on_wall:.1f} s with, {off_wall:.1f} s without; losses equal: {on_losses == off_losses}")
        for faults in faults_timed:
            log, wall = train(folder / faults.replace("@", "_").replace(":", "_").replace("=", ""), args.steps,
                              args.layout, patches="+inject_faults", faults=faults)
            times, losses = step_times(log)
            notes = REPAIR_NOTE.findall(log)
            if not notes:
                sys.exit(f"bench_step_repair: {faults}: no repair noted:\n{log[-3000:]}")
            step = int(notes[0][0])
            extra = (times[step] - times[step - 1]) - (on_times[step] - on_times[step - 1])
            repair = max(float(note[3]) for note in notes)
            print(f"{faults}: fault to training again {extra:.1f} s (step {step}'s wall time over the run without "
                  f"the fault), of which the repair {repair:.1f} s; caught as {notes[0][2]} of rank {notes[0][1]}; "
                  f"losses equal: {losses == on_losses}; run {wall:.1f} s")


if __name__ == "__main__":
    main()

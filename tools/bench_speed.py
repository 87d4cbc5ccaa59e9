"""How fast: npu-inject plan's step and layer times beside measured ones (docs/planner.md, "Checked against").

    python tools/bench_speed.py rehearsal [--hardware-file F] [--steps 10]
    python tools/bench_speed.py layer LAYER_JSON [--hardware H100] [--hardware-file F]

``rehearsal``: the CPU rehearsal's llama3 debug job (the quickstart's: seq 256, local batch 2) on 1 and on 2
ranks, run for ``--steps`` steps, its step time read from torchtitan's tps (the median of the steps after the
third); and ``npu-inject plan --hardware cpu`` of the same job with the rates ``npu-inject calibrate``
measured on this host (``--hardware-file``; calibrated here first when not given). Prints both and the error.
The cpu family's overhead is fitted on the first row (1 rank; printed); the 2-rank row is the prediction.

``layer``: a decoder layer (llama3_8b's at local batch 2 x seq 8192, or qwen3_30b_a3b's MoE layer at 2 x 4096;
no activation checkpointing, FSDP 8, no expert parallelism) as the planner plans it (``time_by_module["layers.1"]``
and its classes), beside ``tools/bench_layer.py --profile --json`` measured on a real accelerator (the file it
wrote names the model).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
REHEARSAL = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "256",
             "--training.local_batch_size", "2"]
# The job each tools/bench_layer.py --model is a layer of; planned at the batch and seq_len it ran, without
# activation checkpointing.
LAYER = {
    "llama3_8b": ["--module", "llama3", "--config", "llama3_8b"],
    "qwen3_30b_a3b": ["--module", "qwen3", "--config", "qwen3_30b_a3b"],
}


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


def plan(hardware: str, hardware_file: str | None, ranks: int, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "plan.json")
        command = [os.path.join(BIN, "npu-inject"), "plan", "--hardware", hardware, "--ngpu", str(ranks),
                   "--json", out, *(["--hardware-file", hardware_file] if hardware_file else []), *argv]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if not os.path.exists(out):
            raise SystemExit(f"npu-inject plan failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)


def rehearsal_step_s(steps: int, ranks: int) -> list[float]:
    """Each logged step's seconds on rank 0: the tokens it trains (local batch x seq) over torchtitan's tps."""
    # One thread per rank, as torchrun sets for several ranks (and calibrate measures with --threads 1): the
    # 1-rank row would otherwise compute on every core.
    env = {**os.environ, "TORCHTITAN_NPU": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", str(ranks),
                               "-m", "torchtitan.train", *REHEARSAL, "--training.steps", str(steps),
                               "--checkpoint.no-enable", "--validator.no-enable", "--dump_folder", folder],
                              cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the rehearsal failed ({done.returncode}): {done.stderr.strip().splitlines()[-3:]}")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    tps = [int(value) for value in re.findall(r"step:\s+\d+\s.*?tps:\s+([\d,]+)", plain.replace(",", ""))]
    tokens = 2 * 256
    return [tokens / value for value in tps[::ranks]]  # every rank logs each step: rank 0's


def cmd_rehearsal(args) -> int:
    hardware_file = args.hardware_file
    if hardware_file is None:
        hardware_file = os.path.join(tempfile.mkdtemp(prefix="npu_inject_bench_"), "calibrated-cpu.json")
        subprocess.run([os.path.join(BIN, "npu-inject"), "calibrate", "--device", "cpu", "--ranks", str(max(args.ranks)),
                        "-o", hardware_file], check=True)
    print(f"CPU rehearsal, llama3_debugmodel, seq 256, local batch 2; planned from {hardware_file}")
    for ranks in args.ranks:
        measured = rehearsal_step_s(args.steps, ranks)
        steady = statistics.median(measured[3:]) if len(measured) > 4 else statistics.median(measured)
        planned = plan("cpu", hardware_file, ranks, REHEARSAL)
        breakdown = planned["breakdown"]
        print(f"  {ranks} rank{'s' if ranks > 1 else ''}: measured step {steady:.3f} s (median of steps 4-{len(measured)}: "
              f"{', '.join(f'{s:.3f}' for s in measured[3:])}); planned {planned['step_s']:.3f} s "
              f"({_error(planned['step_s'], steady)})")
        if ranks == args.ranks[0]:
            # The cpu family's overhead that makes this row's plan its measurement: on the CPU the operators run on
            # the issuing core, so the step grows by the stretched compute (exact for the one-rank row).
            base = planned["step_s"] - breakdown.get("overhead_s", 0.0)
            print(f"    the cpu family's overhead fitted on this row: {(steady - base) / breakdown['compute_s']:.3f} "
                  "(npu_inject/hardware.json efficiency cpu.overhead)")
        print(f"    planned: compute {breakdown['compute_s']:.3f}, overhead {breakdown.get('overhead_s', 0.0):.3f}, "
              f"exposed communication {breakdown['exposed_comm_s']:.3f}, host {breakdown['host_s']:.3f}; by class "
              + ", ".join(f"{name} {sum(phases.values()):.3f}" for name, phases in planned["time_by_class"].items()))
    return 0


def cmd_layer(args) -> int:
    with open(args.layer_json, encoding="utf-8") as handle:
        measured = json.load(handle)
    model = measured.get("model", "llama3_8b")  # files written before --model existed are llama3_8b's
    if model not in LAYER:
        raise SystemExit(f"{args.layer_json}: model {model!r} is not one of {', '.join(LAYER)}")
    argv = [*LAYER[model], "--training.seq_len", str(measured["seq"]), "--training.local_batch_size",
            str(measured["batch"]), "activation-checkpoint:none"]
    planned = plan(args.hardware, args.hardware_file, 8, argv)
    layer_s = planned["time_by_module"]["layers.1"]
    print(f"{model} decoder layer, local batch {measured['batch']} x seq {measured['seq']}, bf16, AC none; "
          f"measured on {measured['device']} "
          f"(torch {measured['torch']}), planned on {planned['hardware']}")
    print(f"  planned layers.1: {layer_s * 1e3:.1f} ms forward + backward (time_by_module)")
    for kernel, run in measured["runs"].items():
        ms = run["forward_backward_ms"]
        print(f"  measured, SDPA {kernel}: {ms:.1f} ms forward + backward; planned {_error(layer_s * 1e3, ms)}"
              + (f"; kernels by class (ms) {run['kernels_ms']}" if "kernels_ms" in run else ""))
    classes = planned["time_by_module_class"]["layers.1"]
    print("  planned layers.1 by class (ms): " + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in
                                                         sorted(classes.items(), key=lambda item: -item[1])))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rehearsal = commands.add_parser("rehearsal")
    rehearsal.add_argument("--hardware-file", default=None, help="a file npu-inject calibrate wrote on this host")
    rehearsal.add_argument("--steps", type=int, default=10)
    rehearsal.add_argument("--ranks", type=lambda text: [int(value) for value in text.split(",")], default=[1, 2],
                           help="comma list of rank counts to run and plan (default 1,2)")
    rehearsal.set_defaults(run=cmd_rehearsal)
    layer = commands.add_parser("layer")
    layer.add_argument("layer_json", help="what tools/bench_layer.py --profile --json wrote")
    layer.add_argument("--hardware", default="H100")
    layer.add_argument("--hardware-file", default=None)
    layer.set_defaults(run=cmd_layer)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

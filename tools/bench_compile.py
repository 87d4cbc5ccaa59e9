"""Eager vs ``--compile.enable`` step time in the CPU rehearsal (one run each, figures only).

    python tools/bench_compile.py [--config llama3_debugmodel] [--steps 10] [--nproc 2]

Trains the config twice on ``--nproc`` rehearsal ranks (TORCHTITAN_NPU=cpu, fp32,
deterministic, same seed): eager, then with ``--compile.enable`` (patch compile picks
torch's C++ inductor). Step time is the median of torchtitan's per-step wall time after
the first two steps (which include compilation); it is read from the ``tps`` column
(tokens per second per rank). Prints both, the ratio, the compile backend from the
report and the largest relative loss difference. One run each, no assertion: figures
depend on the machine and its load.
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torchtitan's training metric line ("validate step: N  loss: L ... tps: T" is the validator's)
STEP_LINE = re.compile(r"(?<!validate )step:\s*(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s*([-+0-9.naif]+).*?tps:\s*([0-9,]+)")


def train(config: str, module: str, steps: int, nproc: int, seq_len: int, batch: int, dump: str, extra: list[str]):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "-m", "torchtitan.train", "--module", module, "--config", config, "--training.steps", str(steps),
               "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
               "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42", "--debug.deterministic",
               "--training.mixed_precision_param", "float32", "--dump_folder", dump, *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_NPU")}
    env.update(TORCHTITAN_NPU="cpu", HF_HUB_OFFLINE="1")
    started = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"bench_compile: {' '.join(extra) or 'eager'} run failed:\n{result.stdout[-4000:]}")
    losses, tps = {}, {}
    for match in STEP_LINE.finditer(result.stdout):
        step = int(match.group(1))
        losses[step] = float(match.group(2))
        tps[step] = float(match.group(3).replace(",", ""))
    return losses, tps, wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama3_debugmodel")
    parser.add_argument("--module", default="llama3")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4: the first two steps include compilation")
    tokens = args.seq_len * args.batch
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as tmp:
        for name, extra in (("eager", []), ("compiled", ["--compile.enable"])):
            dump = os.path.join(tmp, name)
            losses, tps, wall_s = train(args.config, args.module, args.steps, args.nproc, args.seq_len,
                                        args.batch, dump, extra)
            steady = [tokens / tps[step] for step in sorted(tps) if step > 2 and tps[step] > 0]
            backend = ""
            report = os.path.join(dump, "npu_inject", "report_rank0.json")
            if name == "compiled" and os.path.exists(report):
                with open(report, encoding="utf-8") as handle:
                    notes = json.load(handle)["patches"]["compile"]["notes"]
                backend = "; ".join(note for note in notes if "model blocks" in note)
            results[name] = (losses, statistics.median(steady), wall_s, backend)
    eager, compiled = results["eager"], results["compiled"]
    worst = max(abs(compiled[0][s] - eager[0][s]) / abs(eager[0][s]) for s in eager[0])
    print(f"{args.config}, {args.nproc} CPU-rehearsal ranks, seq_len {args.seq_len}, batch {args.batch}, "
          f"{args.steps} steps (median step time over steps 3-{args.steps})")
    print(f"  eager:    {eager[1] * 1000:8.1f} ms/step   run {eager[2]:6.1f} s")
    print(f"  compiled: {compiled[1] * 1000:8.1f} ms/step   run {compiled[2]:6.1f} s   ({compiled[3]})")
    print(f"  step time eager / compiled: {eager[1] / compiled[1]:.2f}x")
    print(f"  max relative loss difference: {worst:.2e}")


if __name__ == "__main__":
    main()

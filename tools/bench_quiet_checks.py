"""Issue 57's detectors on a long run without a fault: nothing may be detected, no loss may change.

Two runs of an upstream debug model on the CPU rehearsal (2 ranks, bf16 as the rehearsal computes): one with
the silent-corruption patches on (``--patches``, default matmul_checks every ``--every`` steps, spikes, and
replica_check where the job has replicas), one without. Prints the detections the reports hold (any verdict,
spike, disagreement: each is a false alarm here), whether every step's loss equals the plain run's, and both
runs' wall times.

    .venv/bin/python tools/bench_quiet_checks.py --steps 300
    .venv/bin/python tools/bench_quiet_checks.py --steps 300 --module deepseek_v3 --config deepseek_v3_debugmodel

A job with replicas (``--replicas 2``: DDP) lets replica_check compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.training_runs import clean_env, parse_losses, torchrun  # noqa: E402

# notes that say something was detected (each patch's report lines; anything else is bookkeeping)
DETECTIONS = {"matmul_checks": "failed their checksums", "spikes": "spike", "replica_check": "differ"}


def run(args: argparse.Namespace, folder: Path, patches: str) -> tuple[dict[int, float], float, dict]:
    command = ["--module", args.module, "--config", args.config, "--training.steps", str(args.steps),
               "--training.seq_len", "128", "--training.local_batch_size", "1", "--validator.no-enable",
               "--checkpoint.no-enable", "--debug.seed", "42", "--metrics.log_freq", "1", "--dump_folder",
               str(folder)]
    if args.replicas > 1:
        command += ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree",
                    str(args.replicas)]
    env = clean_env(TORCHTITAN_NPU="cpu", **({"TORCHTITAN_NPU_PATCHES": patches,
                                             "TORCHTITAN_NPU_SDC_EVERY": str(args.every)} if patches else {}))
    started = time.monotonic()
    result = torchrun(command, env, nproc=max(2, args.replicas), timeout=args.timeout)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        sys.exit(f"bench_quiet_checks: the run with patches {patches or '(none)'} failed:\n{result.stdout[-3000:]}")
    notes = {}
    report = folder / "npu_inject" / "report_rank0.json"
    if patches:
        notes = {patch: entry.get("notes", []) for patch, entry in json.loads(report.read_text())["patches"].items()
                 if patch in DETECTIONS}
    return parse_losses(result.stdout), seconds, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="llama3")
    parser.add_argument("--config", default="llama3_debugmodel")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=20, help="matmul_checks' every (TORCHTITAN_NPU_SDC_EVERY)")
    parser.add_argument("--replicas", type=int, default=2, help="DDP replicas (1: FSDP over 2 ranks)")
    parser.add_argument("--patches", default="+matmul_checks,+spikes,+replica_check")
    parser.add_argument("--timeout", type=int, default=3600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quiet_checks_") as scratch:
        checked, checked_s, notes = run(args, Path(scratch) / "checked", args.patches)
        plain, plain_s, _ = run(args, Path(scratch) / "plain", "")
    alarms = [f"{patch}: {note}" for patch, lines in notes.items() for note in lines if DETECTIONS[patch] in note]
    differing = [step for step in plain if checked.get(step) != plain[step]]
    print(f"{args.module} {args.config}, {args.steps} steps, patches {args.patches}, matmul_checks every {args.every}, "
          f"{args.replicas} replica(s)")
    for patch, lines in notes.items():
        print(f"  {patch}: {len(lines)} report lines" + "".join(f"\n    {line}" for line in lines[:6]))
    print(f"  detections (false alarms here): {len(alarms)}" + "".join(f"\n    {alarm}" for alarm in alarms[:10]))
    print(f"  losses equal to the plain run's: {not differing and len(checked) == len(plain)} "
          f"({len(plain)} steps; step {args.steps}: {checked.get(args.steps)} against {plain.get(args.steps)})"
          + (f"; differ at steps {differing[:10]}" if differing else ""))
    print(f"  wall time: {checked_s:.0f} s checked, {plain_s:.0f} s plain")
    return 1 if alarms or differing else 0


if __name__ == "__main__":
    sys.exit(main())

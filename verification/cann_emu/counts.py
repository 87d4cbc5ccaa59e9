"""Reads the CANN emulation's per-process counts (CANN_EMU_COUNTS) and prints them per training step.

    python verification/cann_emu/counts.py /tmp/run/counts_*.json            # one table, every process
    python verification/cann_emu/counts.py /tmp/run/counts_*.json --ops 2    # operators of step 2, per name

Each file is one process (one rank): what torch_npu asked of CANN, per step torchtitan ran
(step_marks/sitecustomize.py marks them) and outside steps: aclnn operators by name, those CANN runs on
AI CPU, operators sent down the legacy aclop path, host synchronisations by call.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def load(paths: list[Path]) -> list[dict]:
    runs = []
    for path in paths:
        data = json.loads(path.read_text())
        if data.get("schema") != 2:
            sys.exit(f"{path}: not a CANN_EMU_COUNTS file of schema 2 (keys: {sorted(data)})")
        runs.append(data)
    return runs


def step_order(name: str) -> tuple[int, int]:
    return (1, 0) if name == "outside steps" else (0, int(name))


def summary(runs: list[dict]) -> list[dict]:
    """One row per step over every process: calls, distinct operators, AI CPU, aclop and syncs."""
    steps: dict[str, dict[str, Counter]] = {}
    for run in runs:
        for step, counts in run["steps"].items():
            row = steps.setdefault(step, {k: Counter() for k in ("aclnn", "aicpu", "aclop", "syncs")})
            for key in row:
                row[key].update(counts[key])
    rows = []
    for step in sorted(steps, key=step_order):
        c = steps[step]
        rows.append({
            "step": step,
            "processes": len(runs),
            "aclnn_calls": sum(c["aclnn"].values()),
            "aclnn_operators": len(c["aclnn"]),
            "aicpu_calls": sum(c["aicpu"].values()),
            "aclop": dict(c["aclop"]),
            "syncs": dict(c["syncs"]),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| step | aclnn calls (operators) | AI CPU calls | legacy aclop | host syncs |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        syncs = ", ".join(f"{k} {n}" for k, n in sorted(r["syncs"].items())) or "0"
        aclop = ", ".join(f"{k} {n}" for k, n in sorted(r["aclop"].items())) or "0"
        lines.append(f"| {r['step']} | {r['aclnn_calls']} ({r['aclnn_operators']}) | {r['aicpu_calls']} | {aclop} | {syncs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--ops", metavar="STEP", help="list the aclnn operators of one step (or 'outside steps')")
    args = parser.parse_args()
    runs = load(args.files)
    if args.ops:
        total = Counter()
        for run in runs:
            total.update(run["steps"].get(args.ops, {}).get("aclnn", {}))
        for name, n in sorted(total.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"{n:8d}  {name}")
        return
    print(markdown(summary(runs)))


if __name__ == "__main__":
    main()

"""Train a torchtitan config for N steps and print its throughput table.

    python tools/bench_train.py --module llama3 --config llama3_8b --nproc 8 --steps 30 -- \\
        --hf_assets_path ASSETS_DIR --training.local_batch_size 2

runs ``torchrun -m torchtitan.train`` under the current ``TORCHTITAN_NPU`` (``--target``
overrides it; default ``cpu``), with torchtitan logging every step, then prints, for the
steps after ``--warmup``, the mean of torchtitan's own per-step figures:

    | model | devices | tokens/s/device | TFLOPS/device | MFU | peak memory (GiB) |

-- the columns of the anchor's table (torchtitan-npu publishes model, NPUs, tokens/s per
NPU, MFU) plus TFLOPS and memory. tokens/s/device and TFLOPS are torchtitan's ``tps`` and
``tflops``; MFU is torchtitan's, computed against the ``metrics`` patch's cited Ascend
peak on an NPU target. In the CPU rehearsal the figures are labelled REHEARSAL: host
throughput of reference kernels, memory as process RSS, MFU against the host's measured
matmul peak. They say nothing about NPU performance.

Options after ``--`` go to torchtitan unchanged. ``--json PATH`` also writes the row and
the per-step figures. Exit status: torchrun's, or 2 when no step figures were printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI = re.compile(r"\x1b\[[0-9;]*m")
NUMBER = r"[-+]?(?:[\d,]+\.?\d*(?:[eE][-+]?\d+)?|nan|inf|N/A)"
# torchtitan 0.3.0 MetricsProcessor.log: "step: N  loss: L  grad_norm: G  memory: XGiB(P%)  tps: T
# tflops: F  mfu: M%" (mfu "N/A" under quantization).
STEP_LINE = re.compile(
    rf"(?<!validate )step:\s*(?P<step>\d+)\s+loss:\s*{NUMBER}.*?memory:\s*(?P<memory>{NUMBER})GiB"
    rf".*?tps:\s*(?P<tps>{NUMBER})\s+tflops:\s*(?P<tflops>{NUMBER})\s+mfu:\s*(?P<mfu>{NUMBER})%?"
)
RANK_PREFIX = re.compile(r"^\s*\[(?:rank|default)(\d+)\]:")
HEADER = ("model", "devices", "tokens/s/device", "TFLOPS/device", "MFU", "peak memory (GiB)")


def _number(text: str) -> float:
    return math.nan if text in ("N/A", "nan") else float(text.replace(",", ""))


def parse_step_figures(log: str) -> dict[int, dict[str, float]]:
    """step -> {tps, tflops, mfu, memory_gib} from the lowest rank's metric lines."""
    by_rank: dict[int, dict[int, dict[str, float]]] = {}
    for raw in log.splitlines():
        line = ANSI.sub("", raw)
        prefix = RANK_PREFIX.match(line)
        rank = int(prefix.group(1)) if prefix else 0
        match = STEP_LINE.search(line)
        if match:
            by_rank.setdefault(rank, {})[int(match.group("step"))] = {
                "tps": _number(match.group("tps")),
                "tflops": _number(match.group("tflops")),
                "mfu": _number(match.group("mfu")),
                "memory_gib": _number(match.group("memory")),
            }
    return by_rank[min(by_rank)] if by_rank else {}


def summarize(figures: dict[int, dict[str, float]], warmup: int) -> dict[str, float]:
    """Means over the steps after ``warmup`` (all steps when there are no others); peak memory."""
    steps = sorted(step for step in figures if step > warmup) or sorted(figures)
    mean = lambda key: sum(figures[s][key] for s in steps) / len(steps)  # noqa: E731
    return {"steps": steps, "tps": mean("tps"), "tflops": mean("tflops"), "mfu": mean("mfu"),
            "memory_gib": max(figures[s]["memory_gib"] for s in steps)}


def device_label(dump_folder: str, target: str, nproc: int) -> str:
    """"2 x Ascend910B2" from rank 0's npu_inject report (the device patch's note)."""
    report_path = os.path.join(dump_folder, "npu_inject", "report_rank0.json")
    name = "CPU rehearsal" if target == "cpu" else "NPU"
    if os.path.exists(report_path):
        with open(report_path, encoding="utf-8") as handle:
            notes = json.load(handle)["patches"].get("device", {}).get("notes", [])
        for note in notes:
            found = re.match(r"device npu x\d+: (.+)", note)
            if found:
                name = found.group(1)
    return f"{nproc} x {name}"


def format_table(row: dict[str, str]) -> str:
    cells = [row[column] for column in HEADER]
    return "\n".join([
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
        "| " + " | ".join(cells) + " |",
    ])


def table_row(model: str, devices: str, summary: dict[str, float], rehearsal: bool) -> dict[str, str]:
    mfu = summary["mfu"]
    if math.isnan(mfu):
        mfu_text = "n/a (no peak)"
    else:
        mfu_text = f"{mfu:.2f}%" + (" (of the host's measured peak)" if rehearsal else "")
    return {
        "model": model,
        "devices": devices,
        "tokens/s/device": f"{summary['tps']:,.0f}",
        "TFLOPS/device": f"{summary['tflops']:.2f}",
        "MFU": mfu_text,
        "peak memory (GiB)": f"{summary['memory_gib']:.2f}" + (" (RSS)" if rehearsal else ""),
    }


def build_command(args, dump_folder: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
            "-m", "torchtitan.train", "--module", args.module, "--config", args.config,
            "--training.steps", str(args.steps), "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--checkpoint.no-enable", "--dump_folder", dump_folder,
            *args.torchtitan_args]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", default="llama3", help="torchtitan model module (default llama3)")
    parser.add_argument("--config", default="llama3_debugmodel", help="torchtitan config (default llama3_debugmodel)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (devices) on this node (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the means (default 2)")
    parser.add_argument("--target", choices=("cpu", "npu"), default=None,
                        help="TORCHTITAN_NPU for the run (default: the environment's, else cpu)")
    parser.add_argument("--dump-folder", default=None, help="torchtitan dump folder (default: a temporary one)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the row and per-step figures")
    args = parser.parse_args(argv)
    args.torchtitan_args = extra
    target = args.target or {"1": "npu", "npu": "npu"}.get(os.environ.get("TORCHTITAN_NPU", ""), "cpu")
    dump_folder = args.dump_folder or tempfile.mkdtemp(prefix="bench_train_")
    env = {**os.environ, "TORCHTITAN_NPU": "1" if target == "npu" else "cpu", "HF_HUB_OFFLINE": "1"}
    command = build_command(args, dump_folder)
    print("running:", " ".join(command), flush=True)
    result = subprocess.run(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(dump_folder, "bench_train.log"), "w", encoding="utf-8") as log_file:
        log_file.write(result.stdout)
    figures = parse_step_figures(result.stdout)
    if result.returncode != 0 or not figures:
        print(result.stdout[-4000:])
        print(f"bench_train: torchrun exited {result.returncode} with {len(figures)} step lines; "
              f"log in {dump_folder}/bench_train.log", file=sys.stderr)
        return result.returncode or 2
    summary = summarize(figures, args.warmup)
    rehearsal = target == "cpu"
    row = table_row(f"{args.module} {args.config}", device_label(dump_folder, target, args.nproc), summary, rehearsal)
    if rehearsal:
        print("REHEARSAL FIGURES (TORCHTITAN_NPU=cpu: reference kernels on the host, memory = process RSS, "
              "MFU of the host's measured matmul peak): they say nothing about NPU performance.")
    print(f"means over steps {summary['steps'][0]}-{summary['steps'][-1]} of {args.steps} "
          f"(first {args.warmup} left out); log: {dump_folder}/bench_train.log")
    print(format_table(row))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rehearsal": rehearsal, "row": row, "summary": summary,
                       "steps": {str(k): v for k, v in figures.items()}}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

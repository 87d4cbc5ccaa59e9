"""Standalone collectives per training step with and without the MC2 path, and the bytes each moves.

Runs torchtitan (2 ranks, tensor parallel 2, bf16, seq 256, local batch 2) through the real torch_npu
2.14.0 wheel on the CANN emulation and reads rank 0's per-step HCCL counts (CANN_EMU_COUNTS): the
collectives torch_npu called itself ("standalone") and those an MC2 operator made inside it
(aclnnAllGatherMatmul / aclnnMatmulReduceScatter), with the bytes rank 0 put in. One row per model
and path, from the last step (the first compiles nothing here, but warms the allocator):

    python tools/bench_mc2.py              # every row below (about 6 minutes on 2 cores)
    python tools/bench_mc2.py --rows llama3_debug

Rows:
* llama3 debug (dim 256): plain TP vs ``tp_gemm_backend="dist_gemm"`` (upstream's
  llama3_debugmodel_dist_gemm). wo's reduce-scatter has k = 256 / 2 = 128 < 256, which MC2 refuses.
* llama3 debug at dim 512 (``tools/bench_mc2_configs.py``; 2 layers, otherwise the debug model): every
  block projection's k is >= 256, so all of them take MC2.
* deepseek_v3 debug: plain TP only. torchtitan 0.3.0 offers dist_gemm for llama3 alone, its async TP is an
  inductor pass (the emulation compiles with aot_eager), and EP's MC2 kernels (npu_moe_distribute_*) have
  no backward: it has no MC2 path to compare.

What it cannot show: time. The emulation computes on the host; the counts and bytes are torch_npu's own
calls, the speed an NPU would reach is not (see docs/planner.md for modelled time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from npu_inject.commands.audit import collectives  # noqa: E402
from tools.training_runs import parse_losses  # noqa: E402
from verification.cann_emu import DEFAULT_VENV, cann_env  # noqa: E402

SHAPE = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--training.steps", "3",
         "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
         "--training.mixed_precision_param", "bfloat16", "--parallelism.data_parallel_shard_degree", "1",
         "--parallelism.tensor_parallel_degree", "2"]
TAIL = ["activation-checkpoint:none"]
ROWS = {
    "llama3_debug": [("plain TP", ["--module", "llama3", "--config", "llama3_debugmodel"]),
                     ("dist_gemm (MC2)", ["--module", "llama3", "--config", "llama3_debugmodel_dist_gemm"])],
    "llama3_debug_dim512": [("plain TP", ["--module", "tools.bench_mc2_configs", "--config", "llama3_dim512"]),
                            ("dist_gemm (MC2)", ["--module", "tools.bench_mc2_configs",
                                                 "--config", "llama3_dim512_dist_gemm"])],
    "deepseek_v3_debug": [("plain TP (no MC2 path)", ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel"])],
}


def run(arguments: list[str], workdir: Path, python: str) -> tuple[dict, dict[int, float]]:
    """Rank 0's counts and the losses of one 2-rank run on the emulation."""
    counts = workdir / "cann_emu_rank{rank}.json"
    env = cann_env({**os.environ, "TORCHTITAN_NPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
                   counts=str(counts))
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "torchtitan.train", *arguments, *SHAPE, "--dump_folder", str(workdir / "dump"), *TAIL]
    result = subprocess.run(command, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"bench_mc2: {' '.join(arguments)} failed:\n{result.stdout[-4000:]}")
    return json.loads((workdir / "cann_emu_rank0.json").read_text()), parse_losses(result.stdout)


def _cell(calls_and_bytes: dict[str, tuple[int, int]]) -> str:
    short = {name.replace("aclnn", "").replace("Hccl", ""): value for name, value in calls_and_bytes.items()}
    return ", ".join(f"{name} {calls} x, {moved / 2**20:.2f} MiB" for name, (calls, moved) in sorted(short.items())) or "0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--python", default=str(REPO / DEFAULT_VENV / "bin" / "python"),
                        help="the emulation venv's python (bash verification/cann_emu/setup.sh)")
    args = parser.parse_args()
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        parser.error(f"--rows {', '.join(unknown)}: not one of {', '.join(ROWS)}")
    print("| model | path | standalone collectives per step (calls, MiB rank 0 put in) | inside MC2 operators | "
          "losses |")
    print("|---|---|---|---|---|")
    for row in args.rows.split(","):
        for path, arguments in ROWS[row]:
            with tempfile.TemporaryDirectory(prefix="bench_mc2_") as workdir:
                counts, losses = run(arguments, Path(workdir), args.python)
            last = max((step for step in counts["steps"] if step.isdigit()), key=int)
            standalone, fused = collectives(counts["steps"][last])
            total = sum(moved for _, moved in standalone.values())
            print(f"| {row} | {path} | {_cell(standalone)} (all: {sum(n for n, _ in standalone.values())} x, "
                  f"{total / 2**20:.2f} MiB) | {_cell(fused)} | "
                  + " / ".join(f"{losses[step]:.5f}" for step in sorted(losses)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

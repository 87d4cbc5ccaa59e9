"""The parallelism matrix: each configuration trains from one seed checkpoint and is compared with a 1-rank run.

    .venv/bin/python tools/parallel_matrix.py                 # every case, prints the table
    .venv/bin/python tools/parallel_matrix.py --cases cp_ulysses_flex,tp_sp
    .venv/bin/python tools/parallel_matrix.py --list

Every run is fp32, deterministic (``--debug.seed 42 --debug.deterministic``), starts
from the same per-model seed checkpoint (written once by one rank), and trains
``--steps`` steps; a case passes when every step's loss is within ``--rtol``
(default 1e-4) of the 1-rank run of the same model -- or, for a case with data
parallel degree d > 1 (each rank reads its own samples), of an FSDP-only run on d
ranks. The table gives the case, its
ranks, the largest relative loss difference and seconds per step (from the
trainer's timestamps of the first and last step, start-up excluded). The same
cases back ``tests/e2e/test_parallel_matrix.py`` (``bash tools/test.sh -m parallel``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # tools/ and verification/ are not installed

from tools.training_runs import clean_env, parse_losses, torchrun  # noqa: E402
from verification.cann_emu import BUILD_DIR, DEFAULT_VENV, cann_env  # noqa: E402
from verification.sim_npu import sim_env  # noqa: E402

# The real torch_npu 2.14.0 wheel on the CANN emulation (verification/cann_emu): its venv.
CANN_PYTHON = os.path.join(os.environ.get("CANN_EMU_VENV") or os.path.join(REPO, DEFAULT_VENV), "bin", "python")


def cann_missing() -> str | None:
    """Why the "cann" cases cannot run here, or None."""
    if not os.path.exists(CANN_PYTHON):
        return f"the CANN emulation's venv ({CANN_PYTHON}) is absent: bash verification/cann_emu/setup.sh"
    if not (BUILD_DIR / "libascendcl.so").exists():
        return f"the emulated CANN libraries are not built in {BUILD_DIR}: bash verification/cann_emu/setup.sh"
    return None

DETERMINISTIC = ["--debug.seed", "42", "--debug.deterministic", "--training.mixed_precision_param", "float32"]
MODELS = {
    # name: (torchtitan module, config, run arguments)
    "llama3": ("llama3", "llama3_debugmodel",
               ["--training.seq_len", "256", "--training.local_batch_size", "2"]),
    "llama3_varlen": ("llama3", "llama3_debugmodel_varlen_attn",
                      ["--training.seq_len", "256", "--training.local_batch_size", "2"]),
    # torchtitan's dist_gemm: TP collectives folded into the projections (stock parameter layouts)
    "llama3_dist_gemm": ("llama3", "llama3_debugmodel_dist_gemm",
                         ["--training.seq_len", "256", "--training.local_batch_size", "2"]),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3_debugmodel",
                    ["--training.seq_len", "128", "--training.local_batch_size", "2",
                     "--training.disable_cuda_graphs"]),
    "qwen3": ("qwen3", "qwen3_debugmodel",
              ["--training.seq_len", "256", "--training.local_batch_size", "2"]),
}
# The 1-rank run each model is compared with (varlen computes the same attention as flex).
BASELINE_OF = {"llama3": "llama3", "llama3_varlen": "llama3", "llama3_dist_gemm": "llama3", "deepseek_v3": "deepseek_v3", "qwen3": "qwen3"}
TAIL = ["activation-checkpoint:none"]  # a subcommand: must come last


def _p(**degrees: int) -> list[str]:
    names = {"dp_shard": "data_parallel_shard_degree", "dp_replicate": "data_parallel_replicate_degree",
             "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree",
             "cp": "context_parallel_degree", "ep": "expert_parallel_degree"}
    arguments = ["--parallelism.data_parallel_shard_degree", str(degrees.pop("dp_shard", 1))]
    for key, value in degrees.items():
        arguments += [f"--parallelism.{names[key]}", str(value)]
    return arguments


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    ranks: int
    arguments: list[str]
    target: str = "cpu"  # "cpu" (rehearsal), "sim" (simulated NPUs) or "cann" (real torch_npu, CANN emulation)
    options: dict = field(default_factory=dict)  # registry options per patch id
    ci: bool = False  # one case per dimension, and every simulated-NPU case, run in CI (e2e)

    @property
    def data_parallel(self) -> int:
        """Data-parallel degree (replicate x shard): ranks reading different samples."""
        degrees = dict(zip(self.arguments[::2], self.arguments[1::2]))
        return (int(degrees.get("--parallelism.data_parallel_shard_degree", 1))
                * int(degrees.get("--parallelism.data_parallel_replicate_degree", 1)))


PP_1F1B = ["--parallelism.pipeline_parallel_schedule", "1F1B"]
PP_INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                  "--parallelism.pipeline_parallel_layers_per_stage", "2"]
# Inductor's micro-pipeline TP pass rewrites the compiled blocks' all-gather + matmul into symm_mem's fused op
# (tp_mc2's kernel); on targets compiling with aot_eager (no NPU inductor) the pass does not run.
ASYNC_TP = ["--compile.enable", "--compile.enable_async_tensor_parallel"]
ULYSSES, ALLGATHER = {"context_parallel": {"scheme": "ulysses"}}, {"context_parallel": {"scheme": "allgather"}}

CASES = [
    # FSDP on d ranks is the baseline of every case with data-parallel degree d (see Matrix.baseline).
    Case("ddp", "llama3", 2, _p(dp_replicate=2), ci=True),
    Case("hsdp", "llama3", 4, _p(dp_replicate=2, dp_shard=2)),
    Case("tp_sp", "llama3", 2, _p(tp=2), ci=True),
    Case("pp_1f1b", "llama3", 2, _p(pp=2) + PP_1F1B, ci=True),
    Case("pp_interleaved", "llama3", 2, _p(pp=2) + PP_INTERLEAVED),
    Case("cp_ulysses_flex", "llama3", 2, _p(cp=2), options=ULYSSES, ci=True),
    Case("cp_allgather_flex", "llama3", 2, _p(cp=2), options=ALLGATHER),
    Case("cp_allgather_flex_ptrr", "llama3", 2, _p(cp=2) + ["--parallelism.context_parallel_load_balancer", "ptrr"],
         options=ALLGATHER),
    Case("cp_ulysses_varlen", "llama3_varlen", 2, _p(cp=2), options=ULYSSES),
    Case("cp_allgather_varlen", "llama3_varlen", 2, _p(cp=2), options=ALLGATHER, ci=True),
    Case("fsdp_x_tp", "llama3", 4, _p(dp_shard=2, tp=2)),
    Case("tp_dist_gemm", "llama3_dist_gemm", 2, _p(tp=2), ci=True),
    Case("tp_async_compile", "llama3", 2, _p(tp=2) + ASYNC_TP),
    Case("pp_x_fsdp", "llama3", 4, _p(pp=2, dp_shard=2) + PP_1F1B),
    Case("cp_x_tp", "llama3", 4, _p(cp=2, tp=2)),
    Case("qwen3_cp_ulysses", "qwen3", 2, _p(cp=2), options=ULYSSES),
    Case("deepseek_tp", "deepseek_v3", 2, _p(tp=2)),
    Case("deepseek_pp", "deepseek_v3", 2, _p(pp=2) + PP_1F1B),
    Case("deepseek_cp_ulysses", "deepseek_v3", 2, _p(cp=2), options=ULYSSES),
    Case("deepseek_cp_allgather", "deepseek_v3", 2, _p(cp=2), options=ALLGATHER),
    Case("deepseek_ep", "deepseek_v3", 2, _p(dp_shard=2, ep=2)),
    Case("deepseek_ep_x_fsdp", "deepseek_v3", 4, _p(dp_shard=4, ep=2)),
    # Simulated NPUs: "hccl" sub-groups (TP x FSDP), point-to-point (PP), all-to-all (CP Ulysses).
    Case("sim_fsdp_x_tp", "llama3", 4, _p(dp_shard=2, tp=2), target="sim", ci=True),
    # 1F1B's crossing sends need the simulated hccl's asynchronous send/recv.
    Case("sim_pp_1f1b", "llama3", 2, _p(pp=2) + PP_1F1B, target="sim", ci=True),
    Case("sim_cp_allgather_flex", "llama3", 2, _p(cp=2), target="sim", options=ALLGATHER, ci=True),
    Case("sim_cp_ulysses_varlen", "llama3_varlen", 2, _p(cp=2), target="sim", options=ULYSSES, ci=True),
    Case("sim_tp_dist_gemm", "llama3_dist_gemm", 2, _p(tp=2), target="sim", ci=True),
    Case("sim_tp_async_compile", "llama3", 2, _p(tp=2) + ASYNC_TP, target="sim"),
    # The same four through the real torch_npu wheel on the CANN emulation: its ProcessGroupHCCL
    # (sub-groups, batched send/recv, all-to-all) over the emulated HCCL, DCP loading the seed
    # checkpoint onto npu tensors, and the real op-plugin's attention kernels.
    Case("cann_fsdp_x_tp", "llama3", 4, _p(dp_shard=2, tp=2), target="cann"),
    Case("cann_tp_dist_gemm", "llama3_dist_gemm", 2, _p(tp=2), target="cann", ci=True),
    Case("cann_tp_async_compile", "llama3", 2, _p(tp=2) + ASYNC_TP, target="cann"),
    Case("cann_pp_1f1b", "llama3", 2, _p(pp=2) + PP_1F1B, target="cann", ci=True),
    Case("cann_cp_allgather_flex", "llama3", 2, _p(cp=2), target="cann", options=ALLGATHER),
    Case("cann_cp_ulysses_varlen", "llama3_varlen", 2, _p(cp=2), target="cann", options=ULYSSES),
]
CASES_BY_NAME = {case.name: case for case in CASES}

_STEP_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}).*?step:\s*(\d+)\s")


def seconds_per_step(log: str) -> float | None:
    """From the trainer's timestamps of its first and last step lines (start-up excluded)."""
    stamps = {}
    for match in _STEP_TIME.finditer(log):
        stamps.setdefault(int(match.group(2)), datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    if len(stamps) < 2:
        return None
    first, last = min(stamps), max(stamps)
    return (stamps[last] - stamps[first]).total_seconds() / (last - first)


def _environment(target: str, ranks: int, options: dict, workdir: str) -> dict[str, str]:
    overrides = {}
    if options:
        registry = os.path.join(workdir, f"registry_{abs(hash(json.dumps(options, sort_keys=True)))}.json")
        with open(registry, "w", encoding="utf-8") as handle:
            json.dump({"patches": {pid: {"options": opts} for pid, opts in options.items()}}, handle)
        overrides["TORCHTITAN_NPU_REGISTRY"] = registry
    if target == "sim":
        base = clean_env(TORCHTITAN_NPU="1", TORCHTITAN_NPU_SIM_DTENSOR_RNG="philox", **overrides)
        return sim_env(base, devices=max(ranks, 2))
    if target == "cann":
        return cann_env(clean_env(TORCHTITAN_NPU="1", OMP_NUM_THREADS="1", **overrides))
    return clean_env(TORCHTITAN_NPU="cpu", **overrides)


def train(model: str, ranks: int, arguments: list[str], env: dict, dump: str, steps: int, seed: str | None,
          extra=(), python: str | None = None) -> tuple[dict[int, float], str]:
    module, config, model_arguments = MODELS[model]
    args = ["--module", module, "--config", config, "--training.steps", str(steps), *model_arguments,
            "--validator.no-enable", *DETERMINISTIC, "--dump_folder", dump, *arguments, *extra]
    if seed is not None:
        args += ["--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.initial_load_path", seed]
    elif "--checkpoint.create_seed_checkpoint" not in extra:
        args.append("--checkpoint.no-enable")
    result = torchrun(args + TAIL, env, nproc=ranks, timeout=1800, python=python)
    if result.returncode != 0:
        raise RuntimeError(f"{model} {' '.join(arguments)} failed:\n{result.stdout[-5000:]}")
    # Pipeline ranks without the last stage log the placeholder loss -1.0, summed over the loss
    # mesh (-2.0 under PP x FSDP 2): cross-entropy is never negative, so keep the others.
    losses: dict[int, float] = {}
    for line in result.stdout.splitlines():
        for step, loss in parse_losses(line).items():
            if loss >= 0.0:
                losses[step] = loss
    return losses, result.stdout


class Matrix:
    """Seed checkpoints and 1-rank baselines, made once per model and reused by every case."""

    def __init__(self, workdir: str, steps: int, seeds: dict[str, str] | None = None):
        self.workdir, self.steps = workdir, steps
        self.seeds: dict[str, str] = dict(seeds or {})

    def seed(self, model: str) -> str:
        """The model's seed checkpoint; one left in the workdir by an earlier run is reused."""
        base = BASELINE_OF[model]
        if base not in self.seeds:
            dump = os.path.join(self.workdir, f"seed_{base}")
            checkpoint = os.path.join(dump, "checkpoint", "step-0")
            if not os.path.isdir(checkpoint):
                train(base, 1, _p(), clean_env(TORCHTITAN_NPU="cpu"), dump, 1, None,
                      extra=["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"])
            self.seeds[base] = checkpoint
        return self.seeds[base]

    def baseline(self, model: str, data_parallel: int = 1) -> dict[int, float]:
        """Losses of the run a case is compared with, kept in the workdir as JSON and reused.

        Data parallelism changes the batch each step sees (each rank reads its own samples), so
        a case with data-parallel degree d > 1 is compared with an FSDP-only run on d ranks;
        every other case with the 1-rank run.
        """
        base = BASELINE_OF[model]
        name = f"baseline_{base}" if data_parallel == 1 else f"baseline_{base}_fsdp{data_parallel}"
        path = os.path.join(self.workdir, f"{name}_{self.steps}_steps.json")
        if not os.path.exists(path):
            losses, _ = train(base, data_parallel, _p(dp_shard=data_parallel), clean_env(TORCHTITAN_NPU="cpu"),
                              os.path.join(self.workdir, name), self.steps, self.seed(base))
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(losses, handle)
        with open(path, encoding="utf-8") as handle:
            return {int(step): loss for step, loss in json.load(handle).items()}

    def run(self, case: Case) -> dict:
        expected = self.baseline(case.model, case.data_parallel)
        # A fresh dump folder each run: one left by an earlier run holds its last checkpoint, which
        # the run would resume from (training no step, so no loss to compare).
        dump = tempfile.mkdtemp(prefix=f"{case.name}_", dir=self.workdir)
        env = _environment(case.target, case.ranks, case.options, self.workdir)
        started = time.monotonic()
        losses, log = train(case.model, case.ranks, case.arguments, env, dump, self.steps, self.seed(case.model),
                            python=CANN_PYTHON if case.target == "cann" else None)
        missing = sorted(set(expected) - set(losses))
        difference = max((abs(losses[s] - expected[s]) / abs(expected[s]) for s in expected if s in losses),
                         default=float("inf"))
        return {"case": case.name, "model": case.model, "target": case.target, "ranks": case.ranks,
                "max_rel_diff": difference, "missing_steps": missing, "s_per_step": seconds_per_step(log),
                "wall_s": time.monotonic() - started, "losses": losses, "expected": expected,
                "notes": _context_parallel_notes(dump)}


def _context_parallel_notes(dump: str) -> list[str]:
    path = os.path.join(dump, "npu_inject", "report_rank0.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)["patches"].get("context_parallel", {}).get("notes", [])


def table(rows: list[dict], rtol: float) -> str:
    lines = [f"| {'configuration':<26} | {'model':<13} | target | ranks | max rel loss diff | s/step | ok |",
             f"|{'-' * 28}|{'-' * 15}|--------|-------|-------------------|--------|----|"]
    for row in rows:
        ok = "yes" if row["max_rel_diff"] <= rtol and not row["missing_steps"] else "NO"
        per_step = "-" if row["s_per_step"] is None else f"{row['s_per_step']:.2f}"
        lines.append(f"| {row['case']:<26} | {row['model']:<13} | {row['target']:<6} | {row['ranks']:>5} | "
                     f"{row['max_rel_diff']:>17.2e} | {per_step:>6} | {ok:<3}|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma list of case names (default: all)")
    parser.add_argument("--ci", action="store_true", help="only the cases CI runs")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--list", action="store_true")
    arguments = parser.parse_args(argv)
    if arguments.list:
        for case in CASES:
            print(f"{case.name:<26} {case.model:<14} {case.target:<4} ranks={case.ranks} {' '.join(case.arguments)}")
        return 0
    names = [n for n in arguments.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES_BY_NAME]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES_BY_NAME)}")
    cases = [CASES_BY_NAME[n] for n in names] if names else [c for c in CASES if c.ci or not arguments.ci]
    if any(case.target == "cann" for case in cases) and cann_missing():
        parser.error(cann_missing())
    workdir = arguments.workdir or tempfile.mkdtemp(prefix="parallel_matrix_")
    matrix, rows, failures = Matrix(workdir, arguments.steps), [], []
    for case in cases:
        try:
            rows.append(matrix.run(case))
            print(f"{case.name}: max rel loss diff {rows[-1]['max_rel_diff']:.2e}, s/step {rows[-1]['s_per_step']}, "
                  f"{rows[-1]['notes']}", flush=True)
        except RuntimeError as error:
            failures.append(f"{case.name}: {error}")
            print(f"{case.name}: FAILED", flush=True)
    print(table(rows, arguments.rtol))
    for failure in failures:
        print(failure[-3000:], file=sys.stderr)
    bad = [r["case"] for r in rows if r["max_rel_diff"] > arguments.rtol or r["missing_steps"]]
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main())

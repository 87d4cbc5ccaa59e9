"""How good are npu-inject plan's predictions? Figures, predicted beside measured or published.

    python tools/bench_plan.py memory [--only NAME,...] [--expandable off|on|both] [--json PATH]
    python tools/bench_plan.py published [--calibrate] [--only PART,...]
    python tools/bench_plan.py depth
    python tools/bench_plan.py microbatches [--count N] [--schemes 'W:F,M;...'] [--only PART,...]
    python tools/bench_plan.py stages [--count N] [--only PART,...]
    python tools/bench_plan.py syncs [--only NAME,...] [--verbose] [--json PATH]
    python tools/bench_plan.py search [--which llama3_8b,deepseek_v3_671b]

``memory``: each configuration of :data:`MEMORY_CONFIGS` (debug models; FSDP, HSDP, TP, PP, CP, EP,
activation checkpointing none/selective/full; llama3, qwen3, deepseek_v3) runs 3 steps of the
unmodified torchtitan command through the real torch_npu 2.14.0 wheel on the CANN emulation, whose
caching allocator reports each step's peaks (the memory_probe plugin reads ``torch.npu.memory_stats()``
where torchtitan resets them); the planner plans the same command. Printed per configuration and
rank: predicted and measured peak allocated and reserved bytes (the larger of steps 1 and 2) and the
relative error. Needs ``.venv-cann`` (``bash verification/cann_emu/setup.sh``).

``published``: every published training row of :data:`PUBLISHED` with a full configuration, planned on
its hardware profile; predicted tokens/s per device (and memory where the row states it) beside the
published figure. ``--calibrate`` fits each calibration row's family's ``overhead`` (what the row takes
beyond the kernels at their measured or published rates: the device's operators stretched by that
fraction, reported as its own term) so that its prediction equals the published figure, and prints the
fitted value for ``npu_inject/hardware.json``.

``depth``: shallow plans (the search's and the advice's: :data:`npu_inject.planner.depth.SHALLOW_UNITS` and one
more repeats of the layer block, extrapolated) against full-depth plans.

``microbatches``: llama3_70b's pipelines (TP 8 x PP 4 and PP 8 on A2) with ``--count`` microbatches per step, every
one recorded, against plans from the few :data:`npu_inject.planner.job.RECORDED_MICROBATCHES` records (each scheme
``W:F,M``: a warm-up step of W, then F and M microbatches per pipeline rank, extrapolated): the time each took to
plan, the step time and each pipeline rank's reserved memory with their errors.

``stages``: the same pipelines with every pipeline rank recorded, against plans in which one middle stage's
recording, reordered, stands for the middle stages of its kind (:mod:`npu_inject.planner.stages`): the time each
took to plan, the step time and each pipeline rank's reserved memory with their errors.

``syncs``: the host reads the planner marks in a step (:mod:`npu_inject.planner.host_reads`: torchtitan's, the
runtime's) against the host synchronisations the CANN emulation counts in the same step of the same command run
through the real torch_npu wheel (``npu-inject audit``'s sites: a read is a blocking device-to-host copy, or a
synchronisation with no copy beside it, at one Python caller). Printed per owner (torchtitan, npu_inject), planned
beside counted, and the planned host-wait time.

``search``: ``npu-inject plan --search`` for llama3_8b on 8 Atlas A2 and deepseek_v3_671b on 1024
Atlas A3 dies: its wall time and the largest resident memory of the planner's processes together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GIB = 2**30
EMULATION_PROFILE = "Ascend910B2"  # what the CANN emulation presents (verification/cann_emu DEFAULTS)
SEQ = ["--training.seq_len", "256"]
LLAMA = ["--module", "llama3", "--config", "llama3_debugmodel", *SEQ]
# name -> (ranks, torchtitan flags, the ranks to compare)
MEMORY_CONFIGS: dict[str, tuple[int, list[str], tuple[int, ...]]] = {
    "llama3 FSDP2 AC selective": (2, LLAMA, (0,)),
    "llama3 FSDP2 AC none": (2, [*LLAMA, "activation-checkpoint:none"], (0,)),
    "llama3 FSDP2 AC full": (2, [*LLAMA, "activation-checkpoint:full"], (0,)),
    "llama3 TP2": (2, [*LLAMA, "--parallelism.tensor_parallel_degree", "2"], (0,)),
    "llama3 HSDP 2x2": (4, [*LLAMA, "--parallelism.data_parallel_replicate_degree", "2"], (0,)),
    "llama3 CP2": (2, [*LLAMA, "--parallelism.context_parallel_degree", "2"], (0,)),
    "llama3 PP2": (2, [*LLAMA, "--parallelism.pipeline_parallel_degree", "2"], (0, 1)),
    "qwen3 TP2": (2, ["--module", "qwen3", "--config", "qwen3_debugmodel", *SEQ,
                      "--parallelism.tensor_parallel_degree", "2"], (0,)),
    "deepseek_v3 EP2": (2, ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", *SEQ,
                            "--parallelism.expert_parallel_degree", "2"], (0,)),
}


@dataclass
class PublishedRow:
    name: str
    source: str
    hardware: str
    world_size: int
    argv: list[str]
    tokens_per_s: float  # per device
    memory_gib: float | None = None  # the row's peak memory per device (torchtitan's memory line: reserved)
    calibrates: bool = False  # one of the (at most two) rows the efficiencies are fitted to
    not_planned: str = ""  # why the planner cannot plan this row as published
    notes: list[str] = field(default_factory=list)
    expert_load: str = ""  # npu-inject plan --expert-load for the row (the busiest expert rank's share)


TT_BENCH = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024; H100 96 GB HBM2e, 500 W, 8 per host)"
TTN_README = "torchtitan-npu README, performance table (2026.04), config deepseek_v3_671b_61layers_4k_128die.toml"
MINDSPEED = "MindSpeed-LLM v1.0.RC2.0 examples/llama3/README.md (Atlas 900 A2 PoDc)"
# Ascend/MindSpeed-LLM README.md's performance table (tokens per card per second, Atlas 900 A2 PODc): the 128K row
# as on branch 1.0.RC3 (7acd2296ab454fd1a596c2c2eafc3f2a68e84e96); the DeepSeek-V2-Lite row and its script as on
# master of 2024-09-29 (773a9c6b3b65e058869c492e588a0be1925a90ee; 1.0.RC3's README no longer lists it, and its
# script of that name is another: pretrain_deepseek2_lite_ptd_8p.sh).
MINDSPEED_128K = ("MindSpeed-LLM README.md performance table (branch 1.0.RC3), "
                  "examples/mcore/llama31/pretrain_llama31_8b_128k_ptd.sh")
MINDSPEED_V2_LITE = ("MindSpeed-LLM README.md performance table (master at 773a9c6b, 2024-09-29), "
                     "examples/mcore/deepseek2_lite/pretrain_deepseek2_lite_16b_ptd_8p.sh")
V2_LITE = ["--module", "deepseek_v3", "--config", "deepseek_v3_16b", "--training.seq_len", "8192",
           "--training.local_batch_size", "1", "--training.global_batch_size", "8",
           "--parallelism.data_parallel_shard_degree", "8", "--parallelism.expert_parallel_degree", "8",
           "--parallelism.pipeline_parallel_degree", "1", "--compile.no-enable", "activation-checkpoint:full"]
# The row's routing: its script routes with --moe-router-load-balancing-type softmax_topk, which its arguments' help
# says "implies no load balancing", from DeepSeek-V2-Lite's released weights (--load; lr 1e-6), trained with a
# softmax gate and an expert-level balance loss. The nearest published figure: Wang et al. 2024 (arXiv 2408.15664,
# "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"), Table 6, a softmax gate with an auxiliary
# loss, 64 routed experts, top 6: MaxVio_global 0.937, the busiest expert 1.94 times the mean (as two independent
# summaries of the paper quote it; the paper's own text was not reachable from here). A rank of EP 8 holds 8
# experts: 1.94 is its bound (all 8 as busy as the busiest), 1 + 0.937 / sqrt(8) = 1.33 its share were their loads
# independent. DeepSeek's own routing logs of a V2-Lite model (deepseek-ai/ESFT, counted in
# docs/measured/esft_v2_lite_router_counts.json) put the busiest of 8 contiguous ranks, averaged over the 26 layers,
# at 1.27 with four domains pooled and 1.38-1.69 with one domain alone (translation the most uneven).
V2_LITE_ROUTING = ("MindSpeed's softmax_topk routing balances nothing; the busiest rank's share is not published: "
                   "planned at {ratio} ({which}) from Wang et al. 2024 Table 6 (softmax gate, auxiliary loss, 64 "
                   "experts top 6: the busiest expert 1.94 times the mean)")
ESFT_COUNTS = os.path.join(REPO, "docs", "measured", "esft_v2_lite_router_counts.json")
ESFT_ROUTING = ("the busiest of 8 ranks {which}, each layer's averaged, counted from DeepSeek's routing logs of a "
                "V2-Lite model (deepseek-ai/ESFT at 579a7711, ESFT-vanilla-lite on chat data of four domains; "
                "docs/measured/esft_v2_lite_router_counts.json)")
LLAMA8B_TT = ["--module", "llama3", "--config", "llama3_8b", "--training.seq_len", "8192"]
TTN_DSV3 = ["--module", "deepseek_v3", "--config", "deepseek_v3_671b", "--training.seq_len", "4096",
            "--training.local_batch_size", "1", "--training.global_batch_size", "1024",
            "--parallelism.data_parallel_shard_degree", "32", "--parallelism.tensor_parallel_degree", "4",
            "--parallelism.expert_parallel_degree", "128", "--parallelism.pipeline_parallel_degree", "1",
            "--compile.no-enable", "activation-checkpoint:full"]
WHOLE_LOSS = ["--loss.num_chunks", "1"]
WHOLE_LOSS_NOTE = ("torchtitan 0.3.0 with --loss.num_chunks 1: the memory of the row's program (the rows above plan "
                   "0.3.0's 8 chunks; their tokens/s barely move)")
PUBLISHED = [
    PublishedRow(
        "DeepSeek-V3 671B, 64 Atlas 800T A3 chips = 128 dies, FSDP 32 x TP 4, EP 128, full AC, read per die",
        TTN_README, "Ascend910_9382", 128, TTN_DSV3, 546,
        notes=["the per-chip reading is the source's own: its README at ffab798 showed MFU 21.78% beside 546, which at "
               "281 GFLOP/token and a die's 353.89 TFLOP/s is 274 tokens/s per die (2 x 274 = 548); read per die its log "
               "would have shown 43%; the model, at published Ascend kernel rates, plans it near the per-chip reading",
               "its swap optimizer keeps AdamW's states on the host: planned on the device here"]),
    PublishedRow(
        "DeepSeek-V3 671B, the same read per chip (546 per chip = 273 per die)", TTN_README, "Ascend910_9382", 128,
        TTN_DSV3, 273, calibrates=True),
    PublishedRow(
        "DeepSeek-V3 671B, the same with torch.compile, read per chip (288 per die)", TTN_README, "Ascend910_9382",
        128, [arg for arg in TTN_DSV3 if arg != "--compile.no-enable"], 288,
        notes=["compile is planned as eager; read per die it would be 576"]),
    PublishedRow(
        "Llama 3 8B, 8 H100, FSDP 8, local batch 2, selective AC", TT_BENCH, "H100-96GB", 8,
        [*LLAMA8B_TT, "--training.local_batch_size", "2", "--compile.no-enable", "activation-checkpoint:selective"],
        5762, memory_gib=82.4, calibrates=True),
    PublishedRow(
        "Llama 3 8B, 8 H100, the same with torch.compile", TT_BENCH, "H100-96GB", 8,
        [*LLAMA8B_TT, "--training.local_batch_size", "2", "activation-checkpoint:selective"],
        6667, memory_gib=77.0, notes=["compile is planned as eager"]),
    PublishedRow(
        "Llama 3 8B, 128 H100, FSDP 128, local batch 2, selective AC", TT_BENCH, "H100-96GB", 128,
        [*LLAMA8B_TT, "--training.local_batch_size", "2", "--compile.no-enable", "activation-checkpoint:selective"],
        5605, memory_gib=67.0),
    # torchtitan of Dec 2024 took its loss over the whole sequence's logits at once, upcast to float32
    # (train.py's loss_fn: cross_entropy(pred.flatten(0, 1).float(), ...)); torchtitan 0.3.0's llama3_8b chunks it
    # (ChunkedLossWrapper, 8 chunks). One chunk is that program's memory: its memory line is held here.
    PublishedRow(
        "Llama 3 8B, 8 H100, FSDP 8, the loss over the whole sequence at once (as torchtitan of Dec 2024)", TT_BENCH,
        "H100-96GB", 8, [*LLAMA8B_TT, "--training.local_batch_size", "2", "--compile.no-enable", *WHOLE_LOSS,
                         "activation-checkpoint:selective"],
        5762, memory_gib=82.4, notes=[WHOLE_LOSS_NOTE]),
    PublishedRow(
        "Llama 3 8B, 128 H100, FSDP 128, the loss over the whole sequence at once (as torchtitan of Dec 2024)",
        TT_BENCH, "H100-96GB", 128, [*LLAMA8B_TT, "--training.local_batch_size", "2", "--compile.no-enable",
                                     *WHOLE_LOSS, "activation-checkpoint:selective"],
        5605, memory_gib=67.0, notes=[WHOLE_LOSS_NOTE]),
    PublishedRow(
        "Llama 3 8B, 128 H100, the same with torch.compile", TT_BENCH, "H100-96GB", 128,
        [*LLAMA8B_TT, "--training.local_batch_size", "2", "activation-checkpoint:selective"],
        6514, memory_gib=62.0, notes=["compile is planned as eager"]),
    PublishedRow(
        "Llama 3 8B, 8 Atlas A2 (MindSpeed-LLM), TP 8, seq 8192, micro batch 2, global 64", MINDSPEED, "Ascend910B2", 8,
        [*LLAMA8B_TT, "--parallelism.tensor_parallel_degree", "8", "--training.local_batch_size", "2",
         "--training.global_batch_size", "64", "activation-checkpoint:none"],
        2483, notes=["Megatron-based, not torchtitan: a different program on the same hardware",
                     "the 910B SKU is not stated: planned on 910B2"]),
    PublishedRow(
        "Llama 3.1 8B, 32 Atlas A2 (MindSpeed-LLM), TP 8 x CP 4, seq 131072, micro batch 1, global 32", MINDSPEED_128K,
        "Ascend910B2", 32,
        ["--module", "llama3", "--config", "llama3_8b", "--training.seq_len", "131072",
         "--training.local_batch_size", "1", "--training.global_batch_size", "32",
         "--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "8",
         "--parallelism.context_parallel_degree", "4", "--compile.no-enable", "activation-checkpoint:none"],
        1297, notes=["Megatron-based, not torchtitan: ring-attention CP (megatron_cp_algo), sequence parallel, and "
                     "TP's communication overlapped with its matmuls (mc2), which torchtitan 0.3 does not do; marked "
                     "[Test] in the source, the 910B SKU not stated: planned on 910B2"]),
    PublishedRow(
        "DeepSeek-V2-Lite 16B, 8 Atlas A2 (MindSpeed-LLM), EP 8, seq 8192, micro batch 1, global 8, full AC",
        MINDSPEED_V2_LITE, "Ascend910B2", 8, V2_LITE,
        2830, notes=["Megatron-based, not torchtitan: an all-gather token dispatcher (7/8 of every rank's tokens to "
                     "each rank, where torchtitan's all-to-all sends each its own), each expert's matmuls one by "
                     "one (no --moe-grouped-gemm) and the distributed optimizer; torchtitan's deepseek_v3 16B flavor "
                     "stands for the model; marked [Test] in the source",
                     "routing planned balanced: the three rows below plan the busiest rank"]),
    PublishedRow(
        "DeepSeek-V2-Lite 16B, the same, routing as DeepSeek's V2-Lite logs, four domains pooled (1.27x)",
        MINDSPEED_V2_LITE, "Ascend910B2", 8, V2_LITE, 2830, expert_load=ESFT_COUNTS,
        notes=[ESFT_ROUTING.format(which="with the four domains' tokens pooled: 1.27 times the mean")]),
    PublishedRow(
        "DeepSeek-V2-Lite 16B, the same, routing as those logs' most uneven domain (1.69x)",
        MINDSPEED_V2_LITE, "Ascend910B2", 8, V2_LITE, 2830, expert_load="1.69",
        notes=[ESFT_ROUTING.format(which="with one domain's tokens alone (translation; the others 1.38-1.44): 1.69 "
                                         "times the mean")]),
    PublishedRow(
        "DeepSeek-V2-Lite 16B, the same, busiest expert rank at 1.94x (its 8 experts as busy as the busiest)",
        MINDSPEED_V2_LITE, "Ascend910B2", 8, V2_LITE, 2830, expert_load="1.94",
        notes=[V2_LITE_ROUTING.format(ratio=1.94, which="the bound")]),
    PublishedRow("Llama 3 8B, 8 H100, Float8, compile (torchtitan)", TT_BENCH, "H100-96GB", 8, [], 8532, 76.8,
                 not_planned="Float8 training: the planner times matmuls at the BF16 peak"),
    PublishedRow("Llama 3 70B, 256 H100, FSDP 32 x TP 8, Float8, compile", TT_BENCH, "H100-96GB", 256, [], 829, 71.9,
                 not_planned="Float8 training: the planner times matmuls at the BF16 peak"),
    PublishedRow("Llama 3 405B, 512 H100, FSDP 8 x TP 8 x PP 8, Float8, async TP", TT_BENCH, "H100-96GB", 512, [], 128,
                 72.7, not_planned="Float8 and async TP"),
    PublishedRow("Llama 3 8B, 8 H100, long context (32k-256k), Float8", TT_BENCH, "H100-96GB", 8, [], 3890, 83.9,
                 not_planned="Float8 training"),
    PublishedRow("DeepSeek-V3.2 / V4-Flash on 64 A3 chips (torchtitan-npu)", TTN_README, "Ascend910_9382", 128, [],
                 1056, not_planned="models torchtitan 0.3.0 does not have"),
    PublishedRow("Llama 3 70B, A2 (MindSpeed-LLM)", MINDSPEED, "Ascend910B2", 64, [], 283,
                 not_planned="its layout is not stated beside the figure"),
    PublishedRow("Megatron/NeMo DGX-H100 rows (Llama 3 8B-405B, DeepSeek-V3)", "NVIDIA Megatron-Bridge performance summary",
                 "H100-SXM", 8, [], 0, not_planned="FP8 training"),
]


# -- helpers ---------------------------------------------------------------------

def _pool(argv, expert_load: str = ""):
    from npu_inject.planner import job, workers

    return workers.executor(selection=os.environ.get("TORCHTITAN_NPU_PATCHES", ""), modules=job.model_packages(argv),
                            expert_load=expert_load)


def predict_memory(ranks: int, argv: list[str], expandable: bool, pool=None) -> dict[int, tuple[int, int]]:
    """pipeline rank -> (peak allocated, peak reserved) the planner predicts for the emulation's device."""
    from npu_inject import hardware
    from npu_inject.planner import job

    catalog = hardware.load()
    profile = catalog.find(EMULATION_PROFILE)
    plan = job.plan_job(argv, profile=profile, efficiency=catalog.efficiency[profile.family], world_size=ranks,
                        expandable=expandable, pool=pool or _pool(argv))
    per_stage = ranks // plan.parallel["pp"]
    return {role.role * per_stage: (role.peak_allocated, role.peak_reserved) for role in plan.roles}


def measure_memory(ranks: int, argv: list[str], expandable: bool, folder: str) -> dict[int, tuple[int, int]]:
    """rank -> (peak allocated, peak reserved) torch_npu's allocator reported on the emulation, the larger
    of steps 1 and 2, as the planner's."""
    from verification.cann_emu import cann_env

    flags = [arg for arg in argv if not arg.startswith("activation-checkpoint:")]
    subcommand = [arg for arg in argv if arg.startswith("activation-checkpoint:")]
    env = cann_env({k: v for k, v in os.environ.items() if not k.startswith(("CANN_EMU_", "TORCHTITAN_NPU"))})
    env.update(TORCHTITAN_NPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TORCHTITAN_NPU_REGISTRY=os.path.join(REPO, "tests/support/plugins/memory_probe_registry.json"),
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests/support/plugins"), env.get("PYTHONPATH", "")]),
               NPU_INJECT_MEMORY_PROBE=folder)
    if expandable:
        env["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"
    command = [os.path.join(REPO, ".venv-cann/bin/python"), "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(ranks), "-m", "torchtitan.train", *flags, "--training.steps", "3",
               "--checkpoint.no-enable", "--validator.no-enable", "--metrics.log_freq", "1", "--debug.seed", "0",
               "--dump_folder", os.path.join(folder, "dump"), *subcommand]
    run = subprocess.run(command, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=1800)
    if run.returncode:
        raise RuntimeError(f"the emulation's run failed ({run.returncode}):\n{run.stdout[-3000:]}")
    measured = {}
    for rank in range(ranks):
        with open(os.path.join(folder, f"memory_rank{rank}.json"), encoding="utf-8") as handle:
            readings = json.load(handle)  # [at start, after step 1, after step 2, ...]
        measured[rank] = (max(r["peak_allocated"] for r in readings[1:3]), max(r["peak_reserved"] for r in readings[1:3]))
    return measured


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


# -- commands --------------------------------------------------------------------

def cmd_memory(args) -> int:
    names = [n.strip() for n in args.only.split(",")] if args.only else list(MEMORY_CONFIGS)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.expandable]
    print(f"{'configuration':28} {'rank':>4} {'segments':>10}  {'allocated: predicted':>21} {'measured':>9} {'error':>7}"
          f"  {'reserved: predicted':>20} {'measured':>9} {'error':>7}")
    worst, rows = 0.0, []
    for name in names:
        ranks, argv, compared = MEMORY_CONFIGS[name]
        for expandable in modes:
            with tempfile.TemporaryDirectory(prefix="bench_plan_") as folder:
                measured = measure_memory(ranks, argv, expandable, folder)
            predicted = predict_memory(ranks, argv, expandable)
            for rank in compared:
                (pa, pr), (ma, mr) = predicted[rank], measured[rank]
                worst = max(worst, abs(pa - ma) / ma, abs(pr - mr) / mr)
                rows.append({"configuration": name, "rank": rank, "expandable_segments": expandable,
                             "predicted_allocated": pa, "measured_allocated": ma,
                             "predicted_reserved": pr, "measured_reserved": mr})
                print(f"{name:28} {rank:>4} {'expandable' if expandable else 'default':>10}  {pa / 2**20:18.1f} MiB"
                      f" {ma / 2**20:9.1f} {_error(pa, ma):>7}  {pr / 2**20:17.1f} MiB {mr / 2**20:9.1f} {_error(pr, mr):>7}",
                      flush=True)
    print(f"largest error: {worst:.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)
    return 0


def _calibrate(recording, profile, efficiency, target: float) -> tuple[float, object]:
    """The family's overhead (operators stretched by that fraction, reported apart from the kernels) at which the
    recording predicts ``target`` tokens/s; the kernels keep their measured or published rates."""
    from npu_inject.planner import job

    def predicted(overhead: float):
        plan = job.evaluate(recording, profile=profile, efficiency={**efficiency, "overhead": overhead})
        return plan.tokens_per_s_per_npu, plan

    low, high = 0.0, 10.0
    if predicted(low)[0] < target:
        return float("-inf"), predicted(low)[1]  # slower than published with no overhead: the rates are too slow
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle)[0] > target else (low, middle)
    return low, predicted(low)[1]


def cmd_published(args) -> int:
    from npu_inject import hardware
    from npu_inject.planner import job

    catalog = hardware.load()
    recordings = {}
    print(f"{'row':100} {'published':>9} {'predicted':>9} {'error':>7}  {'memory GiB: published':>21} {'predicted':>9}")
    rows = [row for row in PUBLISHED if not args.only or any(part in row.name for part in args.only.split(","))]
    for row in rows:
        if row.not_planned:
            shown = f"{row.tokens_per_s:9,.0f}" if row.tokens_per_s else f"{'-':>9}"
            print(f"{row.name[:100]:100} {shown} {'-':>9} {'':>7}  not planned: {row.not_planned}")
            continue
        profile = catalog.find(row.hardware)
        efficiency = catalog.efficiency[profile.family]
        key = (tuple(row.argv), row.world_size, row.expert_load)
        if key not in recordings:  # rows that read one run two ways share its recording
            pool = _pool(row.argv, row.expert_load)
            try:
                recordings[key] = job.record(row.argv, world_size=row.world_size, pool=pool)
            finally:
                pool.shutdown()
        recording = recordings[key]
        plan = job.evaluate(recording, profile=profile, efficiency=efficiency)
        memory = f"{row.memory_gib:21.1f} {plan.worst.peak_reserved / GIB:9.1f}" if row.memory_gib else f"{'-':>21} {plan.worst.peak_reserved / GIB:9.1f}"
        tag = " (calibration)" if row.calibrates else ""
        print(f"{(row.name + tag)[:100]:100} {row.tokens_per_s:9,.0f} {plan.tokens_per_s_per_npu:9,.0f} "
              f"{_error(plan.tokens_per_s_per_npu, row.tokens_per_s):>7}  {memory}", flush=True)
        if profile.rates is not None and profile.rates.attention_ranged:
            # The kernel rates taken from others' measurements carry their sources' span: the row's plan at both ends.
            ends = [job.evaluate(recording, profile=replace(profile, rates=profile.rates.at_attention_end(end)),
                                 efficiency=efficiency).tokens_per_s_per_npu for end in ("low", "high")]
            print(f"    attention at the slow and fast ends of its rates' sourced ranges: {ends[0]:,.0f} to {ends[1]:,.0f} "
                  f"tokens/s ({_error(ends[0], row.tokens_per_s)} to {_error(ends[1], row.tokens_per_s)})", flush=True)
        if args.calibrate and row.calibrates:
            fitted, fitted_plan = _calibrate(recording, profile, efficiency, row.tokens_per_s)
            reach = ("below zero: with no overhead the kernels' rates already predict fewer tokens/s"
                     if fitted == float("-inf") else f"{fitted:.3f} (now {efficiency['overhead']:.3f})")
            print(f"    fitted {profile.family} overhead: {reach}; then step {fitted_plan.step_s:.2f} s = "
                  f"compute {fitted_plan.timing.compute_s:.2f} + overhead {fitted_plan.timing.overhead_s:.2f} "
                  f"+ exposed {fitted_plan.timing.exposed_comm_s:.2f}")
        for note in row.notes:
            print(f"    note: {note}")
    return 0


SYNC_CASES = {
    "llama3 FSDP 2": (2, LLAMA),
    "deepseek_v3 EP 2": (2, MEMORY_CONFIGS["deepseek_v3 EP2"][1]),
}


def counted_reads(counts: dict, step: str) -> dict[str, int]:
    """Host reads per owner in one step of the emulation's counts: each Python caller's copies between host and
    device (torch_npu's are synchronous from pageable memory), or where it made none its synchronisations (a
    copy's own stream sync is not a second wait)."""
    from npu_inject.commands.audit import sync_sites

    by_caller: dict[tuple[str, str], dict[str, int]] = {}
    for kind, owner, caller, _via, count in sync_sites(counts["steps"][step]):
        kinds = by_caller.setdefault((owner, caller), {})
        kinds[kind] = kinds.get(kind, 0) + count
    owners: dict[str, int] = {}
    for (owner, _caller), kinds in by_caller.items():
        copies = sum(n for kind, n in kinds.items() if kind.startswith("aclrtMemcpy"))
        owners[owner] = owners.get(owner, 0) + (copies or sum(kinds.values()))
    return owners


def cmd_syncs(args) -> int:
    from npu_inject import hardware
    from npu_inject.planner import host_reads, job
    from verification.cann_emu import cann_env

    catalog = hardware.load()
    profile = catalog.find(EMULATION_PROFILE)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(SYNC_CASES)
    print(f"{'case':20} {'owner':12} {'planned':>8} {'counted':>8}  planned host waits")
    rows = []
    for name in names:
        ranks, argv = SYNC_CASES[name]
        plan = job.plan_job(argv, profile=profile, efficiency=catalog.efficiency[profile.family], world_size=ranks,
                            pool=_pool(argv))
        # The runtime's reads as a step begins run in the step owner before torchtitan's train_step, outside the
        # emulation's step marks: planned, not compared.
        outside = {read.site for read in host_reads.RUNTIME_READS if read.where == host_reads.STEP_START}
        planned: dict[str, int] = {}
        for site, count in plan.timing.host_reads.items():
            owner = "torchtitan" if site.startswith("torchtitan:") else "npu_inject"
            if site not in outside:
                planned[owner] = planned.get(owner, 0) + int(count)
        with tempfile.TemporaryDirectory(prefix="bench_plan_syncs_") as folder:
            counts_path = os.path.join(folder, "counts_rank{rank}.json")
            env = cann_env({k: v for k, v in os.environ.items() if not k.startswith(("CANN_EMU_", "TORCHTITAN_NPU"))},
                           counts=counts_path)
            env.update(TORCHTITAN_NPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
            command = [os.path.join(REPO, ".venv-cann/bin/python"), "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", str(ranks), "-m", "torchtitan.train", *argv, "--training.steps", "3",
                       "--checkpoint.no-enable", "--validator.no-enable", "--metrics.log_freq", "1",
                       "--debug.seed", "0", "--dump_folder", os.path.join(folder, "dump")]
            run = subprocess.run(command, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, timeout=1800)
            if run.returncode:
                raise RuntimeError(f"the emulation's run failed ({run.returncode}):\n{run.stdout[-3000:]}")
            with open(counts_path.format(rank=0), encoding="utf-8") as handle:
                counted = counted_reads(json.load(handle), "3")
        for owner in sorted(set(planned) | set(counted)):
            rows.append({"case": name, "owner": owner, "planned": planned.get(owner, 0),
                         "counted": counted.get(owner, 0), "host_wait_s": plan.timing.host_wait_s,
                         "step_s": plan.step_s})
            print(f"{name:20} {owner:12} {planned.get(owner, 0):8d} {counted.get(owner, 0):8d}  "
                  f"{plan.timing.host_wait_s * 1e3:.2f} ms of a {plan.step_s * 1e3:.1f} ms step", flush=True)
        if args.verbose:
            for site, count in sorted(plan.timing.host_reads.items()):
                print(f"    planned: {site} x{count:g}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)
    return 0


PIPELINES = {
    "llama3_70b TP 8 x PP 4 (A2)": ("A2", 32, ["--module", "llama3", "--config", "llama3_70b",
                                              "--parallelism.tensor_parallel_degree", "8",
                                              "--parallelism.pipeline_parallel_degree", "4",
                                              "--parallelism.pipeline_parallel_microbatch_size", "1"]),
    "llama3_70b TP 8 x PP 8 (A2)": ("A2", 64, ["--module", "llama3", "--config", "llama3_70b",
                                              "--parallelism.tensor_parallel_degree", "8",
                                              "--parallelism.pipeline_parallel_degree", "8",
                                              "--parallelism.pipeline_parallel_microbatch_size", "1"]),
}


def _scheme(text: str) -> tuple[int, tuple[int, int]]:
    """'W:F,M' -> (warm-up, (fewer, more)) microbatches per pipeline rank."""
    warm, _, counts = text.partition(":")
    fewer, more = (int(n) for n in counts.split(","))
    return int(warm), (fewer, more)


def _compare_pipelines(args, variants: list[tuple[str, dict]]) -> int:
    """Each case of :data:`PIPELINES` (``--only``) with ``--count`` microbatches per step, planned once per variant
    (label, the settings of :mod:`npu_inject.planner.job` it plans with), against the first; the settings are put
    back after."""
    from npu_inject import hardware
    from npu_inject.planner import job

    catalog = hardware.load()
    names = [name for name in PIPELINES if not args.only or any(part in name for part in args.only.split(","))]
    saved = {name: getattr(job, name) for _, settings in variants for name in settings}
    print(f"{'case':34} {'recorded':>22} {'planned in s':>12} {'step s':>9}  reserved GiB per pp rank")
    for name in names:
        hardware_name, ranks, base = PIPELINES[name]
        argv = [*base, "--training.local_batch_size", str(args.count), "--training.global_batch_size",
                str(args.count)]
        profile = catalog.find(hardware_name)
        pool = _pool(argv)
        plans = {}
        try:
            for label, settings in variants:
                for setting, value in settings.items():
                    setattr(job, setting, value)
                started = time.monotonic()
                plan = job.plan_job(argv, profile=profile, efficiency=catalog.efficiency[profile.family],
                                    world_size=ranks, pool=pool)
                plans[label] = (plan, time.monotonic() - started)
        finally:
            for setting, value in saved.items():
                setattr(job, setting, value)
            pool.shutdown()
        truth = plans[variants[0][0]][0]
        for label, (plan, seconds) in plans.items():
            reserved = " ".join(f"{role.peak_reserved / GIB:6.2f}" for role in plan.roles)
            errors = "" if plan is truth else "  errors: step {}, reserved {}".format(
                _error(plan.step_s, truth.step_s),
                " ".join(_error(a.peak_reserved, b.peak_reserved) for a, b in zip(plan.roles, truth.roles)))
            print(f"{name:34} {label:>22} {seconds:12.1f} {plan.step_s:9.3f}  {reserved}{errors}", flush=True)
    return 0


def cmd_microbatches(args) -> int:
    """A pipeline's many microbatches planned from a few, against recording every one of ``--count``."""
    # Every microbatch recorded: the recorded counts above the job's.
    variants = [(f"all {args.count}", {"RECORDED_MICROBATCHES": (args.count, args.count + 1),
                                       "WARM_UP_MICROBATCHES": 1})]
    for scheme in args.schemes.split(";"):
        warm_up, counts = _scheme(scheme)
        variants.append((f"x pp {scheme}", {"RECORDED_MICROBATCHES": counts, "WARM_UP_MICROBATCHES": warm_up}))
    return _compare_pipelines(args, variants)


def cmd_stages(args) -> int:
    """Pipelines planned with their middle stages sharing one recording, against every stage recorded."""
    return _compare_pipelines(args, [("every stage", {"SHARE_STAGES": False}),
                                     ("middle stages shared", {"SHARE_STAGES": True})])


DEPTH_CASES = {
    "llama3_8b FSDP 8 (A2)": ("A2", 8, LLAMA8B_TT),
    "llama3_8b PP 4 (A2)": ("A2", 8, [*LLAMA8B_TT, "--parallelism.pipeline_parallel_degree", "4",
                                      "--training.local_batch_size", "8"]),
    "deepseek_v3_671b FSDP 32 x TP 4 x EP 128 (A3)": ("A3", 128, PUBLISHED[0].argv),
}


def cmd_depth(args) -> int:
    from npu_inject import hardware
    from npu_inject.planner import depth as depth_mod, job

    catalog = hardware.load()
    print(f"{'case':48} {'':>8} {'planned in s':>12} {'step s':>8} {'allocated GiB':>13} {'reserved GiB':>12}")
    for name, (hardware_name, ranks, argv) in DEPTH_CASES.items():
        profile = catalog.find(hardware_name)
        pool = _pool(argv)
        try:
            plans = {depth: job.plan_job(argv, profile=profile, efficiency=catalog.efficiency[profile.family],
                                         world_size=ranks, units=units, pool=pool)
                     for depth, units in (("full", None), ("shallow", depth_mod.SHALLOW_UNITS))}
        finally:
            pool.shutdown()
        full = plans["full"]
        for depth, plan in plans.items():
            worst = max(plan.roles, key=lambda r: r.peak_reserved)
            full_worst = max(full.roles, key=lambda r: r.peak_reserved)
            errors = "" if depth == "full" else (
                f"  errors: step {_error(plan.step_s, full.step_s)}, allocated "
                f"{_error(worst.peak_allocated, full_worst.peak_allocated)}, reserved {_error(worst.peak_reserved, full_worst.peak_reserved)}")
            print(f"{name:48} {depth:>8} {plan.seconds:12.1f} {plan.step_s:8.3f} {worst.peak_allocated / GIB:13.2f} "
                  f"{worst.peak_reserved / GIB:12.2f}{errors}", flush=True)
    return 0


SEARCHES = {
    "llama3_8b": ["--hardware", "A2", "--ngpu", "8", "--search", "--module", "llama3", "--config", "llama3_8b"],
    "deepseek_v3_671b": ["--hardware", "A3", "--ngpu", "1024", "--search", "--module", "deepseek_v3",
                         "--config", "deepseek_v3_671b"],
}


def cmd_search(args) -> int:
    from npu_inject.process_memory import process_tree_rss_kib  # the suite samples its runs the same way

    for name in args.which.split(","):
        command = [sys.executable, "-m", "npu_inject", "plan", *SEARCHES[name][:4], "--search",
                   "--json", os.path.join(tempfile.gettempdir(), f"bench_plan_search_{name}.json"), *SEARCHES[name][5:]]
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        peak = 0

        def sample():
            nonlocal peak
            while process.poll() is None:
                peak = max(peak, process_tree_rss_kib(process.pid) * 1024)
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out, _ = process.communicate()
        sampler.join()
        print(out.rstrip())
        print(f"== {name}: exit {process.returncode}, {time.monotonic() - started:.0f} s, "
              f"largest resident memory of the planner's processes together {peak / GIB:.2f} GiB", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    memory = commands.add_parser("memory")
    memory.add_argument("--only", help="comma-separated configuration names")
    memory.add_argument("--expandable", choices=("off", "on", "both"), default="both")
    memory.add_argument("--json", metavar="PATH", help="also write the rows (bytes) as JSON")
    memory.set_defaults(run=cmd_memory)
    published = commands.add_parser("published")
    published.add_argument("--calibrate", action="store_true")
    published.add_argument("--only", help="comma-separated parts of the rows' names (e.g. 'V2-Lite,131072')")
    published.set_defaults(run=cmd_published)
    commands.add_parser("depth").set_defaults(run=cmd_depth)
    microbatches = commands.add_parser("microbatches")
    microbatches.add_argument("--count", type=int, default=32, help="the job's microbatches per step, all recorded")
    microbatches.add_argument("--schemes", default="1:2,3",
                              help="';'-separated W:F,M: warm-up, fewer and more microbatches per pipeline rank")
    microbatches.add_argument("--only", help="comma-separated parts of the cases' names")
    microbatches.set_defaults(run=cmd_microbatches)
    shared = commands.add_parser("stages")
    shared.add_argument("--count", type=int, default=32, help="the job's microbatches per step")
    shared.add_argument("--only", help="comma-separated parts of the cases' names")
    shared.set_defaults(run=cmd_stages)
    syncs = commands.add_parser("syncs")
    syncs.add_argument("--only", help="comma-separated case names")
    syncs.add_argument("--verbose", action="store_true", help="also list the planned sites")
    syncs.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    syncs.set_defaults(run=cmd_syncs)
    search = commands.add_parser("search")
    search.add_argument("--which", default=",".join(SEARCHES))
    search.set_defaults(run=cmd_search)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

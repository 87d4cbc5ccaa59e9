"""``npu-inject plan`` end to end: the command a user runs, on torchtitan's debug models.

What it checks: the table, the JSON a scheduler reads and the PNG are written for a plan that fits; the
search lists layouts with the flags that select them, fastest first; bad input is one line and exit 2.
The predictions' accuracy is checked elsewhere: against torch_npu's allocator on the CANN emulation
(tests/cann_emu/test_planner_memory.py) and against published figures (tools/bench_plan.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import REPO, clean_env

DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "256"]
PLAN_KEYS = {"fits", "peak_bytes_per_rank", "step_s", "tokens_per_s_per_npu", "mfu", "breakdown"}


def _plan(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = clean_env()
    env.pop("TORCHTITAN_NPU", None)
    return subprocess.run([sys.executable, "-m", "npu_inject", "plan", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_plan_that_fits_prints_the_table_and_writes_json_and_plot(tmp_path):
    json_path, png_path = tmp_path / "plan.json", tmp_path / "plan.png"
    run = _plan("--hardware", "A2", "--ngpu", "2", "--json", str(json_path), "--plot", str(png_path),
                *DEBUG, "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FITS" in run.stdout and "tokens/s per NPU" in run.stdout, run.stdout
    plan = json.loads(json_path.read_text())
    assert PLAN_KEYS <= plan.keys()
    assert plan["fits"] is True and plan["parallel"]["pp"] == 2
    assert set(plan["peak_bytes_per_rank"]) == {"0", "1"}  # one role per pipeline rank
    assert all(0 < peak < plan["capacity_bytes"] for peak in plan["peak_bytes_per_rank"].values())
    assert plan["step_s"] > 0 and plan["tokens_per_s_per_npu"] > 0 and 0 < plan["mfu"] < 1
    assert {"compute_s", "exposed_comm_s", "bubble_s", "optimizer_s"} <= plan["breakdown"].keys()
    assert plan["breakdown"]["bubble_s"] > 0  # two stages: the schedule's bubble is there
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_lists_fitting_layouts_fastest_first_with_their_flags(tmp_path):
    json_path = tmp_path / "search.json"
    # A global batch of 2: each layout's accumulation is at most 2 microbatches deep, 12 layouts (a batch of 4
    # planned 18 in 83 s, this 12 in 53 s on an idle 2-core host).
    run = _plan("--hardware", "A2", "--ngpu", "2", "--search", "--json", str(json_path), *DEBUG,
                "--training.local_batch_size", "1", "--training.global_batch_size", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(json_path.read_text())
    fitting = [layout for layout in result["layouts"] if layout["fits"]]
    assert len(fitting) >= 3 and result["best"] is not None
    speeds = [layout["tokens_per_s_per_npu"] for layout in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for layout in fitting:
        assert PLAN_KEYS <= layout.keys()
        assert "--parallelism.data_parallel_shard_degree" in layout["flags"]


@pytest.mark.parametrize("args, message", [
    (["--hardware", "B200", "--ngpu", "2", *DEBUG], "unknown hardware 'B200'"),
    (["--hardware", "A2", "--ngpu", "3", *DEBUG, "--parallelism.tensor_parallel_degree", "2"], "3"),
    (["--hardware", "A2", "--ngpu", "2", "--expert-load", "0.5", *DEBUG], "--expert-load 0.5: the busiest"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    run = _plan(*args)
    assert run.returncode == 2, run.stdout + run.stderr
    # what the planner was doing before it found out (progress: "planning on ...", then "  [  10 s] ...") aside
    lines = [line for line in run.stderr.strip().splitlines() if not line.startswith(("planning on", "  ["))]
    assert len(lines) == 1 and message in lines[0], run.stderr


@pytest.mark.parametrize("args", [
    # MoE: the expert weight gradients' K-grouped kernel is planned from the NPU kernels' fakes; this host; the
    # busiest expert-parallel rank planned with half again the balanced rows
    ["--hardware", "cpu", "--ngpu", "2", "--expert-load", "1.5", "--module", "deepseek_v3", "--config",
     "deepseek_v3_debugmodel", "--training.seq_len", "256", "--parallelism.expert_parallel_degree", "2"],
    # spmd_types' type checker builds its own meshes (upstream's features/default case checks types)
    ["--hardware", "A2", "--ngpu", "2", *DEBUG, "--debug.spmd_typechecking", "activation-checkpoint:none"],
    # --compile.enable is planned as eager (torch 2.14 refuses fullgraph blocks dynamo skipped under the planner)
    ["--hardware", "A2", "--ngpu", "2", *DEBUG, "--compile.enable"],
    # qwen3_5 (multimodal, gated delta net): the batch's special tokens, varlen documents the planner's
    # batch defines (upstream finds them with nonzero), the gated delta rule's per-sequence loop
    ["--hardware", "A2", "--ngpu", "1", "--module", "qwen3_5", "--config", "qwen35_debugmodel_moe",
     "--training.seq_len", "128", *(f"--parallelism.{axis}_parallel_degree=1" for axis in
                                    ("tensor", "pipeline", "expert")), "--parallelism.data_parallel_shard_degree=1"],
    # -m models: gpt_oss (varlen metadata without host offsets, which the attention patch reads back) and
    # muse_glimmer (its masks find document ends through npu_inject.ops.attention)
    pytest.param(["--hardware", "A2", "--ngpu", "1", "--module", "gpt_oss", "--config", "gpt_oss_debugmodel",
                  "--training.seq_len", "256"], marks=pytest.mark.models),
    pytest.param(["--hardware", "A2", "--ngpu", "1", "--module", "muse_glimmer", "--config",
                  "muse_glimmer_debugmodel_mm", "--training.seq_len", "256", "--parallelism.data_parallel_shard_degree",
                  "1", "--parallelism.tensor_parallel_degree", "1"], marks=pytest.mark.models),
], ids=["deepseek_v3_ep2_on_this_host", "llama3_spmd_typechecking", "llama3_compile", "qwen3_5_moe", "gpt_oss",
        "muse_glimmer"])
def test_the_suites_model_and_checker_paths_plan(args, tmp_path):
    json_path = tmp_path / "plan.json"
    run = _plan("--json", str(json_path), *args)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "FITS" in run.stdout, run.stdout
    if "--expert-load" in args:
        assert "the busiest expert-parallel rank, planned here, receives 1.50 times" in run.stdout, run.stdout
    plan = json.loads(json_path.read_text())
    if plan["hardware"] == "cpu":  # the rehearsal: both ranks share this host, one verdict for them
        host = plan["host"]
        assert "FITS THIS HOST" in run.stdout and "note: rehearsal computes in" in run.stdout, run.stdout
        assert host["fits"] and host["need_bytes"] == sum(
            2 // len(plan["roles"]) * (role["total_bytes"] + host["process_baseline_bytes"]) for role in plan["roles"])


def test_a_pipeline_with_many_microbatches_is_extrapolated_from_fewer_and_agrees_with_recording_them_all(monkeypatch):
    """16 microbatches on 2 pipeline ranks: recorded with 4 and 8 and extrapolated, against recording all 16
    (llama3_70b PP 4 with 512 microbatches ran for 20 minutes recording them all)."""
    from npu_inject import hardware
    from npu_inject.planner import job, workers

    argv = [*DEBUG, "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "16",
            "--parallelism.pipeline_parallel_microbatch_size", "1"]
    profile = hardware.load().find("A2")
    efficiency = hardware.load().efficiency[profile.family]
    pool = workers.executor(selection="", modules=job.model_packages(argv))
    lines: list[str] = []
    try:
        extrapolated = job.plan_job(argv, profile=profile, efficiency=efficiency, world_size=2, pool=pool,
                                    progress=lines.append)
        monkeypatch.setattr(job, "RECORDED_MICROBATCHES", (4, 8))  # 16 is no more than 8 per rank: all recorded
        recorded = job.plan_job(argv, profile=profile, efficiency=efficiency, world_size=2, pool=pool)
    finally:
        pool.shutdown()
    assert extrapolated.info["microbatches_recorded"] == [4, 6] and extrapolated.info["pp_microbatches"] == 16
    assert "microbatches_recorded" not in recorded.info and recorded.info["pp_microbatches"] == 16
    assert any("a step of 2 microbatches to warm up, then 4 and 6 of the step's 16" in line for line in lines), lines
    assert extrapolated.tokens_per_step == recorded.tokens_per_step
    assert extrapolated.step_s == pytest.approx(recorded.step_s, rel=0.05)
    for a, b in zip(extrapolated.roles, recorded.roles):
        assert a.peak_allocated == pytest.approx(b.peak_allocated, rel=0.05)
        # The cache from the recording replayed holding 16 microbatches' receive buffers, as the job does.
        assert a.peak_reserved == pytest.approx(b.peak_reserved, rel=0.02)


def test_a_middle_stage_reordered_plans_as_its_own_recording(monkeypatch):
    """1F1B on 4 stages of the debug model (stages 1 and 2 hold two layers each): stage 1's recording reordered
    for stage 2 against stage 2 recorded, op for op, and the plans made both ways."""
    from npu_inject import hardware
    from npu_inject.planner import job, memory, stages, workers

    argv = [*DEBUG, "--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule",
            "1F1B", "--training.local_batch_size", "16", "--parallelism.pipeline_parallel_microbatch_size", "1"]
    profile = hardware.load().find("A2")
    efficiency = hardware.load().efficiency[profile.family]
    pool = workers.executor(selection="", modules=job.model_packages(argv))
    lines: list[str] = []
    try:
        facts = pool.submit(workers.describe, argv, 4).result()
        built = job._with_microbatches(argv, facts, 4)
        donor, own = (pool.submit(workers.record, built, 4, stage, None, (8, 12)) for stage in (1, 2))
        donor, own = donor.result(), own.result()
        shared = job.plan_job(argv, profile=profile, efficiency=efficiency, world_size=4, pool=pool,
                              progress=lines.append)
        monkeypatch.setattr(job, "SHARE_STAGES", False)
        recorded = job.plan_job(argv, profile=profile, efficiency=efficiency, world_size=4, pool=pool)
    finally:
        pool.shutdown()
    copy = stages.as_stage(donor.trace, donor=1, stage=2, stages=4, ranks_per_stage=1,
                           layer_offset=facts["stage_first_layers"][2] - facts["stage_first_layers"][1])

    def what(op):
        return (op.name, op.flops, op.bytes, op.phase, op.module, op.collective, op.group, op.peer, op.shape)

    assert [what(op) for op in copy.ops] == [what(op) for op in own.trace.ops]
    # The same allocations between the same ops (numbered as each recording made them).
    assert (sorted((a.op, a.freed if a.freed is not None else -1, a.nbytes) for a in copy.allocations)
            == sorted((a.op, a.freed if a.freed is not None else -1, a.nbytes) for a in own.trace.allocations))
    replayed = [memory.replay(trace, pad=512, expandable=False, device_memory=2**36).steps
                for trace in (copy, own.trace)]
    assert {name: step.peak_reserved for name, step in replayed[0].items()} == {
        name: step.peak_reserved for name, step in replayed[1].items()}
    assert any("stage 1's recording reordered for stage 2)" in line for line in lines), lines
    assert shared.info["stages_reordered"] == {2: 1} and "stages_reordered" not in recorded.info
    assert shared.step_s == pytest.approx(recorded.step_s, rel=1e-9)
    assert [role.peak_reserved for role in shared.roles] == [role.peak_reserved for role in recorded.roles]


def test_a_torchft_job_is_planned_as_one_replica_group_with_its_cross_group_all_reduce(tmp_path):
    # upstream's torchft config (llama3's debug model), HSDP across 4 replica groups of 8 ranks
    json_path = tmp_path / "plan.json"
    run = _plan("--hardware", "A2", "--ngpu", "8", "--json", str(json_path), "--module", "torchft.llama3",
                "--config", "llama3_torchft_debugmodel", "--fault_tolerance.group_size", "4",
                "--fault_tolerance.semi_sync_method", "None")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "torchft, 4 replica groups of these 8 ranks" in run.stdout, run.stdout
    ft = json.loads(json_path.read_text())["torchft"]
    # independent of the planner: the model's parameters sharded over 8 ranks, fp32 gradients (FSDP's reduce
    # dtype), a ring across the 4 groups over the A2 profile's scale-out links
    import torch
    from torchtitan.experiments.torchft.llama3 import config_registry

    from npu_inject import hardware

    with torch.device("meta"):
        model = config_registry.llama3_torchft_debugmodel().model_spec.model.build()
    shard_bytes = sum(p.numel() for p in model.parameters()) // 8 * 4
    catalog = hardware.load()
    profile = catalog.find("A2")
    link, comm = profile.scale_out, catalog.efficiency[profile.family]["comm"]
    expected_s = 2 * 3 / 4 * shard_bytes / (link.bandwidth_gbps * 1e9 * comm) + 2 * 3 * link.latency_us * 1e-6
    assert ft["replica_groups"] == 4 and ft["allreduce_bytes"] == shard_bytes
    assert abs(ft["allreduce_s"] - expected_s) < 1e-9 * max(expected_s, 1)
    # DiLoCo (upstream's default for this config) is not planned: one line
    diloco = _plan("--hardware", "A2", "--ngpu", "8", "--module", "torchft.llama3", "--config",
                   "llama3_torchft_debugmodel", "--fault_tolerance.group_size", "4")
    assert diloco.returncode == 2 and "plans torchft's synchronous replica groups only" in diloco.stdout + diloco.stderr

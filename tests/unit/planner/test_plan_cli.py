"""``npu-inject plan``'s inputs: the command line split, the world size, the hardware, bad input in one line.

Nothing here records a step (tests/e2e/test_plan.py does): these are the parts that must answer at once.
"""

from __future__ import annotations

import json
import types

import pytest

from npu_inject import hardware
from npu_inject.commands import cli
from npu_inject.commands import plan as plan_cmd
from npu_inject.errors import ConfigError
from npu_inject.planner import config, host_memory, render, search

TORCHTITAN = ["--module", "llama3", "--config", "llama3_8b", "activation-checkpoint:full"]


def _plan_parser():
    return cli.build_parser()._subparsers._group_actions[0].choices["plan"]


def test_the_planners_flags_come_first_and_the_rest_is_torchtitans():
    ours, theirs = plan_cmd.split_argv(_plan_parser(), ["--hardware", "A2", "--ngpu=8", "--search", *TORCHTITAN])
    assert ours == ["--hardware", "A2", "--ngpu=8", "--search"]
    assert theirs == TORCHTITAN


def test_a_planner_flag_among_torchtitans_is_named_with_where_it_belongs():
    with pytest.raises(ConfigError, match=r"--json is npu-inject plan's flag: put it before torchtitan's \(which start at --module\)"):
        plan_cmd.split_argv(_plan_parser(), ["--ngpu", "8", *TORCHTITAN[:4], "--json", "out.json"])


@pytest.mark.parametrize("flags, ranks", [(["--ngpu", "16"], 16), (["--nnodes", "4", "--nproc-per-node", "8"], 32)])
def test_world_size_from_ngpu_or_nodes(flags, ranks):
    args = _plan_parser().parse_args(flags)
    assert plan_cmd.world_size(args) == ranks


@pytest.mark.parametrize("flags, message", [
    ([], "how many ranks"),
    (["--nnodes", "4"], "--nnodes N and --nproc-per-node M go together"),
    (["--ngpu", "0"], "at least one rank"),
])
def test_world_size_errors_say_what_is_valid(flags, message):
    with pytest.raises(ConfigError, match=message):
        plan_cmd.world_size(_plan_parser().parse_args(flags))


@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}, True),
    ({"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}, False),
])
def test_expandable_segments_follow_the_allocator_configuration(monkeypatch, env, expected):
    for name in plan_cmd.ALLOC_CONF_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert plan_cmd.expandable_segments(types.SimpleNamespace(expandable_segments=None)) is expected
    assert plan_cmd.expandable_segments(types.SimpleNamespace(expandable_segments=True)) is True


def test_unknown_hardware_lists_the_known_names_and_exits_2(capsys):
    assert cli.main(["plan", "--hardware", "Ascend9000", "--ngpu", "8", *TORCHTITAN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "unknown hardware 'Ascend9000'" in err and "A2" in err and "Ascend910B2" in err and "H100" in err


def test_search_on_the_rehearsal_is_refused_with_what_to_run_instead(capsys):
    assert cli.main(["plan", "--hardware", "cpu", "--ngpu", "4", "--search", *TORCHTITAN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--search with --hardware cpu" in err and "without --search" in err


def test_without_hardware_and_without_an_npu_the_error_lists_the_names(capsys, monkeypatch):
    monkeypatch.setattr(plan_cmd, "visible_device", lambda: None)
    assert cli.main(["plan", "--ngpu", "8", *TORCHTITAN]) == 2
    assert "no NPU visible here: give --hardware NAME (known: " in capsys.readouterr().err


@pytest.mark.parametrize("name, profile", [
    ("A2", "Ascend910B2"), ("A3", "Ascend910_9382"), ("950", "Ascend950DT"), ("H100", "H100-SXM"),
    ("Ascend910B2C", "Ascend910B2"), ("Ascend910_9391", "Ascend910_9392"), ("Ascend910B4-1", "Ascend910B4"),
])
def test_hardware_by_soc_name_variant_or_alias(name, profile):
    assert hardware.load().find(name).name == profile


def test_every_hardware_number_has_a_source():
    catalog = hardware.load()
    for profile in catalog.profiles.values():
        for key in (*hardware.NUMBERS, *(f"peak_tflops.{d}" for d in profile.peak_tflops),
                    *(f"{link}.{part}" for link in hardware.LINKS for part in ("bandwidth_gbps", "latency_us"))):
            assert profile.sources.get(key), f"{profile.name}: {key} has no source"


def test_a_user_hardware_file_adds_a_profile(tmp_path):
    raw = json.load(open(hardware.PACKAGED))
    mine = dict(raw["profiles"]["Ascend910B2"], description="our 910B2 cluster, 100GE per NPU")
    mine["scale_out"] = {"bandwidth_gbps": {"value": 12.5, "source": "our switch"},
                         "latency_us": {"value": 40, "source": "measured"}}
    path = tmp_path / "ours.json"
    path.write_text(json.dumps({"profiles": {"OurA2": mine}}))
    profile = hardware.load(str(path)).find("OurA2")
    assert profile.scale_out.bandwidth_gbps == 12.5 and profile.peak("bfloat16") == pytest.approx(353.89e12)


def test_a_family_without_every_efficiency_is_refused_naming_what_is_missing(tmp_path):
    path = tmp_path / "family.json"
    path.write_text(json.dumps({"profiles": {}, "efficiency": {"mine": {"cube": 0.5, "memory": "fast"}}}))
    with pytest.raises(ConfigError, match=r"efficiency 'mine': missing attention, comm.*not a number: memory"):
        hardware.load(str(path))


def test_every_packaged_efficiency_says_where_it_comes_from():
    raw = json.load(open(hardware.PACKAGED))
    for family, values in raw["efficiency"].items():
        if family != "about":
            assert set(values["sources"]) == set(hardware.EFFICIENCY_KEYS), family


def test_a_hardware_number_without_a_source_is_refused(tmp_path):
    raw = json.load(open(hardware.PACKAGED))
    mine = dict(raw["profiles"]["Ascend910B2"], memory_gib=64)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"profiles": {"Bad": mine}}))
    # The file and the key: the user's file is where to look.
    with pytest.raises(ConfigError, match=r"bad\.json: profile 'Bad'\.memory_gib must be \{\"value\": <number>, \"source\""):
        hardware.load(str(path))


@pytest.mark.parametrize("degrees, world, message", [
    (dict(tp=3), 8, r"the layout's degrees \(dp_replicate 1 x cp 1 x tp 3 x pp 1 = 3\) do not divide the 8 ranks"),
    (dict(dp_shard=2, tp=2), 8, r"dp_shard 2 = 4\) are not the 8 ranks planned"),
    (dict(ep=3), 8, r"--parallelism.expert_parallel_degree 3 does not divide dp_shard 8"),
])
def test_a_layout_torchtitan_would_refuse_is_one_line(degrees, world, message):
    parallelism = types.SimpleNamespace(
        data_parallel_replicate_degree=1, data_parallel_shard_degree=degrees.get("dp_shard", -1),
        context_parallel_degree=1, tensor_parallel_degree=degrees.get("tp", 1), pipeline_parallel_degree=1,
        expert_parallel_degree=degrees.get("ep", 1))
    problem = config.layout_problem(parallelism, world)
    assert problem is not None and "\n" not in problem
    assert __import__("re").search(message, problem), problem


FACTS = {"layers": 32, "heads": 32, "kv_heads": 8, "experts": None, "seq_len": 8192, "global_batch_size": 8,
         "microbatch_size": 1}


def test_the_search_space_for_a_dense_model_on_one_node():
    layouts = search.layouts(FACTS, 8, scale_up=8)
    assert all(l.dp_replicate * l.dp_shard * l.cp * l.tp * l.pp == 8 for l in layouts)
    assert {l.tp for l in layouts} == {1, 2, 4, 8} and {l.cp for l in layouts} == {1, 2}
    assert {l.ep for l in layouts} == {1} and {l.dp_replicate for l in layouts} == {1}
    assert len(set(layouts)) == len(layouts)


def test_the_search_space_respects_heads_experts_and_scale_up():
    facts = dict(FACTS, heads=128, kv_heads=128, experts=256, seq_len=4096, layers=61)
    layouts = search.layouts(facts, 1024, scale_up=16)
    assert max(l.tp for l in layouts) == 8 and {l.cp for l in layouts} == {1}
    assert all(256 % l.ep == 0 and (l.dp_shard * l.cp * l.tp) % l.ep == 0 for l in layouts)
    assert {l.dp_replicate for l in layouts} >= {1, 64}  # HSDP across whole scale-up domains only
    assert all((1024 // l.dp_replicate) % 16 == 0 for l in layouts)


def test_local_batches_hold_the_global_batch():
    layout = search.Layout(1, 4, 1, 2, 1, 1)
    assert search.local_batches(layout, 8, 1) == [2, 1]
    assert search.local_batches(search.Layout(1, 3, 1, 1, 1, 1), 8, 1) == []
    pipelined = search.Layout(1, 2, 1, 1, 4, 1)
    assert search.local_batches(pipelined, 16, 1) == [8, 4]  # at least as many microbatches as stages


def test_a_candidate_replaces_the_commands_layout_and_checkpointing():
    argv = ["--module", "llama3", "--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size=2",
            "--config", "llama3_8b", "activation-checkpoint:full", "--activation-checkpoint.early-stop"]
    candidate = search.Candidate(search.Layout(1, 4, 1, 2, 1, 1), 1, "none", 8)
    out = candidate.argv(argv)
    assert out[-1] == "activation-checkpoint:none"
    assert out.count("--parallelism.tensor_parallel_degree") == 1
    assert out[out.index("--parallelism.tensor_parallel_degree") + 1] == "2"
    assert "--training.local_batch_size=2" not in out and out[out.index("--training.local_batch_size") + 1] == "1"
    assert out[:2] == ["--module", "llama3"] and "--config" in out


def test_the_rehearsals_ranks_share_the_host_one_verdict_for_all():
    from types import SimpleNamespace

    gib = host_memory.GIB
    roles = [SimpleNamespace(total=3 * gib), SimpleNamespace(total=1 * gib)]  # two pipeline stages
    job = SimpleNamespace(world_size=4, roles=roles)  # two ranks per stage
    need = host_memory.host_need(job)
    assert need == 2 * (3 * gib + host_memory.PROCESS_BASELINE_BYTES) + 2 * (1 * gib + host_memory.PROCESS_BASELINE_BYTES)
    asked = host_memory.host_asked(job)
    assert asked == int(need * host_memory.HOST_MARGIN) > need  # the verdict keeps the measured shortfall's margin
    fits = render.host_lines(job, asked, "MemAvailable")
    assert fits[-1].startswith("FITS THIS HOST") and "2 x 3.0 + 2 x 1.0 GiB planned" in fits[0]
    assert f"{asked / gib:.1f} GiB with the 70% margin" in fits[0]
    short = render.host_lines(job, need, "MemAvailable")  # the bare plan fits; with the margin it does not
    assert short[-1].startswith("DOES NOT FIT THIS HOST") and f"{(asked - need) / gib:.1f} more than" in short[-1]


# What advice() reads of a plan: a variant that fits in 1 GiB, and the job's own plan (70 GiB).
GIB = 2**30
FITTING_VARIANT = types.SimpleNamespace(fits=True, worst=types.SimpleNamespace(total=GIB), tokens_per_s_per_npu=90.0)


def _variant(gib: float, fits: bool | None = None):
    return types.SimpleNamespace(fits=gib <= 64 if fits is None else fits, worst=types.SimpleNamespace(total=gib * GIB),
                                 tokens_per_s_per_npu=90.0)


def _unfit_plan(degrees: dict[str, int], *, seq_len: int, local_batch: int, global_batch: int, ac: str,
                experts: int | None = None, world_size: int = 8):
    parallel = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    return types.SimpleNamespace(
        parallel=parallel, info={"seq_len": seq_len, "local_batch_size": local_batch, "activation_checkpoint": ac,
                                 "experts": experts},
        tokens_per_step=global_batch * seq_len, capacity=64 * GIB, world_size=world_size,
        worst=types.SimpleNamespace(at_peak={}, total=70 * GIB))


@pytest.mark.parametrize("config_ac, on_command_line, planned", [
    ("full", None, ["full"]),  # llama3_70b's config says full: only the halved batch (still full) is planned
    ("none", None, ["full", "selective"]),  # full recomputation; the halved batch with selective
    ("none", "full", ["full"]),  # the command line's mode wins over the config's
])
def test_the_advice_plans_only_variants_that_differ_from_the_job(config_ac, on_command_line, planned):
    job_plan = _unfit_plan({"dp_shard": 8}, seq_len=1024, local_batch=4, global_batch=32, ac=config_ac)
    argv = ["--module", "llama3", "--config", "llama3_8b"] + ([f"activation-checkpoint:{on_command_line}"]
                                                              if on_command_line else [])
    asked = []

    def run_variant(variant_argv):
        asked.append(variant_argv[-1].split(":", 1)[1])
        return FITTING_VARIANT

    lines = plan_cmd.advice(argv, job_plan, run_variant)
    assert asked == planned and lines[0] == "what would fit (each planned shallow unless said):", lines
    assert len(lines) == 1 + len(planned) and all("tokens/s/NPU" in line for line in lines[1:]), lines


def test_the_advice_lists_only_the_variants_that_fit():
    job_plan = _unfit_plan({"dp_shard": 8}, seq_len=1024, local_batch=4, global_batch=32, ac="none")
    figures = {"full": _variant(66.0), "selective": _variant(50.0)}  # AC full at batch 4 is still too much
    lines = plan_cmd.advice(["--module", "llama3"], job_plan, lambda argv: figures[argv[-1].split(":", 1)[1]])
    assert lines == ["what would fit (each planned shallow unless said):",
                     "  dp_shard 8, local batch 2 x 2 accumulated, AC selective: fits, 50.0 GiB, 90 tokens/s/NPU"], lines


def test_when_no_variant_fits_the_advice_says_so_and_points_to_expert_and_pipeline_degrees_and_the_search():
    """deepseek_v3_671b on 1024 A3 dies (EP 2, local batch 4, selective): neither full recomputation nor half the
    batch fits, so the most frugal variant (one sequence per microbatch, full) is planned too; none fits."""
    job_plan = _unfit_plan({"dp_shard": 1024, "ep": 2}, seq_len=4096, local_batch=4, global_batch=4096,
                           ac="selective", experts=256, world_size=1024)
    job_plan.worst.total = 507.6 * GIB
    asked = []

    def run_variant(argv):
        batch = argv[argv.index("--training.local_batch_size") + 1]
        asked.append((batch, argv[-1]))
        return _variant(90.0)

    lines = plan_cmd.advice(["--module", "deepseek_v3", "--config", "deepseek_v3_671b"], job_plan, run_variant)
    assert asked == [("4", "activation-checkpoint:full"), ("2", "activation-checkpoint:selective"),
                     ("1", "activation-checkpoint:full")], asked
    assert lines[0] == "none of the 3 variants tried fits (each planned shallow unless said):", lines
    assert lines[3] == "  dp_shard 1024 x ep 2, local batch 1 x 4 accumulated, AC full: does not fit, 90.0 GiB, " \
                       "90 tokens/s/NPU", lines
    assert lines[4] == "what might fit instead:", lines
    assert "--parallelism.expert_parallel_degree up to 256" in lines[5] and "this job has 2" in lines[5], lines
    assert "--parallelism.pipeline_parallel_degree" in lines[6], lines
    assert lines[7].startswith("  --search plans every layout of these 1024 ranks"), lines


def test_a_variant_planned_above_the_job_itself_is_flagged_not_taken_at_its_word():
    """A variant recomputes at least as much on no larger a batch: a shallow plan above the job's full-depth one
    is the extrapolation's error (AC full was planned at 1220.2 GiB beside the job's 507.6)."""
    job_plan = _unfit_plan({"dp_shard": 8}, seq_len=1024, local_batch=1, global_batch=8, ac="selective")
    lines = plan_cmd.advice(["--module", "llama3"], job_plan, lambda argv: _variant(80.0))
    assert lines[1].startswith("  dp_shard 8, local batch 1, AC full: does not fit, 80.0 GiB, 90 tokens/s/NPU "
                               "(above the job's own 70.0 GiB at full depth"), lines


def test_the_advice_gives_a_pipelines_memory_only():
    """A shallow plan of a pipeline with many microbatches was 3x slow (llama3_70b PP 4, 512 microbatches)."""
    job_plan = _unfit_plan({"tp": 8, "pp": 4}, seq_len=8192, local_batch=512, global_batch=512, ac="full")
    lines = plan_cmd.advice(["--module", "llama3", "--config", "llama3_70b"], job_plan, lambda argv: FITTING_VARIANT)
    assert lines[1] == "  tp 8 x pp 4, local batch 256 x 2 accumulated, AC full: fits, 1.0 GiB", lines
    assert "memory only" in lines[2] and len(lines) == 3, lines


def test_a_pipelines_smaller_batch_is_planned_from_the_jobs_own_recordings():
    """Halving a pipeline's local batch with the same recomputation only runs fewer microbatches: the job's
    recordings say it at full depth, with its speed, and nothing is recorded again."""
    job_plan = _unfit_plan({"tp": 8, "pp": 4}, seq_len=8192, local_batch=512, global_batch=512, ac="full")
    job_plan.info["pp_microbatches"] = 512
    asked: list[int] = []

    def fewer_microbatches(count):
        asked.append(count)
        return FITTING_VARIANT

    def run_variant(argv):
        raise AssertionError("recorded again")

    lines = plan_cmd.advice(["--module", "llama3", "--config", "llama3_70b"], job_plan, run_variant, fewer_microbatches)
    assert asked == [256], asked
    assert lines[1:] == ["  tp 8 x pp 4, local batch 256 x 2 accumulated, AC full: fits, 1.0 GiB, 90 tokens/s/NPU "
                         "(from the job's own recordings, at full depth)"], lines

"""host_memory_check: the rehearsal's start-up verdict on this host's memory, from a stubbed plan.

The plan documents here are what ``npu-inject plan --hardware cpu --json`` writes (its ``roles`` and
``host`` keys), with round figures; the expected lines are worked out by hand from them. A real run
that does not fit this host is in the issue-43 report (torchrun, llama3_debugmodel at seq_len 65536).
"""

from __future__ import annotations

import logging
import types

import pytest

from npu_inject import module_facts
from npu_inject.patching import PatchContext
from npu_inject.patches import host_memory_check

GIB = 2**30


def _document(world_size: int = 2, total_gib: int = 10) -> dict:
    """One role of 10 GiB: 2 GiB of parameters, gradients and optimizer states, 8 GiB that scale with the batch."""
    role = {"pp_rank": 0, "rank": 0, "total_bytes": total_gib * GIB,
            "at_peak_bytes": {"parameters": 1 * GIB, "gradients": GIB // 2, "optimizer states": GIB // 2,
                              "activations": (total_gib - 3) * GIB, "temporaries": 0, "communication": 0}}
    baseline = int(0.8 * GIB)
    need = world_size * (total_gib * GIB + baseline)
    return {"world_size": world_size, "roles": [role],
            "host": {"need_bytes": need, "asked_bytes": int(need * 1.7), "margin": 1.7,
                     "available_bytes": 20 * GIB, "fits": False, "process_baseline_bytes": baseline, "argv": []}}


# asked = 1.7 x 2 ranks x (2 GiB of states + 8 GiB x scale + 0.8 GiB per process): 36.7 GiB as planned.
NEEDS = ("the rehearsal's 2 ranks on this host need about 21.6 GiB (per rank 10.0 GiB planned + 0.8 GiB for torch "
         "and torchtitan), 36.7 GiB with the planner's 70% margin")


def test_a_job_the_host_holds_fits():
    status, line = host_memory_check.verdict(_document(), 40 * GIB, 2, local_batch_size=8, seq_len=2048)
    assert status == host_memory_check.FITS
    assert line == f"host memory checked: {NEEDS}; 40.0 GiB available"


@pytest.mark.parametrize("available_gib, would_fit", [
    # batch 4: 1.7 x 2 x (2.8 + 4) = 23.1 GiB; batch 2: 1.7 x 2 x (2.8 + 2) = 16.3 GiB
    (20, "--training.local_batch_size 2 (estimated from the plan)"),
    # batch 1: 12.9 GiB; then at batch 1, seq 1024: 11.2, 512: 10.4, 256: 9.9 GiB
    (10, "--training.local_batch_size 1 --training.seq_len 256 (estimated from the plan)"),
    # no activations at all: 1.7 x 2 x 2.8 = 9.5 GiB
    (5, "no smaller batch or sequence: without activations the job still asks about 9.5 GiB (parameters, "
        "gradients, optimizer states and each process's own 0.8 GiB, with the margin); fewer ranks or a smaller "
        "--config"),
])
def test_a_job_too_large_stops_with_one_line_saying_what_would_fit(available_gib, would_fit):
    status, line = host_memory_check.verdict(_document(), available_gib * GIB, 2, local_batch_size=8, seq_len=2048)
    assert status == host_memory_check.DOES_NOT_FIT
    assert line == (f"this host cannot hold the job: {NEEDS}, and {available_gib:.1f} GiB are available "
                    "(MemAvailable and what the ranks hold already); it would be ended by the OOM killer. What "
                    f"would fit: {would_fit}. The plan: npu-inject plan --hardware cpu --ngpu 2 <these flags>; to run "
                    "anyway: TORCHTITAN_NPU_PATCHES=-host_memory_check")
    assert "\n" not in line


def test_the_advice_is_planned_and_a_refuted_estimate_says_so():
    planned = []

    def plan(flags):  # the planner's documents for the smaller shapes: batch 2 asks more than the estimate
        planned.append(flags)
        return _document(total_gib={"2": 7, "1": 4}[flags[-1]])

    status, line = host_memory_check.verdict(_document(), 20 * GIB, 2, local_batch_size=8, seq_len=2048, plan=plan)
    # batch 2 planned at 7 GiB a rank: 1.7 x 2 x 7.8 = 26.5 GiB; batch 1 estimated at 12.9 GiB, not planned again
    assert "What would fit: --training.local_batch_size 1 (estimated from the plan; --training.local_batch_size 2, " \
           "planned, asks 26.5 GiB)." in line
    assert planned == [["--training.local_batch_size", "2"]]
    # batch 2 planned at 4 GiB a rank: 1.7 x 2 x 4.8 = 16.3 GiB
    status, line = host_memory_check.verdict(_document(), 20 * GIB, 2, local_batch_size=8, seq_len=2048,
                                             plan=lambda flags: _document(total_gib=4))
    assert "What would fit: --training.local_batch_size 2 (planned: about 16.3 GiB with the margin)." in line


class StandInModel:
    """A model config the upper bound does not know (not torchtitan's Decoder): the job is planned."""


NOT_BOUNDED = "; planned because StandInModel is not torchtitan's Decoder"


def _config(mode: str = "default"):
    return types.SimpleNamespace(comm=types.SimpleNamespace(mode=mode, init_timeout_seconds=300),
                                 training=types.SimpleNamespace(local_batch_size=8, seq_len=2048),
                                 parallelism=types.SimpleNamespace(pipeline_parallel_degree=1),
                                 model_spec=types.SimpleNamespace(model=StandInModel()))


def _apply(monkeypatch, stub_init):
    """The patch applied over a stand-in Trainer.__init__ (upstream's would start the process group)."""
    import torchtitan.trainer

    monkeypatch.setattr(torchtitan.trainer.Trainer, "__init__", stub_init)
    ctx = PatchContext(patch_id="host_memory_check", device_kind="cpu", options={},
                       declared_targets=module_facts.declared_names(host_memory_check))
    host_memory_check.apply(ctx)
    return ctx, torchtitan.trainer.Trainer


def _build(trainer_class, config) -> None:
    trainer_class.__init__(object.__new__(trainer_class), config)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_every_rank_stops_with_rank0s_line_before_the_model_is_built(monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    planned = []

    def plan_document(argv, world_size, timeout_s):  # the job, then the advice's smaller batch (4 GiB a rank)
        planned.append(argv)
        return _document(total_gib=4 if "--training.local_batch_size" in argv else 10), ""

    monkeypatch.setattr(host_memory_check, "plan_document", plan_document)
    monkeypatch.setattr(host_memory_check, "available_to_job", lambda document, ranks_here: 20 * GIB)
    seen = {}

    def init(trainer, config):
        # What Trainer.init_distributed's rank agreement does: hand every rank rank 0's proposal.
        ((name, proposal, use),) = ctx.agreements
        seen["proposal"] = proposal
        use(rank0_verdict)
        seen["model built"] = True

    rank0_verdict = host_memory_check.check(["--module", "llama3"], 2, 240, 8, 2048)
    assert planned == [["--module", "llama3", "--debug.no-spmd_typechecking"],
                       ["--module", "llama3", "--debug.no-spmd_typechecking", "--training.local_batch_size", "2"]]
    ctx, trainer_class = _apply(monkeypatch, init)
    try:
        with pytest.raises(SystemExit) as stopped:
            _build(trainer_class, _config())
    finally:
        ctx.restore()
    def untimed(verdict):  # the line ends with how long this check's planning took
        return None if verdict is None else (verdict[0], verdict[1].rsplit(" (planned in ", 1)[0])

    assert untimed(seen["proposal"]) == (untimed(rank0_verdict) if rank == "0" else None)
    assert "model built" not in seen
    assert ctx.notes[0].startswith("this host cannot hold the job")  # in the report written as it exits
    assert str(stopped.value).startswith("npu_inject host_memory_check: this host cannot hold the job: the "
                                         "rehearsal's 2 ranks on this host need about 21.6 GiB")
    assert ("What would fit: --training.local_batch_size 2 (planned: about 16.3 GiB with the margin)."
            in str(stopped.value))


def test_a_job_that_fits_is_noted_and_goes_on(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    planned = {}

    def plan_document(argv, world_size, timeout_s):
        planned.update(argv=argv, world_size=world_size, timeout_s=timeout_s)
        return _document(), ""

    monkeypatch.setattr(host_memory_check, "plan_document", plan_document)
    monkeypatch.setattr(host_memory_check, "available_to_job", lambda document, ranks_here: 40 * GIB)
    monkeypatch.setattr(host_memory_check.sys, "argv", ["torchtitan/train.py", "--module", "llama3"])

    def init(trainer, config):
        ((_, proposal, use),) = ctx.agreements
        use(proposal)

    ctx, trainer_class = _apply(monkeypatch, init)
    try:
        with caplog.at_level(logging.INFO, logger="npu_inject"):
            _build(trainer_class, _config())
    finally:
        ctx.restore()
    # The training flags as torchtitan.train took them (planned without the SPMD type checker); the plan may take
    # what the other ranks can wait, less a minute.
    assert planned == {"argv": ["--module", "llama3", "--debug.no-spmd_typechecking"], "world_size": 2,
                       "timeout_s": 240}
    (note,) = ctx.notes
    assert note.startswith(f"host memory checked: {NEEDS}; 40.0 GiB available (planned in ")
    assert f"npu_inject: {note}" in caplog.text
    assert not ctx.fallbacks


def test_a_job_the_planner_cannot_plan_is_reported_and_goes_on(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(host_memory_check, "plan_document", lambda argv, world_size, timeout_s: (
        None, "npu-inject plan: torchtitan refused the layout: decay_steps must not be zero to reach this branch"))
    built = []

    def init(trainer, config):
        ((_, proposal, use),) = ctx.agreements
        use(proposal)
        built.append(True)

    ctx, trainer_class = _apply(monkeypatch, init)
    try:
        _build(trainer_class, _config())
    finally:
        ctx.restore()
    assert built and ctx.fallbacks == [
        "host memory not checked: the planner could not plan this job (npu-inject plan: torchtitan refused the "
        f"layout: decay_steps must not be zero to reach this branch{NOT_BOUNDED})"]


@pytest.mark.parametrize("mode, local_world_size, says", [
    ("fake_backend", "2", "host memory not checked: --comm.mode fake_backend runs one process for every rank"),
    ("default", "1", "host memory not checked: the job spans hosts (1 of its 2 ranks here)"),
])
def test_dry_runs_and_jobs_across_hosts_are_not_planned_and_say_so(monkeypatch, mode, local_world_size, says):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)

    def no_plan(argv, world_size, timeout_s):
        raise AssertionError("nothing to plan")

    monkeypatch.setattr(host_memory_check, "plan_document", no_plan)
    ctx, trainer_class = _apply(monkeypatch, lambda trainer, config: None)
    try:
        _build(trainer_class, _config(mode))
    finally:
        ctx.restore()
    assert ctx.agreements == [] and ctx.notes[0].startswith(says)


def test_without_the_rank_agreement_the_check_is_reported_as_not_done(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(host_memory_check, "plan_document", lambda argv, world_size, timeout_s: (_document(1), ""))
    monkeypatch.setattr(host_memory_check, "available_to_job", lambda document, ranks_here: 40 * GIB)
    ctx, trainer_class = _apply(monkeypatch, lambda trainer, config: None)
    try:
        _build(trainer_class, _config())
    finally:
        ctx.restore()
    assert ctx.fallbacks and "ran without the runtime's rank agreement" in ctx.fallbacks[0]


@pytest.mark.parametrize("user_selection", ["", "-rms_norm", "attention,device,host_memory_check"])
def test_the_planners_recordings_and_the_suites_runs_run_without_it(user_selection):
    """No recursion (a recording would plan itself again) and no second plan of a case the suite planned."""
    from npu_inject import registry, selection
    from npu_inject.commands import suite
    from npu_inject.planner import config

    catalog = registry.load(None, entry_points=False)
    with_check = selection.select(catalog, user_selection)
    for patches in (config.environment(user_selection)["TORCHTITAN_NPU_PATCHES"],
                    suite.without_host_check(user_selection)):
        enabled = selection.select(catalog, patches)
        assert not enabled["host_memory_check"]
        assert {k: v for k, v in enabled.items() if k not in config.PLANNER_EXCLUDED} == \
            {k: v for k, v in with_check.items() if k not in config.PLANNER_EXCLUDED}


def _llama3_debug(*flags: str):
    """torchtitan's own config of the quickstart's job, command line merged."""
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len",
                                       "256", "--training.local_batch_size", "2", *flags])


def _no_plan(argv, world_size, timeout_s):
    raise AssertionError("a job that fits by its bound is not planned")


def test_a_small_job_fits_by_its_upper_bound_without_a_plan(monkeypatch):
    monkeypatch.setattr(host_memory_check, "plan_document", _no_plan)
    monkeypatch.setattr(host_memory_check, "available_now", lambda ranks_here: 40 * GIB)
    config = _llama3_debug()
    status, line = host_memory_check.check(["--module", "llama3"], 2, 240, 2, 256, config)
    assert status == host_memory_check.FITS
    assert line.startswith("host memory checked by an upper bound, not planned: the rehearsal's 2 ranks need at "
                           "most ")
    # the bound counts the parameters torchtitan itself counts (its log line "size: N total parameters")
    from torchtitan.models.llama3 import model_registry  # noqa: F401 (the config's model, as torchtitan builds it)
    import copy

    import torch

    model_config = copy.deepcopy(config.model_spec.model)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    count, _ = model_config.get_nparams_and_flops(model, 256)
    assert f"per rank 0.6 GiB: {count:,} parameters x 24 B" in line
    assert line.endswith("s at start-up)") and "under half of the 40.0 GiB available" in line


def test_a_job_whose_bound_comes_near_the_host_is_planned_and_says_why(monkeypatch):
    planned = []
    monkeypatch.setattr(host_memory_check, "plan_document",
                        lambda argv, world_size, timeout_s: planned.append(argv) or (_document(total_gib=1), ""))
    monkeypatch.setattr(host_memory_check, "available_now", lambda ranks_here: 6 * GIB)
    monkeypatch.setattr(host_memory_check, "available_to_job", lambda document, ranks_here: 8 * GIB)
    status, line = host_memory_check.check(["--module", "llama3"], 2, 240, 2, 256, _llama3_debug())
    assert planned and status == host_memory_check.FITS
    assert "planned because its upper bound (" in line and ") comes near this host's memory)" in line


def test_a_pipelined_job_is_planned(monkeypatch):
    monkeypatch.setattr(host_memory_check, "plan_document", lambda argv, world_size, timeout_s: (_document(), ""))
    monkeypatch.setattr(host_memory_check, "available_to_job", lambda document, ranks_here: 40 * GIB)
    config = _llama3_debug("--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs")
    status, line = host_memory_check.check(["--module", "llama3"], 2, 240, 2, 256, config)
    assert line.endswith("; planned because a pipeline schedule keeps several microbatches' activations)")

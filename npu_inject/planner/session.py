"""One rank of a torchtitan job, built and stepped on fake tensors: the planner's measurement.

The job is parsed from the same torchtitan flags the training command takes (:mod:`npu_inject.planner.config`)
and built by torchtitan's own ``Trainer`` in one process that stands for rank ``rank`` of ``world_size`` (a fake
process group, as torchtitan's ``--comm.mode fake_backend`` dry run), through this runtime's patches,
with every tensor a FakeTensor: nothing is allocated or computed. A :class:`~npu_inject.planner.trace.Recorder`
sees the whole of it, from the model's materialisation to the end of the last step. What the planner
changes in torchtitan, torch and this runtime to make that possible: :mod:`npu_inject.planner.interventions`.
Here: the session feeds the steps' token batches itself and names what each recorded allocation was.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

from npu_inject.planner import host_reads
from npu_inject.planner.config import (FORCED_FLAGS, PlanError, activation_checkpoint_mode, environment, experts,
                                       guard)
from npu_inject.torchtitan_argv import with_flags


@dataclass
class RoleResult:
    rank: int
    world_size: int
    trace: Any  # trace.Trace
    info: dict[str, Any] = field(default_factory=dict)


class _NoSpecialTokens(dict):
    """A multimodal collator's ``special_tokens`` for the planner's text-only batch: any id asked for is one
    no planned token has (the batch's tokens are 0), so no image or video placeholder is found."""

    def __missing__(self, name: str) -> int:
        return -1


def _batch(rows: int, seq_len: int, special_tokens: bool = False):
    import torch

    tokens = torch.zeros(rows, seq_len, dtype=torch.int64)
    positions = torch.arange(seq_len, dtype=torch.int64).expand(rows, seq_len).contiguous()
    labels = torch.zeros(rows, seq_len, dtype=torch.int64)
    inputs = {"input": tokens, "positions": positions}
    if special_tokens:  # a multimodal model's forward reads them (qwen3_5): a text-only batch
        inputs["special_tokens"] = _NoSpecialTokens()
    return inputs, labels


def one_replica_group(config) -> int:
    """A torchft job (``--fault_tolerance.enable``) is planned as one of its replica groups, each its own
    torchrun: the same layout and batch per rank, built by torchtitan's base trainer with the base optimizer
    container (torchft's needs a manager that reaches a lighthouse). Returns the number of replica groups
    (``--fault_tolerance.group_size``; 1 for any other job) for the cross-group all-reduce's cost."""
    import dataclasses

    from torchtitan.components.optimizer import OptimizersContainer

    ft = getattr(config, "fault_tolerance", None)
    if ft is None or not ft.enable:
        return 1
    if ft.semi_sync_method is not None:
        raise PlanError(f"--fault_tolerance.semi_sync_method {ft.semi_sync_method}: the planner plans torchft's "
                        "synchronous replica groups only (--fault_tolerance.semi_sync_method None, HSDP across "
                        "the groups)")
    fields = dataclasses.fields(OptimizersContainer.Config)
    config.optimizer = OptimizersContainer.Config(**{field.name: getattr(config.optimizer, field.name) for field in fields})
    ft.enable = False
    return max(ft.group_size, 1)


def _step(trainer, recorder, step: int, groups_recorded: int, runtime_reads=()) -> None:
    """One training step as torchtitan's ``train_step`` runs it, with the host reads the NPU job makes marked
    (:mod:`npu_inject.planner.host_reads`; ``runtime_reads``: the runtime's)."""
    import torch
    from torchtitan.distributed import utils as dist_utils

    config, parallel_dims = trainer.config, trainer.parallel_dims
    recorder.mark(f"step {step}")
    for read in runtime_reads:
        if read.where == host_reads.STEP_START:
            recorder.host_read(read.site)
    recorder.host_read(host_reads.TOKEN_COUNT_COPY)
    recorder.phase = "forward"
    trainer.optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
    rows = (config.parallelism.pipeline_parallel_microbatch_size if parallel_dims.pp_enabled
            else config.training.local_batch_size)
    global_valid_tokens = torch.tensor(config.training.global_batch_size * config.training.seq_len,
                                       dtype=torch.int64)
    special_tokens = "special_tokens" in inspect.signature(trainer.model_parts[0].forward).parameters
    for group in range(groups_recorded):
        recorder.mark(f"microbatch group {group}")
        batches = [_batch(rows, config.training.seq_len, special_tokens)
                   for _ in range(trainer.num_pipeline_parallel_microbatches)]
        # torchtitan copies the group's one (input_dict, labels) of the local batch tensor by tensor (a pipeline's
        # schedule cuts its microbatches on the device).
        inputs = batches[0][0]
        for _ in range(1 + sum(isinstance(value, torch.Tensor) for value in (
                inputs.values() if isinstance(inputs, dict) else [inputs]))):
            recorder.host_read(host_reads.BATCH_COPY)
        if parallel_dims.pp_enabled:
            trainer.forward_backward_step(input_dict=[b[0] for b in batches], labels=[b[1] for b in batches],
                                          global_valid_tokens=global_valid_tokens)
        else:
            trainer.forward_backward_step(input_dict=batches[0][0], labels=batches[0][1],
                                          global_valid_tokens=global_valid_tokens)
        del batches
    recorder.phase = "optimizer"
    recorder.mark("optimizer")
    dist_utils.clip_grad_norm_(
        [p for m in trainer.model_parts for p in m.parameters()], config.training.max_norm, foreach=True,
        pp_mesh=parallel_dims.get_optional_mesh("pp"), ep_enabled=parallel_dims.ep_enabled)
    for read in runtime_reads:
        if read.where == host_reads.BEFORE_OPTIMIZER:
            recorder.host_read(read.site)
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    for site in host_reads.logged_reads(parallel_dims.dp_cp_enabled):  # --metrics.log_freq 1: every step logs
        recorder.host_read(site)
    recorder.phase = "forward"
    recorder.mark("reset_peaks")  # torchtitan logs every step here (--metrics.log_freq 1) and resets its peaks


def _categorize(trainer, recorder) -> None:
    """Name what each allocation was: parameters, gradients and optimizer states by identity at the end,
    the rest by where it was made and how long it lived."""
    _name_state(trainer, recorder)
    allocations = recorder.trace.allocations
    collective_outputs = {i for op in recorder.trace.ops if op.kind == "collective" for i in op.outputs}
    for allocation in allocations:
        if allocation.category:
            continue
        if allocation.stream != 0 or allocation.id in collective_outputs:
            allocation.category = "communication"
        elif allocation.phase == "forward":
            allocation.category = "activations"
        elif allocation.phase == "setup":
            allocation.category = "parameters"
        else:
            allocation.category = "temporaries"


def _name_state(trainer, recorder) -> None:
    """Name the allocations that hold parameters, gradients and optimizer states now (by identity)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(tensor):
        return tensor._local_tensor if isinstance(tensor, DTensor) else tensor

    allocations = recorder.trace.allocations

    def name(tensor, category):
        allocation_id = recorder._ids.get(getattr(local(tensor).untyped_storage(), "_cdata", None))
        if allocation_id is not None:
            allocations[allocation_id].category = category

    for part in trainer.model_parts:
        for tensor in (*part.parameters(), *part.buffers()):
            name(tensor, "parameters")
        for parameter in part.parameters():
            if parameter.grad is not None:
                name(parameter.grad, "gradients")
    for optimizer in trainer.optimizers.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    name(value, "optimizer states")


def run(argv: list[str], *, world_size: int, rank: int, steps: int = 2, selection: str = "",
        units: int | None = None, microbatches: tuple[int, int] | None = None) -> RoleResult:
    """Build the job for ``rank`` of ``world_size`` and record ``steps`` training steps (a fresh process).
    With ``units``, the model keeps that many repeats of its layer block per pipeline stage
    (:mod:`npu_inject.planner.depth`); ``info["depth"]`` then describes the full model. With ``microbatches``
    (fewer, more), a pipeline job's steps before its last warm up with the microbatches it was built with, its last
    runs with the fewer, and one more step with the more (:func:`split_grown` parts the two)."""
    # torchtitan's fake process group takes its size from NGPU and this rank from RANK.
    os.environ.update({**environment(selection), "NGPU": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"})
    from npu_inject import runtime

    runtime.activate()
    import torch
    import torchtitan.trainer as titan_trainer
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_inject.planner.interventions import NotBuilt, planner_changes
    from npu_inject.planner.trace import Recorder

    # Recordings run side by side: each writes the runtime's report into a folder of its own, removed after.
    # --debug.seed when absent: otherwise rank 0 broadcasts a seed it reads back.
    dump_folder = tempfile.TemporaryDirectory(prefix="npu_inject_plan_")
    argv = with_flags(argv, [*FORCED_FLAGS, "--dump_folder", dump_folder.name,
                             *([] if "--debug.seed" in argv else ["--debug.seed", "0"])])
    config = guard(argv, world_size)
    # The learning-rate schedule must reach the steps recorded: a job of fewer (--training.steps 1) is planned
    # as its steps, torchtitan's scheduler refusing to decay over zero steps otherwise.
    config.training.steps = max(config.training.steps, steps)
    # Planned as eager: dynamo would skip every frame under the planner's dispatch modes, which torch 2.14
    # refuses for torchtitan's fullgraph blocks ("found no compiled frames").
    compiled, config.compile.enable = bool(config.compile.enable), False
    replica_groups = one_replica_group(config)
    shape = None
    if units is not None:
        from npu_inject.planner import depth

        shape = depth.shape(config)
        if shape is None:
            raise PlanError(f"{config.model_spec.name} {config.model_spec.flavor}: its layers do not repeat; "
                            "it can only be planned at full depth")
        depth.reduce(config, shape, units)
    config.tokenizer = NotBuilt("the tokenizer")
    config.dataloader = NotBuilt("the data loader")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = Recorder(fake_mode, {torch.cpu.current_stream(): 0})
    if config.parallelism.pipeline_parallel_degree > 1:
        recorder.keep_events()  # a middle stage's recording may stand for others (npu_inject.planner.stages)
    context = planner_changes(recorder, fake_mode, config)
    try:
        trainer = titan_trainer.Trainer(config)
        info = {**_role_info(trainer), "compile": compiled, "replica_groups": replica_groups}
        if info["parallel"]["ep"] > 1 and info["experts"]:
            from npu_inject.planner import expert_load

            load = expert_load.from_environment()
            info["expert_load"] = {"ratio": load.ratio(info["parallel"]["ep"], info["experts"]), "source": load.source}
        groups = min(trainer.gradient_accumulation_steps, 2)
        reads = host_reads.runtime_reads(runtime.current().selection.enabled, world_size,
                                         torchft=replica_groups > 1)
        schedules = []  # each schedule's receive buffers: (its microbatches, their allocation ids)
        for step in range(1, steps + 1):
            if microbatches is not None and step == steps \
                    and microbatches[0] != trainer.num_pipeline_parallel_microbatches:
                schedules.append(_grow_pipeline(trainer, recorder, microbatches[0]))
            _step(trainer, recorder, step, groups, reads)
            _name_state(trainer, recorder)  # this step's gradients, which the next may free and make again
        if microbatches is not None:
            info["fewer"] = _pipeline_batch(trainer)
            schedules.append(_grow_pipeline(trainer, recorder, microbatches[1]))
            _step(trainer, recorder, steps + 1, groups, reads)
            info["grown"] = _pipeline_batch(trainer)
            held = (recorder.allocation_of(buffer) for buffer in _receive_buffers(trainer.pp_schedule))
            schedules.append((trainer.num_pipeline_parallel_microbatches, [i for i in held if i is not None]))
            info["receive_buffers"] = schedules
        _categorize(trainer, recorder)
    finally:
        context.restore()
        runtime.current().clear_dump_folder()
        dump_folder.cleanup()
    info.update(gradient_accumulation_steps=trainer.gradient_accumulation_steps, groups_recorded=groups,
                steps_recorded=steps, units=units, shape=shape)
    return RoleResult(rank, world_size, recorder.trace, info)


def _pipeline_batch(trainer) -> dict[str, int]:
    """The batch facts a pipeline's schedule runs now (they change with :func:`_grow_pipeline`)."""
    return {"local_batch_size": trainer.config.training.local_batch_size,
            "global_batch_size": trainer.config.training.global_batch_size,
            "pp_microbatches": trainer.num_pipeline_parallel_microbatches}


def _schedule_stages(schedule) -> list:
    return getattr(schedule, "_stages", None) or [schedule._stage]


def _receive_buffers(schedule) -> list:
    """The buffers a pipeline schedule's stages receive activations and gradients into, one set per microbatch,
    made at the schedule's first step."""
    return [info.buffer for stage in _schedule_stages(schedule)
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
            for info in infos if getattr(info, "buffer", None) is not None]


def _grow_pipeline(trainer, recorder, microbatches: int) -> tuple[int, list[int]]:
    """Give the trainer's pipeline schedule ``microbatches`` per step, as torchtitan builds it for that local
    batch (gradient accumulation kept): the stages, their parameters, gradients and optimizer states stay. The
    old schedule's microbatches and the allocation ids of its receive buffers."""
    from torchtitan.distributed import pipeline_parallel

    training, parallelism = trainer.config.training, trainer.config.parallelism
    local_batches_per_step = training.global_batch_size // training.local_batch_size  # data parallel x accumulated
    training.local_batch_size = parallelism.pipeline_parallel_microbatch_size * microbatches
    training.global_batch_size = training.local_batch_size * local_batches_per_step
    schedule, old = trainer.pp_schedule, trainer.num_pipeline_parallel_microbatches
    stages = _schedule_stages(schedule)
    # The fewer microbatches' receive buffers: the new schedule makes its own. Something of the last step's
    # autograd state still holds a few of them, so they are recorded as freed here, as a job that ran the more
    # microbatches from the start never had them.
    released = [recorder.release(buffer) for buffer in _receive_buffers(schedule)]
    for stage in stages:
        stage.args_recv_info.clear()
        stage.grad_recv_info.clear()
    trainer.pp_schedule = pipeline_parallel._build_pipeline_schedule(
        parallelism=parallelism, local_batch_size=training.local_batch_size, stages=stages, loss_fn=trainer.loss_fn)
    trainer.num_pipeline_parallel_microbatches = microbatches
    return old, [i for i in released if i is not None]


def split_grown(result: RoleResult) -> tuple[RoleResult, RoleResult]:
    """A recording made with ``microbatches`` as two: its first ``steps`` (the last with the fewer microbatches,
    those before it warming up), and its last step with the more (each with the steps whose peaks count,
    ``info["peak_steps"]``)."""
    steps = result.info["steps_recorded"]
    info = {name: value for name, value in result.info.items() if name not in ("fewer", "grown")}
    fewer = {**info, **result.info["fewer"], "peak_steps": [f"step {step}" for step in range(1, steps + 1)]}
    more = {**info, **result.info["grown"], "steps_recorded": steps + 1, "peak_steps": [f"step {steps + 1}"]}
    return replace(result, info=fewer), replace(result, info=more)


def _role_info(trainer) -> dict[str, Any]:
    dims = trainer.parallel_dims
    config = trainer.config
    return {
        "parallel": {name: getattr(dims, name) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")},
        "flops_per_token": trainer.metrics_processor.num_flops_per_token,
        "local_batch_size": config.training.local_batch_size,
        "global_batch_size": config.training.global_batch_size,
        "seq_len": config.training.seq_len,
        "pp_microbatches": trainer.num_pipeline_parallel_microbatches,
        "pp_first_stage": getattr(trainer, "pp_has_first_stage", True),
        "pp_last_stage": getattr(trainer, "pp_has_last_stage", True),
        "pp_schedule": config.parallelism.pipeline_parallel_schedule if dims.pp_enabled else None,
        "dtype": config.training.mixed_precision_param,
        "compile": bool(config.compile.enable),
        "activation_checkpoint": activation_checkpoint_mode(config),
        "experts": experts(config),
    }

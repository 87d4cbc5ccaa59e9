"""One rank of a torchtitan job, built and stepped on fake tensors: the planner's measurement.

The job is parsed from the same torchtitan flags the training command takes and built by
torchtitan's own ``Trainer`` in one process that stands for rank ``rank`` of ``world_size`` (a fake
process group, as torchtitan's ``--comm.mode fake_backend`` dry run), through this runtime's patches,
with every tensor a FakeTensor: nothing is allocated or computed. A :class:`~npu_inject.planner.trace.Recorder`
sees the whole of it, from the model's materialisation to the end of the last step.

What the session changes, and why (recorded and undone like a patch's changes):

* ``Trainer.init_distributed``: the fake tensor mode and the recorder start once the process group
  exists; ``DeviceMesh`` construction, flattening and slicing run outside the mode (a mesh reads its
  ranks from a real tensor).
* ``BaseModel.init_weights``: initialisation is skipped (its rejection sampling reads values back);
  it allocates only temporaries, which the allocator model does not see as a result.
* ``document_ends_from_positions`` (attention patch and ops) and upstream's
  ``create_varlen_metadata_for_document`` (wherever torchtitan bound it): every sequence is one document,
  read from the positions' shape instead of their values (upstream's nonzero has no fake output shape);
  the varlen metadata carries its host offsets.
* the gated delta rule's reference (qwen3_5): its sequences, one per row of the batch, all of one length.
* a multimodal model's ``special_tokens`` (qwen3_5): a text-only batch, every id one no token has.
* ``DeviceMemoryMonitor``: its ``reset_peak_memory_stats``/``empty_cache`` calls become trace marks, so
  the replay resets its peaks where torchtitan does.
* the tokenizer and the data loader are not built: the session feeds token batches of the
  configured shape itself.
* context parallel's sequence positions (read back and all-gathered to plan each rank's attention):
  computed from torch's head-tail balancer (PTRR's order depends on the mask; head-tail stands for it).
* FSDP's ``_chunk_with_empty``: the chunks of a parameter are cut when FSDP reads one (it reads this
  rank's and the first), not all at once.
* expert parallel's token counts, which each rank reads back to size its all-to-all: routing is
  assumed balanced (every rank sends and receives tokens x top_k / ep rows), the device-to-host
  copies of the counts still made as upstream makes them.
* a pipeline stage's input/output metadata (which ranks exchange before the first step, and a fake
  process group cannot) is given statically: the first stage takes the token batch, the others the
  residual stream torchtitan's decoders pass between stages, (microbatch, sequence / cp / (tp with
  sequence parallel), dim) in the compute dtype; outputs come from running the stage on that input.

The runtime runs the CPU rehearsal's patches (the NPU target's code paths, with the NPU kernels'
fakes), less those whose work is a probe or a host-side choice: ``rehearsal_dtype`` (the NPU keeps
bf16), ``optimizer`` (its probe steps a real optimizer; the NPU runs torchtitan's fused AdamW, as on
the emulation) and ``model_guard``, whose checks the planner runs itself except the data set's
presence (no data is read). ``compile`` is planned as eager (noted in the result).
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

PLANNER_EXCLUDED = ("rehearsal_dtype", "optimizer", "model_guard")
FORCED_FLAGS = ("--comm.mode", "fake_backend", "--checkpoint.no-enable", "--validator.no-enable",
                "--metrics.log_freq", "1")


class PlanError(Exception):
    """The job cannot be planned as asked: one line saying why (torchtitan's or model_guard's message)."""


@dataclass
class RoleResult:
    rank: int
    world_size: int
    trace: Any  # trace.Trace
    info: dict[str, Any] = field(default_factory=dict)


class _NotBuilt:
    """Stands for a config whose ``build`` the planner must not run (tokenizer, data loader)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def build(self, *args, **kwargs):
        return None

    def __getattr__(self, name):  # torchtitan reads a few fields (e.g. for its log line)
        raise AttributeError(f"{self.what} is not built by npu-inject plan ({name})")


def with_flags(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` with ``flags`` added before its subcommands (tyro's ``activation-checkpoint:MODE`` stays last).
    ``--debug.seed`` is set when absent: otherwise rank 0 broadcasts a seed it reads back."""
    first = next((i for i, arg in enumerate(argv) if not arg.startswith("-") and ":" in arg), len(argv))
    return [*argv[:first], *flags, *argv[first:]]


def environment(selection: str = "") -> dict[str, str]:
    """The runtime's settings for a recording: the rehearsal target, the user's ``selection`` of patches
    (``TORCHTITAN_NPU_PATCHES`` syntax) less the planner's exclusions."""
    excluded = ",".join(f"-{patch_id}" for patch_id in PLANNER_EXCLUDED)
    return {"TORCHTITAN_NPU": "cpu", "TORCHTITAN_NPU_PATCHES": f"{selection},{excluded}" if selection else excluded}


def _parse(argv: list[str]):
    """torchtitan's configuration for ``argv``, or PlanError with torchtitan's (tyro's) own message."""
    import contextlib
    import io

    from torchtitan.config import ConfigManager

    from npu_inject.patches import model_guard

    _, config_name = model_guard.selection(argv)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            return ConfigManager().parse_args(argv)
    except (ImportError, ValueError) as exc:
        problem = model_guard.quantization_problem(exc, config_name, "npu")
        raise PlanError(problem or f"torchtitan refused the configuration: {exc}") from None
    except SystemExit:
        # tyro prints a titled panel (a box on a terminal, rules otherwise) after whatever torchtitan
        # printed: keep the panel's words.
        lines = [line.strip(" │╭╮╰╯─┃━┏┓┗┛-") for line in printed.getvalue().splitlines()]
        rules = [i for i, line in enumerate(printed.getvalue().splitlines()) if line.strip() and not lines[i]]
        panel = lines[max(rules[0] - 1, 0):] if rules else lines
        message = "; ".join(line for line in panel if line and not line.startswith(("For full helptext", "usage:", "/")))
        raise PlanError(f"torchtitan refused the command line: {message or 'see --help'}") from None


def _guard(argv: list[str], world_size: int):
    """model_guard's start-up checks for the NPU target, but the data set's presence, and the layout
    against the world size; the parsed configuration."""
    from npu_inject.patches import model_guard

    family, config_name = model_guard.selection(argv)
    problem = model_guard.family_problem(family, "npu")
    if problem:
        raise PlanError(problem)
    config = _parse(argv)
    problem = (model_guard.optimizer_problem(config, config_name, "npu") or model_guard.override_problem(config, "npu")
               or layout_problem(config.parallelism, world_size))
    if problem:
        raise PlanError(problem)
    return config


def layout_problem(parallelism, world_size: int) -> str | None:
    """Why torchtitan would refuse these degrees on ``world_size`` ranks, in one line; None if it would not."""
    names = {"dp_replicate": parallelism.data_parallel_replicate_degree, "cp": parallelism.context_parallel_degree,
             "tp": parallelism.tensor_parallel_degree, "pp": parallelism.pipeline_parallel_degree}
    fixed = names["dp_replicate"] * names["cp"] * names["tp"] * names["pp"]
    shown = " x ".join(f"{name} {degree}" for name, degree in names.items())
    dp_shard = parallelism.data_parallel_shard_degree
    if dp_shard == -1:
        if world_size % fixed:
            return (f"the layout's degrees ({shown} = {fixed}) do not divide the {world_size} ranks "
                    "(--parallelism.data_parallel_shard_degree -1 takes the rest)")
        dp_shard = world_size // fixed
    elif fixed * dp_shard != world_size:
        return (f"the layout's degrees ({shown} x dp_shard {dp_shard} = {fixed * dp_shard}) are not the "
                f"{world_size} ranks planned")
    ep = parallelism.expert_parallel_degree
    if ep > 1 and (dp_shard * names["cp"] * names["tp"]) % ep:
        return (f"--parallelism.expert_parallel_degree {ep} does not divide dp_shard {dp_shard} x cp {names['cp']} "
                f"x tp {names['tp']} = {dp_shard * names['cp'] * names['tp']} (torchtitan borrows experts' ranks "
                "from these)")
    return None


def describe(argv: list[str], world_size: int) -> dict[str, Any]:
    """What the layout search needs to know of the job: the model's shape and the batch it trains on."""
    config = _guard(with_flags(argv, list(FORCED_FLAGS)), world_size)
    model = config.model_spec.model
    layers = getattr(model, "layers", None) or []
    last = layers[-1] if layers else None
    attention = getattr(last, "attention", None)
    moe = getattr(last, "moe", None)
    parallelism, training = config.parallelism, config.training
    dp = world_size // (parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
                        * parallelism.pipeline_parallel_degree)
    return {
        "model": f"{config.model_spec.name} {config.model_spec.flavor}",
        "layers": len(layers),
        "heads": getattr(attention, "n_heads", None),
        "kv_heads": getattr(attention, "n_kv_heads", None) or getattr(attention, "n_heads", None),
        "experts": getattr(moe, "num_experts", None) if moe is not None else None,
        "seq_len": training.seq_len,
        "local_batch_size": training.local_batch_size,
        "global_batch_size": training.global_batch_size if training.global_batch_size > 0
        else training.local_batch_size * dp,
        "microbatch_size": parallelism.pipeline_parallel_microbatch_size,
        "pp_schedule": parallelism.pipeline_parallel_schedule,
        "activation_checkpoint": type(config.activation_checkpoint).__qualname__.split(".")[0]
        if config.activation_checkpoint is not None else "none",
    }


def _stage_metadata(config, model_config, stages, args, kwargs) -> None:
    """Static metadata for the pipeline stages on this rank that lack it (see the module docstring)."""
    import torch
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    parallelism = config.parallelism
    sequence = config.training.seq_len // parallelism.context_parallel_degree
    if parallelism.tensor_parallel_degree > 1 and parallelism.enable_sequence_parallel:
        sequence //= parallelism.tensor_parallel_degree
    sharded = parallelism.data_parallel_shard_degree != 1 or parallelism.data_parallel_replicate_degree > 1
    dtype = getattr(torch, config.training.mixed_precision_param if sharded else config.training.dtype)
    for stage in stages:
        if stage._user_meta.is_complete_for_forward():
            continue
        if stage.is_first:
            inputs = tuple(args)
        else:
            inputs = (torch.empty(parallelism.pipeline_parallel_microbatch_size, sequence, model_config.dim,
                                  dtype=dtype, requires_grad=True),)
        with torch.no_grad():
            outputs = stage.submod(*inputs, **(kwargs or {}))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        metas = extract_tensor_metas(inputs), extract_tensor_metas(outputs)
        stage._user_meta = _StageMeta(inputs=metas[0], outputs=metas[1],
                                      input_grads=metas[0] if not stage.is_first else None, output_grads=metas[1])


class _Chunks:
    """FSDP's ``_chunk_with_empty(tensor, num_chunks, dim)``, made on demand: FSDP reads this rank's
    chunk and the first, but the list holds ``num_chunks`` fake views (a thousand per parameter at a
    thousand ranks, a third of a recording's time). Chunks as ``torch.chunk`` cuts them, empty past the end."""

    def __init__(self, tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.count, self.dim = tensor, num_chunks, dim
        self.step = -(-tensor.size(dim) // num_chunks) if tensor.size(dim) else 0

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        if not -self.count <= index < self.count:
            raise IndexError(index)
        index %= self.count
        start, size = index * self.step, self.tensor.size(self.dim)
        if not size:
            return self.tensor.narrow(self.dim, 0, 0)  # torch.chunk of an empty tensor: empty views of it
        if start >= size:
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, size - start))


def _planner_changes(recorder, fake_mode, config):
    """The session's own changes to torchtitan and the runtime (see the module docstring)."""
    import torch
    from torchtitan.components import metrics

    from npu_inject.patching import PatchContext

    from torch.distributed.device_mesh import DeviceMesh

    # Every function of DeviceMesh (construction, flattening, slicing, process groups) runs outside the
    # fake mode: a mesh holds its ranks in a real tensor and reads them back.
    mesh_targets = tuple(f"torch.distributed.device_mesh:DeviceMesh.{name}" for name, value in vars(DeviceMesh).items()
                         if callable(getattr(value, "__func__", value)) and not isinstance(value, type)
                         and (not name.startswith("__") or name in ("__init__", "__getitem__")))
    # Every module that bound upstream's varlen metadata maker (the decoders, qwen3_5's gated delta net).
    from torchtitan.models.common import attention as common_attention

    varlen_makers = tuple(f"{name}:create_varlen_metadata_for_document" for name, module in list(sys.modules.items())
                          if name.startswith("torchtitan.") and getattr(module, "create_varlen_metadata_for_document",
                                                                        None) is common_attention.create_varlen_metadata_for_document)
    context = PatchContext("planner", "cpu", {}, declared_targets=mesh_targets + varlen_makers + (
        "torchtitan.trainer:Trainer.init_distributed",
        "torchtitan.protocols.model:BaseModel.init_weights",
        "npu_inject.patches.attention:document_ends_from_positions",
        "npu_inject.ops.attention:document_ends_from_positions",
        "torchtitan.components.metrics:DeviceMemoryMonitor.reset_peak_stats",
        "torchtitan.components.metrics:DeviceMemoryMonitor.__init__",
        "torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_non_cached",
        "torch:UntypedStorage.resize_",
        "torch.distributed.pipelining.schedules:_PipelineSchedule._initialize_pp_stages",
        "torchtitan.distributed.parallel_dims:init_device_mesh",
        "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher.dispatch",
        "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._sync_token_count_exchange",
        "npu_inject.patches.context_parallel:exchange_positions",
        "torch.distributed.fsdp._fully_shard._fsdp_param:_chunk_with_empty",
        "spmd_types._checker:_ShardPropagator._get_mesh",
        "npu_inject.ops.gated_delta_net:npu_chunk_gated_delta_rule",
    ))

    def init_distributed(original, trainer, *args, **kwargs):
        parallel_dims = original(trainer, *args, **kwargs)
        fake_mode.__enter__()
        recorder.__enter__()
        context.add_cleanup(lambda: (recorder.__exit__(None, None, None), fake_mode.__exit__(None, None, None)))
        return parallel_dims

    def document_ends(positions_BL):
        rows, length = positions_BL.shape
        return tuple(range(length, rows * length + 1, length))

    def varlen_metadata(positions_BL, *, include_host_offsets: bool = False):
        # The planner's batch is one document per row (positions 0..L-1); upstream finds the boundaries
        # with nonzero, whose output shape fake tensors cannot know. The host offsets always: without
        # them the attention patch reads them back (tolist), which fake tensors cannot give either.
        rows, length = positions_BL.shape
        ends = tuple(range(0, rows * length + 1, length))
        cu_seq = torch.tensor(ends, dtype=torch.int32, device=positions_BL.device)
        return common_attention.VarlenMetadata(cu_seq, cu_seq, length, length, ends)

    for target in varlen_makers:
        context.replace(target, varlen_metadata)

    def gated_delta_rule(original, query, key, value, *, actual_seq_lengths=None, **kwargs):
        # The reference loops over the sequences, reading their lengths: here every sequence is one row
        # of the planner's batch, all of one length, which a fake tensor cannot give back.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        if actual_seq_lengths is not None:
            sequences = actual_seq_lengths.shape[0]
            with unset_fake_temporarily():
                actual_seq_lengths = torch.full((sequences,), query.shape[0] // sequences, dtype=torch.int64)
        return original(query, key, value, actual_seq_lengths=actual_seq_lengths, **kwargs)

    import npu_inject.ops.gated_delta_net  # noqa: F401 (named in the targets)

    context.wrap("npu_chunk_gated_delta_rule", gated_delta_rule)

    def monitor_init(original, monitor, *args, **kwargs):
        original(monitor, *args, **kwargs)
        recorder.mark("reset_peaks")
        recorder.mark("empty_cache")

    def reset_peak_stats(original, monitor):
        recorder.mark("reset_peaks")

    def propagate_tensor_meta(original, *args, **kwargs):
        # DTensor derives output shapes by running the op on global-shape tensors in the active fake
        # mode, ours: not this rank's memory or work.
        recorder.paused += 1
        try:
            return original(*args, **kwargs)
        finally:
            recorder.paused -= 1

    def chunk_with_empty(tensor, num_chunks: int, dim: int):
        return _Chunks(tensor, num_chunks, dim)

    context.replace("_chunk_with_empty", chunk_with_empty)
    context.wrap("Trainer.init_distributed", init_distributed)
    context.replace("BaseModel.init_weights", lambda model, *args, **kwargs: None)
    context.replace("npu_inject.patches.attention:document_ends_from_positions", document_ends)
    context.replace("npu_inject.ops.attention:document_ends_from_positions", document_ends)  # muse_glimmer's masks
    context.wrap("DeviceMemoryMonitor.__init__", monitor_init)
    context.wrap("DeviceMemoryMonitor.reset_peak_stats", reset_peak_stats)
    context.wrap("ShardingPropagator._propagate_tensor_meta_non_cached", propagate_tensor_meta)

    original_resize = torch.UntypedStorage.resize_  # a C method: replaced, not wrapped

    def storage_resize(storage, nbytes):
        result = original_resize(storage, nbytes)
        recorder.resized(storage, nbytes)
        return result

    context.replace("UntypedStorage.resize_", storage_resize)

    def initialize_pp_stages(original, schedule, stages, args, kwargs, *rest, **keywords):
        if not recorder.paused:
            recorder.paused += 1  # working out shapes, not this rank's step
            try:
                _stage_metadata(config, config.model_spec.model, stages, args, kwargs)
            finally:
                recorder.paused -= 1
        return original(schedule, stages, args, kwargs, *rest, **keywords)

    context.wrap("_PipelineSchedule._initialize_pp_stages", initialize_pp_stages)

    def real_tensors(original, *args, **kwargs):
        # A device mesh holds its ranks in a real tensor and reads them back.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        recorder.paused += 1
        try:
            with unset_fake_temporarily():
                return original(*args, **kwargs)
        finally:
            recorder.paused -= 1

    # spmd_types' type checker (--debug.spmd_typechecking) builds 1-D meshes over torch.arange itself.
    for target in (*mesh_targets, "torchtitan.distributed.parallel_dims:init_device_mesh",
                   "spmd_types._checker:_ShardPropagator._get_mesh"):
        context.wrap(target, real_tensors)

    routed_rows: list[int] = []  # this rank's T x top_k of the dispatch in progress

    def dispatch(original, dispatcher, x_TD, *args, **kwargs):
        routed_rows.append(x_TD.shape[0] * dispatcher.top_k)
        try:
            return original(dispatcher, x_TD, *args, **kwargs)
        finally:
            routed_rows.pop()

    def sync_token_count_exchange(original, dispatcher, num_local_tokens_per_expert_E,
                                  num_global_tokens_per_local_expert_EP_e, ep_size):
        # Upstream's tensor work (the counts' device-to-host copies), then balanced split sizes where
        # upstream reads the counts back.
        num_global_E = torch.ops._c10d_functional.wait_tensor(num_global_tokens_per_local_expert_EP_e).reshape(-1)
        num_local_tokens_per_expert_E.view(ep_size, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=True)
        num_global_E.view(ep_size, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=False)
        rows = routed_rows[-1]
        balanced = [rows // ep_size + (1 if peer < rows % ep_size else 0) for peer in range(ep_size)]
        return num_global_E, balanced, list(balanced)

    def exchange_positions(local_positions_Bl, cp_mesh, load_balancer_type):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

        ranks, local = cp_mesh.size(), local_positions_Bl.shape[-1]
        with unset_fake_temporarily():
            order = (list(range(local * ranks)) if load_balancer_type in (None, "none") else
                     _HeadTailLoadBalancer(local * ranks, ranks, "cpu")._generate_indices().flatten().tolist())
        rank = cp_mesh.get_local_rank()
        return tuple(order[rank * local:(rank + 1) * local]), tuple(order)

    import npu_inject.patches.context_parallel  # noqa: F401 (imported with torchtitan.trainer; named here)

    context.replace("exchange_positions", exchange_positions)
    context.wrap("AllToAllTokenDispatcher.dispatch", dispatch)
    context.wrap("AllToAllTokenDispatcher._sync_token_count_exchange", sync_token_count_exchange)

    from npu_inject.ops import planning

    planning.announce = recorder.kernel
    context.add_cleanup(lambda: setattr(planning, "announce", None))
    del metrics
    return context


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


def _step(trainer, recorder, step: int, groups_recorded: int) -> None:
    import torch
    from torchtitan.distributed import utils as dist_utils

    config, parallel_dims = trainer.config, trainer.parallel_dims
    recorder.mark(f"step {step}")
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
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    recorder.phase = "forward"
    recorder.mark("reset_peaks")  # torchtitan logs every step here (--metrics.log_freq 1) and resets its peaks


def _categorize(trainer, recorder) -> None:
    """Name what each allocation was: parameters, gradients and optimizer states by identity at the end,
    the rest by where it was made and how long it lived."""
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


def run(argv: list[str], *, world_size: int, rank: int, steps: int = 2, selection: str = "",
        units: int | None = None) -> RoleResult:
    """Build the job for ``rank`` of ``world_size`` and record ``steps`` training steps (a fresh process).
    With ``units``, the model keeps that many repeats of its layer block per pipeline stage
    (:mod:`npu_inject.planner.depth`); ``info["depth"]`` then describes the full model."""
    # torchtitan's fake process group takes its size from NGPU and this rank from RANK.
    os.environ.update({**environment(selection), "NGPU": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"})
    from npu_inject import runtime

    runtime.activate()
    import torch
    import torchtitan.trainer as titan_trainer
    from torch._subclasses.fake_tensor import FakeTensorMode

    import npu_inject.patches.attention  # noqa: F401 (the session changes one of its names)
    from npu_inject.planner.trace import Recorder

    # Recordings run side by side: each writes the runtime's report into a folder of its own, removed after.
    dump_folder = tempfile.TemporaryDirectory(prefix="npu_inject_plan_")
    argv = with_flags(argv, [*FORCED_FLAGS, "--dump_folder", dump_folder.name,
                             *([] if "--debug.seed" in argv else ["--debug.seed", "0"])])
    config = _guard(argv, world_size)
    # Planned as eager: dynamo would skip every frame under the planner's dispatch modes, which torch 2.14
    # refuses for torchtitan's fullgraph blocks ("found no compiled frames").
    compiled, config.compile.enable = bool(config.compile.enable), False
    shape = None
    if units is not None:
        from npu_inject.planner import depth

        shape = depth.shape(config)
        if shape is None:
            raise PlanError(f"{config.model_spec.name} {config.model_spec.flavor}: its layers do not repeat; "
                            "it can only be planned at full depth")
        depth.reduce(config, shape, units)
    config.tokenizer = _NotBuilt("the tokenizer")
    config.dataloader = _NotBuilt("the data loader")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = Recorder(fake_mode, {torch.cpu.current_stream(): 0})
    context = _planner_changes(recorder, fake_mode, config)
    try:
        trainer = titan_trainer.Trainer(config)
        info = {**_role_info(trainer), "compile": compiled}
        groups = min(trainer.gradient_accumulation_steps, 2)
        for step in range(1, steps + 1):
            _step(trainer, recorder, step, groups)
        _categorize(trainer, recorder)
    finally:
        context.restore()
        runtime.current().dump_dir = None
        dump_folder.cleanup()
    info.update(gradient_accumulation_steps=trainer.gradient_accumulation_steps, groups_recorded=groups,
                steps_recorded=steps, units=units, shape=shape)
    return RoleResult(rank, world_size, recorder.trace, info)


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
    }

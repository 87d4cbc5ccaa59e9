"""The planner's changes to torchtitan, torch and this runtime while it records a rank's step on fake tensors.

Upstream's functions are changed as a patch changes them (a :class:`~npu_inject.patching.PatchContext`
with its declared targets); this project's own code is changed only through the hooks it asks
(:mod:`npu_inject.ops.planner_hooks`), installed here and removed with the context.

What the planner changes, and why (recorded and undone like a patch's changes):

* ``Trainer.init_distributed``: the fake tensor mode and the recorder start once the process group
  exists; ``DeviceMesh`` construction, flattening and slicing run outside the mode (a mesh reads its
  ranks from a real tensor).
* ``BaseModel.init_weights``: initialisation is skipped (its rejection sampling reads values back);
  it allocates only temporaries, which the allocator model does not see as a result.
* the packed documents' ends (hook ``document_ends``, asked for by the attention patch and muse_glimmer's
  masks) and upstream's ``create_varlen_metadata_for_document`` (wherever torchtitan bound it): every
  sequence is one document, read from the positions' shape instead of their values (upstream's nonzero
  has no fake output shape); the varlen metadata carries its host offsets.
* the gated delta rule's sequence lengths (hook ``gated_delta_rule_lengths``, qwen3_5): one sequence per
  row of the batch, all of one length.
* a multimodal model's ``special_tokens`` (qwen3_5; in the session's batch): a text-only batch, every id
  one no token has.
* ``DeviceMemoryMonitor``: its ``reset_peak_memory_stats``/``empty_cache`` calls become trace marks, so
  the replay resets its peaks where torchtitan does.
* the tokenizer and the data loader are not built (:class:`NotBuilt`): the session feeds token batches
  of the configured shape itself.
* context parallel's sequence positions (hook ``cp_positions``; the patch reads them back and all-gathers
  them to plan each rank's attention): computed from torch's head-tail balancer (PTRR's order depends on
  the mask; head-tail stands for it).
* FSDP's ``_chunk_with_empty``: the chunks of a parameter are cut when FSDP reads one (it reads this
  rank's and the first), not all at once.
* expert parallel's token counts, which each rank reads back to size its all-to-all: the planned rank is the
  busiest (it sends tokens x top_k / ep rows to each peer, as every rank does, and receives the load ratio of
  ``npu-inject plan --expert-load`` times that, :mod:`npu_inject.planner.expert_load`; balanced without it), the
  device-to-host
  copies of the counts still made as upstream makes them, and the read marked (the host waits there).
* a pipeline stage's input/output metadata (which ranks exchange before the first step, and a fake
  process group cannot) is given statically: the first stage takes the token batch, the others the
  residual stream torchtitan's decoders pass between stages, (microbatch, sequence / cp / (tp with
  sequence parallel), dim) in the compute dtype; outputs come from running the stage on that input.
* torch's 1F1B schedule (``Schedule1F1B._step_microbatches``), each microbatch's forward and backward on a
  stage and each batch of sends and receives: marked in the trace where they begin and end, so that one middle
  stage's recording can be laid out in another's order (:mod:`npu_inject.planner.stages`).
* the NPU kernels' planning fakes (:mod:`npu_inject.ops.planning`, hook ``announce``): each call is one
  kernel launch the recorder counts, with the bytes it reads and writes.
"""

from __future__ import annotations

import sys


class NotBuilt:
    """Stands for a config whose ``build`` the planner must not run (tokenizer, data loader)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def build(self, *args, **kwargs):
        return None

    def __getattr__(self, name):  # torchtitan reads a few fields (e.g. for its log line)
        raise AttributeError(f"{self.what} is not built by npu-inject plan ({name})")


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


def planner_changes(recorder, fake_mode, config):
    """The planner's changes (see the module docstring), applied: the context whose ``restore`` undoes them."""
    import torch
    from torchtitan.components import metrics

    from npu_inject.ops import planner_hooks
    from npu_inject.patching import PatchContext
    from npu_inject.planner import expert_load, host_reads
    from npu_inject.planner.config import activation_checkpoint_mode

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
        "torchtitan.components.metrics:DeviceMemoryMonitor.reset_peak_stats",
        "torchtitan.components.metrics:DeviceMemoryMonitor.__init__",
        "torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_non_cached",
        "torch:UntypedStorage.resize_",
        "torch.distributed.pipelining.schedules:_PipelineSchedule._initialize_pp_stages",
        "torchtitan.distributed.parallel_dims:init_device_mesh",
        "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher.dispatch",
        "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._sync_token_count_exchange",
        "torch.distributed.fsdp._fully_shard._fsdp_param:_chunk_with_empty",
        "spmd_types._checker:_ShardPropagator._get_mesh",
        "torch.distributed.pipelining.schedules:Schedule1F1B._step_microbatches",
        "torch.distributed.pipelining.schedules:_batch_p2p",
        "torch.distributed.pipelining.stage:_PipelineStageBase.forward_one_chunk",
        "torch.distributed.pipelining.stage:_PipelineStageBase.backward_one_chunk",
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

    def gated_delta_rule_lengths(lengths_N, tokens: int):
        # The reference loops over the sequences, reading their lengths: here every sequence is one row
        # of the planner's batch, all of one length, which a fake tensor cannot give back.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        sequences = lengths_N.shape[0]
        with unset_fake_temporarily():
            return torch.full((sequences,), tokens // sequences, dtype=torch.int64)

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

    # A 1F1B schedule's parts marked, so that the recording of one middle stage can stand for the others
    # (npu_inject.planner.stages reorders its parts as another stage's schedule runs them).
    from npu_inject.planner import stages as pipeline_stages

    def marked(opening):
        def around(original, *args, **kwargs):
            if recorder.paused:
                return original(*args, **kwargs)
            recorder.mark(opening(*args, **kwargs))
            try:
                return original(*args, **kwargs)
            finally:
                recorder.mark(pipeline_stages.PART_END)
        return around

    context.wrap("Schedule1F1B._step_microbatches", marked(lambda *args, **kwargs: pipeline_stages.SCHEDULE))
    context.wrap("_batch_p2p", marked(lambda *args, **kwargs: pipeline_stages.P2P))
    context.wrap("_PipelineStageBase.forward_one_chunk", marked(
        lambda stage, *args, **kwargs: f"{pipeline_stages.FORWARD} {args[0] if args else kwargs['fwd_chunk_id']}"))
    context.wrap("_PipelineStageBase.backward_one_chunk", marked(
        lambda stage, *args, **kwargs: f"{pipeline_stages.BACKWARD} {args[0] if args else kwargs['bwd_chunk_id']}"))

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
    load = expert_load.from_environment()
    # Recomputation under selective AC takes the split sizes' copies from the forward's saved results (patch
    # selective_ac saves device-to-host copies on any device, upstream only CUDA's): no second read. Full AC reads
    # again, as the CANN emulation counts (deepseek_v3 EP 2, selective: 5 reads a step for 5 MoE layers).
    from npu_inject import runtime

    def d2h_saved() -> bool:
        return (activation_checkpoint_mode(config) == "selective"
                and "selective_ac" in runtime.current().ids("applied"))

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
        if not (torch._C._current_graph_task_id() != -1 and d2h_saved()):
            recorder.host_read(host_reads.MOE_SPLITS)  # upstream's .tolist() of the copies: the host waits here
        rows = routed_rows[-1]
        balanced = [rows // ep_size + (1 if peer < rows % ep_size else 0) for peer in range(ep_size)]
        # The planned rank is the busiest (npu-inject plan --expert-load): it sends its own rows as every rank does
        # and receives the load ratio times the balanced share.
        ratio = load.ratio(ep_size, num_local_tokens_per_expert_E.shape[0])
        return num_global_E, balanced, expert_load.receive_splits(rows, ep_size, ratio)

    def exchange_positions(local_positions_Bl, cp_mesh, load_balancer_type):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

        ranks, local = cp_mesh.size(), local_positions_Bl.shape[-1]
        with unset_fake_temporarily():
            order = (list(range(local * ranks)) if load_balancer_type in (None, "none") else
                     _HeadTailLoadBalancer(local * ranks, ranks, "cpu")._generate_indices().flatten().tolist())
        rank = cp_mesh.get_local_rank()
        return tuple(order[rank * local:(rank + 1) * local]), tuple(order)

    context.wrap("AllToAllTokenDispatcher.dispatch", dispatch)
    context.wrap("AllToAllTokenDispatcher._sync_token_count_exchange", sync_token_count_exchange)

    context.add_cleanup(planner_hooks.install(
        announce=recorder.kernel, document_ends=document_ends, cp_positions=exchange_positions,
        gated_delta_rule_lengths=gated_delta_rule_lengths))
    del metrics
    return context

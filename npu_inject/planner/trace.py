"""What one rank's training step dispatches, allocates and communicates, recorded on fake tensors.

:class:`Recorder` is a TorchDispatchMode that sits above the planner's FakeTensorMode and sees every
operator torchtitan's step runs on local tensors (DTensor desugars first; DTensor's own sharding
propagation, which runs under another fake mode, is skipped, as torch's MemTracker does). For each
it keeps the operator, its FLOPs (torch's flop formulas, plus the NPU kernels'), the bytes it reads
and writes, the stream it was issued on, the phase (forward, backward, optimizer) and the module it
ran in; for collectives the kind, the bytes and the ranks of the group. Every new storage is an
allocation, and a weakref callback records when it is freed: the sequence the allocator model
replays (:mod:`npu_inject.planner.allocator`).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

# Operators that create no data of their own (views, metadata): no kernel, no time.
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "as_strided", "expand", "permute", "transpose", "t",
              "squeeze", "unsqueeze", "slice", "select", "alias", "detach", "split", "split_with_sizes",
              "unbind", "chunk", "narrow", "_reshape_alias", "view_as", "unflatten", "flatten",
              "lift_fresh", "_to_copy_meta", "empty", "empty_strided", "empty_like", "new_empty",
              "new_empty_strided", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
              "is_same_size", "resize_", "set_", "_has_same_storage_numel", "wait_tensor",
              "record_stream", "_conj", "_neg_view", "view_as_real", "view_as_complex", "diagonal",
              "movedim", "clone_meta", "_wrapped_call_index"}
# Collective operators (c10d and functional collectives) -> kind.
_COLLECTIVES = {
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier",
}
# FLOPs of the NPU kernels (the rehearsal's custom ops standing for torch_npu's), per call.
_KERNEL_FLOPS: dict[str, Any] = {}


@dataclass
class Op:
    index: int
    name: str  # "aten.mm", "npu_inject.npu_fusion_attention_v3", "c10d._allgather_base_"
    kind: str  # "compute", "view", "collective"
    flops: float
    bytes: int  # bytes read and written
    dtype: str
    phase: str  # "setup", "forward", "backward", "optimizer"
    stream: int
    module: str
    inputs: tuple[int, ...]  # allocation ids read
    outputs: tuple[int, ...]  # allocation ids written (new or in place)
    collective: str | None = None
    group: tuple[int, ...] = ()  # global ranks of the collective's group
    mesh: str = ""  # the device mesh dimension whose group it is ("dp_shard_cp", "cp": torchtitan's names), else ""
    comm_bytes: int = 0  # the collective's payload: the full (gathered) tensor for all-gather/reduce-scatter
    peer: int | None = None  # send/recv: the other end's rank within the group
    blocking: bool = False  # a c10d collective issued with async_op=False: its stream waits for it
    views: int = 0  # view operators issued since the previous op (host time only; not recorded one by one)
    # The kernel's shape as its measured rates are looked up (npu_inject.kernel_rates): a matmul's (M, N, K),
    # a grouped matmul's (rows per group, N, K), the fused attention's (sequence, head dim, causal).
    shape: tuple = ()


@dataclass
class Allocation:
    id: int
    nbytes: int
    stream: int
    op: int  # index of the op that allocated it (-1: before recording)
    phase: str
    freed: int | None = None  # index of the first op after it was freed; None: alive at the end
    category: str = ""  # parameters, gradients, optimizer states, activations, temporaries, communication


@dataclass
class Trace:
    ops: list[Op] = field(default_factory=list)
    allocations: list[Allocation] = field(default_factory=list)
    # (op index, event): "reset_peaks" / "empty_cache" where torchtitan calls them, "step <n>" markers
    marks: list[tuple[int, str]] = field(default_factory=list)
    # Everything above in the order it happened, when kept (a pipeline's, :mod:`npu_inject.planner.stages`):
    # (OP, op index), (MARK, position in ``marks``), (ALLOCATED, allocation id), (FREED, allocation id). An
    # allocation's ``op`` and ``freed`` say which ops it lived between, not whether a mark came before or after.
    events: list[tuple[str, int]] | None = None

    def log(self, kind: str, key: int) -> None:
        """One entry of ``events``, when they are kept."""
        if self.events is not None:
            self.events.append((kind, key))

    def free(self, allocation_id: int) -> None:
        """Allocation ``allocation_id`` freed before the next op (once: the first free counts)."""
        allocation = self.allocations[allocation_id]
        if allocation.freed is None:
            allocation.freed = len(self.ops)
            self.log(FREED, allocation_id)


OP, MARK, ALLOCATED, FREED = "op", "mark", "allocated", "freed"


def _storage(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, nested or functional wrappers: not tracked
        return None


class _UncheckedModTracker(ModTracker):
    """torch's ModTracker whose gradient hooks are registered outside spmd_types' checker.

    --debug.spmd_typechecking runs the step under spmd_types' TorchFunctionMode, which has no rule for
    ``Tensor.register_hook`` on a typed tensor and stops the plan. The hooks are the planner's bookkeeping,
    not the model's math, so they bypass the checker; everything the model computes is still checked.

    It also numbers each module's entries (``entered``): in backward ModTracker can hold two modules of one
    depth at once (one's pop hook has not run when the next one's backward begins), and picking one from its
    set followed the string hash, a different module per process (qwen3_30b_a3b's layers.1 was planned 7.5,
    8.0 and 8.6 ms by three runs of one command).
    """

    def __init__(self) -> None:
        super().__init__()
        self.entered: dict[str, int] = {}
        self._entries = itertools.count()

    def _get_append_fn(self, w_mod, name, is_bw):
        append = super()._get_append_fn(w_mod, name, is_bw)

        def numbered(*args):
            self.entered[name] = next(self._entries)
            return append(*args)

        return numbered

    def _fw_pre_hook(self, mod, input):
        with _no_typecheck():
            tensors = [t for t in tree_flatten(input)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            inner = [t for t in tensors if t.grad_fn is not None]
            if len(inner) == len(tensors) or torch._dynamo.eval_frame._is_in_optimized_module():
                return super()._fw_pre_hook(mod, input)  # (which returns at once in a compiled module)
            # torch's pre-hook waits for all inputs' gradients with register_multi_grad_hook(mode="all"), whose
            # closure holds each input's grad_fn; a leaf's is its AccumulateGrad, which holds the leaf, and the
            # hook it carries holds the closure: a cycle gc cannot see, so the leaf and its storage never die.
            # torchtitan's chunked loss feeds lm_head detached views of the final norm's output, so every
            # microbatch's hidden states stayed alive (llama3_70b PP 4, 512 microbatches: 130 GiB that a real
            # run frees). The backward pop waits for the non-leaf inputs' gradients alone (for any gradient
            # when all are leaves), which holds no leaf.
            name = self._get_mod_name(mod)
            module = weakref.ref(mod)
            self._get_append_fn(module, name, False)()
            if self._user_pre_fw_hook is not None:
                self._user_pre_fw_hook(mod, input)
            if not self.is_bw:
                register_multi_grad_hook(inner or tensors, self._get_pop_fn(module, name, True),
                                         mode="all" if inner else "any")
            return None

    def _fw_post_hook(self, mod, input, output):
        with _no_typecheck():
            return super()._fw_post_hook(mod, input, output)


def _no_typecheck():
    """spmd_types' pause when torchtitan's type checker is loaded (a no-op without an active checker)."""
    module = sys.modules.get("spmd_types")
    return module.no_typecheck() if module is not None else contextlib.nullcontext()


class Recorder(TorchDispatchMode):
    """Records ops and allocations under the active FakeTensorMode (see module docstring)."""

    def __init__(self, fake_mode, stream_ids: dict[Any, int]) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.trace = Trace()
        self.phase = "setup"
        self._stream_ids = stream_ids  # torch.cpu.Stream -> small int (0: the default stream)
        # Which module each op runs in, forward, backward and recomputation: torch's module tracker (hooks on
        # every module's forward and on the gradients of its inputs and outputs).
        self._modules = _UncheckedModTracker()
        self._ids: dict[int, int] = {}  # storage _cdata -> allocation id, while alive
        self.paused = 0  # > 0 inside DTensor's sharding propagation (global shapes, not this rank's work)
        self._refs: dict[int, weakref.ref] = {}  # storage _cdata -> weakref whose callback records the free
        self._group_cache: dict[Any, tuple[tuple[int, ...], str]] = {}  # group -> its ranks, its mesh dimension
        self._views = 0  # views since the last recorded op

    def __enter__(self):
        self._modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._modules.__exit__(*exc_info)

    def _module_of(self) -> str:
        """The innermost module running, by its name in the model ("layers.0.attention.wq"); "" outside any."""
        parents = self._modules.parents
        if len(parents) == 1:  # only ModTracker's "Global"
            return ""
        # The deepest; of those, the one entered last (the op belongs to the backward that began last).
        entered = self._modules.entered
        innermost = max((name for name in parents if name != "Global"),
                        key=lambda name: (name.count("."), entered.get(name, -1)))
        # The first component is the root's class name (FSDPTransformer, Decoder, ...): the model's own names follow.
        return innermost.partition(".")[2]

    # -- storages ---------------------------------------------------------------------------
    def _stream(self) -> int:
        stream = torch.cpu.current_stream()
        return self._stream_ids.setdefault(stream, len(self._stream_ids))

    def track(self, tensor: torch.Tensor, op_index: int = -1, category: str = "") -> int | None:
        """The allocation id of ``tensor``'s storage, recording a new allocation when it is new."""
        if tensor.device.type == "meta":
            return None  # DTensor's sharding propagation: shapes only, no device memory
        storage = _storage(tensor)
        if storage is None:
            return None
        key = storage._cdata
        known = self._ids.get(key)
        if known is not None:
            return known
        allocation = self._allocate(key, storage.nbytes(), op_index, category)
        self._watch(storage, key)
        return allocation.id

    def _allocate(self, key: int, nbytes: int, op_index: int, category: str = "") -> Allocation:
        allocation = Allocation(len(self.trace.allocations), nbytes, self._stream(), op_index, self.phase,
                                category=category)
        self.trace.allocations.append(allocation)
        self._ids[key] = allocation.id
        self.trace.log(ALLOCATED, allocation.id)
        return allocation

    def _watch(self, storage, key: int) -> None:
        """Record the free of whatever allocation the storage holds when the storage itself dies."""
        if key in self._refs:
            return
        trace, ids, refs = self.trace, self._ids, self._refs

        def freed(_ref, key=key):
            refs.pop(key, None)
            current = ids.pop(key, None)
            if current is not None:
                trace.free(current)

        self._refs[key] = weakref.ref(storage, freed)

    def release(self, tensor: torch.Tensor) -> int | None:
        """Record ``tensor``'s memory as freed here, whatever still holds the tensor (it is not used again); the
        allocation id it had, None when it was not tracked."""
        storage = _storage(tensor)
        current = self._ids.pop(storage._cdata, None) if storage is not None else None
        if current is not None:
            self.trace.free(current)
        return current

    def allocation_of(self, tensor: torch.Tensor) -> int | None:
        """The id of the live allocation holding ``tensor``'s storage, None when it is not tracked."""
        storage = _storage(tensor)
        return self._ids.get(storage._cdata) if storage is not None else None

    def resized(self, storage, nbytes: int) -> None:
        """``UntypedStorage.resize_``: FSDP2 frees an unsharded parameter's memory by resizing its storage
        to 0 and allocates it again by resizing it back, the storage object living on throughout."""
        if self.paused:
            return
        key = storage._cdata  # a fake tensor's storage is a meta storage: its device says nothing
        current = self._ids.pop(key, None)
        if current is not None:
            self.trace.free(current)
        if nbytes > 0:
            self._allocate(key, nbytes, len(self.trace.ops))
            self._watch(storage, key)

    def kernel(self, name: str, inputs: tuple, outputs: tuple) -> None:
        """A kernel of :mod:`npu_inject.ops.planning` (its outputs were allocated by ops already
        recorded): one launch reading and writing these tensors."""
        from torch.distributed.tensor import DTensor

        local = [t._local_tensor if isinstance(t, DTensor) else t for t in (*inputs, *outputs)]
        ids = [self.track(t) for t in local]
        nbytes = sum(t.numel() * t.element_size() for t in local)
        self.trace.ops.append(Op(len(self.trace.ops), f"npu_inject.{name}", "compute", 0.0, nbytes,
                                 str(local[-1].dtype).removeprefix("torch."),
                                 "backward" if torch._C._current_graph_task_id() != -1 else self.phase,
                                 self._stream(), self._module_of(),
                                 tuple(i for i in ids[:len(inputs)] if i is not None),
                                 tuple(i for i in ids[len(inputs):] if i is not None), views=self._views))
        self.trace.log(OP, len(self.trace.ops) - 1)
        self._views = 0

    def mark(self, event: str) -> None:
        self.trace.marks.append((len(self.trace.ops), event))
        self.trace.log(MARK, len(self.trace.marks) - 1)

    def keep_events(self) -> None:
        """Log from now on the order in which ops, marks, allocations and frees happen (``Trace.events``)."""
        if self.trace.events is None:
            self.trace.events = []

    def host_read(self, site: str) -> None:
        """The NPU job reads a device value on the host here (:mod:`npu_inject.planner.host_reads`)."""
        from npu_inject.planner.costmodel import HOST_SYNC_MARK

        self.mark(f"{HOST_SYNC_MARK}: {site}")

    # -- ops --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops first
        kwargs = kwargs or {}
        if func is torch.ops._c10d_functional.wait_tensor.default:
            out = args[0]  # eager's wait returns its input; the fake kernel would allocate a new tensor
        else:
            out = func(*args, **kwargs)
        if self.paused or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not self.fake_mode:
            return out  # DTensor's sharding propagation (in this fake mode or its own): not this rank's work
        if func.is_view or func.namespace == "prim":
            # Aliases of storages already tracked: a host-side cost, counted, not recorded (FSDP's
            # sharding alone chunks every parameter into world-size views).
            self._views += 1
            return out
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        index = len(self.trace.ops)
        in_tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        inputs = tuple(i for i in (self.track(t) for t in in_tensors) if i is not None)
        outputs = tuple(i for i in (self.track(t, index) for t in out_tensors) if i is not None)
        namespace = func.namespace
        short = func._schema.name.split("::")[-1]
        name = f"{namespace}.{short}"
        collective = _COLLECTIVES.get(short) if namespace in ("c10d", "_c10d_functional") else None
        if collective is not None:
            kind = "collective"
        elif short in _NO_KERNEL or namespace == "prim" or all(t.numel() == 0 for t in out_tensors) and not in_tensors:
            kind = "view"
        else:
            kind = "compute"
        nbytes = sum(t.numel() * t.element_size() for t in (*in_tensors, *out_tensors)) if kind == "compute" else 0
        op = Op(index, name, kind, self._flops(func, args, kwargs, out) if kind == "compute" else 0.0, nbytes,
                str(out_tensors[0].dtype).removeprefix("torch.") if out_tensors else "",
                "backward" if torch._C._current_graph_task_id() != -1 else self.phase,
                self._stream(), self._module_of(), inputs, outputs, collective, views=self._views,
                shape=_kernel_shape(func, args, kwargs) if kind == "compute" else ())
        self._views = 0
        if collective is not None:
            op.group, op.mesh, op.comm_bytes = self._collective(func, args, kwargs, in_tensors, out_tensors)
            values = _by_name(func, args, kwargs)
            op.peer = values.get("dst", values.get("src"))
            op.blocking = namespace == "c10d" and values.get("async_op", True) is False
            if collective in ("recv", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
                # c10d's collectives write into tensors they are given: those are what they produce.
                written = [t for t in tree_flatten(values.get("tensors", values.get("output_tensor", values.get(
                    "output_tensors", values.get("output")))))[0] if isinstance(t, torch.Tensor)]
                op.outputs = tuple(dict.fromkeys((*op.outputs, *(i for i in map(self.track, written) if i is not None))))
        self.trace.ops.append(op)
        self.trace.log(OP, index)

    def _flops(self, func, args, kwargs, out) -> float:
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            return float(formula(*args, **kwargs, out_val=out))
        kernel = _KERNEL_FLOPS.get(func._schema.name.split("::")[-1]) if func.namespace == "npu_inject" else None
        return float(kernel(**_by_name(func, args, kwargs))) if kernel is not None else 0.0

    def _collective(self, func, args, kwargs, in_tensors, out_tensors) -> tuple[tuple[int, ...], str, int]:
        import torch.distributed as dist

        group = None
        # The group is the argument the schema names: a functional collective's group_name, or a c10d
        # op's ProcessGroup.
        for position, argument in enumerate(func._schema.arguments):
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            if argument.name == "group_name" and isinstance(value, str):
                group = dist.distributed_c10d._resolve_process_group(value)
                break
            if isinstance(value, torch.ScriptObject):
                group = dist.ProcessGroup.unbox(value)
                break
        known = self._group_cache.get(group)
        if known is None:
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
            # DeviceMesh describes each dimension's group as "mesh_<name>" (torchtitan 0.3's "dp_shard_cp", "cp").
            description = getattr(group, "group_desc", "") or ""
            known = self._group_cache[group] = (ranks, description.removeprefix("mesh_")
                                                if description.startswith("mesh_") else "")
        sizes = [t.numel() * t.element_size() for t in (*in_tensors, *out_tensors)]
        return *known, max(sizes, default=0)


def _kernel_shape(func, args, kwargs) -> tuple:
    """The shape a kernel's measured rate is looked up by (:class:`Op`'s ``shape``); () for other ops."""
    short = func._schema.name.split("::")[-1]
    if func.namespace == "aten":
        if short == "mm":
            a, b = args[0], args[1]
            return (a.shape[0], b.shape[1], a.shape[1])
        if short == "addmm":
            a, b = args[1], args[2]
            return (a.shape[0], b.shape[1], a.shape[1])
        if short in ("bmm", "baddbmm"):
            a, b = (args[0], args[1]) if short == "bmm" else (args[1], args[2])
            return (a.shape[0] * a.shape[1], b.shape[2], a.shape[2])  # the batch as more rows
        if short == "_grouped_mm":
            a, b = args[0], args[1]
            offsets = args[2] if len(args) > 2 else kwargs.get("offs")
            groups = offsets.shape[0] if offsets is not None else (b.shape[0] if b.dim() == 3 else 1)
            if b.dim() == 3:  # along M: a (rows, K), b (groups, K, N)
                return (max(a.shape[0] // groups, 1), b.shape[-1], a.shape[-1])
            return (a.shape[0], b.shape[-1], max(a.shape[-1] // groups, 1))  # along K: the per-group weight gradient
        return ()
    if func.namespace != "npu_inject":
        return ()
    values = _by_name(func, args, kwargs)
    if short.startswith("npu_grouped_matmul"):
        x, weight = values["x"][0], values["weight"][0]
        groups = weight.shape[0] if weight.dim() == 3 else max(values["group_list"].shape[0], 1)
        if weight.dim() == 3:  # along M: x (rows, K), weight (E, K, N)
            return (max(x.shape[0] // groups, 1), weight.shape[-1], x.shape[-1])
        return (x.shape[0], weight.shape[-1], max(x.shape[-1] // groups, 1))  # along K: per-expert dW
    if short.startswith("npu_fusion_attention"):
        query, layout = values["query"], values["input_layout"]
        head_dim = query.shape[-1] if layout in ("TND", "BSND", "BNSD") else query.shape[-1] // values["head_num"]
        if layout == "TND":
            lengths = values.get("actual_seq_qlen")
            documents = lengths.numel() if isinstance(lengths, torch.Tensor) else len(lengths or ()) or 1
            sequence = query.shape[0] // documents
        else:
            sequence = {"BSND": query.shape[1], "BSH": query.shape[1], "SBH": query.shape[0]}.get(layout, query.shape[-2])
        causal = values.get("sparse_mode", 0) in (2, 3, 4) or layout == "TND"
        return (sequence, head_dim, causal)
    return ()


def _by_name(func, args, kwargs) -> dict[str, Any]:
    """An op call's arguments by their schema names, defaults filled in."""
    return {argument.name: (args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value))
            for i, argument in enumerate(func._schema.arguments)}


def register_kernel_flops(name: str, formula) -> None:
    """FLOPs of an ``npu_inject::<name>`` op from its arguments, passed by their schema names."""
    _KERNEL_FLOPS[name] = formula


def _grouped_matmul_flops(x, weight, **unused) -> float:
    # M-grouped (x (M, K), weight (E, K, N)): 2*M*K*N; K-grouped (x (K, M) viewed, weight (K, N)): 2*M*K*N too.
    x0, w0 = x[0], weight[0]
    if w0.dim() == 3:
        return 2.0 * x0.shape[0] * x0.shape[1] * w0.shape[-1]
    return 2.0 * x0.shape[-1] * x0.shape[0] * w0.shape[-1]


def _query_key_pairs(query, key, input_layout, actual_seq_qlen) -> float:
    """(query, key) position pairs the kernel scores, before a causal mask halves them."""
    if input_layout == "TND":
        tokens = query.shape[0]
        if isinstance(actual_seq_qlen, (list, tuple)) and actual_seq_qlen:
            ends = [0, *actual_seq_qlen]  # cumulative document ends (v1: host integers)
            return float(sum((end - start) ** 2 for start, end in zip(ends, ends[1:])))
        # v3's lengths are a tensor (fake here): documents of equal length, one per sequence.
        documents = actual_seq_qlen.numel() if isinstance(actual_seq_qlen, torch.Tensor) else 1
        return float(documents * (tokens // documents) ** 2)
    if input_layout == "BSND":
        return float(query.shape[0] * query.shape[1] * key.shape[1])
    if input_layout == "BSH":
        return float(query.shape[0] * query.shape[1] * key.shape[1])
    if input_layout == "SBH":
        return float(query.shape[1] * query.shape[0] * key.shape[0])
    return float(query.shape[0] * query.shape[2] * key.shape[2])  # BNSD


def _fusion_attention_flops(query, key, value, head_num, input_layout, sparse_mode=0, actual_seq_qlen=None,
                            **unused) -> float:
    """2 * pairs * heads * (qk_dim + v_dim): QK^T and PV, halved for the causal modes."""
    qk_dim = query.shape[-1] if input_layout in ("TND", "BSND", "BNSD") else query.shape[-1] // head_num
    v_dim = value.shape[-1] if input_layout in ("TND", "BSND", "BNSD") else value.shape[-1] // head_num
    causal = sparse_mode in (2, 3, 4) or input_layout == "TND"
    pairs = _query_key_pairs(query, key, input_layout, actual_seq_qlen)
    return 2.0 * pairs * head_num * (qk_dim + v_dim) * (0.5 if causal else 1.0)


def _backward(forward, factor: float):
    """A ``<name>_backward`` op's FLOPs: the forward's arguments follow the output gradients."""
    return lambda grad_outputs, **arguments: factor * forward(**arguments)


register_kernel_flops("npu_grouped_matmul", _grouped_matmul_flops)
# dx and dweight: two products of the forward's size.
register_kernel_flops("npu_grouped_matmul_backward", _backward(_grouped_matmul_flops, 2.0))
for _name in ("npu_fusion_attention", "npu_fusion_attention_v3"):
    register_kernel_flops(_name, _fusion_attention_flops)
    # QK^T again, dV, dP, dQ and dK: five products where the forward has two.
    register_kernel_flops(f"{_name}_backward", _backward(_fusion_attention_flops, 2.5))

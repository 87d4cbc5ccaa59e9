"""What a real NPU would make of the ops the simulator runs: op coverage, host syncs, stream order.

On with ``TORCHTITAN_NPU_SIM_AUDIT=1`` (see verification/sim_npu/README.md, "Audit"). A
TorchDispatchMode (the design of ``torch.cuda._sanitizer``) sees every aten op on
plain npu tensors, after autograd and after tensor subclasses such as DTensor
(for those it returns NotImplemented, so their local ops come back through it):

* **Op coverage**: an aten op is an NPU kernel when the real torch_npu 2.14.0
  wheel lists it (``npu_native_functions*.yaml``, read by ../../torch_npu_wheel.py);
  ops torch runs through its own composite kernels on any device are "composite";
  anything else runs on the host through torch_npu's CPU fallback ("fallback":
  warned once, counted, and fatal with ``TORCHTITAN_NPU_SIM_AUDIT_FAIL=fallback``).
* **Host syncs**: ``.item()`` (``_local_scalar_dense``), blocking copies between
  host and device, data-dependent output shapes, and synchronize calls, counted per
  training step and call site.
* **Stream order**: vector clocks per stream, advanced by event records/waits,
  stream waits and host synchronisation; an access on stream S to memory last
  written (or, for a write, read) on stream T with no ordering in between is a
  finding with both call sites.

Each rank writes ``audit_rank<N>.json`` next to the runtime's report at exit and
after every training step; ``npu-inject audit PATH`` prints it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import sys
import threading
import warnings
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode, is_traceable_wrapper_subclass
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

ENABLE_VAR = "TORCHTITAN_NPU_SIM_AUDIT"
FAIL_VAR = "TORCHTITAN_NPU_SIM_AUDIT_FAIL"
DIR_VAR = "TORCHTITAN_NPU_SIM_AUDIT_DIR"
FAIL_KINDS = ("fallback", "sync", "stream")
SCHEMA = 1

_SIM_ROOT = Path(__file__).resolve().parents[2]  # verification/sim_npu
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep  # the separator keeps torchtitan out
_THIS_FILE = str(Path(__file__).resolve())
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_HOST = ("host", 0)

# Ops whose output shape depends on tensor values: the host must wait for the device.
_DATA_DEPENDENT = {
    "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount",
    "aten::repeat_interleave",
}
_BOOLEAN_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
# Bookkeeping ops whose schema marks an argument written although no kernel touches its bytes.
_NOT_ACCESSES = {"aten::record_stream", "aten::is_pinned"}
# Allocation is no write: memory from the caching allocator is ready on any stream.
_ALLOCATIONS = ("aten::empty", "aten::new_empty")
_COPIES = {"aten::copy_", "aten::_to_copy", "aten::_copy_from_and_resize"}


class AuditError(RuntimeError):
    """Raised at the offending op when TORCHTITAN_NPU_SIM_AUDIT_FAIL names its kind."""


def _load_wheel_module():
    spec = importlib.util.spec_from_file_location("_torch_npu_sim_wheel", _SIM_ROOT / "torch_npu_wheel.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"Cannot load {_SIM_ROOT / 'torch_npu_wheel.py'}.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_npu_op_names() -> frozenset[str]:
    try:
        return _load_wheel_module().op_names_with_npu_kernel()
    except (RuntimeError, OSError, ImportError) as error:
        raise RuntimeError(
            f"{ENABLE_VAR}=1 needs the real torch_npu wheel's op lists and could not read them: {error}"
        ) from error


def fail_kinds_from_env() -> frozenset[str]:
    raw = os.environ.get(FAIL_VAR, "")
    kinds = frozenset(k.strip() for k in raw.split(",") if k.strip())
    unknown = kinds - set(FAIL_KINDS)
    if unknown:
        raise ValueError(f"{FAIL_VAR}={raw!r}: unknown kinds {sorted(unknown)}; valid: {', '.join(FAIL_KINDS)}.")
    return kinds


# -- where an op comes from ----------------------------------------------------


def call_site() -> str:
    """file:line of the first frame outside torch, the standard library and this module.

    Without one (torch's own threads and hooks): the autograd node in backward, else
    the innermost torch frame.
    """
    frame, innermost_torch = sys._getframe(1), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_TORCH_DIR):
            innermost_torch = innermost_torch or frame
        elif filename != _THIS_FILE and not filename.startswith((_STDLIB_DIR, "<frozen")):
            return f"{_short(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward of {node.name()}"
    if innermost_torch is not None:
        return f"torch/{innermost_torch.f_code.co_filename[len(_TORCH_DIR):]}:{innermost_torch.f_lineno}"
    return "<no Python frame>"


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/verification/sim_npu/site/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return filename[len(cwd):] if filename.startswith(cwd) else filename


# -- stream order ---------------------------------------------------------------

Clock = dict  # stream key -> sequence number of the last access ordered before


def _merge(into: Clock, other: Clock) -> None:
    for stream, seq in other.items():
        if into.get(stream, 0) < seq:
            into[stream] = seq


@dataclass
class _Access:
    stream: tuple
    seq: int
    op: str
    site: str


@dataclass
class _Memory:
    """Accesses to one storage since it was allocated, by byte range [start, end)."""

    data_ptr: int
    writes: list[tuple[int, int, _Access]] = field(default_factory=list)
    reads: list[tuple[int, int, _Access]] = field(default_factory=list)


# Per storage, accesses kept for checking; the oldest go first (a race that old is missed).
_MAX_ACCESSES = 256


class StreamOrder:
    """Happens-before between streams (and the host) from the ops, events and waits seen."""

    def __init__(self) -> None:
        self.clocks: dict[tuple, Clock] = {_HOST: {_HOST: 0}}
        self.events: dict[int, Clock] = {}
        self.memory: dict[int, _Memory] = {}
        self.findings: Counter = Counter()
        self.streams_seen: set[tuple] = set()

    def _clock(self, stream: tuple) -> Clock:
        clock = self.clocks.get(stream)
        if clock is None:
            clock = self.clocks[stream] = {stream: 0}
        return clock

    def launch(self, stream: tuple) -> int:
        """An op enqueued on ``stream``: ordered after everything the host already waited for."""
        clock = self._clock(stream)
        if stream != _HOST:
            _merge(clock, self.clocks[_HOST])
        clock[stream] += 1
        self.streams_seen.add(stream)
        return clock[stream]

    def record_event(self, event_id: int, stream: tuple) -> None:
        self.events[event_id] = dict(self._clock(stream))

    def wait_event(self, stream: tuple, event_id: int) -> None:
        _merge(self._clock(stream), self.events.get(event_id, {}))

    def wait_stream(self, stream: tuple, other: tuple) -> None:
        _merge(self._clock(stream), self._clock(other))

    def host_waits_for_stream(self, stream: tuple) -> None:
        _merge(self.clocks[_HOST], self._clock(stream))

    def host_waits_for_event(self, event_id: int) -> None:
        _merge(self.clocks[_HOST], self.events.get(event_id, {}))

    def host_waits_for_device(self, device_index: int) -> None:
        for stream in list(self.clocks):
            if stream != _HOST and stream[0] == device_index:
                self.host_waits_for_stream(stream)

    def forget(self, storage_key: int) -> None:
        self.memory.pop(storage_key, None)

    def access(self, storage: torch.UntypedStorage, span: tuple[int, int], write: bool, fresh: bool,
               access: _Access, on_finding: Callable[[str], None]) -> None:
        """Check and record an access to bytes [start, end) of ``storage`` (views of one arena
        touch disjoint bytes; only overlapping accesses can race)."""
        key = storage._cdata
        data_ptr = storage.data_ptr()
        memory = self.memory.get(key)
        if memory is None or memory.data_ptr != data_ptr or fresh:
            # New memory (or reallocated by resize_): no earlier access can race with it.
            if memory is None:
                self._watch(storage, key)
            memory = self.memory[key] = _Memory(data_ptr)
        clock = self.clocks[access.stream]
        start, end = span
        earlier = [("written", w) for w in memory.writes] + ([("read", r) for r in memory.reads] if write else [])
        for other_kind, (other_start, other_end, other) in earlier:
            overlaps = other_start < end and start < other_end
            if overlaps and other.stream != access.stream and clock.get(other.stream, 0) < other.seq:
                kind = "write" if write else "read"
                finding = (f"{kind} on {_name(access.stream)} by {access.op} at {access.site} of memory "
                           f"{other_kind} on {_name(other.stream)} by {other.op} at {other.site}, "
                           f"with no event or stream wait in between")
                self.findings[finding] += 1
                on_finding(finding)
        covered = lambda entry: start <= entry[0] and entry[1] <= end  # noqa: E731
        if write:
            memory.writes = [w for w in memory.writes if not covered(w)][-_MAX_ACCESSES:] + [(start, end, access)]
            memory.reads = [r for r in memory.reads if not covered(r)]
        else:
            memory.reads = [r for r in memory.reads if not (covered(r) and r[2].stream == access.stream)]
            memory.reads = memory.reads[-_MAX_ACCESSES:] + [(start, end, access)]

    def _watch(self, storage: torch.UntypedStorage, key: int) -> None:
        # Storage Python objects live as long as their StorageImpl: the entry goes with it.
        weakref.finalize(storage, self.forget, key)


def _name(stream: tuple) -> str:
    return "the host" if stream == _HOST else f"npu:{stream[0]} stream {stream[1]}"


def _stream_key(stream: torch.Stream) -> tuple:
    return (stream.device_index, stream.stream_id)


# -- the audit --------------------------------------------------------------------


class _PhaseState(threading.local):
    optimizer_depth = 0
    suspended = 0


class Audit(TorchDispatchMode):
    """The dispatch mode plus what it counted; ``report()`` is the JSON document."""

    def __init__(self, npu_op_names: frozenset[str], fail: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.npu_op_names = npu_op_names
        self.fail = fail
        self._classes: dict[Any, str] = {}
        self.fallback_ops: dict[str, dict] = {}
        self.composite_ops: Counter = Counter()
        self.npu_kernels: Counter = Counter()
        self.fused_ops: Counter = Counter()
        self.syncs: dict[str, Counter] = defaultdict(Counter)  # step ("1", ..., or "outside steps") -> key
        self.stream_order = StreamOrder()
        self.step: int | None = None
        self.steps_seen: list[int] = []
        self._local = _PhaseState()
        self._lock = threading.RLock()

    # -- the process's audit while entered (torch.npu's stream and event calls report to it) --
    def __enter__(self) -> "Audit":
        global _ACTIVE
        self._previous_active = _ACTIVE
        _ACTIVE = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = self._previous_active
        return super().__exit__(*exc)

    # -- classification --
    def classify(self, func: torch._ops.OpOverload) -> str:
        """'npu' (torch_npu kernel), 'composite' (torch's own device-generic kernel) or 'fallback'."""
        cls = self._classes.get(func)
        if cls is None:
            name = func.name()  # "aten::add.Tensor"
            base, _, overload = name.partition("::")[2].partition(".")
            listed = base if overload in ("", "default") else f"{base}.{overload}"
            has = functools.partial(torch._C._dispatch_has_kernel_for_dispatch_key, name)
            if listed in self.npu_op_names:
                cls = "npu"
            elif has("CompositeExplicitAutogradNonFunctional") and has("CPU"):
                # A structured op's functional/in-place form: torch runs it through the out= kernel.
                stem = base.rstrip("_")
                outs = {f"{stem}.out", f"{stem}.{overload}_out"}
                cls = "npu" if outs & self.npu_op_names else "fallback"
            elif any(has(key) for key in ("CompositeImplicitAutograd", "CompositeExplicitAutograd",
                                           "CompositeExplicitAutogradNonFunctional")):
                cls = "composite"
            else:
                cls = "fallback"
            self._classes[func] = cls
        return cls

    def phase(self) -> str:
        if self._local.optimizer_depth:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self.step is not None else "outside steps"

    # -- events from torch.npu and the trainer --
    def sync(self, kind: str, what: str) -> None:
        site = call_site()
        step = "outside steps" if self.step is None else str(self.step)
        key = f"{kind} | {what} | {site}"
        with self._lock:
            self.syncs[step][key] += 1
        if "sync" in self.fail and self.step is not None:
            raise AuditError(f"host sync in training step {self.step}: {kind} ({what}) at {site} "
                             f"[{FAIL_VAR}=sync]")

    def _on_finding(self, finding: str) -> None:
        if "stream" in self.fail:
            raise AuditError(f"stream order: {finding} [{FAIL_VAR}=stream]")

    @contextlib.contextmanager
    def fused(self, name: str) -> Iterator[None]:
        """One torch_npu kernel (here a reference implementation): its inner ops are not audited."""
        with self._lock:
            self.fused_ops[name] += 1
        self._local.suspended += 1
        try:
            yield
        finally:
            self._local.suspended -= 1

    def call_fused(self, name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """torch_npu.<name>(...): one kernel forward, and its custom-op backward is one kernel too.

        The backward runs with the mode off: the reference kernels' backward ops use
        torch.func.vjp, which fails under any TorchDispatchMode ("Cannot access storage of
        TensorWrapper", torch 2.14), and torch_npu's *_grad kernels are opaque anyway.
        """
        with self.fused(name):
            outputs = function(*args, **kwargs)
        for node in _custom_op_nodes(outputs):
            node.register_prehook(self._leave_for_backward)
            node.register_hook(self._return_after_backward)
        return outputs

    def _leave_for_backward(self, grad_outputs) -> None:
        popped = _pop_mode()
        if popped is not self:
            _push_mode(popped)
            raise RuntimeError(f"the audit expected to be the innermost dispatch mode, found {popped!r}")
        with self._lock:
            self.fused_ops["(backward of fused kernels)"] += 1

    def _return_after_backward(self, grad_inputs, grad_outputs) -> None:
        _push_mode(self)

    def optimizer_pre_hook(self, optimizer, args, kwargs) -> None:
        self._local.optimizer_depth += 1

    def optimizer_post_hook(self, optimizer, args, kwargs) -> None:
        self._local.optimizer_depth -= 1

    # -- the dispatch mode --
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._local.suspended:
            return func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_traceable_wrapper_subclass(t) for t in leaves):
            return NotImplemented  # DTensor & co. run their local ops, which come back here
        if any(_is_functorch_wrapped(t) for t in leaves):
            # torch.func's wrappers (reference kernels) unwrap to plain tensors, which come back here.
            return func(*args, **kwargs)
        npu = [t for t in leaves if t.device.type == "npu"]
        device = npu[0].device if npu else _factory_device(kwargs)
        if device is None:
            if self.stream_order.memory and leaves:
                self._host_access(func, leaves, args, kwargs)
            return func(*args, **kwargs)
        name = func.name()
        if func.namespace == "npu":
            # torch_npu's kernels are npu::* operators: one NPU kernel, not looked into.
            with self.fused(name):
                return func(*args, **kwargs)
        if func.namespace == "aten":
            cls = self.classify(func)
            if cls == "fallback":
                self._fallback(name)
            else:
                with self._lock:
                    counts = self.npu_kernels if cls == "npu" else self.composite_ops
                    counts[name] += 1
        device_index = device.index if device.index is not None else torch.npu.current_device()
        stream = _stream_key(torch.accelerator.current_stream(device_index))
        site = call_site()
        with self._lock:
            seq = self.stream_order.launch(stream)
        out = func(*args, **kwargs)
        self._census(func, name, args, kwargs, leaves, out, stream)
        if func.is_view or name in _NOT_ACCESSES or name.startswith(_ALLOCATIONS):  # views touch no bytes
            return out
        self._stream_accesses(func, name, args, kwargs, out, _Access(stream, seq, name, site))
        return out

    def _fallback(self, name: str) -> None:
        phase, site = self.phase(), call_site()
        with self._lock:
            record = self.fallback_ops.get(name)
            if record is None:
                record = self.fallback_ops[name] = {"count": 0, "phases": Counter(), "sites": Counter()}
                warnings.warn(
                    f"{name} has no NPU kernel in torch_npu 2.14.0 (not in npu_native_functions*.yaml): "
                    f"on a real NPU it runs on the host through torch_npu's CPU fallback (first at {site})",
                    stacklevel=2,
                )
            record["count"] += 1
            record["phases"][phase] += 1
            record["sites"][site] += 1
        if "fallback" in self.fail:
            raise AuditError(f"{name} would run on the host on a real NPU (no kernel in torch_npu 2.14.0), "
                             f"at {site} in {phase} [{FAIL_VAR}=fallback]")

    def _census(self, func, name, args, kwargs, leaves, out, stream) -> None:
        base = name.partition(".")[0]
        blocking_host_copy = None
        if base in _COPIES:
            devices = {t.device.type for t in leaves}
            if isinstance(out, torch.Tensor):
                devices.add(out.device.type)
            non_blocking = bool(kwargs.get("non_blocking", False) or (len(args) > 2 and args[2] is True))
            if "cpu" in devices and not non_blocking:
                to_host = isinstance(out, torch.Tensor) and out.device.type == "cpu"
                blocking_host_copy = "device-to-host copy" if to_host else "blocking host-to-device copy"
        if base == "aten::_local_scalar_dense":
            self.sync(".item() / bool() / tolist()", name)
        elif blocking_host_copy:
            self.sync(blocking_host_copy, name)
        elif base in _DATA_DEPENDENT and not (base == "aten::repeat_interleave" and kwargs.get("output_size")):
            self.sync("data-dependent shape", name)
        elif base in _BOOLEAN_INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                self.sync("data-dependent shape (boolean indexing)", name)
        else:
            return
        with self._lock:
            self.stream_order.host_waits_for_stream(stream)

    def _stream_accesses(self, func, name, args, kwargs, out, access: _Access) -> None:
        written = set()
        for index, argument in enumerate(func._schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            is_write = argument.alias_info is not None and argument.alias_info.is_write
            for tensor in _tensors(value):
                self._touch(tensor, is_write, False, access)
                if is_write:
                    written.add(id(tensor))
        # Fresh outputs are writes to new memory; aliasing outputs (views, in-place) were seen as arguments.
        if not any(r.alias_info is not None for r in func._schema.returns):
            for tensor in _tensors(out):
                if id(tensor) not in written:
                    self._touch(tensor, True, True, access)

    def _host_access(self, func, leaves, args, kwargs) -> None:
        if func.is_view or func.name() in _NOT_ACCESSES:
            return
        tracked = [t for t in leaves if t.untyped_storage()._cdata in self.stream_order.memory]
        if not tracked:
            return
        access = _Access(_HOST, self.stream_order.launch(_HOST), func.name(), call_site())
        writes = {id(t) for index, argument in enumerate(func._schema.arguments)
                  if argument.alias_info is not None and argument.alias_info.is_write
                  for t in _tensors(args[index] if index < len(args) else kwargs.get(argument.name))}
        for tensor in tracked:
            self._touch(tensor, id(tensor) in writes, False, access)

    def _touch(self, tensor: torch.Tensor, write: bool, fresh: bool, access: _Access) -> None:
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            return  # pageable host memory: copies to or from it are synchronous
        if tensor.device.type not in ("npu", "cpu") or is_traceable_wrapper_subclass(tensor):
            return
        span = _byte_span(tensor)
        if span is None:
            return
        with self._lock:
            self.stream_order.access(tensor.untyped_storage(), span, write, fresh, access, self._on_finding)

    # -- the JSON document --
    def on_step_start(self, step: int) -> None:
        self.step = step
        if step not in self.steps_seen:
            self.steps_seen.append(step)

    def on_step_end(self) -> None:
        self.step = None

    def report(self, rank: int) -> dict:
        with self._lock:
            return {
                "schema": SCHEMA,
                "rank": rank,
                "op_lists": "torch_npu 2.14.0 wheel: torch_npu/csrc/aten/npu_native_functions*.yaml",
                "steps": list(self.steps_seen),
                "fallback_ops": {
                    name: {"count": r["count"], "phases": dict(r["phases"]), "sites": dict(r["sites"])}
                    for name, r in sorted(self.fallback_ops.items())},
                "syncs": {step: _sync_rows(counter) for step, counter in self.syncs.items()},
                "stream_findings": [{"finding": f, "count": n} for f, n in self.stream_order.findings.items()],
                "streams": sorted(_name(s) for s in self.stream_order.streams_seen),
                "npu_kernels": dict(sorted(self.npu_kernels.items())),
                "composite_ops": dict(sorted(self.composite_ops.items())),
                "fused_ops": dict(sorted(self.fused_ops.items())),
            }


def _sync_rows(counter: Counter) -> list[dict]:
    rows = []
    for key, count in sorted(counter.items()):
        kind, what, site = key.split(" | ", 2)
        rows.append({"kind": kind, "op": what, "site": site, "count": count})
    return rows


def _byte_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Bytes [start, end) of its storage that ``tensor`` can touch (None when empty)."""
    if tensor.numel() == 0:
        return None
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * tensor.element_size()
    return start, start + extent * tensor.element_size()


def _custom_op_nodes(outputs: Any, depth: int = 3) -> set:
    """Autograd nodes of torch.library custom ops behind ``outputs`` (a few nodes deep)."""
    found, frontier = set(), {t.grad_fn for t in tree_leaves(outputs)
                              if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    for _ in range(depth):
        found |= {node for node in frontier if node.name().startswith("GeneratedBackwardFor_")}
        frontier = {n for node in frontier - found for n, _ in node.next_functions if n is not None}
    return found


def _is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _factory_device(kwargs: dict) -> torch.device | None:
    device = kwargs.get("device")
    if device is None:
        return None
    device = torch.device(device)
    return device if device.type == "npu" else None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


# -- process-wide installation ----------------------------------------------------

_ACTIVE: Audit | None = None


def active() -> Audit | None:
    return _ACTIVE


def enabled() -> bool:
    raw = os.environ.get(ENABLE_VAR, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ENABLE_VAR}={raw!r}: use 1 (audit on) or 0/unset (off).")
    return raw == "1"


def start(audit: Audit) -> Audit:
    """Make ``audit`` the process's audit: the mode is pushed for good, hooks installed."""
    if _ACTIVE is not None:
        raise RuntimeError("The simulated NPU audit is already running in this process.")
    register_optimizer_step_pre_hook(audit.optimizer_pre_hook)
    register_optimizer_step_post_hook(audit.optimizer_post_hook)
    audit.__enter__()
    return audit


def install_from_env() -> None:
    """Called by torch_npu's import: start the audit when TORCHTITAN_NPU_SIM_AUDIT=1."""
    if not enabled():
        return
    audit = start(Audit(load_npu_op_names(), fail_kinds_from_env()))
    _hook_trainer(audit)
    atexit.register(write_report)


def _hook_trainer(audit: Audit) -> None:
    import wrapt

    def wrap(module) -> None:
        original = module.Trainer.train_step

        @functools.wraps(original)
        def train_step(self, *args, **kwargs):
            audit.on_step_start(int(self.step))
            try:
                return original(self, *args, **kwargs)
            finally:
                audit.on_step_end()
                write_report()

        module.Trainer.train_step = train_step

    wrapt.register_post_import_hook(wrap, "torchtitan.trainer")


def report_path() -> str | None:
    """<dump_folder>/npu_inject/audit_rank<N>.json (the runtime's report directory), or $TORCHTITAN_NPU_SIM_AUDIT_DIR."""
    directory = os.environ.get(DIR_VAR)
    if not directory:
        try:
            from npu_inject import runtime
        except ImportError:
            runtime = None
        current = runtime.current() if runtime is not None else None
        if current is not None:
            directory = current.dump_dir or current.settings.report_dir
    if not directory:
        return None
    return os.path.join(directory, f"audit_rank{os.environ.get('RANK', '0')}.json")


def write_report() -> str | None:
    if _ACTIVE is None:
        return None
    path = report_path()
    if path is None:
        warnings.warn(f"{ENABLE_VAR}=1 but no report directory: neither npu_inject's runtime "
                      f"(dump folder) nor {DIR_VAR} names one; the audit is not written.")
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    document = _ACTIVE.report(int(os.environ.get("RANK", "0")))
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
    os.replace(path + ".tmp", path)
    return path

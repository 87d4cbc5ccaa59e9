"""How long a recorded step takes on a given piece of hardware: each operator and collective timed,
then played out over streams, links and pipeline stages as the dependencies between them allow.

An operator's time is a roofline with the fraction of the peak its class reaches (the hardware
profile's family efficiencies): matrix operators (matmul, grouped matmul, the fused attention) by
their FLOPs against the dtype's cube peak, everything else by the bytes it reads and writes against
the memory bandwidth; each launch costs at least ``kernel_us`` on the device and ``host_us`` on the host.
A collective's time is its bytes over the link its group spans (within a scale-up domain, or across
domains through each device's NIC) plus a latency per algorithm step: HCCL's Mesh algorithms (one
step) within the domain, Ring and PairWise (n - 1 steps) across it. An Ascend group spanning domains
runs HCCL's hierarchical algorithms (only 1/ranks-per-domain of the data crosses the NICs); NVIDIA's
runs NCCL's rings, bound by each GPU's NIC.

The play-out is a dataflow simulation: an operator starts when the host has issued it, its stream is
free and its inputs are written; a collective runs on its group's link and delays only what reads its
result (so FSDP's prefetched all-gathers overlap compute, and TP's, whose results are needed at once,
do not); a blocking collective holds its stream. Pipeline stages are played out together: a receive
waits for the matching send of the stage before it, so the schedule's bubbles appear where they are.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

CUBE_OPS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten._grouped_mm",
            "aten.convolution", "aten.convolution_backward", "npu_inject.npu_grouped_matmul",
            "npu_inject.npu_grouped_matmul_backward"}
ATTENTION_OPS = {"npu_inject.npu_fusion_attention", "npu_inject.npu_fusion_attention_v3",
                 "npu_inject.npu_fusion_attention_backward", "npu_inject.npu_fusion_attention_v3_backward"}
# Host reads the planner marks (a device value read on the host, a device synchronisation) as "host_sync: <site>":
# the host waits there until the device has run everything issued, and the device then idles until the host has
# issued what follows (npu_inject/planner/host_reads.py lists the sites).
HOST_SYNC_MARK = "host_sync"


def host_sync_site(event: str) -> str | None:
    """The site a trace mark names when it is a host read, else None."""
    return event.partition(": ")[2] if event.startswith(HOST_SYNC_MARK + ": ") else None


# torchtitan's world mesh, outermost dimension first (ParallelDims builds it in this order).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class Layout:
    world_size: int
    pp: int
    scale_up_devices: int
    # The mesh's degrees by name (MESH_ORDER's), to name the dimensions a collective's group spans; None: unnamed.
    degrees: dict[str, int] | None = None

    def role(self, rank: int) -> int:
        """The pipeline rank (torchtitan's meshes put pp outermost): ranks of one stage share a trace."""
        return rank // (self.world_size // self.pp)

    def spans_nodes(self, ranks) -> bool:
        """Whether a group's ranks reach each other only through the scale-out network."""
        return len({rank // self.scale_up_devices for rank in ranks}) > 1

    def dimensions(self, ranks) -> str:
        """The mesh dimensions a group's ranks differ in ("tp", "cp", "dp_shard x cp"; expert parallelism borrows
        dp_shard's and cp's ranks, so its groups are named by those), or "" when the degrees are not known."""
        degrees = self.degrees or {}
        if not ranks or math.prod(degrees.get(name, 1) for name in MESH_ORDER) != self.world_size:
            return ""
        varying, stride = [], 1
        for name in reversed(MESH_ORDER):
            degree = degrees.get(name, 1)
            if degree > 1 and len({(rank // stride) % degree for rank in ranks}) > 1:
                varying.append(name)
            stride *= degree
        return " x ".join(reversed(varying))


@dataclass
class Timing:
    step_s: float = 0.0
    compute_s: float = 0.0  # busy time of the compute stream
    optimizer_s: float = 0.0
    bubble_s: float = 0.0  # time the compute stream waited on a pipeline receive
    exposed_comm_s: float = 0.0  # the rest of the step: waiting on collectives, the host, other streams
    # What published steps show beyond the modelled kernels (framework, power limits): the device's operators
    # stretched by the fitted ``overhead`` fraction, counted here and not in compute_s or any kernel's rate.
    overhead_s: float = 0.0
    comm_s: dict[str, float] = field(default_factory=dict)  # collective time by kind
    # By the group's device mesh dimension (torchtitan's name: "dp_shard_cp" is FSDP's; a group of no mesh by the
    # dimensions its ranks differ in) and kind ("cp all_to_all"): busy time on the links, and how long the compute
    # stream waited on them (an operator held back by a collective's result, a blocking collective holding the
    # stream): the part of that busy time nothing hid. A ring's exchange issued before the block it overlaps
    # shows as waited near zero.
    comm_by_group_s: dict[str, float] = field(default_factory=dict)
    waited_by_group_s: dict[str, float] = field(default_factory=dict)
    kernels: int = 0
    host_s: float = 0.0  # the host's time issuing the step's operators (dispatch and launch, host_us each)
    # What the host reads add to the step (the step played again without them: the device idle after each until the
    # host has issued enough to keep it busy; a term of its own, not in exposed_comm_s), and the reads by site.
    host_wait_s: float = 0.0
    host_reads: dict[str, float] = field(default_factory=dict)
    # Busy time of the compute stream by module (torchtitan's names: "tok_embeddings", "layers.0", "norm",
    # "output", plus "loss" and "optimizer") and by (operator class, phase): forward, backward and recomputation.
    by_module: dict[str, float] = field(default_factory=dict)
    by_class: dict[tuple[str, str], float] = field(default_factory=dict)
    by_module_class: dict[tuple[str, str], float] = field(default_factory=dict)  # (module, class) -> seconds

    def settle(self) -> "Timing":
        """Set exposed_comm_s: the step's time no other term holds (waiting on collectives and other streams)."""
        self.exposed_comm_s = max(0.0, self.step_s - self.compute_s - self.bubble_s - self.overhead_s
                                  - self.host_wait_s)
        return self

    @property
    def host_bound(self) -> bool:
        """The host needs longer to issue the operators than the compute stream to run them, so the device
        waits for launches (the host's last issue always precedes the device's end: comparing those ends says
        nothing)."""
        return self.host_s >= self.compute_s


SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def op_class(op) -> str:
    """The class an operator's time is reported under: matmul, grouped matmul, attention, memory-bound (every
    other kernel), communication, view."""
    if op.kind != "compute":
        return "communication" if op.kind == "collective" else "view"
    if op.name in ATTENTION_OPS:
        return "attention"
    if op.name in CUBE_OPS:
        return "grouped matmul" if "grouped" in op.name else "matmul"
    return "memory-bound"


def _measured_tflops(op, rates) -> float | None:
    """The measured TFLOP/s of a matrix or attention operator at its shape; None where none was measured."""
    if not op.shape:
        return None
    if op.name in ATTENTION_OPS:
        sequence, head_dim, causal = op.shape
        return rates.attention_tflops("backward" if op.name.endswith("_backward") else "forward", sequence, head_dim,
                                      causal)
    dtype = SHORT_DTYPES.get(op.dtype, op.dtype)
    if "grouped" in op.name:
        return rates.grouped_tflops(dtype, *op.shape)
    return rates.matmul_tflops(dtype, *op.shape)


def op_seconds(op, profile, eff) -> float:
    """An operator's device time: a roofline with the profile's measured rates where it has them (by class and
    shape), else the family's fractions of the peaks."""
    if op.kind == "view":
        return 0.0
    if op.kind == "collective":
        raise ValueError("collectives are timed by collective_seconds")
    rates = profile.rates
    kernel = eff["kernel_us"] * 1e-6
    measured_gbps = rates.memory_gbps_at(op.bytes, SHORT_DTYPES.get(op.dtype, op.dtype)) if rates is not None else None
    bandwidth = measured_gbps * 1e9 if measured_gbps else profile.memory_bandwidth_gbps * 1e9 * eff["memory"]
    memory = op.bytes / bandwidth
    if op.name in CUBE_OPS or op.name in ATTENTION_OPS:
        tflops = _measured_tflops(op, rates) if rates is not None else None
        if tflops is not None:
            # A measured rate already holds the kernel's own memory traffic.
            return max((op.flops or 0.0) / (tflops * 1e12), kernel)
        fraction = eff["attention"] if op.name in ATTENTION_OPS else eff["cube"]
        compute = (op.flops or 0.0) / (profile.peak(op.dtype) * fraction)
        return max(compute, memory, kernel)
    if rates is not None and op.name.startswith("npu_inject."):
        name = op.name.removeprefix("npu_inject.")
        gbps = rates.fused_gbps(name.removesuffix("_backward"), "backward" if name.endswith("_backward") else "forward",
                                op.bytes)
        if gbps is not None:
            return max(op.bytes / (gbps * 1e9), kernel)
    vector = op.flops / (profile.vector_tflops * 1e12 * eff["memory"]) if op.flops else 0.0
    return max(memory, vector, kernel)


def efficiency_with_rates(profile, eff: dict[str, float]) -> dict[str, float]:
    """The family's numbers with the profile's own in their place: the launch and host times it measured, and
    its overhead (a profile calibrated on its machine has none fitted)."""
    rates = profile.rates
    own = {"overhead": getattr(profile, "overhead", None)}
    if rates is not None:
        own.update(kernel_us=rates.kernel_us, host_us=rates.host_us)
    return {**eff, **{key: value for key, value in own.items() if value is not None}}


def collective_seconds(op, profile, eff, layout: Layout) -> float:
    n = max(len(op.group), 1)
    spans = layout.spans_nodes(op.group)
    link = profile.scale_out if spans else profile.scale_up
    bandwidth = link.bandwidth_gbps * 1e9 * eff["comm"]
    latency = link.latency_us * 1e-6
    size = op.comm_bytes
    if op.collective == "all_to_all" and spans and n > 1:
        # Each rank's rows for the peers in its own node go over the node's links, the others through
        # its NIC, at once.
        local = _ranks_in_first_domain(op.group, layout)
        within = (local - 1) / n * size / (profile.scale_up.bandwidth_gbps * 1e9 * eff["comm"])
        across = (n - local) / n * size / bandwidth
        return max(within, across) + (n - 1) * latency
    if op.collective in ("send", "recv"):
        return size / bandwidth + latency
    if n == 1:
        return 0.0
    measured = profile.rates.collective(op.collective, size) if profile.rates is not None and not spans else None
    if measured is not None:
        # Measured within one scale-up domain: bus bandwidth at this size (nccl-tests' convention).
        bus_gbps, latency_us = measured
        factor = 2 * (n - 1) / n if op.collective == "all_reduce" else (n - 1) / n
        return max(factor * size / (bus_gbps * 1e9), latency_us * 1e-6)
    if spans and profile.family == "ascend" and op.collective in ("all_gather", "reduce_scatter", "all_reduce"):
        return _hierarchical_seconds(op, profile, eff, layout)
    # Latency steps: within a scale-up domain HCCL's Mesh algorithms send to every peer at once (one
    # step); across it the Ring and PairWise ones take n - 1 (CANN hccl docs/Mesh.md, Ring.md). The
    # bandwidth term is the same: (n - 1)/n of the data through the device's links.
    steps = 1 if not spans else n - 1
    if op.collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * size / bandwidth + steps * latency
    if op.collective == "all_reduce":
        return 2 * (n - 1) / n * size / bandwidth + 2 * steps * latency
    if op.collective == "broadcast":
        return size / bandwidth + math.ceil(math.log2(n)) * latency
    return math.ceil(math.log2(n)) * latency  # barrier


def _ranks_in_first_domain(group, layout: Layout) -> int:
    """How many of the group's ranks share the scale-up domain of its first rank."""
    return sum(1 for rank in group if rank // layout.scale_up_devices == group[0] // layout.scale_up_devices)


def _hierarchical_seconds(op, profile, eff, layout: Layout) -> float:
    """HCCL across scale-up domains: level 0 (Mesh) within each domain, level 1 (Ring) between the
    ranks of equal local index in each, so only 1/local of the data crosses the NICs. NCCL's rings
    (the nvidia family) cross them with all of it, as the ring formula above charges."""
    n, size = len(op.group), op.comm_bytes
    local = _ranks_in_first_domain(op.group, layout)
    domains = max(n // local, 1)
    up = profile.scale_up.bandwidth_gbps * 1e9 * eff["comm"]
    out = profile.scale_out.bandwidth_gbps * 1e9 * eff["comm"]
    up_latency, out_latency = profile.scale_up.latency_us * 1e-6, profile.scale_out.latency_us * 1e-6
    within = (local - 1) / local * size / up + (up_latency if local > 1 else 0.0)
    across = (domains - 1) / domains * size / local / out + (domains - 1) * out_latency
    return 2 * (within + across) if op.collective == "all_reduce" else within + across


def _durations(trace, profile, eff, layout):
    stretch = 1.0 + eff.get("overhead", 0.0)
    out = []
    for op in trace.ops:
        out.append(collective_seconds(op, profile, eff, layout) if op.kind == "collective"
                   else op_seconds(op, profile, eff) * stretch)
    return out


class _Role:
    """One pipeline rank's trace being played out between two op indices."""

    def __init__(self, trace, durations, start: int, stop: int, eff, reads: dict[int, list[str]]) -> None:
        self.trace, self.durations, self.index, self.stop, self.eff = trace, durations, start, stop, eff
        self.host = 0.0
        self.stream: dict[int, float] = defaultdict(float)
        self.lane: dict[tuple, float] = defaultdict(float)
        self.ready: dict[int, float] = {}
        self.compute_busy = self.optimizer = self.bubble = self.overhead = 0.0
        self.comm: dict[str, float] = defaultdict(float)
        self.comm_by_group: dict[str, float] = defaultdict(float)
        self.waited: dict[str, float] = defaultdict(float)
        self.written_by: dict[int, str] = {}  # allocation -> the collective (group label) whose result it holds
        self.by_module: dict[str, float] = defaultdict(float)
        self.by_class: dict[tuple[str, str], float] = defaultdict(float)
        self.by_module_class: dict[tuple[str, str], float] = defaultdict(float)
        self.kernels = 0
        self.issue = 0.0
        self.host_syncs = reads  # op index -> the sites read before it runs
        self.host_reads: dict[str, float] = defaultdict(float)
        self.read: set[int] = set()  # marks already read (a role paused at a receive resumes at the same index)
        self.end = 0.0

    def read_on_host(self, index: int, done: float) -> None:
        """The host reads at mark ``index``: it waits until everything issued (``done``) has run."""
        for site in self.host_syncs[index]:
            self.host_reads[site] += 1
        self.host = max(self.host, done)

    def done(self) -> bool:
        return self.index >= self.stop


def module_key(op) -> str:
    """The top-level module an op's time is reported under: ``layers.<i>`` for a layer's ops, the first name of
    any other module's, ``optimizer`` for the optimizer step, ``loss`` for what runs outside the model."""
    if op.phase == "optimizer":
        return "optimizer"
    if not op.module:
        return "loss"
    parts = op.module.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def simulate(traces: dict[int, object], profile, eff, layout: Layout, windows: dict[int, tuple[int, int]],
             reads: dict[int, dict[int, list[str]]] | None = None) -> Timing:
    """Play out every role's window [start, stop) together; the step ends when the last stream does.
    On the CPU (the rehearsal's host) the thread that issues an operator also runs it, and a collective's
    copies and reductions take the same core: the host waits for each.

    ``reads``: each role's host reads in the window (op index they precede -> sites; without it, those marked in
    [start, stop)). At a read the host waits until the device has run everything issued. Their cost, the
    ``host_wait_s`` term, is what they add to the step: the window played again without them (the device idles
    after a read until the host has issued enough to keep it busy, where the host had been ahead). A read at
    ``stop`` is counted and costs nothing: every window starts with nothing queued."""
    eff = efficiency_with_rates(profile, eff)
    durations = {role: _durations(trace, profile, eff, layout) for role, trace in traces.items()}
    if reads is None:
        reads = {role: {} for role in traces}
        for role, trace in traces.items():
            for index, event in trace.marks:
                site = host_sync_site(event)
                if site is not None and windows[role][0] <= index < windows[role][1]:
                    reads[role].setdefault(index, []).append(site)
    timing = _play(traces, durations, profile, eff, layout, windows, reads)
    if any(index < windows[role][1] for role, marked in reads.items() for index in marked):
        unread = _play(traces, durations, profile, eff, layout, windows, {role: {} for role in traces})
        timing.host_wait_s = max(timing.step_s - unread.step_s, 0.0)
    return timing.settle()


def _play(traces, durations, profile, eff, layout: Layout, windows, reads) -> Timing:
    serial = profile.family == "cpu"
    kernel_share = 1.0 / (1.0 + eff.get("overhead", 0.0))  # of a stretched operator's time, the kernel's
    roles = {role: _Role(trace, durations[role], *windows[role], eff, reads[role]) for role, trace in traces.items()}
    sends: dict[tuple[int, int], list[float]] = defaultdict(list)  # (from role, to role) -> arrival times
    received: dict[tuple[int, int], int] = defaultdict(int)
    host_us, view_us = eff["host_us"] * 1e-6, eff["host_view_us"] * 1e-6
    labels: dict[tuple[tuple[int, ...], str, str], str] = {}

    def label(op) -> str:
        # The mesh's own name where the group is a mesh dimension's: FSDP's "dp_shard_cp" and the ring's "cp" can
        # span the same ranks (dp_shard 1).
        key = (op.group, op.mesh, op.collective)
        if key not in labels:
            labels[key] = " ".join(filter(None, (op.mesh or layout.dimensions(op.group), op.collective)))
        return labels[key]

    def latest_input(role, op) -> int:
        return max(op.inputs, key=lambda allocation: role.ready.get(allocation, 0.0))

    progressing = True
    while progressing:
        progressing = False
        for role_id, role in roles.items():
            while not role.done():
                if role.index in role.host_syncs and role.index not in role.read:
                    role.read.add(role.index)
                    role.read_on_host(role.index, max((role.end, *role.stream.values()), default=0.0))
                op = role.trace.ops[role.index]
                d = role.durations[role.index]
                inputs_ready = max((role.ready.get(i, 0.0) for i in op.inputs), default=0.0)
                issued = (view_us if op.kind == "view" else host_us) + op.views * view_us
                role.host += issued
                role.issue += issued
                free = max(role.host, role.stream[op.stream])  # when the op could start, its inputs aside
                start = max(free, inputs_ready)
                if op.collective == "recv":
                    sender = layout.role(op.group[op.peer]) if op.peer is not None and op.group else role_id
                    key = (sender, role_id)
                    if sender != role_id and sender in roles and received[key] >= len(sends[key]):
                        role.host -= issued
                        role.issue -= issued
                        break  # the sender has not sent yet: play another stage
                    arrival = sends[key][received[key]] if sender != role_id and sender in roles else start
                    received[key] += 1
                    end = max(start, arrival) + d
                    if op.stream == 0:
                        role.bubble += max(0.0, arrival - start)
                    for output in op.outputs:
                        role.ready[output] = end
                        role.written_by.pop(output, None)  # a receive's wait is the bubble, counted apart
                    role.comm[op.collective] += d
                elif op.kind == "collective":
                    lane = (op.group, op.collective in ("send", "recv"))
                    begin = max(start, role.lane[lane])
                    end = begin + d
                    role.lane[lane] = end
                    role.comm[op.collective] += d
                    named = label(op)
                    role.comm_by_group[named] += d
                    for output in op.outputs:
                        role.ready[output] = end
                        role.written_by[output] = named
                    if op.blocking and op.stream == 0:
                        role.waited[named] += end - start
                    if op.collective == "send" and op.peer is not None and op.group:
                        sends[(role_id, layout.role(op.group[op.peer]))].append(end)
                    if op.blocking:
                        role.stream[op.stream] = end
                    if serial:  # gloo's threads share the rank's one core with its compute
                        role.host = max(role.host, end)
                elif op.kind == "view":
                    # Metadata on the host: neither waits for its input's data nor holds a stream.
                    end = role.host
                    for output in op.outputs:
                        if inputs_ready > role.ready.get(output, 0.0):
                            role.ready[output] = inputs_ready
                            source = role.written_by.get(latest_input(role, op))
                            if source is None:
                                role.written_by.pop(output, None)
                            else:
                                role.written_by[output] = source
                else:
                    if op.stream == 0 and inputs_ready > free:
                        source = role.written_by.get(latest_input(role, op))
                        if source is not None:
                            role.waited[source] += inputs_ready - free
                    for output in op.outputs:
                        role.written_by.pop(output, None)
                    end = start + d
                    role.stream[op.stream] = end
                    for output in op.outputs:
                        role.ready[output] = end
                    if op.kind == "compute":
                        role.kernels += 1
                        if op.stream == 0:
                            kernel_s = d * kernel_share
                            role.compute_busy += kernel_s
                            role.overhead += d - kernel_s
                            role.by_module[module_key(op)] += kernel_s
                            role.by_class[(op_class(op), op.phase)] += kernel_s
                            role.by_module_class[(module_key(op), op_class(op))] += kernel_s
                            if op.phase == "optimizer":
                                role.optimizer += kernel_s
                        if serial:
                            role.host = max(role.host, end)
                role.end = max(role.end, end, role.host)
                role.index += 1
                progressing = True
    for role in roles.values():
        role.index = role.stop  # a receive whose sender never sent (a trace cut short): nothing more to wait for
        for site in role.host_syncs.get(role.stop, ()):
            # Read after the step's last operator: the next step starts with nothing queued, as every step is played.
            role.host_reads[site] += 1
    slowest = max(roles.values(), key=lambda r: r.end)
    timing = Timing(step_s=slowest.end, compute_s=slowest.compute_busy, optimizer_s=slowest.optimizer,
                    bubble_s=slowest.bubble, comm_s=dict(slowest.comm), comm_by_group_s=dict(slowest.comm_by_group),
                    waited_by_group_s=dict(slowest.waited), kernels=slowest.kernels,
                    host_s=slowest.issue, overhead_s=slowest.overhead, by_module=dict(slowest.by_module),
                    by_class=dict(slowest.by_class),
                    by_module_class=dict(slowest.by_module_class), host_reads=dict(slowest.host_reads))
    return timing



# patch matmul_checks on a checked step: per checked linear product (M x K by K x N), what the V-ABFT kernel and
# its inputs read and write beyond the product itself: a and b once (b twice: its segment sums and its spread),
# c once in its dtype, cast to fp32 (written and read: the kernel takes c in fp32); the statistics are vectors.
# Memory-bound; five launches per product (cast, kernel, the verdict's reduction). EST: no NPU measured it.
CHECK_LAUNCHES = 5


def matmul_check_seconds(op, profile, eff) -> float:
    rows, columns, inner = op.shape
    size = op.bytes // max(rows * inner + inner * columns + rows * columns, 1) or 2
    moved = size * (rows * inner + 2 * inner * columns + rows * columns) + 8 * rows * columns
    return moved / (profile.memory_bandwidth_gbps * 1e9 * eff["memory"]) + CHECK_LAUNCHES * eff["kernel_us"] * 1e-6


# MoE experts' grouped products on a checked step take the torch check (npu_inject.ops.matmul_check's grouped
# check): fp32 copies of both operands and the result written and read, the weights' segment statistics and
# the one-hot [rows, experts] products, about five times the product's own bytes, and some 60 operators per
# product (a grouped backward kernel computes two). EST: no NPU measured it.
GROUPED_CHECK_BYTES = 5.0
GROUPED_CHECK_LAUNCHES = 60
GROUPED_PRODUCTS = {"aten._grouped_mm": 1, "npu_inject.npu_grouped_matmul": 1,
                    "npu_inject.npu_grouped_matmul_backward": 2}


def grouped_check_seconds(op, profile, eff) -> float:
    products = GROUPED_PRODUCTS[op.name]
    return (GROUPED_CHECK_BYTES * op.bytes / (profile.memory_bandwidth_gbps * 1e9 * eff["memory"])
            + products * GROUPED_CHECK_LAUNCHES * eff["kernel_us"] * 1e-6)


def attention_rate_range(traces: dict[int, object], profile, eff, windows: dict[int, tuple[int, int]]
                         ) -> dict[str, float] | None:
    """Attention's device time in ``windows`` with every attention rate at the slow (``low``) and the fast (``high``)
    end of its range, over its time at the rates themselves (the pipeline rank with the most attention); None where
    the profile's attention points carry no range (measured on the machine) or the window runs no attention."""
    rates = profile.rates
    if rates is None or not rates.attention_ranged:
        return None
    eff = efficiency_with_rates(profile, eff)
    slow, fast = (replace(profile, rates=rates.at_attention_end(end)) for end in ("low", "high"))
    most = (0.0, 0.0, 0.0)
    for role, trace in traces.items():
        start, stop = windows[role]
        ops = [op for op in trace.ops[start:stop] if op_class(op) == "attention"]
        seconds = tuple(sum(op_seconds(op, at, eff) for op in ops) for at in (profile, slow, fast))
        most = max(most, seconds)
    at_rates, at_slow, at_fast = most
    return {"slow": at_slow / at_rates, "fast": at_fast / at_rates} if at_rates > 0 else None


def matmul_check_cost(traces: dict[int, object], profile, eff, windows: dict[int, tuple[int, int]]) -> dict[str, float]:
    """Device seconds the checks add to each role's ops in ``windows`` (one recorded step, as :func:`simulate`
    plays it), the largest over the pipeline ranks: ``dense`` (the linears' products on CANN's V-ABFT kernel) and
    ``grouped`` (the experts' products on the torch check)."""
    worst = {"dense": 0.0, "grouped": 0.0}
    for role, trace in traces.items():
        start, stop = windows[role]
        checked = [op for op in trace.ops[start:stop] if op.phase in ("forward", "backward")]
        dense = sum(matmul_check_seconds(op, profile, eff) for op in checked
                    if op.name == "aten.mm" and len(op.shape) == 3)
        grouped = sum(grouped_check_seconds(op, profile, eff) for op in checked if op.name in GROUPED_PRODUCTS)
        if dense + grouped > worst["dense"] + worst["grouped"]:
            worst = {"dense": dense, "grouped": grouped}
    return worst

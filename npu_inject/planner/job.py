"""Plan one job layout: every distinct role recorded in a child process, then memory and time.

A role is a pipeline rank: the ranks of one stage run the same code on equal shards (tensor, context,
expert and data parallel shards are symmetric), so one rank stands for each. Every pipeline rank is
recorded (their schedules differ: a 1F1B stage runs as many warm-up forwards as stages follow it), except
the middle stages of a 1F1B pipeline that hold what an earlier middle stage holds: that stage's recording,
reordered as their schedule runs its parts, stands for them (:mod:`npu_inject.planner.stages`). Each recording
is made by :mod:`npu_inject.planner.session` in a fork of a preloaded process (:mod:`workers`), as many
at once as the host has cores; a role's memory is replayed through the allocator model, and all
roles' steps are played out together by the cost model. Recording every stage costs about what one
unpipelined rank does: each holds its share of the layers. With ``units``, the job is recorded shallow at two
depths and extrapolated (:mod:`npu_inject.planner.depth`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from npu_inject.planner import costmodel, depth, memory, session, stages, workers

GIB = 2**30


@dataclass
class RolePlan:
    role: int  # the pipeline rank
    rank: int  # the global rank recorded
    peak_allocated: int
    peak_reserved: int
    comm_buffers: int  # HCCL/NCCL buffers of this rank's communicators (outside the allocator)
    runtime: int  # the runtime and driver (outside the allocator)
    at_peak: dict[str, int]  # live bytes by category when allocated memory peaked
    timeline: list[tuple[int, int, int, dict[str, int]]]
    communicators: int
    retries: int = 0  # the allocator released its cache to make room (slow, not fatal)
    failed: int = 0  # allocations that did not fit: out of memory
    peak_by_module: dict[str, int] = field(default_factory=dict)  # memory.StepMemory.by_module, the counted steps'

    @property
    def total(self) -> int:
        """What the device must hold at the peak: reserved + communicator buffers + runtime."""
        return self.peak_reserved + self.comm_buffers + self.runtime


@dataclass
class JobPlan:
    argv: list[str]
    hardware: str
    world_size: int
    parallel: dict[str, int]
    roles: list[RolePlan]
    timing: costmodel.Timing
    tokens_per_step: int
    capacity: int
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # how long planning took
    expandable: bool = False
    extrapolated: dict[str, Any] | None = None  # depth.describe() and the units recorded, when shallow

    @property
    def step_s(self) -> float:
        return self.timing.step_s

    @property
    def tokens_per_s_per_npu(self) -> float:
        return self.tokens_per_step / self.timing.step_s / self.world_size if self.timing.step_s else 0.0

    @property
    def mfu(self) -> float:
        return self.info["flops_per_token"] * self.tokens_per_s_per_npu / self.info["peak_flops"]

    @property
    def fits(self) -> bool:
        return all(role.total <= self.capacity and not role.failed for role in self.roles)

    @property
    def worst(self) -> RolePlan:
        return max(self.roles, key=lambda role: role.total)


def _communicators(trace) -> tuple[int, int]:
    """(collective communicators, point-to-point peers) this rank used: a communicator per process group, two
    mesh dimensions over the same ranks (FSDP's dp_shard_cp and cp with dp_shard 1) two of them."""
    groups, peers = set(), set()
    for op in trace.ops:
        if op.kind != "collective" or len(op.group) < 2:
            continue
        if op.collective in ("send", "recv"):
            peers.add(op.group[op.peer] if op.peer is not None else op.group)
        else:
            groups.add((op.group, op.mesh))
    return len(groups), len(peers)


def _window(trace, step: int) -> tuple[int, int]:
    start = next(index for index, event in trace.marks if event == f"step {step}")
    stop = next((index for index, event in trace.marks if index > start and event == "reset_peaks"), len(trace.ops))
    return start, stop


def _reads(marks, opening: str, closes) -> dict[int, list[str]]:
    """The host reads marked between the first mark ``opening`` of ``marks`` and the next mark ``closes(event)``
    accepts, by the op index they precede. Marks, not op indices, bound them: a step's last reads and the next
    step's opening mark precede the same op."""
    reads: dict[int, list[str]] = {}
    inside = False
    for index, event in marks:
        if not inside:
            inside = event == opening
            continue
        if closes(event):
            break
        site = costmodel.host_sync_site(event)
        if site is not None:
            reads.setdefault(index, []).append(site)
    return reads


def _step_marks(trace, step: int) -> list:
    """The trace's marks from step ``step``'s opening mark on."""
    position = next(position for position, (_, event) in enumerate(trace.marks) if event == f"step {step}")
    return trace.marks[position:]


def _step_reads(trace, step: int) -> dict[int, list[str]]:
    return _reads(_step_marks(trace, step), f"step {step}", lambda event: event == "reset_peaks")


def _group_reads(trace, step: int, group: int) -> dict[int, list[str]]:
    return _reads(_step_marks(trace, step), f"microbatch group {group}",
                  lambda event: event.startswith(("microbatch group", "optimizer")))


def _group_window(trace, step: int, group: int) -> tuple[int, int]:
    start, stop = _window(trace, step)
    marks = [(index, event) for index, event in trace.marks if start <= index <= stop]
    begin = next(index for index, event in marks if event == f"microbatch group {group}")
    end = next((index for index, event in marks if index > begin and event.startswith(("microbatch group", "optimizer"))), stop)
    return begin, end


# A pipeline job running more microbatches per pipeline rank in a step than RECORDED_MICROBATCHES' second is
# recorded with both counts per rank and extrapolated: past the warm-up each microbatch adds the same work to every
# stage. The first step, which only warms up (the optimizer's states made, the allocator's cache filled), runs the
# fewest 1F1B takes, one per stage: recordings of full depth are the planner's cost. Two and three per stage hold
# llama3_70b TP 8 x PP 4's 32 microbatches and PP 8's 64 within 0.05% of recording them all (tools/bench_plan.py
# microbatches); one and two put PP 4's first stage 4.3% high (with an earlier cache rule).
RECORDED_MICROBATCHES = (2, 3)
WARM_UP_MICROBATCHES = 1
# A 1F1B pipeline's middle stages of one kind share one recording at full depth (npu_inject.planner.stages);
# tools/bench_plan.py stages turns it off to hold the copies against recordings of their own.
SHARE_STAGES = True


def reduced_microbatches(facts: dict[str, Any]) -> tuple[int, int, int] | None:
    """(fewer, more, the job's) microbatches per step to record and extrapolate from, or None to record all."""
    pp, microbatch = facts["pp"], facts["microbatch_size"]
    if pp <= 1 or not microbatch:
        return None
    count = facts["local_batch_size"] // microbatch
    fewer, more = (pp * factor for factor in RECORDED_MICROBATCHES)
    return (fewer, more, count) if count > more else None


def _with_microbatches(argv: list[str], facts: dict[str, Any], count: int | None) -> list[str]:
    """``argv`` with ``count`` microbatches per step (the local batch cut, gradient accumulation kept)."""
    if count is None:
        return list(argv)
    from npu_inject.torchtitan_argv import with_flags

    accumulation = max(facts["global_batch_size"] // (facts["local_batch_size"] * facts["dp"]), 1)
    local = facts["microbatch_size"] * count
    return with_flags(argv, ["--training.local_batch_size", str(local),
                             "--training.global_batch_size", str(local * facts["dp"] * accumulation)])


class Pending:
    """A recording under way: its roles' futures at each depth (and microbatch count, see
    :func:`reduced_microbatches`). ``facts`` (:func:`workers.describe`'s, with this job's degrees and batch) spare
    a pipeline job the wait for its own: the search knows them for every layout it starts. A 1F1B pipeline's
    middle stages of one kind are recorded once at full depth (:mod:`npu_inject.planner.stages`)."""

    def __init__(self, argv, world_size, depths, pool, pp: int | None, progress=None, facts=None) -> None:
        self.argv, self.world_size, self.depths, self.pool = list(argv), world_size, depths, pool
        self.progress = progress or (lambda line: None)
        self.started = time.monotonic()
        self.microbatches = None
        self.shared: dict[int, int] = {}  # stage -> the stage whose recording stands for it
        self.reordered: dict[int, int] = {}  # of those, the stages whose donor's recording could be reordered
        self.facts = facts
        if pp is None or pp > 1:
            # The parsed job says how many pipeline ranks to record and how many microbatches they run.
            if facts is None:
                described = pool.submit(workers.describe, argv, world_size)
                for _ in workers.wait_for([described], self.progress, lambda _, seconds: (
                        f"reading the job's configuration in the planner's workers ({seconds:.0f} s)")):
                    facts = described.result()
                self.facts = facts
            pp = facts["pp"]
            self.microbatches = reduced_microbatches(facts)
            if depths == (None,) and SHARE_STAGES:
                self.shared = stages.donors(facts)
        self.pp = pp
        self.futures = {key: self._submit(*key) for key in
                        ((index, stage) for index in range(len(depths)) for stage in range(pp)
                         if stage not in self.shared)}
        fewer, more = self.microbatches[:2] if self.microbatches else (None, None)
        depth_text = ("at full depth" if depths == (None,) else
                      f"with {depths[0]} and {depths[1]} repeats of the layer block per stage (extrapolated)")
        roles = f"{pp} pipeline ranks" if pp > 1 else "one rank (it stands for all)"
        if self.shared:
            by_donor: dict[int, list[int]] = {}
            for stage, donor in self.shared.items():
                by_donor.setdefault(donor, []).append(stage)
            roles += " (" + "; ".join(f"stage {donor}'s recording reordered for stage{'s' if len(copies) > 1 else ''} "
                                      f"{stages.stage_list(copies)}" for donor, copies in sorted(by_donor.items())) + ")"
        if self.microbatches:
            self.progress(f"recording {roles} {depth_text}, a step of {pp * WARM_UP_MICROBATCHES} microbatches to "
                          f"warm up, then {fewer} and {more} of the step's {self.microbatches[2]} (extrapolated): "
                          f"{len(self.futures)} recordings")
        else:
            self.progress(f"recording {roles} {depth_text}: {len(self.futures)} recording"
                          + ("s" if len(self.futures) > 1 else ""))

    def _submit(self, index: int, stage: int):
        # With fewer microbatches recorded, each recording warms up with one microbatch per stage, then runs a step
        # of the fewer and one of the more (the model built once for all three).
        built = self.pp * WARM_UP_MICROBATCHES if self.microbatches else None
        return self.pool.submit(workers.record, _with_microbatches(self.argv, self.facts, built), self.world_size,
                                stage * (self.world_size // self.pp), self.depths[index],
                                self.microbatches[:2] if self.microbatches else None)

    def wait(self, timeout: float | None) -> bool:
        """Whether every recording has finished, waiting at most ``timeout`` seconds for them."""
        import concurrent.futures

        return not concurrent.futures.wait(self.futures.values(), timeout=timeout).not_done

    def _collect(self, futures: dict) -> dict:
        keys = {future: key for key, future in futures.items()}
        results = {}
        try:
            for done, future in enumerate(workers.wait_for(keys, self.progress, lambda finished, _: (
                    f"recording: {finished} of {len(keys)} done "
                    f"({time.monotonic() - self.started:.0f} s)")), start=1):
                results[keys[future]] = future.result()
                if len(keys) > 1:
                    self.progress(f"recorded {done} of {len(keys)} ({time.monotonic() - self.started:.0f} s)")
        except BaseException:
            for future in futures.values():
                future.cancel()
            raise
        return results

    def _reordered(self, results: dict) -> dict:
        """The shared stages' recordings, their donors' reordered; those that cannot be are recorded now."""
        made, refused = {}, {}
        ranks_per_stage = self.world_size // self.pp
        first = self.facts.get("stage_first_layers") or []
        for (index, donor), result in list(results.items()):
            for stage in (stage for stage, of in self.shared.items() if of == donor):
                try:
                    trace = stages.as_stage(result.trace, donor=donor, stage=stage, stages=self.pp,
                                            ranks_per_stage=ranks_per_stage,
                                            layer_offset=first[stage] - first[donor] if first else 0)
                except stages.NotShareable as exc:
                    refused[(index, stage)] = str(exc)
                    continue
                made[(index, stage)] = replace(result, rank=stage * ranks_per_stage, trace=trace,
                                               info=dict(result.info))
        again = {stage for _, stage in refused}  # a copy at one depth and a recording at another: recorded
        self.reordered = {stage: donor for stage, donor in self.shared.items() if stage not in again}
        if refused:
            reason = next(iter(refused.values()))
            # Said, and recorded after all: a stage planned as its donor's copy would be wrong without a word.
            self.progress(f"stage{'s' if len(again) > 1 else ''} {stages.stage_list(sorted(again))} recorded after all: the "
                          f"donor's recording could not be reordered ({reason})")
            made.update(self._collect({key: self._submit(*key) for key in refused}))
        return made

    def result(self) -> "Recording":
        results = self._collect(self.futures)
        if self.shared:
            results.update(self._reordered(results))
        roles: list[dict[int, Any]] = [{} for _ in range(len(self.depths) * (2 if self.microbatches else 1))]
        for (index, stage), result in results.items():
            result.trace.events = None  # the order of events served the reordering
            if self.microbatches:  # (depth, fewer), (depth, more): the order evaluate() pairs them in
                roles[2 * index][stage], roles[2 * index + 1][stage] = session.split_grown(result)
            else:
                roles[index][stage] = result
        return Recording(self.argv, self.world_size, self.depths, [dict(sorted(r.items())) for r in roles],
                         time.monotonic() - self.started, self.microbatches, reordered=dict(self.reordered))


def _replay(trace, profile, expandable: bool, buffers: int):
    """``trace``'s memory through the allocator model, with what lives outside the allocator (``buffers``, the
    runtime's reserve) kept out of its reach."""
    capacity = int(profile.memory_gib * GIB)
    limit = max(capacity - buffers - int(profile.runtime_reserved_gib * GIB), 0)
    return memory.replay(trace, pad=profile.allocator_pad_bytes, expandable=expandable, device_memory=capacity,
                         limit=limit)


def _evaluate(recorded: dict[int, Any], *, profile, efficiency, world_size, expandable, argv, started,
              replays: dict) -> JobPlan:
    """``replays``: memory replays by trace, shared by the plans of one evaluation (a pipeline's fewer and more
    microbatches are two steps of one trace)."""
    info = dict(recorded[0].info)
    pp = info["parallel"]["pp"]
    capacity = int(profile.memory_gib * GIB)
    runtime = int(profile.runtime_reserved_gib * GIB)
    roles = []
    for stage, result in sorted(recorded.items()):
        collectives, peers = _communicators(result.trace)
        buffer = int(profile.comm_buffer_mib * 2**20)
        buffers = collectives * buffer + peers * buffer // 10
        replayed = replays.get(id(result.trace))
        if replayed is None:
            replayed = replays[id(result.trace)] = _replay(result.trace, profile, expandable, buffers)
        steady = replayed.steps[f"step {result.info['steps_recorded']}"]
        counted = [replayed.steps[name] for name in result.info.get("peak_steps", replayed.steps)]
        by_module: dict[str, int] = {}
        for step in counted:
            for key, peak in step.by_module.items():
                by_module[key] = max(by_module.get(key, 0), peak)
        roles.append(RolePlan(stage, result.rank,
                              max(s.peak_allocated for s in counted),
                              max(s.peak_reserved for s in counted), buffers, runtime,
                              steady.at_peak, replayed.timeline, collectives + peers, replayed.retries, replayed.failed,
                              by_module))
    layout = costmodel.Layout(world_size, pp, profile.scale_up_devices,
                              {name: info["parallel"].get(name, 1) for name in costmodel.MESH_ORDER})
    traces = {stage: recorded[stage].trace for stage in range(pp)}
    step = info["steps_recorded"]
    windows = {s: _window(t, step) for s, t in traces.items()}
    timing = costmodel.simulate(traces, profile, efficiency, layout, windows,
                                {s: _step_reads(t, step) for s, t in traces.items()})
    checks = costmodel.matmul_check_cost(traces, profile, efficiency, windows)
    extra_groups = info["gradient_accumulation_steps"] - info["groups_recorded"]
    if extra_groups > 0:
        # The recorded step ran at most two microbatch groups: the others take as long as the last.
        last = info["groups_recorded"] - 1
        group_windows = {s: _group_window(t, step, last) for s, t in traces.items()}
        group = costmodel.simulate(traces, profile, efficiency, layout, group_windows,
                                   {s: _group_reads(t, step, last) for s, t in traces.items()})
        group_checks = costmodel.matmul_check_cost(traces, profile, efficiency, group_windows)
        checks = {kind: seconds + extra_groups * group_checks[kind] for kind, seconds in checks.items()}
        timing.step_s += extra_groups * group.step_s
        timing.compute_s += extra_groups * group.compute_s
        timing.bubble_s += extra_groups * group.bubble_s
        timing.kernels += extra_groups * group.kernels
        timing.host_s += extra_groups * group.host_s
        timing.overhead_s += extra_groups * group.overhead_s
        for totals, seconds_by in ((timing.comm_s, group.comm_s), (timing.comm_by_group_s, group.comm_by_group_s),
                                   (timing.waited_by_group_s, group.waited_by_group_s)):
            for kind, seconds in seconds_by.items():
                totals[kind] = totals.get(kind, 0.0) + extra_groups * seconds
        for name, seconds in group.by_module.items():
            timing.by_module[name] = timing.by_module.get(name, 0.0) + extra_groups * seconds
        for key, seconds in group.by_class.items():
            timing.by_class[key] = timing.by_class.get(key, 0.0) + extra_groups * seconds
        for key, seconds in group.by_module_class.items():
            timing.by_module_class[key] = timing.by_module_class.get(key, 0.0) + extra_groups * seconds
        timing.host_wait_s += extra_groups * group.host_wait_s
        for site, count in group.host_reads.items():
            timing.host_reads[site] = timing.host_reads.get(site, 0) + extra_groups * count
        timing.settle()
    batch_degree = world_size // (pp * info["parallel"]["cp"] * info["parallel"]["tp"])
    global_batch = info["global_batch_size"] if info["global_batch_size"] > 0 else info["local_batch_size"] * batch_degree
    info["peak_flops"] = profile.peak("bf16")
    info["matmul_check_seconds"] = checks
    info["attention_rate_range"] = costmodel.attention_rate_range(traces, profile, efficiency, windows)
    if info.get("replica_groups", 1) > 1:
        info["torchft"] = _cross_group_allreduce(info["replica_groups"], roles, profile, efficiency)
    return JobPlan(list(argv), profile.name, world_size, info["parallel"], roles, timing,
                   global_batch * info["seq_len"], capacity, info, time.monotonic() - started, expandable)


def _cross_group_allreduce(groups: int, roles: list[RolePlan], profile, efficiency) -> dict[str, Any]:
    """torchft's synchronous replica groups (HSDP across them): each step every rank all-reduces its gradient
    shards (the reduce-scatter's output, FSDP's reduce dtype) with the rank of the same place in every other
    group, over the scale-out links, as a ring across the groups."""
    shard = max(max((entry[3].get("gradients", 0) for entry in role.timeline), default=0) for role in roles)
    link = profile.scale_out
    seconds = (2 * (groups - 1) / groups * shard / (link.bandwidth_gbps * 1e9 * efficiency.get("comm", 1.0))
               + 2 * (groups - 1) * link.latency_us * 1e-6)
    return {"replica_groups": groups, "allreduce_bytes": shard, "allreduce_s": seconds}


def model_packages(argv: list[str]) -> list[str]:
    """The torchtitan model package a command names (``--module llama3``), for the fork server to preload."""
    for flag, value in zip(argv, argv[1:]):
        if flag == "--module":
            return [f"torchtitan.models.{value}"] if "." not in value else [value]
    return []


@dataclass
class Recording:
    """A job's recorded roles: one dict (pipeline rank -> RoleResult) per depth recorded."""
    argv: list[str]
    world_size: int
    depths: tuple[int | None, ...]  # (None,): the full model; (k, k + 1): shallow, to extrapolate
    roles: list[dict[int, Any]]  # per depth, then (with ``microbatches``) per microbatch count recorded
    seconds: float
    microbatches: tuple[int, int, int] | None = None  # (fewer, more) recorded of the step's (last) microbatches
    # A pipeline's recorded counts as evaluated, by (profile, efficiency, expandable): another count of the same
    # recordings (the advice's smaller batch) is only another point on their line. Shared by its copies.
    evaluated: dict = field(default_factory=dict, repr=False, compare=False)
    reordered: dict[int, int] = field(default_factory=dict)  # pipeline stage -> the stage whose recording, reordered, stands for it


def submit(argv: list[str], *, world_size: int, pool, units: int | None = None, pp: int | None = None,
           progress=None, facts: dict[str, Any] | None = None) -> Pending:
    """Start recording ``argv``'s roles for ``world_size`` ranks in ``pool`` (a :func:`workers.executor`): at
    full depth, or with ``units`` and one more repeats of the layer block per stage (:mod:`depth` says how many
    it takes). With ``pp`` 1, every role starts at once; otherwise the parsed job (``facts``, else read in the
    pool) says how many pipeline ranks and microbatches. ``progress`` is called with a line as recordings start
    and finish, and while nothing finishes for :data:`~config.HEARTBEAT_S` (:func:`workers.wait_for`)."""
    return Pending(argv, world_size, (None,) if units is None else (units, units + 1), pool, pp, progress, facts)


def record(argv: list[str], *, world_size: int, units: int | None = None, pool=None, pp: int | None = None,
           selection: str = "", progress=None) -> Recording:
    """:func:`submit` and wait; without ``pool``, one is made for this recording (with ``selection``)."""
    own_pool = pool is None
    pool = pool or workers.executor(selection=selection, modules=model_packages(argv))
    try:
        return submit(argv, world_size=world_size, pool=pool, units=units, pp=pp, progress=progress).result()
    finally:
        if own_pool:
            pool.shutdown()


def evaluate(recording: Recording, *, profile, efficiency: dict[str, float], expandable: bool = False,
             progress=None) -> JobPlan:
    """Memory and time of a recording on ``profile`` (recordings can be evaluated again and again; a pipeline's
    take tens of seconds, said to ``progress`` every :data:`~config.HEARTBEAT_S`)."""
    started = time.monotonic() - recording.seconds
    key = (id(profile), tuple(sorted(efficiency.items())), expandable)
    plans = recording.evaluated.get(key, (None, None))[1] if recording.microbatches else None
    if plans is None:
        replays: dict = {}  # each trace replayed once (its traces live as long as the recording)
        with workers.saying(progress, lambda seconds: (
                f"replaying the recorded memory through the allocator model, playing out the step ({seconds:.0f} s)")):
            plans = [_evaluate(roles, profile=profile, efficiency=efficiency, world_size=recording.world_size,
                               expandable=expandable, argv=recording.argv, started=started, replays=replays)
                     for roles in recording.roles]
        if recording.microbatches:  # _more_microbatches makes new plans from these: they stay as evaluated
            recording.evaluated[key] = (profile, plans)  # the profile held: its id stays its own
    if recording.microbatches:
        count = recording.microbatches[2]
        caches = recording.evaluated.get((key, count))
        if caches is None:  # each recording replayed once more, as a job of the step's microbatches holds them
            caches = recording.evaluated[(key, count)] = [_held_caches(fewer, plan, profile, expandable, count)
                                                          for fewer, plan in zip(recording.roles[::2], plans[::2])]
        plans = [_more_microbatches(fewer, more, recording.microbatches, cache)
                 for fewer, more, cache in zip(plans[::2], plans[1::2], caches)]
    if recording.depths == (None,):
        plan = plans[0]
    else:
        plan = _extrapolate(*plans, recording.depths, time.monotonic() - started)
    if recording.reordered:
        plan = replace(plan, info={**plan.info, "stages_reordered": dict(recording.reordered)})
    return plan


def evaluate_microbatches(recording: Recording, count: int, **evaluate_kwargs) -> JobPlan | None:
    """The recorded pipeline job with ``count`` microbatches per step instead (a smaller local batch, the same
    microbatches): the same recordings extrapolated to ``count``; None where they cannot say (the job's
    microbatches were all recorded, or ``count`` is within the ones recorded)."""
    if not recording.microbatches or count <= recording.microbatches[1]:
        return None
    return evaluate(replace(recording, microbatches=(*recording.microbatches[:2], count)), **evaluate_kwargs)


def plan_job(argv: list[str], *, profile, efficiency: dict[str, float], world_size: int, expandable: bool = False,
             units: int | None = None, pool=None, pp: int | None = None, selection: str = "",
             progress=None) -> JobPlan:
    """:func:`record` then :func:`evaluate`."""
    recording = record(argv, world_size=world_size, units=units, pool=pool, pp=pp, selection=selection,
                       progress=progress)
    return evaluate(recording, profile=profile, efficiency=efficiency, expandable=expandable, progress=progress)


def _line_dict(a: dict, b: dict, line) -> dict:
    return {key: line(a.get(key, 0.0), value) for key, value in b.items()}


def _timing_along(ta: costmodel.Timing, tb: costmodel.Timing, line, **given) -> costmodel.Timing:
    """The Timing each of whose quantities lies on ``line(a, b)`` through ``ta``'s and ``tb``'s (a wait or a count
    no lower than 0), those in ``given`` as they are given."""
    def at_least_0(a, b):
        return max(line(a, b), 0.0)

    values = dict(
        step_s=line(ta.step_s, tb.step_s), compute_s=line(ta.compute_s, tb.compute_s),
        optimizer_s=line(ta.optimizer_s, tb.optimizer_s), bubble_s=line(ta.bubble_s, tb.bubble_s),
        comm_s=_line_dict(ta.comm_s, tb.comm_s, line), kernels=int(line(ta.kernels, tb.kernels)),
        comm_by_group_s=_line_dict(ta.comm_by_group_s, tb.comm_by_group_s, line),
        waited_by_group_s=_line_dict(ta.waited_by_group_s, tb.waited_by_group_s, at_least_0),
        host_s=line(ta.host_s, tb.host_s), overhead_s=line(ta.overhead_s, tb.overhead_s),
        by_module=_line_dict(ta.by_module, tb.by_module, line), by_class=_line_dict(ta.by_class, tb.by_class, line),
        by_module_class=_line_dict(ta.by_module_class, tb.by_module_class, line),
        host_wait_s=at_least_0(ta.host_wait_s, tb.host_wait_s),
        host_reads=_line_dict(ta.host_reads, tb.host_reads, lambda a, b: max(round(line(a, b)), 0)))
    return costmodel.Timing(**{**values, **given}).settle()


def _as_built_for(trace, schedules: list[tuple[int, list[int]]], count: int):
    """``trace`` with its pipeline receive buffers as a job built for ``count`` microbatches holds them: made
    where the recording's first schedule made its own (at its first step) and kept. ``schedules``: each schedule's
    (microbatches, buffer allocation ids), the first's repeated to ``count`` microbatches' worth; the later
    schedules' buffers are not made at all."""
    (built, first), later = schedules[0], schedules[1:]
    by_id = {allocation.id: allocation for allocation in trace.allocations}
    kept, dropped = set(first), {i for _, ids in later for i in ids}
    allocations = [replace(allocation, freed=None) if allocation.id in kept else allocation
                   for allocation in trace.allocations if allocation.id not in dropped]
    # Ids below zero: the recorder's count from zero up.
    allocations += [replace(by_id[first[n % len(first)]], id=-1 - n, freed=None)
                    for n in range(len(first) * count // built - len(first))]
    return replace(trace, allocations=allocations)


def _held_caches(recorded: dict[int, Any], plan: JobPlan, profile, expandable: bool, count: int) -> dict[int, int]:
    """Each pipeline rank's cache beyond its allocated peak (bytes) in a job of ``count`` microbatches: its
    recording's steps with the fewer microbatches (``peak_steps``) replayed with the receive buffers held as that
    job holds them (:func:`_as_built_for`), the communicators' buffers kept out as ``plan`` (their evaluation) has
    them."""
    buffers = {role.role: role.comm_buffers for role in plan.roles}
    caches = {}
    for stage, result in recorded.items():
        replayed = _replay(_as_built_for(result.trace, result.info["receive_buffers"], count), profile, expandable,
                           buffers[stage])
        counted = [replayed.steps[name] for name in result.info["peak_steps"]]
        caches[stage] = max(max(s.peak_reserved for s in counted) - max(s.peak_allocated for s in counted), 0)
    return caches


def _more_microbatches(fewer: JobPlan, more: JobPlan, counts: tuple[int, int, int],
                       caches: dict[int, int]) -> JobPlan:
    """The plan of the step's microbatches from plans of two fewer counts, each quantity on the line through them
    (a 1F1B schedule's peak memory stays put past the warm-up; GPipe's grows with every microbatch), the cache
    beyond the allocated peak ``caches``' (pipeline rank -> bytes, :func:`_held_caches`)."""
    low, high, target = counts

    def line(a: float, b: float) -> float:
        return depth.extrapolate(a, b, (low, high), target)

    roles = []
    for a, b in zip(fewer.roles, more.roles):
        allocated = int(line(a.peak_allocated, b.peak_allocated))
        # Not a line: a job's receive buffers, all made at its first step, fill the holes its earlier allocations
        # left, so the cache shrinks as the microbatches grow, and stops where the holes run out (llama3_70b PP 8,
        # every microbatch recorded: the last stage's 6.54, 6.42, 6.29, 6.16, 5.92, 5.53 GiB at 8, 16, 24, 32, 48,
        # 64; the one before, 7.07, 6.82, 6.44, 6.36, 6.36, 6.45). Taking the fewer's cache put the last stage
        # +3.2% high at 64.
        cached = caches[a.role]
        roles.append(replace(b, peak_allocated=allocated, peak_reserved=allocated + cached,
                             at_peak={name: int(line(a.at_peak.get(name, 0), value)) for name, value in b.at_peak.items()},
                             peak_by_module={name: int(line(a.peak_by_module.get(name, 0), value))
                                             for name, value in b.peak_by_module.items()}))
    timing = _timing_along(fewer.timing, more.timing, line)
    info = {**more.info, "pp_microbatches": target, "microbatches_recorded": [low, high],
            "local_batch_size": more.info["local_batch_size"] * target // high,
            "global_batch_size": more.info["global_batch_size"] * target // high}
    return replace(more, roles=roles, timing=timing, info=info,
                   tokens_per_step=more.tokens_per_step * target // high)


def _full_depth_modules(recorded: dict[str, float], shape: depth.Shape, pp: int, optimizer_s: float) -> dict[str, float]:
    """Time by module of the full model's slowest pipeline rank, from a shallow recording's: each real layer
    takes the recorded time of the layer it repeats (a prefix layer its own, a block layer the mean of the
    recorded layers at its place in the block); the other modules as recorded, the optimizer extrapolated."""
    layers = {name: seconds for name, seconds in recorded.items() if name.startswith("layers.")}
    others = {name: seconds for name, seconds in recorded.items() if not name.startswith("layers.")}
    by_place: dict[int, list[float]] = {}
    for name, seconds in layers.items():
        index = int(name.split(".")[1])
        if index >= shape.prefix:
            by_place.setdefault((index - shape.prefix) % shape.period, []).append(seconds)
    slowest = max(range(pp), key=lambda rank: shape.rank_units(rank, pp))
    names = [name for stage, held in enumerate(shape.stages) if stage % pp == slowest for name in held]
    full: dict[str, float] = {}
    for name in names:
        if not name.startswith("layers."):
            continue
        index = int(name.split(".")[1])
        if index < shape.prefix:
            full[name] = layers.get(name, 0.0)
        else:
            place = by_place.get((index - shape.prefix) % shape.period, [])
            full[name] = sum(place) / len(place) if place else 0.0
    return {**others, **full, **({"optimizer": optimizer_s} if "optimizer" in others else {})}


# The repeats at each end of a stage whose peaks are extrapolated each on their own line (the others lie between):
# with three repeats recorded, the second from either end has a repeat on each side at both depths.
EDGE_REPEATS = 2


def _peak_places(role: RolePlan, shape: depth.Shape, units: int) -> dict[tuple, float]:
    """A shallow role's peak allocated bytes by where in the step it was reached, keyed so that a key is the same
    place at every depth: a prefix layer or another module by its name, a repeat of the block by its stage, its
    place in the block and how far it is from the stage's first or last repeat (:data:`EDGE_REPEATS` at each end).
    The peak moves with depth: deepseek_v3_671b's on 1024 ranks (EP 256, full AC) sat in the first MoE layer's
    backward with three repeats (its all-to-all buffers 0.6 GiB larger), in the second-to-last's with six and 58,
    0.34 GiB higher for each repeat: one line through the copies' peaks planned 32.7 GiB where 58 repeats hold 42.0."""
    places: dict[tuple, float] = {}
    where = depth.shallow_places(shape, units)
    for name, peak in role.peak_by_module.items():
        if not name.startswith("layers."):
            keys = [(name,)]
        else:
            place = where[int(name.split(".")[1])]
            if place[0] == "prefix":
                keys = [place]
            else:
                _, stage, repeat, offset = place
                keys = [key for key, distance in ((("first", stage, repeat, offset), repeat),
                                                  (("last", stage, units - 1 - repeat, offset), units - 1 - repeat))
                        if distance < EDGE_REPEATS]
        for key in keys:
            places[key] = max(places.get(key, 0), peak)
    return places


def peak_at_depth(shallow: RolePlan, deeper: RolePlan, shape: depth.Shape, units: tuple[int, int],
                  target: float) -> float:
    """A role's peak allocated bytes with ``target`` repeats per stage, from its recordings with ``units``: where
    the peak is at full depth, not where it was in the copies, so each place's peak on its own line, the highest."""
    places = [_peak_places(role, shape, count) for role, count in ((shallow, units[0]), (deeper, units[1]))]
    return max(depth.extrapolate(places[0][key], places[1][key], units, target)
               for key in places[0].keys() & places[1].keys())


def _extrapolate(shallow: JobPlan, deeper: JobPlan, units: tuple[int, int], seconds: float) -> JobPlan:
    shape: depth.Shape = deeper.info["shape"]
    pp = deeper.parallel["pp"]

    def line(a: float, b: float, target: float) -> float:
        return depth.extrapolate(a, b, units, target)

    roles = []
    for a, b in zip(shallow.roles, deeper.roles):
        target = shape.rank_units(b.role, pp)
        allocated = peak_at_depth(a, b, shape, units, target)
        # What the caching allocator holds beyond the allocated bytes: the larger of the two recordings', not grown.
        # Between three repeats and four it jumps by whole large blocks (deepseek_v3_671b EP 2, full AC: 2.7, then
        # 12.0 GiB), which a line on a log scale, as this was, took 9 times over to 58 repeats (+87 GiB); it
        # misses llama3_8b's slow growth (5.0, 6.5, 7.8, 9.4 GiB at 4, 8, 16, 32 layers).
        cached = max(a.peak_reserved - a.peak_allocated, b.peak_reserved - b.peak_allocated, 0)
        roles.append(replace(
            b, peak_allocated=int(allocated), peak_reserved=int(allocated + cached),
            at_peak={name: int(line(a.at_peak.get(name, 0), value, target)) for name, value in b.at_peak.items()}))
    # The step lasts as long as the stage with the most repeats makes it.
    target = max(shape.rank_units(stage, pp) for stage in range(pp))
    ta, tb = shallow.timing, deeper.timing
    timing = _timing_along(ta, tb, lambda a, b: line(a, b, target), by_module_class=dict(tb.by_module_class),
                           by_module=_full_depth_modules(tb.by_module, shape, pp, line(
                               ta.by_module.get("optimizer", 0.0), tb.by_module.get("optimizer", 0.0), target)))
    info = dict(deeper.info)
    held = [stage for stage in range(len(shape.stages)) if any(n.startswith("layers.") for n in shape.stages[stage])]
    total_units = sum(shape.units(stage) for stage in range(len(shape.stages)))
    info["flops_per_token"] = depth.extrapolate(shallow.info["flops_per_token"], deeper.info["flops_per_token"],
                                                (units[0] * len(held), units[1] * len(held)), total_units)
    return replace(deeper, roles=roles, timing=timing, info=info, seconds=seconds,
                   extrapolated={**depth.describe(shape), "units_recorded": list(units)})

"""The plan as ``npu-inject plan`` shows it: text lines, the JSON document and the PNG.

Every function takes what :mod:`npu_inject.planner.job` planned (a plan, its timing) and the hardware
profile, and returns lines or a dict; the command prints and writes them.
"""

from __future__ import annotations

from typing import Any

from npu_inject.planner import host_memory, search
from npu_inject.planner.job import GIB
from npu_inject.planner.stages import stage_list


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _shown_roles(plan) -> list:
    roles = plan.roles
    if len(roles) <= 4:
        return roles
    picks = {roles[0].role, plan.worst.role, roles[-1].role}
    return [role for role in roles if role.role in picks]


def memory_lines(plan) -> list[str]:
    from npu_inject.planner.memory import CATEGORIES

    roles = _shown_roles(plan)
    width = 10
    head = "".join(f"{f'pp rank {r.role}' if plan.parallel['pp'] > 1 else f'rank {r.rank}':>{width}}" for r in roles)
    lines = [f"memory per rank (GiB; the device holds {gib(plan.capacity)}){'':4}{head}"]

    def row(label: str, values) -> None:
        lines.append(f"  {label:46}" + "".join(f"{gib(v):>{width}}" for v in values))

    for category in CATEGORIES:
        row(category, [r.at_peak.get(category, 0) for r in roles])
    row("+ the allocator's rounding and padding", [r.peak_allocated - sum(r.at_peak.values()) for r in roles])
    row("= allocated at the peak (max_memory_allocated)", [r.peak_allocated for r in roles])
    row("+ cached, unused: fragmentation at the peak", [r.peak_reserved - r.peak_allocated for r in roles])
    row("= reserved (max_memory_reserved)", [r.peak_reserved for r in roles])
    row("+ HCCL buffers (outside the allocator)", [r.comm_buffers for r in roles])
    row("+ CANN runtime and driver (outside it)", [r.runtime for r in roles])
    row("= the device must hold", [r.total for r in roles])
    if len(roles) < len(plan.roles):
        lines.append(f"  ({len(roles)} of {len(plan.roles)} pipeline ranks shown: the first, the fullest, the last)")
    return lines


def time_by_module(timing) -> dict[str, float]:
    """Seconds per step by torchtitan's module names, in the model's order (embeddings, layers, norm, output),
    then the loss and the optimizer: the compute stream's busy time on the slowest role."""
    def order(name: str):
        if name.startswith("layers."):
            return (1, int(name.split(".")[1]), name)
        return ({"loss": 3, "optimizer": 4}.get(name, 0 if name in ("tok_embeddings", "embeddings") else 2), 0, name)
    return {name: timing.by_module[name] for name in sorted(timing.by_module, key=order)}


def time_by_class(timing) -> dict[str, dict[str, float]]:
    """Seconds per step by operator class, then phase (forward, backward, optimizer; recomputation is backward)."""
    classes: dict[str, dict[str, float]] = {}
    for (op_class, phase), seconds in sorted(timing.by_class.items(), key=lambda item: -item[1]):
        classes.setdefault(op_class, {})[phase] = seconds
    return classes


def where_lines(timing) -> list[str]:
    """Where the time goes: the largest modules (a layer block's repeats summed) and operator classes."""
    modules = time_by_module(timing)
    layers = [seconds for name, seconds in modules.items() if name.startswith("layers.")]
    grouped = {name: seconds for name, seconds in modules.items() if not name.startswith("layers.")}
    if layers:
        grouped[f"layers (x{len(layers)}, {max(layers) * 1e3:.1f} ms the slowest)"] = sum(layers)
    total = sum(grouped.values()) or 1.0
    by_module = ", ".join(f"{name} {seconds:.3f} ({seconds / total:.0%})"
                          for name, seconds in sorted(grouped.items(), key=lambda item: -item[1]))
    by_class = ", ".join(f"{name} {sum(phases.values()):.3f}" for name, phases in
                         sorted(time_by_class(timing).items(), key=lambda item: -sum(item[1].values())))
    return [f"  compute by module (s): {by_module}", f"  compute by operator class (s): {by_class}"]


def rates_line(profile, efficiency: dict[str, float]) -> str:
    """Which kernel rates the plan's times come from, and where its overhead term comes from."""
    if profile.rates is not None:
        kernels = f"kernel rates: {profile.rates.about}" + (" (PARTIAL)" if profile.rates.partial else "")
    else:
        kernels = (f"kernel rates: the {profile.family} family's fractions of the peaks (matmul {efficiency['cube']:.3f}, "
                   f"attention {efficiency['attention']:.3f}); npu-inject calibrate measures them on the machine")
    overhead = profile.overhead if profile.overhead is not None else efficiency.get("overhead", 0.0)
    whose = f"{profile.name}'s own" if profile.overhead is not None else f"the {profile.family} family's, fitted"
    return f"  {kernels}; overhead {overhead:.3f} ({whose}; hardware.json)"


def time_lines(plan) -> list[str]:
    timing = plan.timing
    comm = ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in sorted(timing.comm_s.items(), key=lambda kv: -kv[1]))
    lines = [
        f"time per step {timing.step_s:.3f} s = compute {timing.compute_s:.3f} (optimizer {timing.optimizer_s:.3f}) "
        f"+ exposed communication and waits {timing.exposed_comm_s:.3f} + pipeline bubble {timing.bubble_s:.3f}"
        f" + host waits {timing.host_wait_s:.3f}"
        + (f" + overhead {timing.overhead_s:.3f}" if timing.overhead_s else ""),
        *where_lines(timing),
        *attention_range_lines(plan),
        *host_read_lines(timing),
        f"  collectives, busy time on their links (s): {comm or '-'}",
        *exposure_lines(timing),
        f"  {timing.kernels} kernel launches per step, {timing.host_s:.3f} s of the host's time to issue its operators "
        + ("(more than the device's compute: host-bound, the device waits on launches)" if timing.host_bound
           else "(less than the device's compute: the device sets the pace)"),
        f"throughput {plan.tokens_per_s_per_npu:,.0f} tokens/s per NPU, MFU {plan.mfu:.1%} "
        f"(of {plan.info['peak_flops'] / 1e12:.1f} TFLOPS BF16 dense)",
    ]
    lines.extend(matmul_check_lines(plan))
    ft = plan.info.get("torchft")
    if ft:
        groups = ft["replica_groups"]
        lines.append(
            f"torchft, {groups} replica groups of these {plan.world_size} ranks: each step every rank all-reduces its "
            f"{ft['allreduce_bytes'] / 2**20:,.1f} MiB of gradient shards with its peers in the other groups over the "
            f"scale-out links, {ft['allreduce_s']:.3f} s when nothing hides it (not in the time above: the "
            f"step is {timing.step_s + ft['allreduce_s']:.3f} s at worst)")
    return lines


def exposure_lines(timing) -> list[str]:
    """Each group's collectives (named by the mesh dimensions they span): busy time, and how much of it the compute
    stream waited on. Context parallelism's ring exchange is the one to read for overlap: issued a block ahead, its
    waited share is what attention did not hide."""
    if not timing.comm_by_group_s:
        return []
    parts = []
    for name, busy in sorted(timing.comm_by_group_s.items(), key=lambda kv: -kv[1]):
        if busy < 0.0005 or name.split()[-1] in ("send", "recv"):  # 0.000 s, and the pipeline's (its bubble): left out
            continue
        # Waited can pass busy: a collective queued behind others on its link keeps the stream waiting that long too.
        waited = timing.waited_by_group_s.get(name, 0.0)
        parts.append(f"{name} {waited:.3f} of {busy:.3f} busy ({max(1 - waited / busy, 0.0):.0%} hidden)")
    return [f"  collectives by mesh dimension, the compute stream waiting on them (s): {', '.join(parts)}"] if parts else []


def host_read_lines(timing) -> list[str]:
    """The step's host reads by site (npu_inject/planner/host_reads.py) and the device time they cost."""
    if not timing.host_reads:
        return ["  host reads on the step's path: none marked (host waits 0)"]
    sites = ", ".join(f"{site} x{count:g}" for site, count in sorted(timing.host_reads.items(), key=lambda kv: -kv[1]))
    return [f"  host reads per step {sum(timing.host_reads.values()):g}, the device idle {timing.host_wait_s * 1e3:.2f} "
            f"ms after them (the host waits for the device at each, then issues again): {sites}"]


def attention_range(plan) -> tuple[float, float, float] | None:
    """Attention's seconds per step at the profile's rates, and at the fast and slow ends of their ranges (rates
    taken from others' measurements carry the span of their sources); None where the rates carry no range."""
    ratio = plan.info.get("attention_rate_range")
    seconds = sum(time_by_class(plan.timing).get("attention", {}).values())
    if not ratio or not seconds:
        return None
    return seconds, seconds * ratio["fast"], seconds * ratio["slow"]


def attention_range_lines(plan) -> list[str]:
    spread = attention_range(plan)
    if spread is None:
        return []
    seconds, fast, slow = spread
    timing = plan.timing
    # The device's operators take the overhead's fraction longer (the time line's "+ overhead"), attention's too.
    stretch = 1.0 + (timing.overhead_s / timing.compute_s if timing.compute_s else 0.0)
    return [f"  attention {seconds:.3f} s at the profile's rates, {fast:.3f} to {slow:.3f} s across the ranges of their "
            f"sources (published points and estimates' bounds; the step {timing.step_s + (fast - seconds) * stretch:.3f} "
            f"to {timing.step_s + (slow - seconds) * stretch:.3f} s if attention's time moves it one for one)"]


def matmul_check_lines(plan) -> list[str]:
    """What patch matmul_checks would add (off by default): per checked step, and over every ``every`` steps."""
    cost = plan.info.get("matmul_check_seconds")
    if not cost or not (cost["dense"] + cost["grouped"]):
        return []
    import os

    from npu_inject import registry

    every = int(os.environ.get("TORCHTITAN_NPU_SDC_EVERY", "") or registry.load().patches["matmul_checks"].options["every"])
    added = cost["dense"] + cost["grouped"]
    step = plan.timing.step_s
    parts = f"{cost['dense']:.3f} s for the linears' products on CANN's V-ABFT kernel"
    if cost["grouped"]:
        parts += f", {cost['grouped']:.3f} s for the experts' grouped products on the torch check"
    return [f"  matmul_checks (+matmul_checks; off by default): a checked step adds {added:.3f} s ({added / step:.1%} of "
            f"the step: {parts}; memory-bound, EST, not measured on an NPU); checking every {every} steps: "
            f"{added / every / step:.2%}"]


def header(plan, profile, argv: list[str]) -> str:
    info = plan.info
    degrees = " x ".join(f"{name} {value}" for name, value in plan.parallel.items() if value > 1) or "one rank"
    accumulation = info["gradient_accumulation_steps"]
    return (f"{' '.join(argv)}\n  on {plan.world_size} x {profile.name}: "
            f"{degrees}; local batch {info['local_batch_size']} x seq {info['seq_len']}"
            + (f", {accumulation} microbatches accumulated" if accumulation > 1 else "")
            + (f"; allocator with expandable segments" if plan.expandable else ""))


def verdict(plan) -> str:
    worst = plan.worst
    # --search's figures are shallow plans: say which this one is, where the two are compared.
    depth = "planned shallow" if plan.extrapolated else "planned at full depth"
    if plan.fits:
        return f"FITS: the fullest rank needs {gib(worst.total)} of {gib(plan.capacity)} GiB ({depth})"
    over = worst.total - plan.capacity
    return (f"DOES NOT FIT: {'pp rank ' + str(worst.role) if plan.parallel['pp'] > 1 else 'each rank'} needs "
            f"{gib(worst.total)} GiB, {gib(over)} more than the {gib(plan.capacity)} the device holds ({depth})")


def notes(plan) -> list[str]:
    out = []
    if plan.info.get("compile"):
        out.append("torch.compile is planned as eager: its fusions are not modelled, so expect more tokens/s and "
                   "smaller activations than planned (the published compiled rows' throughput was planned 5-14% low: "
                   "Llama 3 8B on 8 and 128 H100 -13.6% and -13.3%, DeepSeek-V3 671B on 128 A3 dies -5.2%; "
                   "docs/planner.md, checked against published figures)")
    if plan.extrapolated:
        e = plan.extrapolated
        out.append(f"extrapolated from {e['units_recorded'][0]} and {e['units_recorded'][1]} repeats of the "
                   f"{e['period']}-layer block per stage to the model's {e['layers']} layers")
    if plan.info.get("microbatches_recorded"):
        low, high = plan.info["microbatches_recorded"]
        out.append(f"the pipeline's {plan.info['pp_microbatches']} microbatches per step extrapolated from recordings "
                   f"of {low} and {high}")
    reordered = plan.info.get("stages_reordered") or {}
    for donor in sorted(set(reordered.values())):
        copies = sorted(stage for stage, of in reordered.items() if of == donor)
        out.append(f"pipeline stage{'s' if len(copies) > 1 else ''} {stage_list(copies)} planned from stage {donor}'s "
                   "recording, reordered as their 1F1B schedule runs its parts (npu_inject/planner/stages.py)")
    load = plan.info.get("expert_load")
    if plan.parallel.get("ep", 1) > 1 and load:
        if load["ratio"] == 1.0:
            out.append("expert routing is planned balanced (each rank sends and receives tokens x top_k / ep rows; "
                       "--expert-load gives the busiest rank's share, measured or assumed)")
        else:
            out.append(f"expert routing: the busiest expert-parallel rank, planned here, receives {load['ratio']:.2f} "
                       f"times the balanced tokens x top_k / ep rows ({load['source']}); its grouped matmuls, "
                       "all-to-all and memory set the step")
    if any(role.retries for role in plan.roles):
        out.append("the allocator reaches the device's limit and releases its cache to continue (slower steps)")
    return out


def plan_dict(plan, candidate=None) -> dict[str, Any]:
    timing = plan.timing
    spread = attention_range(plan)
    data = {
        "fits": plan.fits,
        "hardware": plan.hardware,
        "world_size": plan.world_size,
        "parallel": plan.parallel,
        "capacity_bytes": plan.capacity,
        "peak_bytes_per_rank": {str(role.role): role.total for role in plan.roles},
        "roles": [{
            "pp_rank": role.role, "rank": role.rank, "fits": role.total <= plan.capacity and not role.failed,
            "peak_allocated_bytes": role.peak_allocated, "peak_reserved_bytes": role.peak_reserved,
            "comm_buffer_bytes": role.comm_buffers, "runtime_bytes": role.runtime, "total_bytes": role.total,
            "at_peak_bytes": role.at_peak, "communicators": role.communicators,
            # another pipeline stage's recording, reordered, stood for this one (npu_inject.planner.stages)
            "reordered_from": (plan.info.get("stages_reordered") or {}).get(role.role),
        } for role in plan.roles],
        "step_s": timing.step_s,
        "tokens_per_s_per_npu": plan.tokens_per_s_per_npu,
        "mfu": plan.mfu,
        "breakdown": {"compute_s": timing.compute_s, "optimizer_s": timing.optimizer_s,
                      "exposed_comm_s": timing.exposed_comm_s, "bubble_s": timing.bubble_s,
                      "overhead_s": timing.overhead_s, "host_wait_s": timing.host_wait_s,
                      "host_reads": timing.host_reads,
                      "comm_s": timing.comm_s, "comm_by_group_s": timing.comm_by_group_s,
                      "waited_by_group_s": timing.waited_by_group_s, "kernels": timing.kernels, "host_s": timing.host_s,
                      "host_bound": timing.host_bound},
        "time_by_module": time_by_module(timing),
        "time_by_class": time_by_class(timing),
        # attention's seconds at the fast and slow ends of its rates' sourced ranges (None: measured rates)
        "attention_range_s": [spread[1], spread[2]] if spread else None,
        "time_by_module_class": {module: {name: seconds for (owner, name), seconds in timing.by_module_class.items()
                                          if owner == module} for module in time_by_module(timing)},
        "tokens_per_step": plan.tokens_per_step,
        "torchft": plan.info.get("torchft"),
        "flops_per_token": plan.info["flops_per_token"],
        "expandable_segments": plan.expandable,
        "extrapolated": plan.extrapolated,
        "planned_in_s": plan.seconds,
        "command": plan.argv,
    }
    if candidate is not None:
        data["flags"] = search.flags_text(candidate).split()
        data["description"] = candidate.describe()
    if plan.extrapolated:  # a shallow plan (the search's): its verdict may differ at full depth this near the limit
        data["near_the_limit"] = search.near_the_limit(plan)
    return data


def write_plot(path: str, plan, title: str) -> None:
    # A Figure without pyplot: no GUI backend, no global state.
    from matplotlib.figure import Figure

    from npu_inject.planner.memory import CATEGORIES

    worst = plan.worst
    figure = Figure(figsize=(13, 5), layout="constrained")
    memory_axes, time_axes = figure.subplots(1, 2, width_ratios=(2, 1))
    points = worst.timeline
    x = [point[0] for point in points]
    stacks = [[point[3].get(category, 0) / GIB for point in points] for category in CATEGORIES]
    memory_axes.stackplot(x, *stacks, labels=CATEGORIES, alpha=0.75)
    memory_axes.plot(x, [p[1] / GIB for p in points], color="black", linewidth=1, label="allocated")
    memory_axes.plot(x, [p[2] / GIB for p in points], color="tab:red", linewidth=1, label="reserved")
    memory_axes.axhline((plan.capacity - worst.comm_buffers - worst.runtime) / GIB, color="gray", linestyle="--",
                        label="device less HCCL buffers and runtime")
    depth_note = " (shallow recording)" if plan.extrapolated else ""
    memory_axes.set_title(f"{'pp rank ' + str(worst.role) if plan.parallel['pp'] > 1 else 'rank 0'} memory over "
                          f"the recorded steps{depth_note}")
    memory_axes.set_xlabel("operator")
    memory_axes.set_ylabel("GiB")
    memory_axes.legend(fontsize="small", loc="upper left")
    memory_axes.grid(alpha=0.3)
    timing = plan.timing
    parts = [("compute", timing.compute_s - timing.optimizer_s), ("optimizer", timing.optimizer_s),
             ("exposed comm. / waits", timing.exposed_comm_s), ("pipeline bubble", timing.bubble_s),
             ("host waits", timing.host_wait_s)]
    left = 0.0
    for label, seconds in parts:
        time_axes.barh(["step"], [seconds], left=left, label=f"{label} {seconds:.3f} s")
        left += seconds
    for kind, seconds in sorted(timing.comm_s.items()):
        time_axes.barh([kind], [seconds], color="tab:gray")
    time_axes.set_xlabel("seconds (collectives: busy time on their links)")
    time_axes.set_title(f"step {timing.step_s:.3f} s, {plan.tokens_per_s_per_npu:,.0f} tokens/s/NPU, MFU {plan.mfu:.1%}")
    time_axes.legend(fontsize="small")
    figure.suptitle(title, fontsize="medium")
    figure.savefig(path, dpi=110)


def host_lines(plan, available: int, source: str) -> list[str]:
    """The host's verdict for the rehearsal's ranks together (they share its memory), with ``available`` bytes."""
    need, asked = host_memory.host_need(plan), host_memory.host_asked(plan)
    baseline, margin = host_memory.PROCESS_BASELINE_BYTES, host_memory.HOST_MARGIN
    ranks_per_role = plan.world_size // len(plan.roles)
    per_rank = " + ".join(f"{ranks_per_role} x {gib(role.total)}" for role in plan.roles)
    lines = [f"host memory (the rehearsal runs all {plan.world_size} ranks here): about {gib(need)} GiB = "
             f"{per_rank} GiB planned + {plan.world_size} x {gib(baseline)} GiB each process holds "
             f"for torch and torchtitan; {gib(asked)} GiB with the {margin - 1:.0%} margin the measured "
             f"runs needed (docs/planner.md); {gib(available)} GiB available now ({source})"]
    if asked <= available:
        lines.append(f"FITS THIS HOST: about {gib(asked)} of {gib(available)} GiB available")
    else:
        lines.append(f"DOES NOT FIT THIS HOST: about {gib(asked)} GiB, {gib(asked - available)} more than the "
                     f"{gib(available)} available; rehearse a smaller shape (--training.seq_len, "
                     "--training.local_batch_size; npu-inject suite --shrink)")
    return lines


def host_dict(plan, available: int, argv: list[str]) -> dict[str, Any]:
    """The host's verdict in the JSON document (its ``host`` key)."""
    asked = host_memory.host_asked(plan)
    return {"need_bytes": host_memory.host_need(plan), "asked_bytes": asked, "margin": host_memory.HOST_MARGIN,
            "available_bytes": available, "fits": asked <= available,
            "process_baseline_bytes": host_memory.PROCESS_BASELINE_BYTES, "argv": argv}


def best_candidate(result):
    """The search's fastest fitting layout (its candidate), whose full-depth plan is ``result.best`` (its shallow
    plan may have been just over the device's memory: :func:`search.near_the_limit`)."""
    return next(o.candidate for o in result.outcomes if o.plan is result.best_shallow)


def search_lines(result, facts: dict[str, Any], ranks: int, profile) -> list[str]:
    """The search's table: the layouts that fit, fastest first, then the fastest planned again at full depth."""
    fitting = result.fitting()
    planned = [o for o in result.outcomes if o.plan is not None]
    lines = [f"{facts['model']} on {ranks} x {profile.name}: {len(planned)} layouts planned, {len(fitting)} fit "
             f"({sum(1 for o in result.outcomes if o.refused)} refused by torchtitan, "
             f"{sum(1 for o in result.outcomes if o.pruned)} pruned) in {result.seconds:.0f} s",
             f"{'tokens/s/NPU':>12} {'MFU':>6} {'step s':>8} {'GiB':>6}  layout"]
    for outcome in fitting:
        plan = outcome.plan
        lines.append(f"{plan.tokens_per_s_per_npu:12,.0f} {plan.mfu:6.1%} {plan.step_s:8.3f} "
                     f"{plan.worst.total / GIB:6.1f}{'*' if search.near_the_limit(plan) else ' '} "
                     f"{outcome.candidate.describe()}")
    if planned:
        # The table's figures are not a single plan's: say which they are, and when a single plan may differ.
        e = planned[0].plan.extrapolated
        depth = (f"{e['units_recorded'][0]} and {e['units_recorded'][1]} repeats of the layer block per stage, "
                 "extrapolated" if e else "recorded at full depth")
        lines.append(f"  (each layout planned shallow: {depth}; * within {search.SHALLOW_MEMORY_ERROR:.0%} of the "
                     f"device's {planned[0].plan.capacity / GIB:.1f} GiB, where a full-depth plan, its flags without "
                     "--search, may give the other verdict)")
    if result.best is not None:
        best, shallow_best = result.best, result.best_shallow
        lines.append(f"the fastest, planned at full depth: {best.tokens_per_s_per_npu:,.0f} tokens/s/NPU, "
                     f"{best.worst.total / GIB:.1f} GiB ({'fits' if best.fits else 'does not fit'}); the shallow "
                     f"plan said {shallow_best.tokens_per_s_per_npu:,.0f} tokens/s/NPU "
                     f"({(shallow_best.step_s / best.step_s - 1):+.1%} step time), "
                     f"{shallow_best.worst.total / GIB:.1f} GiB "
                     f"({(shallow_best.worst.total / best.worst.total - 1):+.1%})"
                     + ("" if shallow_best.fits else ", just over the device: planned at full depth for that"))
        lines.append("  its flags: " + search.flags_text(best_candidate(result)))
    elif fitting:
        lines.append("none of the three fastest fits when planned at full depth: see docs/planner.md#how-it-works (4.)")
    else:
        lines.append("no layout fits: more ranks, or a smaller global batch or sequence")
    return lines


def search_dict(result) -> dict[str, Any]:
    """The search in the JSON document: the layouts planned (those that fit first, fastest first), those
    torchtitan refused or the search pruned, and the fastest planned at full depth."""
    fitting = result.fitting()
    planned = [o for o in result.outcomes if o.plan is not None]
    ordered = fitting + [o for o in planned if not o.plan.fits]
    return {
        "schema": 1, "search": True, "fits": result.best is not None,
        "layouts": [plan_dict(o.plan, o.candidate) for o in ordered],
        "refused": [{"description": o.candidate.describe(), "reason": o.refused} for o in result.outcomes if o.refused],
        "pruned": [{"description": o.candidate.describe(), "reason": o.pruned} for o in result.outcomes if o.pruned],
        "best": plan_dict(result.best, best_candidate(result)) if result.best is not None else None,
        "searched_in_s": result.seconds,
    }

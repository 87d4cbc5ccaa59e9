"""``npu-inject plan``: will this job fit, how fast will it go, and which layout is best.

    npu-inject plan [--hardware NAME] [--ngpu N | --nnodes N --nproc-per-node M] [--search]
                    [--json PATH] [--plot PATH] [--hardware-file PATH] [--expandable-segments]
                    <torchtitan flags, as the training command takes them>

The planner's flags come first; everything from the first flag it does not know is torchtitan's,
``activation-checkpoint:MODE`` last, exactly as the planned ``torchrun ... -m torchtitan.train`` takes
them. How it works and what it cannot know: ``docs/planner.md``. Stdlib only at import; the planner
(torch, torchtitan) runs in worker processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from npu_inject import hardware as hardware_mod
from npu_inject.errors import ConfigError

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_ERROR = 0, 1, 2
GIB = 2**30
ALLOC_CONF_ENV = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
SEARCH_UNITS = 1  # the search plans each layout with 1 and 2 repeats of the layer block per stage


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="will a torchtitan job fit each NPU, how fast will it go, which layout is best",
        description=(
            "Plan a torchtitan training job without an NPU: one step of it is built and run on fake tensors "
            "for each pipeline rank, its memory replayed through a model of torch_npu's caching allocator and "
            "its operators and collectives timed by a model of the hardware. The planner's flags first, then "
            "torchtitan's as the training command takes them. Exit 0: fits; 1: does not fit (the advice says "
            "what would); 2: the job cannot be planned (one line says why)."),
        epilog="How it works, what it cannot know and how to add hardware: docs/planner.md",
    )
    parser.add_argument("--hardware", metavar="NAME",
                        help="the device: a SoC name as torch_npu reports it (Ascend910B2, Ascend910_9382, ...), "
                             "or A2, A3, 950, H100, H200, cpu (default: the visible NPU's)")
    parser.add_argument("--hardware-file", metavar="PATH", help="more hardware profiles (format of hardware.json)")
    world = parser.add_mutually_exclusive_group()
    world.add_argument("--ngpu", type=int, metavar="N", help="ranks in the job (torchrun's nnodes x nproc_per_node)")
    world.add_argument("--nnodes", type=int, metavar="N", help="nodes, with --nproc-per-node")
    parser.add_argument("--nproc-per-node", type=int, metavar="M", help="ranks per node, with --nnodes")
    parser.add_argument("--search", action="store_true",
                        help="plan every layout of the job's ranks (parallel degrees, activation checkpointing, "
                             "local batch) and list those that fit, fastest first")
    parser.add_argument("--json", metavar="PATH", help="write the plan (or the search's layouts) as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write the memory timeline and the step breakdown as a PNG")
    parser.add_argument("--expandable-segments", action=argparse.BooleanOptionalAction, default=None,
                        help="plan the allocator with expandable segments (default: as PYTORCH_NPU_ALLOC_CONF / "
                             "PYTORCH_ALLOC_CONF say)")
    parser.add_argument("torchtitan", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(run=cmd_plan)
    return parser


def split_argv(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(the planner's arguments, torchtitan's): the planner's are the leading ones it knows."""
    takes_value = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        for option in action.option_strings:
            takes_value[option] = action.nargs != 0
    index = 0
    while index < len(argv):
        name = argv[index].split("=", 1)[0]
        if name not in takes_value:
            break
        index += 1 + (takes_value[name] and "=" not in argv[index])
    misplaced = [arg for arg in argv[index:] if arg.split("=", 1)[0] in takes_value]
    if misplaced and argv[index:]:
        raise ConfigError(f"{misplaced[0].split('=', 1)[0]} is npu-inject plan's flag: put it before torchtitan's "
                          f"(which start at {argv[index]})")
    return argv[:index], argv[index:]


# -- inputs ----------------------------------------------------------------------

def world_size(args) -> int:
    if args.ngpu is not None:
        if args.ngpu < 1:
            raise ConfigError(f"--ngpu {args.ngpu}: the job needs at least one rank")
        return args.ngpu
    if args.nnodes is not None or args.nproc_per_node is not None:
        if args.nnodes is None or args.nproc_per_node is None or args.nnodes < 1 or args.nproc_per_node < 1:
            raise ConfigError("--nnodes N and --nproc-per-node M go together, both >= 1")
        return args.nnodes * args.nproc_per_node
    raise ConfigError("how many ranks? give --ngpu N, or --nnodes N --nproc-per-node M")


def expandable_segments(args) -> bool:
    if args.expandable_segments is not None:
        return args.expandable_segments
    for name in ALLOC_CONF_ENV:
        for option in os.environ.get(name, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return False


def visible_device() -> str | None:
    """The SoC name of the NPU this machine shows, or None (probed in a child: torch_npu loads CANN)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torch_npu") is None:
        return None
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, torch_npu; print(torch.npu.get_device_name(0))"],
        capture_output=True, text=True, env={**os.environ, "TORCHTITAN_NPU": "0"})
    return probe.stdout.strip() or None if probe.returncode == 0 else None


def resolve_hardware(args, catalog: hardware_mod.Catalog) -> hardware_mod.Profile:
    name = args.hardware or visible_device()
    if name is None:
        raise ConfigError(f"no NPU visible here: give --hardware NAME (known: {', '.join(catalog.names())})")
    return catalog.find(name)


# -- report ----------------------------------------------------------------------

def _gib(value: float) -> str:
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
    lines = [f"memory per rank (GiB; the device holds {_gib(plan.capacity)}){'':4}{head}"]

    def row(label: str, values) -> None:
        lines.append(f"  {label:46}" + "".join(f"{_gib(v):>{width}}" for v in values))

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
    """Which kernel rates the plan's times come from, and the overhead term's origin."""
    if profile.rates is not None:
        kernels = f"kernel rates measured ({profile.rates.about}" + (", PARTIAL" if profile.rates.partial else "") + ")"
    else:
        kernels = (f"kernel rates: the {profile.family} family's fractions of the peaks (matmul {efficiency['cube']:.3f}, "
                   f"attention {efficiency['attention']:.3f}); npu-inject calibrate measures them on the machine")
    return f"  {kernels}"


def time_lines(plan) -> list[str]:
    timing = plan.timing
    comm = ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in sorted(timing.comm_s.items(), key=lambda kv: -kv[1]))
    lines = [
        f"time per step {timing.step_s:.3f} s = compute {timing.compute_s:.3f} (optimizer {timing.optimizer_s:.3f}) "
        f"+ exposed communication and waits {timing.exposed_comm_s:.3f} + pipeline bubble {timing.bubble_s:.3f}"
        + (f" + overhead {timing.overhead_s:.3f}" if timing.overhead_s else ""),
        *where_lines(timing),
        f"  collectives, busy time on their links (s): {comm or '-'}",
        f"  {timing.kernels} kernel launches per step, {timing.host_s:.3f} s of the host's time to issue its operators "
        + ("(more than the device's compute: host-bound, the device waits on launches)" if timing.host_bound
           else "(less than the device's compute: the device sets the pace)"),
        f"throughput {plan.tokens_per_s_per_npu:,.0f} tokens/s per NPU, MFU {plan.mfu:.1%} "
        f"(of {plan.info['peak_flops'] / 1e12:.1f} TFLOPS BF16 dense)",
    ]
    return lines


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
    if plan.fits:
        return f"FITS: the fullest rank needs {_gib(worst.total)} of {_gib(plan.capacity)} GiB"
    over = worst.total - plan.capacity
    return (f"DOES NOT FIT: {'pp rank ' + str(worst.role) if plan.parallel['pp'] > 1 else 'each rank'} needs "
            f"{_gib(worst.total)} GiB, {_gib(over)} more than the {_gib(plan.capacity)} the device holds")


def notes(plan) -> list[str]:
    out = []
    if plan.info.get("compile"):
        out.append("torch.compile is planned as eager (its fusions would save time and activations)")
    if plan.extrapolated:
        e = plan.extrapolated
        out.append(f"extrapolated from {e['units_recorded'][0]} and {e['units_recorded'][1]} repeats of the "
                   f"{e['period']}-layer block per stage to the model's {e['layers']} layers")
    if plan.parallel.get("ep", 1) > 1:
        out.append("expert routing is planned balanced (each rank sends and receives tokens x top_k / ep rows)")
    if any(role.retries for role in plan.roles):
        out.append("the allocator reaches the device's limit and releases its cache to continue (slower steps)")
    return out


def plan_dict(plan, candidate=None) -> dict[str, Any]:
    timing = plan.timing
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
        } for role in plan.roles],
        "step_s": timing.step_s,
        "tokens_per_s_per_npu": plan.tokens_per_s_per_npu,
        "mfu": plan.mfu,
        "breakdown": {"compute_s": timing.compute_s, "optimizer_s": timing.optimizer_s,
                      "exposed_comm_s": timing.exposed_comm_s, "bubble_s": timing.bubble_s,
                      "overhead_s": timing.overhead_s,
                      "comm_s": timing.comm_s, "kernels": timing.kernels, "host_s": timing.host_s,
                      "host_bound": timing.host_bound},
        "time_by_module": time_by_module(timing),
        "time_by_class": time_by_class(timing),
        "time_by_module_class": {module: {name: seconds for (owner, name), seconds in timing.by_module_class.items()
                                          if owner == module} for module in time_by_module(timing)},
        "tokens_per_step": plan.tokens_per_step,
        "flops_per_token": plan.info["flops_per_token"],
        "expandable_segments": plan.expandable,
        "extrapolated": plan.extrapolated,
        "planned_in_s": plan.seconds,
        "command": plan.argv,
    }
    if candidate is not None:
        from npu_inject.planner import search

        data["flags"] = search.flags_text(candidate).split()
        data["description"] = candidate.describe()
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
             ("exposed comm. / waits", timing.exposed_comm_s), ("pipeline bubble", timing.bubble_s)]
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


# -- advice ----------------------------------------------------------------------

def advice(argv: list[str], plan, run_variant) -> list[str]:
    """For a plan that does not fit: what would, each variant planned (shallow) to say so."""
    from npu_inject.planner import search

    info = plan.info
    layout = search.Layout(*(plan.parallel[name] for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")))
    global_batch = plan.tokens_per_step // info["seq_len"]
    current_ac = next((arg.split(":", 1)[1] for arg in argv if arg.startswith("activation-checkpoint:")), None)
    variants = []
    if current_ac != "full":
        variants.append(search.Candidate(layout, info["local_batch_size"], "full", global_batch))
    if info["local_batch_size"] > 1:
        variants.append(search.Candidate(layout, info["local_batch_size"] // 2, current_ac or "selective", global_batch))
    lines = []
    for candidate in variants:
        try:
            variant = run_variant(candidate.argv(argv))
        except Exception as exc:  # noqa: BLE001 -- a variant torchtitan refuses is reported, not fatal
            lines.append(f"  {search.flags_text(candidate)}: cannot be planned ({str(exc).splitlines()[0]})")
            continue
        state = "fits" if variant.fits else "does not fit"
        lines.append(f"  {candidate.describe()}: {state}, {_gib(variant.worst.total)} GiB, "
                     f"{variant.tokens_per_s_per_npu:,.0f} tokens/s/NPU")
    worst = plan.worst
    states = sum(worst.at_peak.get(name, 0) for name in ("parameters", "gradients", "optimizer states"))
    if states > 0.5 * plan.capacity:
        lines.append(f"  parameters, gradients and optimizer states alone take {_gib(states)} GiB per rank: "
                     "shard them over more ranks (dp_shard, tp, pp, or ep for experts); --search plans the layouts")
    elif not lines:
        lines.append("  --search plans every layout of these ranks and lists those that fit")
    return lines


# -- the CPU rehearsal: every rank on this host, sharing its memory ----------------

# VmRSS of a process once torch 2.14.1 and torchtitan 0.3.0's trainer are imported (0.81 GiB measured on
# this project's machine): what each rank holds besides its tensors.
PROCESS_BASELINE_BYTES = int(0.8 * GIB)

# The plan fell short of the rehearsal's measured peak on every job checked: -13% to -39% (median -22%) over
# the 30 cases of upstream's suite that ran at its shapes with a plan (docs/suite.md, "The rehearsal at
# upstream's shapes"; override_fused_swiglu 6.3 GiB planned, 10.4 measured): CPU malloc's caching and what the
# plan leaves out (the data loader, gloo's buffers). The verdict asks for the plan times this margin, which
# covers the largest measured shortfall (x1.64), so a case it lets start is not ended by the OOM killer.
HOST_MARGIN = 1.7


def rehearsal_job(argv: list[str]) -> tuple[list[str], str]:
    """The job as the CPU rehearsal runs it: in the compute dtype ``rehearsal_dtype`` picks on this host
    (float32 where the CPU has no native bf16), and the sentence saying which and why."""
    from npu_inject.commands.suite import with_flags
    from npu_inject.patches import rehearsal_dtype

    configured = "bfloat16"  # torchtitan's default
    for index, token in enumerate(argv):
        if token.split("=", 1)[0] == "--training.mixed_precision_param":
            configured = token.split("=", 1)[1] if "=" in token else argv[index + 1]
    figures = rehearsal_dtype.bf16_slowdown() if configured != "float32" else None
    dtype, why = rehearsal_dtype.decide("auto", configured, figures)
    return (argv if dtype == configured else with_flags(argv, ["--training.mixed_precision_param", dtype])), why


def mem_available() -> tuple[int, str]:
    """(bytes this host can give new processes now, where that figure comes from)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:  # not Linux: the physical memory, and the output says so
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory, no /proc/meminfo"


def host_need(plan) -> int:
    """Bytes the job's rank processes need together on this host: each rank's plan plus a process's own."""
    ranks_per_role = plan.world_size // len(plan.roles)
    return sum(ranks_per_role * (role.total + PROCESS_BASELINE_BYTES) for role in plan.roles)


def host_asked(plan) -> int:
    """Bytes the verdict asks the host for: the plan with the margin its measured shortfall needs."""
    return int(host_need(plan) * HOST_MARGIN)


def host_lines(plan, available: int, source: str) -> list[str]:
    need, asked = host_need(plan), host_asked(plan)
    ranks_per_role = plan.world_size // len(plan.roles)
    per_rank = " + ".join(f"{ranks_per_role} x {_gib(role.total)}" for role in plan.roles)
    lines = [f"host memory (the rehearsal runs all {plan.world_size} ranks here): about {_gib(need)} GiB = "
             f"{per_rank} GiB planned + {plan.world_size} x {_gib(PROCESS_BASELINE_BYTES)} GiB each process holds "
             f"for torch and torchtitan; {_gib(asked)} GiB with the {HOST_MARGIN - 1:.0%} margin the measured "
             f"runs needed (docs/planner.md); {_gib(available)} GiB available now ({source})"]
    if asked <= available:
        lines.append(f"FITS THIS HOST: about {_gib(asked)} of {_gib(available)} GiB available")
    else:
        lines.append(f"DOES NOT FIT THIS HOST: about {_gib(asked)} GiB, {_gib(asked - available)} more than the "
                     f"{_gib(available)} available; rehearse a smaller shape (--training.seq_len, "
                     "--training.local_batch_size; npu-inject suite --shrink)")
    return lines


# -- the command -----------------------------------------------------------------

def cmd_plan(args) -> int:
    from npu_inject.planner import job, workers
    from npu_inject.planner.session import PlanError

    argv = args.torchtitan
    if not argv:
        raise ConfigError("no torchtitan flags: give the training command's, e.g. --module llama3 --config llama3_8b")
    if args.search and args.hardware == hardware_mod.CPU:
        # The search's verdict is one rank's memory against one device's; the rehearsal's ranks share this host.
        raise ConfigError("--search with --hardware cpu: the rehearsal runs every rank on this host, so a layout's "
                          "verdict is the host's, which the search does not give; plan each layout without --search "
                          "(one verdict for all ranks), or search for an NPU (--hardware A2, A3, 950)")
    catalog = hardware_mod.load(args.hardware_file)
    profile = resolve_hardware(args, catalog)
    ranks = world_size(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    expandable = expandable_segments(args)
    efficiency = catalog.efficiency[profile.family]
    selection = os.environ.get("TORCHTITAN_NPU_PATCHES", "")
    pool = workers.executor(selection=selection, modules=job.model_packages(argv))
    plan_kwargs = dict(profile=profile, efficiency=efficiency, world_size=ranks, expandable=expandable, pool=pool)
    try:
        if args.search:
            return _search(args, argv, profile, ranks, pool, plan_kwargs)
        rehearsal = profile.family == hardware_mod.CPU
        if rehearsal:
            argv, why = rehearsal_job(argv)
        print(f"planning on {profile.name}, {ranks} ranks ...", file=sys.stderr, flush=True)
        plan = job.plan_job(argv, **plan_kwargs)
        print(header(plan, profile, argv))
        print(*memory_lines(plan), sep="\n")
        print(*time_lines(plan), sep="\n")
        print(rates_line(profile, efficiency))
        for note in notes(plan) + ([why] if rehearsal else []):
            print(f"note: {note}")
        extra: dict[str, Any] = {}
        if rehearsal:  # the ranks share the host: one verdict for all of them
            available, source = mem_available()
            asked = host_asked(plan)
            fits = asked <= available
            print(*host_lines(plan, available, source), sep="\n")
            extra["host"] = {"need_bytes": host_need(plan), "asked_bytes": asked, "margin": HOST_MARGIN,
                             "available_bytes": available, "fits": fits,
                             "process_baseline_bytes": PROCESS_BASELINE_BYTES, "argv": argv}
        else:
            fits = plan.fits
            print(verdict(plan))
            if not fits:
                print("what would fit (each planned shallow):")
                print(*advice(argv, plan, lambda variant: job.plan_job(
                    variant, units=SEARCH_UNITS, pp=plan.parallel["pp"], **plan_kwargs)), sep="\n")
        print(f"planned in {plan.seconds:.1f} s; what the plan cannot know: docs/planner.md#what-it-cannot-know")
        if args.json:
            _write_json(args.json, {"schema": 1, **plan_dict(plan), **extra})
        if args.plot:
            write_plot(args.plot, plan, header(plan, profile, argv).splitlines()[1].strip())
        return EXIT_OK if fits else EXIT_DOES_NOT_FIT
    except PlanError as exc:
        print(f"npu-inject plan: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        pool.shutdown(cancel_futures=True)


def _search(args, argv, profile, ranks, pool, plan_kwargs) -> int:
    from npu_inject.planner import job, search, workers

    facts = pool.submit(workers.describe, argv, ranks).result()
    print(f"searching the layouts of {facts['model']} on {ranks} x {profile.name} (global batch "
          f"{facts['global_batch_size']} x seq {facts['seq_len']}) ...", file=sys.stderr, flush=True)

    class Shallow:
        def __init__(self, variant, candidate):
            self.pending = job.submit(variant, world_size=ranks, pool=pool, units=SEARCH_UNITS, pp=candidate.layout.pp)

        def result(self):
            recording, self.pending = self.pending.result(), None  # the recording's traces go once evaluated
            return job.evaluate(recording, profile=profile, efficiency=plan_kwargs["efficiency"],
                                expandable=plan_kwargs["expandable"])

    def full(variant, candidate):
        return job.plan_job(variant, pp=candidate.layout.pp, **plan_kwargs)

    result = search.search(argv, facts, ranks, profile.scale_up_devices, Shallow,
                           progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True), full=full)
    fitting = result.fitting()
    planned = [o for o in result.outcomes if o.plan is not None]
    print(f"{facts['model']} on {ranks} x {profile.name}: {len(planned)} layouts planned, {len(fitting)} fit "
          f"({sum(1 for o in result.outcomes if o.refused)} refused by torchtitan, "
          f"{sum(1 for o in result.outcomes if o.pruned)} pruned) in {result.seconds:.0f} s")
    print(f"{'tokens/s/NPU':>12} {'MFU':>6} {'step s':>8} {'GiB':>6}  layout")
    for outcome in fitting:
        plan = outcome.plan
        print(f"{plan.tokens_per_s_per_npu:12,.0f} {plan.mfu:6.1%} {plan.step_s:8.3f} {plan.worst.total / GIB:6.1f}"
              f"  {outcome.candidate.describe()}")
    if result.best is not None:
        best, shallow_best = result.best, result.best_shallow
        print(f"the fastest, planned at full depth: {best.tokens_per_s_per_npu:,.0f} tokens/s/NPU, "
              f"{best.worst.total / GIB:.1f} GiB ({'fits' if best.fits else 'does not fit'}); the shallow plan said "
              f"{shallow_best.tokens_per_s_per_npu:,.0f} tokens/s/NPU "
              f"({(shallow_best.step_s / best.step_s - 1):+.1%} step time), {shallow_best.worst.total / GIB:.1f} GiB "
              f"({(shallow_best.worst.total / best.worst.total - 1):+.1%})")
        best_candidate = next(o.candidate for o in fitting if o.plan is shallow_best)
        print("  its flags: " + search.flags_text(best_candidate))
    elif fitting:
        print("none of the three fastest fits when planned at full depth: see docs/planner.md#how-it-works (4.)")
    else:
        print("no layout fits: more ranks, or a smaller global batch or sequence")
    if args.json:
        ordered = fitting + [o for o in planned if not o.plan.fits]
        _write_json(args.json, {
            "schema": 1, "search": True, "fits": result.best is not None,
            "layouts": [plan_dict(o.plan, o.candidate) for o in ordered],
            "refused": [{"description": o.candidate.describe(), "reason": o.refused} for o in result.outcomes if o.refused],
            "pruned": [{"description": o.candidate.describe(), "reason": o.pruned} for o in result.outcomes if o.pruned],
            "best": plan_dict(result.best, next(o.candidate for o in fitting if o.plan is result.best_shallow))
            if result.best is not None else None,
            "searched_in_s": result.seconds,
        })
    if args.plot and result.best is not None:
        write_plot(args.plot, result.best, f"the fastest layout: {search.flags_text(next(o.candidate for o in fitting if o.plan is result.best_shallow))}")
    return EXIT_OK if result.best is not None else EXIT_DOES_NOT_FIT


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")

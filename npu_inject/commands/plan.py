"""``npu-inject plan``: will this job fit, how fast will it go, and which layout is best.

    npu-inject plan [--hardware NAME] [--ngpu N | --nnodes N --nproc-per-node M] [--search]
                    [--json PATH] [--plot PATH] [--hardware-file PATH] [--expandable-segments]
                    [--expert-load RATIO|FILE]
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
import time
from typing import Any

from npu_inject import hardware as hardware_mod
from npu_inject.errors import ConfigError
from npu_inject.torchtitan_argv import with_flags

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_ERROR = 0, 1, 2
ALLOC_CONF_ENV = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


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
    parser.add_argument("--expert-load", metavar="RATIO|FILE",
                        help="MoE: how unevenly tokens fall on the expert-parallel ranks, the busiest rank's over "
                             "the mean's (>= 1), or a JSON file of router counts, tokens per expert per layer; the "
                             "planner plans the busiest rank (default: balanced)")
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


# -- advice ----------------------------------------------------------------------

def advice(argv: list[str], plan, run_variant, fewer_microbatches=None, progress=lambda line: None) -> list[str]:
    """For a plan that does not fit: the variants of its activation checkpointing and local batch that would, each
    planned (shallow) to say so; when none does, those tried and what might fit instead. A pipeline's smaller
    local batch with the same activation checkpointing is only fewer microbatches: ``fewer_microbatches(count)``
    plans it from the job's own recordings where they can say (else None). ``progress`` hears of each variant
    planned."""
    from npu_inject.planner import search
    from npu_inject.planner.config import PlanError
    from npu_inject.planner.render import gib

    info = plan.info
    layout = search.Layout(*(plan.parallel[name] for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")))
    global_batch = plan.tokens_per_step // info["seq_len"]
    # The job's own mode, whether its command line or its config chose it (llama3_70b's config says full).
    current_ac = next((arg.split(":", 1)[1] for arg in argv if arg.startswith("activation-checkpoint:")),
                      info.get("activation_checkpoint"))
    variants = []
    if current_ac != "full":
        variants.append(search.Candidate(layout, info["local_batch_size"], "full", global_batch))
    if info["local_batch_size"] > 1:
        variants.append(search.Candidate(layout, info["local_batch_size"] // 2,
                                         current_ac if current_ac in ("selective", "full") else "selective", global_batch))
    # The most frugal variant, one sequence per microbatch with full recomputation (the search's first pass plans
    # every layout so): when the others do not fit, it says whether any recomputation or batch change can.
    frugal = search.Candidate(layout, 1, "full", global_batch) if layout.pp == 1 else None
    microbatch_size = info["local_batch_size"] // max(info.get("pp_microbatches") or 1, 1)
    tried: list[tuple[str, bool, bool]] = []  # (its line, fits, its speed not given: a pipeline planned shallow)

    def plan_variant(candidate) -> None:
        same_recordings = (layout.pp > 1 and fewer_microbatches is not None and candidate.ac == current_ac)
        variant = fewer_microbatches(candidate.local_batch // microbatch_size) if same_recordings else None
        if variant is not None:
            # Its gradient accumulation doubles both the tokens and the pipeline passes of a step: the rate stays.
            tried.append((f"  {candidate.describe()}: {'fits' if variant.fits else 'does not fit'}, "
                          f"{gib(variant.worst.total)} GiB, {variant.tokens_per_s_per_npu:,.0f} tokens/s/NPU "
                          "(from the job's own recordings, at full depth)", variant.fits, False))
            return
        progress(f"planning the variant {candidate.describe()} (shallow)")
        try:
            variant = run_variant(candidate.argv(argv))
        except PlanError as exc:  # a variant torchtitan refuses is reported, not fatal
            tried.append((f"  {search.flags_text(candidate)}: cannot be planned ({str(exc).splitlines()[0]})", False,
                          False))
            return
        state = "fits" if variant.fits else "does not fit"
        # A shallow plan's speed is only given without pipelining: with stages it was 17.5% slow (llama3_8b PP 4)
        # and llama3_70b PP 4 with 512 microbatches said 90 tokens/s/NPU where the full plan says 267.
        speed = f", {variant.tokens_per_s_per_npu:,.0f} tokens/s/NPU" if layout.pp == 1 else ""
        # Every variant recomputes at least as much as the job, on no larger a batch: more memory than the job's
        # is the shallow plan's extrapolation, not the variant.
        above = (f" (above the job's own {gib(plan.worst.total)} GiB at full depth, which it cannot need: the "
                 "shallow plan's extrapolation is off here; plan the variant alone for its full-depth figure)"
                 if variant.worst.total > plan.worst.total else "")
        tried.append((f"  {candidate.describe()}: {state}, {gib(variant.worst.total)} GiB{speed}{above}", variant.fits,
                      layout.pp > 1))

    for candidate in variants:
        plan_variant(candidate)
    if (frugal is not None and not any(fits for _, fits, _ in tried)
            and all((c.local_batch, c.ac) != (frugal.local_batch, frugal.ac) for c in variants)):
        plan_variant(frugal)
    fitting = [entry for entry in tried if entry[1]]
    if fitting:
        lines = ["what would fit (each planned shallow unless said):", *(line for line, _, _ in fitting)]
    else:
        lines = [f"none of the {len(tried)} variants tried fits (each planned shallow unless said):",
                 *(line for line, _, _ in tried)] if tried else []
    if any(memory_only for _, _, memory_only in (fitting or tried)):
        lines.append("  (memory only: a pipeline's speed planned shallow is not reliable; plan a variant "
                     "with its flags for its speed)")
    worst = plan.worst
    states = sum(worst.at_peak.get(name, 0) for name in ("parameters", "gradients", "optimizer states"))
    shard_states = (f"  parameters, gradients and optimizer states alone take {gib(states)} GiB per rank: shard them "
                    "over more ranks (dp_shard, tp, pp, or ep for experts)" if states > 0.5 * plan.capacity else None)
    if fitting:
        return lines + ([f"{shard_states}; --search plans the layouts"] if shard_states else [])
    lines += ["what might fit instead:", *([shard_states] if shard_states else [])]
    experts, borrowed = info.get("experts"), layout.dp_shard * layout.cp * layout.tp
    if experts and search.largest_ep(experts, borrowed) > layout.ep:
        lines.append(f"  a larger expert-parallel degree: --parallelism.expert_parallel_degree up to "
                     f"{search.largest_ep(experts, borrowed)} (it divides the {experts} experts and dp_shard x cp x tp "
                     f"= {borrowed}; this job has {layout.ep}): each rank holds, gathers and reduces fewer experts")
    if layout.pp < search.MAX_PP:
        lines.append(f"  {'pipeline stages' if layout.pp == 1 else 'more pipeline stages'} "
                     "(--parallelism.pipeline_parallel_degree): each holds its share of the layers, their states "
                     "and activations")
    lines.append(f"  --search plans every layout of these {plan.world_size} ranks (degrees, recomputation, local "
                 "batch) and lists those that fit")
    return lines


# -- the CPU rehearsal --------------------------------------------------------

def rehearsal_job(argv: list[str]) -> tuple[list[str], str]:
    """The job as the CPU rehearsal runs it: in the compute dtype ``rehearsal_dtype`` picks on this host
    (float32 where the CPU has no native bf16), and the sentence saying which and why."""
    from npu_inject.rehearsal_compute_dtype import cpu_probe, decide

    configured = "bfloat16"  # torchtitan's default
    for index, token in enumerate(argv):
        if token.split("=", 1)[0] == "--training.mixed_precision_param":
            configured = token.split("=", 1)[1] if "=" in token else argv[index + 1]
    figures = cpu_probe() if configured != "float32" else None
    dtype, why = decide("auto", configured, figures)
    return (argv if dtype == configured else with_flags(argv, ["--training.mixed_precision_param", dtype])), why


# -- the command -----------------------------------------------------------------

def cmd_plan(args) -> int:
    from npu_inject.planner import depth, expert_load, host_memory, job, render, workers
    from npu_inject.planner.config import PlanError

    argv = args.torchtitan
    if not argv:
        raise ConfigError("no torchtitan flags: give the training command's, e.g. --module llama3 --config llama3_8b")
    if args.search and args.hardware == hardware_mod.CPU:
        # The search's verdict is one rank's memory against one device's; the rehearsal's ranks share this host.
        raise ConfigError("--search with --hardware cpu: the rehearsal runs every rank on this host, so a layout's "
                          "verdict is the host's, which the search does not give; plan each layout without --search "
                          "(one verdict for all ranks), or search for an NPU (--hardware A2, A3, 950)")
    started = time.monotonic()
    load = expert_load.parse(args.expert_load)  # before any worker starts: a bad value is one line
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
    progress = workers.Progress(started)
    print(f"{'searching' if args.search else 'planning'} on {profile.name}, {ranks} ranks ...", file=sys.stderr,
          flush=True)
    pool = workers.executor(selection=selection, modules=job.model_packages(argv), progress=progress,
                            expert_load=args.expert_load or "")
    plan_kwargs = dict(profile=profile, efficiency=efficiency, world_size=ranks, expandable=expandable, pool=pool)
    try:
        if args.search:
            return _search(args, argv, profile, ranks, pool, plan_kwargs, progress)
        rehearsal = profile.family == hardware_mod.CPU
        if rehearsal:
            argv, why = rehearsal_job(argv)
        evaluate_kwargs = dict(profile=profile, efficiency=efficiency, expandable=expandable)
        recording = job.record(argv, world_size=ranks, pool=pool, progress=progress)
        progress("recorded: replaying its memory through the allocator model and playing out its step")
        plan = job.evaluate(recording, progress=progress, **evaluate_kwargs)
        print(render.header(plan, profile, argv))
        print(*render.memory_lines(plan), sep="\n")
        print(*render.time_lines(plan), sep="\n")
        print(render.rates_line(profile, efficiency))
        for note in render.notes(plan) + ([why] if rehearsal else []):
            print(f"note: {note}")
        extra: dict[str, Any] = {}
        if rehearsal:  # the ranks share the host: one verdict for all of them
            available, source = host_memory.mem_available()
            extra["host"] = render.host_dict(plan, available, argv)
            fits = extra["host"]["fits"]
            print(*render.host_lines(plan, available, source), sep="\n")
        else:
            fits = plan.fits
            print(render.verdict(plan), flush=True)
            if not fits:
                print(*advice(argv, plan, lambda variant: job.plan_job(
                    variant, units=depth.SHALLOW_UNITS, pp=plan.parallel["pp"], progress=progress, **plan_kwargs),
                    lambda count: job.evaluate_microbatches(recording, count, progress=progress, **evaluate_kwargs),
                    progress), sep="\n")
        # The command's wall time: the pool's start, the recordings and the advice's plans, not only the recording.
        print(f"planned in {time.monotonic() - started:.1f} s; what the plan cannot know: "
              "docs/planner.md#what-it-cannot-know")
        if args.json:
            _write_json(args.json, {"schema": 1, **render.plan_dict(plan), **extra})
        if args.plot:
            render.write_plot(args.plot, plan, render.header(plan, profile, argv).splitlines()[1].strip())
        return EXIT_OK if fits else EXIT_DOES_NOT_FIT
    except PlanError as exc:
        print(f"npu-inject plan: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        pool.shutdown(cancel_futures=True)


def _search(args, argv, profile, ranks, pool, plan_kwargs, progress) -> int:
    from npu_inject.planner import depth, job, render, search, workers

    described = pool.submit(workers.describe, argv, ranks)
    for _ in workers.wait_for([described], progress, lambda _, seconds: (
            f"reading the job's configuration in the planner's workers ({seconds:.0f} s)")):
        facts = described.result()
    print(f"searching the layouts of {facts['model']} on {ranks} x {profile.name} (global batch "
          f"{facts['global_batch_size']} x seq {facts['seq_len']}) ...", file=sys.stderr, flush=True)

    class Shallow:
        def __init__(self, variant, candidate):
            layout = candidate.layout
            # The search knows the layout's facts: a pipeline's recordings start at once, not behind a describe
            # queued after every recording started before it.
            layout_facts = {**facts, "pp": layout.pp, "dp": layout.dp, "local_batch_size": candidate.local_batch,
                            "global_batch_size": candidate.global_batch}
            self.pending = job.submit(variant, world_size=ranks, pool=pool, units=depth.SHALLOW_UNITS, pp=layout.pp,
                                      facts=layout_facts)

        def wait(self, timeout):
            return self.pending is None or self.pending.wait(timeout)  # None: recorded and evaluated

        def result(self):
            recording, self.pending = self.pending.result(), None  # the recording's traces go once evaluated
            return job.evaluate(recording, profile=profile, efficiency=plan_kwargs["efficiency"],
                                expandable=plan_kwargs["expandable"], progress=progress)

    def full(variant, candidate):
        return job.plan_job(variant, pp=candidate.layout.pp, progress=progress, **plan_kwargs)

    result = search.search(argv, facts, ranks, profile.scale_up_devices, Shallow, progress=progress, full=full)
    print(*render.search_lines(result, facts, ranks, profile), sep="\n")
    if args.json:
        _write_json(args.json, render.search_dict(result))
    if args.plot and result.best is not None:
        render.write_plot(args.plot, result.best,
                          f"the fastest layout: {search.flags_text(render.best_candidate(result))}")
    return EXIT_OK if result.best is not None else EXIT_DOES_NOT_FIT


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")

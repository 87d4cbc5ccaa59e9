"""--profiler.enable-profiling records CPU+NPU activity with torch_npu.profiler; memory snapshots from torch.npu.

torchtitan's ``Profiler`` (``torchtitan.tools.profiler``) builds a
``torch.profiler.profile`` whose activities are CPU plus CUDA/XPU when available, and
its memory snapshots call ``device_module.memory._record_memory_history`` and
``device_module.memory._snapshot()``.

* NPU target, ``--profiler.enable-profiling``: the trace is recorded by
  ``torch_npu.profiler.profile`` with activities CPU and NPU, the same
  ``schedule(wait, warmup, active, repeat, skip_first, skip_first_wait)`` torchtitan
  derives from its config, and ``torch_npu.profiler.tensorboard_trace_handler`` as the
  writer: each profiled window becomes ``<dump_folder>/<save_traces_folder>/
  rank<R>_<pid>_<timestamp>_ascend_pt/`` (torch_npu's layout; ``ASCEND_PROFILER_OUTPUT/
  trace_view.json`` is the Chrome trace, also readable by MindStudio Insight), not
  torchtitan's ``iteration_<step>/rank<R>_trace.json.gz``. A configured
  ``trace_post_processor`` is not called (it expects torchtitan's single file); the
  report says so. Memory snapshots need nothing: ``torch.npu.memory`` has
  ``_record_memory_history``/``_snapshot`` with CUDA's signature.
* CPU rehearsal: profiling stays torchtitan's (CPU activity). Memory snapshots record a
  device caching allocator's history; the host has none (``torch.cpu`` has no
  ``memory`` module, which made upstream crash with an AttributeError), so
  ``--profiler.enable-memory-snapshot`` writes no snapshot and says so once, in the log
  and the report.
"""

from __future__ import annotations

import logging
import os

from npu_inject.patching import PatchContext

TARGETS = (
    ("torchtitan.tools.profiler:Profiler.build_torch_profiler",
     "on the NPU target"),
    ("torchtitan.tools.profiler:Profiler.build_memory_profiler",
     "in the CPU rehearsal"),
)

logger = logging.getLogger("npu_inject")

MEMORY_SNAPSHOT_NOTE = (
    "--profiler.enable-memory-snapshot: no snapshot in the CPU rehearsal (memory history is "
    "recorded by a device caching allocator, torch.npu's on the NPU target; the host has none)"
)


def npu_schedule_arguments(config) -> dict[str, int]:
    """torch_npu.profiler.schedule's arguments for torchtitan's Profiler.Config."""
    wait = config.profile_freq - (config.profiler_active + config.profiler_warmup)
    if wait < 0:
        raise ValueError(
            f"--profiler.profile_freq ({config.profile_freq}) must be >= profiler_warmup "
            f"({config.profiler_warmup}) + profiler_active ({config.profiler_active})"
        )
    arguments = {"wait": wait, "warmup": config.profiler_warmup, "active": config.profiler_active}
    for name in ("repeat", "skip_first", "skip_first_wait"):
        value = getattr(config, f"profiler_{name}")
        if value is not None:
            arguments[name] = value
    return arguments


def apply(ctx: PatchContext) -> None:
    def build_npu_profiler(original, profiler, *, global_step: int, base_folder: str, leaf_folder: str):
        config = profiler._config
        if not config.enable_profiling:
            return None
        import torch
        from torch_npu import profiler as npu_profiler
        rank = torch.distributed.get_rank()
        # torchtitan passes leaf_folder="" for a plain run; joining it would leave a trailing "/" that
        # torch_npu's writer doubles ("traces//rank0_...").
        trace_dir = os.path.join(base_folder, config.save_traces_folder, *filter(None, [leaf_folder]))
        os.makedirs(trace_dir, exist_ok=True)
        if config.trace_post_processor is not None:
            ctx.note("profiler.trace_post_processor not called: torch_npu writes a directory per trace")
        torch_profiler = npu_profiler.profile(
            activities=[npu_profiler.ProfilerActivity.CPU, npu_profiler.ProfilerActivity.NPU],
            schedule=npu_profiler.schedule(**npu_schedule_arguments(config)),
            on_trace_ready=npu_profiler.tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}"),
            record_shapes=True,
        )
        torch_profiler.__enter__()
        torch_profiler.step_num = global_step
        ctx.note(f"profiling with torch_npu.profiler (CPU+NPU): traces in {trace_dir}/rank<R>_*_ascend_pt")
        logger.info("npu_inject: torch_npu profiler active, traces in %s", trace_dir)
        return torch_profiler

    def build_host_memory_profiler(original, profiler, *, global_step: int, base_folder: str, leaf_folder: str):
        if not profiler._config.enable_memory_snapshot:
            return None
        if MEMORY_SNAPSHOT_NOTE not in ctx.notes:
            logger.warning("npu_inject: %s", MEMORY_SNAPSHOT_NOTE)
        ctx.note(MEMORY_SNAPSHOT_NOTE)
        return None

    if ctx.device_kind == "npu":
        ctx.wrap("Profiler.build_torch_profiler", build_npu_profiler)
    else:
        ctx.wrap("Profiler.build_memory_profiler", build_host_memory_profiler)

"""TEST ONLY: each rank's device memory statistics at every point torchtitan resets its peaks (after each logged step).

Writes ``$NPU_INJECT_MEMORY_PROBE/memory_rank<N>.json``: a list of {allocated, reserved, peak_allocated,
peak_reserved} in bytes, read from the device module's ``memory_stats()`` right before each reset, so
with ``--metrics.log_freq 1`` entry N is step N's peaks as torch_npu's caching allocator counted them.
The planner's memory predictions are checked against these (tools/bench_plan.py, tests/cann_emu).
With ``NPU_INJECT_MEMORY_PROBE_HISTORY=1`` it also records the allocator's history from the first reset
and writes ``memory_rank<N>_step<K>.pickle`` (torch.npu.memory._snapshot()) at each later one.
"""

import json
import os

TARGETS = (
    "torchtitan.components.metrics:DeviceMemoryMonitor.reset_peak_stats",
)


def apply(ctx):
    from torchtitan.components import metrics

    folder = os.environ["NPU_INJECT_MEMORY_PROBE"]
    rank = int(os.environ.get("RANK", "0"))
    readings = []

    history = os.environ.get("NPU_INJECT_MEMORY_PROBE_HISTORY") == "1"

    def reset_peak_stats(original, monitor):
        import pickle

        if history and readings:
            with open(os.path.join(folder, f"memory_rank{rank}_step{len(readings)}.pickle"), "wb") as handle:
                pickle.dump(metrics.device_module.memory._snapshot(), handle)
        elif history:
            metrics.device_module.memory._record_memory_history(max_entries=200000)
        stats = metrics.device_module.memory_stats()
        readings.append({key: stats.get(name, -1) for key, name in (
            ("allocated", "allocated_bytes.all.current"), ("reserved", "reserved_bytes.all.current"),
            ("peak_allocated", "allocated_bytes.all.peak"), ("peak_reserved", "reserved_bytes.all.peak"))})
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"memory_rank{rank}.json"), "w", encoding="utf-8") as handle:
            json.dump(readings, handle)
        return original(monitor)

    ctx.wrap("DeviceMemoryMonitor.reset_peak_stats", reset_peak_stats)

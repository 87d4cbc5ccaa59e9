"""Swap Optimizer benchmark on the simulated NPU: device memory held by optimizer state, step time.

    python tools/bench_swap_optimizer.py [--slices 1,2,4,8] [--steps 5]

Measures in a child process under the simulated NPU (verification/sim_npu), with
single-threaded kernels and glibc keeping freed memory (see MEASURING_ENV). The model is torchtitan's llama3 debug model (6.2M parameters, 45 tensors) on
``npu:0``, its optimizer torchtitan's ``OptimizersContainer`` built from
``default_adamw`` through the runtime (TORCHTITAN_NPU=1), so the ``optimizer`` patch
picks the implementation and ``swap_optimizer`` (enabled with ``slices=k`` through a
user registry) swaps the states. Gradients are fixed pseudo-random tensors.

Figures, per configuration, from the simulator's byte-counting allocator:

* ``state peak``: ``max_memory_allocated()`` during ``step()`` minus what was on the
  device before the first step (parameters, gradients, buffers), i.e. what the
  optimizer holds on the device at its peak (states, the swap's arena, step
  counters, and any temporaries of the update);
* ``between steps``: the same after ``step()`` returned;
* ``goal``: unswapped state peak / k + the largest slice's state bytes (the step
  counters, a few bytes per parameter that stay on the device, are not divided by k);
* ``step ms`` / ``cpu ms``: median wall / process CPU time of ``optimizer.step()`` over
  the measured steps; ``ratio`` is swapped / unswapped CPU time. The simulated device
  is this host's CPU and runs everything synchronously (streams are bookkeeping), so
  the copies add to the update instead of overlapping it: the ratio is the cost of
  the transfers themselves, an upper bound for the pipeline on a real NPU. CPU time is
  used because wall time on a shared machine includes other processes' time slices.

Every swapped run is also checked bit-for-bit against the unswapped parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


CHILD_MARKER = "NPU_INJECT_BENCH_SWAP_CHILD"
# The measuring process: single-threaded kernels, so CPU time is the simulated device's
# work (idle OpenMP threads spin and would bill other processes' load to the step); and
# glibc keeps freed memory instead of unmapping it, as a caching device allocator
# (torch_npu's) keeps freed blocks -- without it every step would page-fault a fresh
# arena, a cost of the simulator's uncached malloc, not of an NPU.
MEASURING_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def _measuring_process(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    from verification.sim_npu import sim_env

    env = sim_env({k: v for k, v in os.environ.items() if not k.startswith("TORCHTITAN_NPU")}, devices=1)
    env.update(MEASURING_ENV)
    env[CHILD_MARKER] = "1"
    return subprocess.run([sys.executable, __file__, *argv], env=env, cwd=REPO).returncode


def _build_model(device):
    import torch
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel().model_spec.model
    with torch.device("meta"):
        model = config.build()
    torch.manual_seed(0)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _grads(model, steps):
    import torch

    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=generator) * 1e-2 for p in model.parameters()] for _ in range(steps)]


def measure(slices: int | None, steps: int, registry_dir: str) -> dict:
    """One configuration: slices=None is the unswapped optimizer."""
    import torch
    from npu_inject import runtime
    from npu_inject.features import swap_optimizer

    registry = os.path.join(registry_dir, f"registry_{slices}.json")
    with open(registry, "w", encoding="utf-8") as handle:
        json.dump({"schema": 1, "patches": {"swap_optimizer": {"options": {"slices": slices or 1}}}}, handle)
    runtime.deactivate()
    runtime.activate({"TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_REGISTRY": registry,
                      "TORCHTITAN_NPU_PATCHES": "+swap_optimizer" if slices else "-swap_optimizer"})
    from torchtitan.components.optimizer import default_adamw

    device = torch.device("npu", 0)
    model = _build_model(device)
    container = default_adamw().build(model_parts=[model])
    optimizer = container.optimizers[0]
    swap = swap_optimizer.installed(optimizer)
    assert (swap is not None) == bool(slices), "the swap_optimizer patch did not do what was asked"
    all_grads = _grads(model, steps + 1)
    model_bytes = None  # parameters, gradients and buffers: all that is on the device before the first step
    peaks, between, times, cpu_times = [], [], [], []
    for step, grads in enumerate(all_grads):
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad.to(device)
        torch.npu.synchronize()
        if model_bytes is None:
            model_bytes = torch.npu.memory_allocated()
        torch.npu.reset_peak_memory_stats()
        started, started_cpu = time.perf_counter(), time.process_time()
        container.step()
        torch.npu.synchronize()
        elapsed, elapsed_cpu = time.perf_counter() - started, time.process_time() - started_cpu
        if step == 0:
            continue  # the first step creates the state
        times.append(elapsed)
        cpu_times.append(elapsed_cpu)
        peaks.append(torch.npu.max_memory_allocated() - model_bytes)
        between.append(torch.npu.memory_allocated() - model_bytes)
    state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                      for v in s.values() if swap_optimizer.is_swapped_state(v))
    scalar_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                       if not swap_optimizer.is_swapped_state(v) and v.device.type != "cpu")
    largest_slice = 0
    if swap is not None:
        sizes = {id(p): sum(v.numel() * v.element_size() for v in optimizer.state[p].values()
                            if swap_optimizer.is_swapped_state(v)) for p in model.parameters()}
        largest_slice = max(sum(sizes[id(p)] for p in part) for part in swap.slices)
    params = [p.detach().to("cpu") for p in model.parameters()]
    implementation = "fused" if optimizer.param_groups[0]["fused"] else (
        "foreach" if optimizer.param_groups[0]["foreach"] else "for-loop")
    del container, optimizer, model, swap, all_grads
    gc.collect()
    runtime.deactivate()
    return {
        "slices": slices, "state_peak": max(peaks), "between": max(between), "state_bytes": state_bytes,
        "scalar_bytes": scalar_bytes,
        "largest_slice": largest_slice, "step_s": statistics.median(times),
        "step_cpu_s": statistics.median(cpu_times), "params": params,
        "implementation": implementation,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", default="1,2,4,8", help="comma-separated slice counts (default 1,2,4,8)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps after one warm-up step (default 10)")
    args = parser.parse_args(argv)
    slice_counts = [int(k) for k in args.slices.split(",")]
    if os.environ.get(CHILD_MARKER) != "1":
        return _measuring_process(argv)

    import torch
    import torch_npu  # noqa: F401  (the simulator: registers "npu")

    with tempfile.TemporaryDirectory() as registry_dir:
        baseline = measure(None, args.steps, registry_dir)
        rows = [measure(k, args.steps, registry_dir) for k in slice_counts]

    print(f"Swap Optimizer on {torch.npu.get_device_name(0)}: llama3 debug model, AdamW "
          f"({baseline['implementation']}), state {baseline['state_bytes'] / MIB:.1f} MiB, "
          f"{args.steps} measured steps")
    print(f"{'config':<12} {'state peak MiB':>15} {'between steps MiB':>18} {'goal MiB':>9} {'met':>4} "
          f"{'step ms':>8} {'cpu ms':>8} {'ratio':>6} {'bit-identical':>14}")
    print(f"{'unswapped':<12} {baseline['state_peak'] / MIB:>15.2f} {baseline['between'] / MIB:>18.2f} "
          f"{'-':>9} {'-':>4} {baseline['step_s'] * 1e3:>8.2f} {baseline['step_cpu_s'] * 1e3:>8.2f} "
          f"{1.0:>6.2f} {'-':>14}")
    failures = 0
    for row in rows:
        k = row["slices"]
        # Scalar states (step counters) stay on the device by design: not divided by k.
        scalars = baseline["scalar_bytes"]
        goal = (baseline["state_peak"] - scalars) / k + scalars + row["largest_slice"]
        met = row["state_peak"] <= goal
        same = all(torch.equal(a, b) for a, b in zip(baseline["params"], row["params"]))
        failures += (not met) + (not same)
        print(f"{f'swap k={k}':<12} {row['state_peak'] / MIB:>15.2f} {row['between'] / MIB:>18.2f} "
              f"{goal / MIB:>9.2f} {'yes' if met else 'NO':>4} {row['step_s'] * 1e3:>8.2f} "
              f"{row['step_cpu_s'] * 1e3:>8.2f} {row['step_cpu_s'] / baseline['step_cpu_s']:>6.2f} "
              f"{'yes' if same else 'NO':>14}")
    print("goal: state peak <= unswapped state peak / k + largest slice (+ on-device step counters); "
          "ratio: swapped / unswapped median CPU time of step() (the simulator's device is this host's "
          "CPU, synchronous: copies are not overlapped; CPU time is robust to other load on the machine)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The host's matmul peak, measured: what the CPU rehearsal calls its device's peak FLOP/s.

No datasheet figure describes what this process's threads can do, so the peak is measured once per
process: 512x512x512 matmuls in float32, and in bfloat16 too where the CPU computes it natively
(AVX-512 BF16, AMX), the faster of the two, with the process's own thread count. For each dtype,
matmuls first run untimed for ``WARM_UP_S`` of this thread's CPU time, then one at a time for
``MEASURE_S`` of it (at least ``MIN_REPS``), and the fastest is the rate; counted in CPU time, a busy
host stretches both spans but they hold the same matmuls. The figure used is the best this host ever
measured for the same CPU (model and flags), torch version and thread count, kept in
``$XDG_CACHE_HOME/npu_inject/host_peak.json`` (``~/.cache`` without it; delete the file to start over),
so one slow measurement never lowers it; the description says which figure this process measured and
whether the file could be read and written.

Why: the old probe (one untimed matmul, then the best of five, about 1.5 ms timed) measured 389 to 1093
GFLOP/s on one 2-core AMX host, and the rehearsal's MFU moved with it (19% and 8% at the same tokens/s).
The first matmuls of a kind run up to 20x slower (57, 705, 840, 983, 1029 GFLOP/s for the first five bf16
ones after one untimed call: the vector units powering up); a matmul the scheduler interrupts is slower
still; and the host sometimes runs every matmul at 0.4x for longer than a probe lasts (seen: a whole
0.1 s window at 446-450 GFLOP/s, the host loaded), which no single window escapes, hence the cache.
The ``metrics`` patch divides the rehearsal's MFU by rank 0's figure on every rank (unless a calibrated
``cpu`` profile gives the peak); only rank 0 measures, so that the other ranks' probes do not share its
cores. :func:`npu_inject.hardware.measure_host` makes this host a device profile from it. torch is
imported when the probe runs, not at import.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time

from npu_inject.cpu_features import cpu_flags, cpu_model

HOST_PROBE_SIZE = 512  # n of the n x n x n probe matmul: large enough to run at the host's matmul speed
WARM_UP_S = 0.05  # untimed matmuls first, for this much CPU time: the vector units and caches reach full speed
MEASURE_S = 0.1  # then timed matmuls for this much CPU time: the fastest one ran whole at full speed
MIN_REPS = 10


def cache_path() -> str:
    """Where the best figure measured on this host is kept (the user's cache folder, as XDG says)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "npu_inject", "host_peak.json")


def host_key(torch_version: str, threads: int) -> str:
    """What the peak depends on: the CPU (model and flags), torch's matmul kernels, the thread count."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_model()} (flags {flags}), torch {torch_version}, {threads} thread(s)"


def remembered(key: str, rate: float, how: str) -> tuple[float, str]:
    """(FLOP/s, how) of the best of ``rate`` (this process's measurement, described by ``how``) and the figure
    cached for ``key``; a better ``rate`` replaces the cached one."""
    path = cache_path()
    said = []
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
        if not isinstance(entries, dict):
            raise ValueError(f"a JSON {type(entries).__name__}, not an object")
    except FileNotFoundError:
        entries = {}
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError: written over below
        entries = {}
        said.append(f"{path} could not be read ({type(exc).__name__}: {exc})")
    cached = entries.get(key)
    figure = isinstance(cached, dict) and isinstance(cached.get("flops"), (int, float))
    if cached is not None and not figure:
        said.append(f"{path}'s entry for this host held no figure ({json.dumps(cached)[:80]})")
    if figure and cached["flops"] >= rate:
        return cached["flops"], "; ".join([
            f"{cached['flops'] / 1e9:.1f} GFLOP/s, the best measured for this host ({cached.get('how')}; kept in "
            f"{path}); this process measured {rate / 1e9:.1f} GFLOP/s", *said])
    entries[key] = {"flops": rate, "how": how}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staging = f"{path}.{os.getpid()}"
        with open(staging, "w", encoding="utf-8") as handle:
            json.dump(entries, handle, indent=1)
        os.replace(staging, path)  # another job's probe reads the old file or the new one, never half of one
        said.append(f"kept in {path}")
    except OSError as exc:
        said.append(f"not kept: {path}: {exc.strerror or exc}")
    return rate, "; ".join([f"{rate / 1e9:.1f} GFLOP/s measured in {how}", *said])


@functools.lru_cache(maxsize=None)
def measured_host_peak_flops() -> tuple[float, str]:
    """(FLOP/s, how it was measured): the best matmul rate of this host for this process's threads."""
    import torch

    n = HOST_PROBE_SIZE
    dtypes = [torch.float32]
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        dtypes.append(torch.bfloat16)  # native there; emulated bf16 is 30-130x slower and never the peak
    rates = {}
    for dtype in dtypes:
        # Constant operands: drawing random ones would move the job's seeded random stream.
        a, b = torch.full((n, n), 0.5, dtype=dtype), torch.full((n, n), 0.25, dtype=dtype)
        # Both spans in this thread's CPU time: a busy host stretches them, but they hold the same matmuls.
        warm_until = time.thread_time() + WARM_UP_S
        while time.thread_time() < warm_until:
            torch.mm(a, b)
        best, reps = math.inf, 0
        measure_until = time.thread_time() + MEASURE_S
        while reps < MIN_REPS or time.thread_time() < measure_until:
            started = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - started)
            reps += 1
        rates[str(dtype).removeprefix("torch.")] = (2 * n**3 / best, reps)
    dtype, (rate, reps) = max(rates.items(), key=lambda item: item[1][0])
    threads = torch.get_num_threads()
    how = (f"{dtype} ({n}x{n}x{n}, the fastest of {reps} in {MEASURE_S:g} s of CPU time after {WARM_UP_S:g} s of "
           f"warm-up, {threads} thread(s))")
    peak, said = remembered(host_key(torch.__version__, threads), rate, how)
    return peak, f"host matmul peak {said}; not a datasheet figure"

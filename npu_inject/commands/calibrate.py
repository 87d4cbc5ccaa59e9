"""``npu-inject calibrate``: measure this machine's kernel rates and write them as a hardware file.

It times, within ``--budget`` seconds (2 minutes by default) and with a line of progress per
measurement, what the planner's cost model uses (:mod:`npu_inject.kernel_rates`): matmuls over a grid
of shapes per dtype, grouped matmuls, the fused attention forward and backward over sequence length,
head dimension and mask, elementwise kernels' bandwidth by size, the launch and host time per operator.
The file holds one profile: the packaged profile of this device (``--base``; found from the device's
name) with its ``rates`` measured, every point sourced "measured <date> on <device> with <versions>".
``npu-inject plan --hardware-file FILE --hardware NAME`` plans with it.

A suite that fails (a kernel the device refuses, memory) is one line; the file is still written, marked
``partial`` with the classes it lacks. No device (``--device`` names one this machine lacks) is one line
and exit 2, no file. Collectives are not measured by this command yet: the profile's link figures stay.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

EXIT_OK, EXIT_ERROR, EXIT_PARTIAL = 0, 2, 3
# Device names -> the packaged profile that describes the part (peaks, memory, links) the rates refine.
GPU_PROFILES = (("H200", "H200"), ("H100", "H100-SXM"))


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "calibrate", help="measure this machine's kernel rates; write a hardware file for plan",
        description="Time this machine's kernels (matmul grid, grouped matmul, fused attention, memory-bound "
                    "kernels, launch and host time) in about --budget seconds and write a hardware file whose "
                    "profile carries them; npu-inject plan --hardware-file FILE --hardware NAME plans with it.")
    parser.add_argument("--device", choices=("auto", "npu", "cuda", "cpu"), default="auto",
                        help="what to measure (auto: an NPU through torch_npu, else a CUDA GPU, else the CPU)")
    parser.add_argument("--output", "-o", default=None,
                        help="the hardware file to write (default: calibrated-<profile>.json here)")
    parser.add_argument("--base", default=None,
                        help="the packaged profile whose peaks, memory and links the file's profile keeps "
                             "(default: the one matching the device's name; the CPU: this host, measured)")
    parser.add_argument("--name", default=None, help="the profile's name in the file (default: the base's; cpu on the CPU)")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds to spend measuring (default 120)")
    parser.add_argument("--dtypes", default=None,
                        help="matmul dtypes, comma-separated (default: bf16,fp32 on an accelerator; fp32 on a CPU, "
                             "bf16 too where it runs bf16 natively)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU only: torch's threads while measuring (default 1, as each rank of a rehearsal runs)")
    parser.add_argument("--ranks", type=int, default=2,
                        help="CPU only: ranks the rehearsal runs on this host; the others' load is kept running while "
                             "measuring (default 2, the quickstart's)")
    parser.add_argument("--quick", action="store_true",
                        help="a few small shapes per suite: checks the command and the device work (seconds); "
                             "the file is marked partial, not to plan with")
    parser.set_defaults(run=run)


def _progress_printer(started: float):
    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:5.1f} s] {line}", flush=True)
    return progress


class Refused(Exception):
    """Bad input or no device: one line, exit 2, no file."""


@dataclass
class Calibration:
    """What one run measures and writes: the device, the packaged profile it refines, the dtypes, the source
    every point carries, and how its progress is shown."""

    args: argparse.Namespace
    device: Any  # kernel_bench.Device
    base: Any  # hardware.Profile
    dtypes: list[str]
    name: str
    source: str
    progress: Callable[[str], None]
    started: float


# Shares of the budget, by what the planner's time depends on most.
SHARES = {"collectives": 0.1, "memory": 0.1, "fused": 0.08, "matmul": 0.44, "grouped_matmul": 0.08, "attention": 0.28}


def run(args) -> int:
    try:
        calibration = _prepare(args)
    except Refused as exc:
        print(f"npu-inject calibrate: {exc}", file=sys.stderr)
        return EXIT_ERROR
    device, progress = calibration.device, calibration.progress
    ranks = args.ranks if device.kind == "cpu" else device.count
    collective_points = None
    if ranks > 1:
        from npu_inject import kernel_bench

        try:
            collective_points = kernel_bench.collectives(device, ranks, progress,
                                                         budget_s=args.budget * SHARES["collectives"])
        except (RuntimeError, OSError, ValueError) as exc:  # spawn's ProcessRaisedException is a RuntimeError
            progress(f"collectives: not measured: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}")
    else:
        progress("collectives: not measured: one device visible (the profile's link figures stay)")
    load = []
    if device.kind == "cpu" and args.ranks > 1:
        from npu_inject import kernel_bench

        load = kernel_bench.load_cpu(args.ranks - 1, args.budget * 2)
        others = args.ranks - 1
        calibration.source += (f", beside {others} process{'es' if others > 1 else ''} loading the CPU as the "
                               f"rehearsal's other rank{'s' if others > 1 else ''} do")
        progress(f"measuring beside {others} loading process(es), as a {args.ranks}-rank rehearsal shares the CPU")
    try:
        return _measure(calibration, collective_points)
    finally:
        for process in load:
            process.kill()
            process.wait()


def _prepare(args) -> Calibration:
    """The run's device, base profile, dtypes and source; Refused with one line for anything wrong."""
    if args.budget <= 0:
        raise Refused(f"--budget must be above 0 seconds, got {args.budget:g}")
    if args.threads < 1:
        raise Refused(f"--threads must be 1 or more, got {args.threads}")
    from npu_inject import hardware as hardware_mod
    from npu_inject.errors import ConfigError

    try:
        catalog = hardware_mod.load()
    except ConfigError as exc:
        raise Refused(str(exc)) from None
    import torch

    from npu_inject import kernel_bench

    started = time.perf_counter()
    try:
        device = kernel_bench.open_device(None if args.device == "auto" else args.device)
    except kernel_bench.DeviceUnavailable as exc:
        raise Refused(str(exc)) from None
    device.quick = args.quick
    if device.kind == "cpu":
        torch.set_num_threads(args.threads)
        device.threads = args.threads
    try:
        base = _base_profile(catalog, device, args.base)
    except ConfigError as exc:
        raise Refused(str(exc)) from None
    dtypes = _dtypes(args.dtypes, device)
    name = args.name or ("cpu" if device.kind == "cpu" else base.name)
    threads = f", {device.threads} thread{'s' if device.threads != 1 else ''}" if device.kind == "cpu" else ""
    source = f"measured {datetime.date.today().isoformat()} on {device.name}{threads} with {device.versions} " \
             "(npu-inject calibrate)"
    progress = _progress_printer(started)
    progress(f"calibrating {device.kind}:0 ({device.name}; {device.count} visible), {device.versions}; "
             f"budget {args.budget:g} s; profile {name} (base: {base.name})")
    return Calibration(args, device, base, dtypes, name, source, progress, started)


def _measure(calibration: Calibration, collective_points: list[dict] | None) -> int:
    import torch

    from npu_inject import kernel_bench

    args, device, dtypes, source, progress = (calibration.args, calibration.device, calibration.dtypes,
                                              calibration.source, calibration.progress)
    rates: dict = {"about": source, "partial": False}
    failures: list[str] = []
    if collective_points:
        rates["collectives"] = [{**point, "source": source.split(", beside")[0]} for point in collective_points]

    def attempt(what: str, measure):
        try:
            return measure()
        except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError, ImportError, MemoryError) as exc:
            line = f"{what}: not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            progress(line)
            failures.append(what)
            if device.kind != "cpu":
                getattr(torch, device.kind).empty_cache()
            return None

    def sourced(points: list[dict] | None) -> list[dict]:
        return [{**point, "source": source} for point in points or []]

    launch = attempt("launch", lambda: kernel_bench.launch_and_host(device, progress))
    if launch is not None:
        rates["kernel_us"] = {"value": round(max(launch[0], 1e-3), 4), "source": source}
        rates["host_us"] = {"value": round(launch[1], 4), "source": source}
    memory_points = []
    for dtype in dict.fromkeys((dtypes[0], "fp32")):  # the training dtype's, and float32's (optimizer, statistics)
        memory_points += attempt(f"memory {dtype}", lambda: kernel_bench.memory(
            device, dtype, progress, budget_s=args.budget * SHARES["memory"] / 2)) or []
    if memory_points:
        rates["memory"] = sourced(memory_points)
    fused = attempt("fused", lambda: kernel_bench.fused(device, dtypes[0], progress, budget_s=args.budget * SHARES["fused"]))
    if fused:
        rates["fused"] = sourced(fused)
    matmul_points = []
    for dtype in dtypes:
        matmul_points += attempt(f"matmul {dtype}", lambda: kernel_bench.matmul(
            device, dtype, progress, budget_s=args.budget * SHARES["matmul"] / len(dtypes))) or []
    matmul_points += attempt("grouped matmul", lambda: kernel_bench.grouped_matmul(
        device, dtypes[0], progress, budget_s=args.budget * SHARES["grouped_matmul"])) or []
    rates["matmul"] = sourced(matmul_points)
    attention = attempt("attention", lambda: kernel_bench.attention(
        device, dtypes[0], progress, budget_s=args.budget * SHARES["attention"]))
    if attention:
        rates["attention"] = sourced(attention)
        rates["attention_kernel"] = _planned_attention_kernel(device, attention)
    missing = sorted(set(failures) | {key for key in ("kernel_us", "memory", "matmul", "attention") if not rates.get(key)})
    rates["partial"] = bool(missing) or args.quick
    if missing:
        rates["missing"] = missing
    if args.quick:
        rates["about"] += "; --quick: a smoke grid, not rates to plan with"
    return _write(calibration, rates)


def _write(calibration: Calibration, rates: dict) -> int:
    base, name, source, progress = calibration.base, calibration.name, calibration.source, calibration.progress
    document = {
        "schema": 1,
        "about": f"npu-inject calibrate: {source}. The profile's peaks, memory and links come from {base.name}'s "
                 "packaged figures (their own sources); its rates are measured.",
        "profiles": {name: _profile_json(base, calibration.device, rates, source)},
    }
    output = calibration.args.output or f"calibrated-{name}.json"
    with open(output, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
        handle.write("\n")
    elapsed = time.perf_counter() - calibration.started
    if rates["partial"]:
        reasons = (["--quick"] if calibration.args.quick else []) + (
            [f"{', '.join(rates['missing'])} not measured"] if rates.get("missing") else [])
        why = "; ".join(reasons)
        progress(f"wrote {output} (PARTIAL: {why}) in {elapsed:.0f} s")
        return EXIT_PARTIAL
    progress(f"wrote {output} in {elapsed:.0f} s: plan with npu-inject plan --hardware-file {output} --hardware {name}")
    return EXIT_OK


def _dtypes(text: str | None, device) -> list[str]:
    from npu_inject import kernel_bench

    if text is None:
        if device.kind != "cpu":
            return ["bf16", "fp32"]
        from npu_inject.cpu_features import native_bf16

        # The first dtype is the one attention and grouped matmuls are measured in: the rehearsal's (it computes
        # bf16 jobs in bf16 where the CPU has bf16 instructions, else in float32).
        return ["bf16", "fp32"] if native_bf16() else ["fp32"]
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in kernel_bench.DTYPES]
    if unknown or not names:
        raise Refused(f"--dtypes {text!r}: expected a comma list of {', '.join(kernel_bench.DTYPES)}")
    return names


def _base_profile(catalog, device, requested: str | None):
    """The packaged profile this device's measurements refine."""
    if requested:
        return catalog.find(requested)
    if device.kind == "cpu":
        return catalog.find("cpu")
    if device.kind == "npu":
        return catalog.find(device.name)
    for needle, profile in GPU_PROFILES:
        if needle in device.name:
            return catalog.find(profile)
    from npu_inject.errors import ConfigError

    raise ConfigError(f"no packaged profile describes {device.name!r}: name one with --base "
                      f"(known: {', '.join(catalog.names())})")


def _planned_attention_kernel(device, points: list[dict]) -> str:
    """The kernel a job on this device runs: torch_npu's on an NPU, the rehearsal's reference on a CPU, SDPA's
    default choice on a GPU (torchtitan's sdpa)."""
    kernels = {point["kernel"] for point in points}
    preferred = {"npu": "npu_fusion_attention", "cuda": "sdpa", "cpu": "reference_fusion_attention"}[device.kind]
    return preferred if preferred in kernels else sorted(kernels)[0]


def _profile_json(base, device, rates: dict, source: str) -> dict:
    """``base`` as a hardware-file profile, with the measured rates (and, on the CPU, the measured peaks)."""
    def number(value, key):
        return {"value": value, "source": base.sources.get(key, "packaged profile")}

    peaks = {dtype: number(value, f"peak_tflops.{dtype}") for dtype, value in base.peak_tflops.items()}
    memory_bandwidth = number(base.memory_bandwidth_gbps, "memory_bandwidth_gbps")
    if device.kind == "cpu":
        # The host has no datasheet peak: the best measured rates are its peaks.
        for dtype in ("bf16", "fp32"):
            measured = [point["tflops"] for point in rates.get("matmul", []) if point["dtype"] == dtype]
            if measured:
                peaks[dtype] = {"value": max(measured), "source": f"{source}: the best matmul of the grid"}
        if "bf16" not in {point["dtype"] for point in rates.get("matmul", [])} and "fp32" in peaks:
            peaks["bf16"] = {"value": peaks["fp32"]["value"], "source": "the fp32 peak: the rehearsal computes bf16 "
                             "jobs in float32 on a CPU without native bf16"}
        if rates.get("memory"):
            memory_bandwidth = {"value": max(point["gbps"] for point in rates["memory"]),
                                "source": f"{source}: the fastest elementwise add"}

    def link(value, key):
        return {"bandwidth_gbps": number(value.bandwidth_gbps, f"{key}.bandwidth_gbps"),
                "latency_us": number(value.latency_us, f"{key}.latency_us")}

    return {
        "family": base.family,
        "description": f"{base.description}; kernel rates measured on {device.name}",
        "peak_tflops": peaks,
        "vector_tflops": number(base.vector_tflops, "vector_tflops"),
        "memory_gib": number(base.memory_gib, "memory_gib"),
        "memory_bandwidth_gbps": memory_bandwidth,
        "scale_up_devices": number(base.scale_up_devices, "scale_up_devices"),
        "scale_up": link(base.scale_up, "scale_up"),
        "scale_out": link(base.scale_out, "scale_out"),
        "allocator_pad_bytes": number(base.allocator_pad_bytes, "allocator_pad_bytes"),
        "comm_buffer_mib": number(base.comm_buffer_mib, "comm_buffer_mib"),
        "runtime_reserved_gib": number(base.runtime_reserved_gib, "runtime_reserved_gib"),
        "rates": rates,
    }


if __name__ == "__main__":  # python -m npu_inject.commands.calibrate (no console script needed)
    top = argparse.ArgumentParser(prog="npu-inject")
    add_parser(top.add_subparsers(dest="command", required=True))
    parsed = top.parse_args(["calibrate", *sys.argv[1:]])
    sys.exit(parsed.run(parsed))

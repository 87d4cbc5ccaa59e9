"""Hardware profiles (``hardware.json``): peaks, memory, links, each number with its source.

Used by ``npu-inject plan`` (its cost model and the capacity a job must fit) and by the ``metrics``
patch (the peak MFU is measured against). A profile is found by the SoC name torch_npu reports
(``torch.npu.get_device_name()``, e.g. ``Ascend910B2``; a name carrying a listed one, such as
``Ascend910B2C``, takes it), by an alias (``A2``, ``A3``, ``950``, ``H100``, ``H200``), or as ``cpu``:
the rehearsal host, measured when asked for. A user file (``TORCHTITAN_NPU_HARDWARE`` or the
planner's ``--hardware-file``) adds or replaces profiles in the same format. Stdlib only.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from npu_inject import kernel_rates
from npu_inject.errors import ConfigError

PACKAGED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware.json")
ENV_FILE = "TORCHTITAN_NPU_HARDWARE"
CPU = "cpu"
# Fields every profile gives, as {value, source}.
NUMBERS = ("vector_tflops", "memory_gib", "memory_bandwidth_gbps", "scale_up_devices", "allocator_pad_bytes",
           "comm_buffer_mib", "runtime_reserved_gib")
LINKS = ("scale_up", "scale_out")
# The cost model's numbers per family (npu_inject.planner.costmodel): fractions of the peaks, overheads in us, and
# ``overhead``: what published steps take beyond the modelled kernels, communication and host, as a fraction of
# the modelled step (framework, power limits, communication the model misses), fitted on named rows.
EFFICIENCY_KEYS = ("cube", "attention", "memory", "comm", "kernel_us", "host_us", "host_view_us", "overhead")


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float  # GB/s per device, one direction
    latency_us: float


@dataclass(frozen=True)
class Profile:
    name: str
    family: str  # "ascend", "nvidia", "cpu": which calibrated efficiencies apply
    description: str
    peak_tflops: dict[str, float]  # dense matrix peak per dtype ("bf16", "fp16", "fp32", "fp8")
    vector_tflops: float
    memory_gib: float
    memory_bandwidth_gbps: float
    scale_up_devices: int  # devices one another reach over the fast links (a server; an A3 SuperPoD)
    scale_up: Link  # HCCS, UB, NVLink
    scale_out: Link  # RoCE / InfiniBand, through each device's NIC
    allocator_pad_bytes: int
    comm_buffer_mib: float  # per communicator, outside the caching allocator
    runtime_reserved_gib: float  # outside the caching allocator (runtime, driver, kernels)
    sources: dict[str, str] = field(default_factory=dict)
    rates: kernel_rates.Rates | None = None  # measured kernel rates (npu-inject calibrate); None: the family's fractions
    overhead: float | None = None  # its own fitted overhead (0 once calibrated on the machine); None: the family's

    def peak(self, dtype: str) -> float:
        """Dense matrix FLOP/s for ``dtype`` ("bfloat16", "float32", ...)."""
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8"}.get(dtype, dtype)
        return self.peak_tflops.get(short, self.peak_tflops["bf16"]) * 1e12


# Numbers that may be 0 (a part with no padding, no communicator buffer, nothing reserved, no link latency);
# every other number (peaks, sizes, bandwidths, device counts) must be above 0.
MAY_BE_ZERO = ("allocator_pad_bytes", "comm_buffer_mib", "runtime_reserved_gib", "latency_us", "overhead")


def _number(where: str, entry: Any) -> tuple[float, str]:
    if not isinstance(entry, dict) or set(entry) != {"value", "source"} or not isinstance(entry["value"], (int, float)) \
            or isinstance(entry["value"], bool) or not isinstance(entry["source"], str) or not entry["source"]:
        raise ConfigError(f"{where} must be {{\"value\": <number>, \"source\": \"<where it comes from>\"}}, got {entry!r}")
    value = float(entry["value"])
    floor_ok = where.endswith(MAY_BE_ZERO)
    if not math.isfinite(value) or value < 0 or (value == 0 and not floor_ok):
        raise ConfigError(f"{where}: {entry['value']!r} is not a {'non-negative' if floor_ok else 'positive'} "
                          "finite number (a bandwidth, peak, size or count must be above 0)")
    return value, entry["source"]


def _read_json(path: str, unreadable: str) -> Any:
    """``path``'s JSON; ConfigError with ``unreadable`` and the reason, or the line and column of malformed JSON."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as exc:
        raise ConfigError(f"{unreadable}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None


def _rates(where: str, raw: Any, folder: str) -> kernel_rates.Rates:
    """A profile's ``rates``: the object itself, or the path of a JSON file holding it: relative to the hardware
    file, else to the packaged catalog (a profile copied from hardware.json keeps its packaged rates)."""
    if isinstance(raw, str):
        path = os.path.join(folder, raw)
        packaged = os.path.join(os.path.dirname(PACKAGED), raw)
        if not os.path.isabs(raw) and not os.path.exists(path) and os.path.exists(packaged):
            path = packaged
        raw = _read_json(path, f"{where}.rates: cannot read {path}")
        where = path
    return kernel_rates.parse(f"{where}.rates" if not where.endswith(".json") else where, raw)


def _profile(where: str, name: str, raw: Any, folder: str) -> Profile:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a profile is an object, got {type(raw).__name__}")
    required = {"family", "description", "peak_tflops", *NUMBERS, *LINKS}
    missing = sorted(required - set(raw))
    unknown = sorted(set(raw) - required - {"rates", "overhead"})
    if missing or unknown:
        raise ConfigError(f"{where}: " + "; ".join(filter(None, [
            f"missing key(s) {', '.join(missing)}" if missing else "",
            f"unknown key(s) {', '.join(unknown)}" if unknown else ""])) + f" (a profile has {', '.join(sorted(required))})")
    sources: dict[str, str] = {}
    values: dict[str, float] = {}
    for key in NUMBERS:
        values[key], sources[key] = _number(f"{where}.{key}", raw[key])
    peaks = raw["peak_tflops"]
    if not isinstance(peaks, dict) or "bf16" not in peaks:
        raise ConfigError(f"{where}.peak_tflops must map dtypes (bf16 at least) to {{value, source}}")
    peak_tflops = {}
    for dtype, entry in peaks.items():
        peak_tflops[dtype], sources[f"peak_tflops.{dtype}"] = _number(f"{where}.peak_tflops.{dtype}", entry)
    links = {}
    for key in LINKS:
        link = raw[key]
        if not isinstance(link, dict) or set(link) != {"bandwidth_gbps", "latency_us"}:
            raise ConfigError(f"{where}.{key} must have bandwidth_gbps and latency_us")
        bandwidth, sources[f"{key}.bandwidth_gbps"] = _number(f"{where}.{key}.bandwidth_gbps", link["bandwidth_gbps"])
        latency, sources[f"{key}.latency_us"] = _number(f"{where}.{key}.latency_us", link["latency_us"])
        links[key] = Link(bandwidth, latency)
    return Profile(name, str(raw["family"]), str(raw["description"]), peak_tflops, values["vector_tflops"],
                   values["memory_gib"], values["memory_bandwidth_gbps"], int(values["scale_up_devices"]),
                   links["scale_up"], links["scale_out"], int(values["allocator_pad_bytes"]),
                   values["comm_buffer_mib"], values["runtime_reserved_gib"], sources,
                   _rates(where, raw["rates"], folder) if "rates" in raw else None,
                   _number(f"{where}.overhead", raw["overhead"])[0] if "overhead" in raw else None)


@dataclass
class Catalog:
    profiles: dict[str, Profile]
    aliases: dict[str, str]
    efficiency: dict[str, dict[str, float]]  # family -> calibrated fractions and overheads

    def names(self) -> list[str]:
        return sorted(self.profiles) + sorted(set(self.aliases) - set(self.profiles)) + [CPU]

    def find(self, name: str) -> Profile:
        """The profile for a SoC name, an alias, or ``cpu`` (measured on this host)."""
        if name == CPU:
            # A calibrated file's profile of this host (npu-inject calibrate on the CPU), else measured now.
            return self.profiles[CPU] if CPU in self.profiles else measure_host()
        name = self.aliases.get(name, name)
        if name in self.profiles:
            return self.profiles[name]
        # torch_npu's names for variants carry the base part's name (Ascend910B2C, Ascend910B4-1).
        carrying = [known for known in self.profiles if known in name]
        if carrying:
            return self.profiles[max(carrying, key=len)]
        close = difflib.get_close_matches(name, self.names(), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown hardware {name!r}{hint} (known: {', '.join(self.names())}; add a profile "
                          f"with --hardware-file or {ENV_FILE})")


def _merge(catalog_raw: dict, document: Any, source: str) -> None:
    if not isinstance(document, dict) or not isinstance(document.get("profiles", {}), dict):
        raise ConfigError(f"{source}: a hardware file is an object with 'profiles' (name -> profile)")
    unknown = sorted(set(document) - {"schema", "about", "sources", "aliases", "profiles", "efficiency"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(unknown)}")
    for key in ("profiles", "aliases", "efficiency"):
        catalog_raw.setdefault(key, {}).update(document.get(key, {}))


def load(user_file: str | None = None) -> Catalog:
    raw: dict = {}
    origins: dict[str, str] = {}  # profile -> the file it comes from (its errors name it)
    paths = [PACKAGED] + [path for path in (os.environ.get(ENV_FILE), user_file) if path]
    for path in paths:
        document = _read_json(path, f"{path}: cannot read hardware file")
        _merge(raw, document, path)
        origins.update({name: path for name in document.get("profiles", {})})
    profiles = {name: _profile(f"{origins.get(name, PACKAGED)}: profile {name!r}", name, value,
                               os.path.dirname(origins.get(name, PACKAGED)))
                for name, value in raw["profiles"].items()}
    for alias, target in raw.get("aliases", {}).items():
        if target not in profiles:
            raise ConfigError(f"hardware alias {alias!r} names {target!r}, which is not a profile")
    efficiency = {family: _efficiency(family, values) for family, values in raw.get("efficiency", {}).items()
                  if family != "about"}
    for family in {profile.family for profile in profiles.values()} | {CPU}:
        if family not in efficiency:
            raise ConfigError(f"hardware family {family!r} has no 'efficiency' entry (the cost model's fractions)")
    return Catalog(profiles, dict(raw.get("aliases", {})), efficiency)


def _efficiency(family: str, values: Any) -> dict[str, float]:
    """A family's efficiencies: numbers by name, their ``sources`` (name -> text) left to the file's readers."""
    if not isinstance(values, dict):
        raise ConfigError(f"efficiency {family!r}: an object of fractions and overheads by name")
    numbers = {name: value for name, value in values.items() if name != "sources"}
    missing = [name for name in EFFICIENCY_KEYS if name not in numbers]
    wrong = [name for name, value in numbers.items() if isinstance(value, bool) or not isinstance(value, (int, float))]
    if missing or wrong:
        raise ConfigError(f"efficiency {family!r}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"not a number: {', '.join(wrong)}"] if wrong else []))
            + f" (it needs numbers for {', '.join(EFFICIENCY_KEYS)})")
    fractions = ("cube", "attention", "memory", "comm")
    bad = [f"{name}={value!r}" for name, value in numbers.items()
           if not math.isfinite(value) or value < 0 or (name in fractions and not 0 < value <= 1)]
    if bad:
        raise ConfigError(f"efficiency {family!r}: {', '.join(bad)} out of range (fractions of a peak "
                          f"({', '.join(fractions)}) are in (0, 1]; times and the overhead are finite and not negative)")
    return {name: float(value) for name, value in numbers.items()}


_HOST: Profile | None = None


def measure_host() -> Profile:
    """This host as a device: its matmul peak and copy bandwidth measured, one process per 'device'."""
    global _HOST
    if _HOST is None:
        import time

        import torch

        from npu_inject.host_peak import measured_host_peak_flops

        peak, how = measured_host_peak_flops()
        tensor = torch.full(((64 << 20) // 4,), 1.0)
        tensor.clone()
        started = time.perf_counter()
        tensor.clone()
        bandwidth = 2 * tensor.numel() * 4 / (time.perf_counter() - started) / 1e9  # read + write, GB/s
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        measured = f"measured on this host ({how})"
        _HOST = Profile(
            CPU, CPU, "this host (the CPU rehearsal): one rank per process, memory shared by them",
            {"bf16": peak / 1e12, "fp32": peak / 1e12}, peak / 1e12, total, bandwidth, os.cpu_count() or 1,
            Link(bandwidth / 4, 50.0), Link(bandwidth / 4, 50.0), 0, 0.0, 0.0,
            {"peak_tflops.bf16": measured, "memory_bandwidth_gbps": "measured: a 64 MiB copy",
             "memory_gib": "this host's physical memory", "scale_up": "estimate: gloo over shared memory"})
    return _HOST

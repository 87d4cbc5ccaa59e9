"""What this host's CPU supports, read from the kernel's CPU flags (stdlib only, no timing)."""

from __future__ import annotations

import functools
import platform

# x86: AVX-512 BF16 or AMX BF16 multiply bf16 natively; Arm: the BF16 extension (FEAT_BF16).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo ('flags' on x86, 'Features' on Arm); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        return frozenset()
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The first processor's 'model name' in /proc/cpuinfo; the platform's name of it elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass  # no /proc (not Linux): the platform's name below
    return platform.processor() or platform.machine()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (the instruction set says so; nothing is timed)."""
    return bool(set(BF16_FLAGS) & cpu_flags())


def describe_bf16() -> str:
    """One phrase for a report: which flag decided, or why bf16 is emulated."""
    found = sorted(set(BF16_FLAGS) & cpu_flags())
    if found:
        return f"the CPU has {', '.join(found)}"
    return f"no bf16 instructions among this {platform.machine()} CPU's flags ({', '.join(BF16_FLAGS)} absent)"

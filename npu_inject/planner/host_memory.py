"""The CPU rehearsal's memory on this host: every rank of the job runs here, so the ranks share its memory.

What ``npu-inject plan --hardware cpu`` asks of the host: each rank's planned peak plus what a rank's
process holds for torch and torchtitan, with the margin the measured runs needed; and what the host has.
"""

from __future__ import annotations

import os

GIB = 2**30  # as npu_inject.planner.job's; here so that a rank's start-up check imports nothing of the planner

# VmRSS of a process once torch 2.14.1 and torchtitan 0.3.0's trainer are imported (0.81 GiB measured on
# this project's machine): what each rank holds besides its tensors.
PROCESS_BASELINE_BYTES = int(0.8 * GIB)

# The plan fell short of the rehearsal's measured peak on every job checked (docs/suite.md, "The rehearsal at
# upstream's shapes", states the error over upstream's suite cases that ran at its shapes): CPU malloc's caching
# and what the plan leaves out (the data loader, gloo's buffers). The verdict asks for the plan times this margin,
# which covers the largest measured shortfall (a test checks it against the recorded runs), so a case it lets
# start is not ended by the OOM killer.
HOST_MARGIN = 1.7


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

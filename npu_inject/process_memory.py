"""Resident memory of a process tree, read from Linux /proc (stdlib only).

``npu-inject suite`` samples each case's runs with it (the matrix's peak host memory), and
tools/bench_plan.py samples the planner's searches the same way.
"""

from __future__ import annotations

import os


def process_tree_rss_kib(root: int) -> int:
    """Resident memory of ``root`` and every process below it (Linux /proc), KiB."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        rss[pid] = int(fields[21]) * (os.sysconf("SC_PAGE_SIZE") // 1024)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total

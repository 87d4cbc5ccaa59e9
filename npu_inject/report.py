"""Per-process record of what was patched, skipped or failed, and why.

A view: the runtime builds it from its patch states whenever it is asked for
(``Runtime.report``); changing a Report changes nothing in the runtime.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# applied: in effect; skipped: enabled but not applied (version, requirement);
# failed: apply raised or a target is missing (everything it changed was restored);
# disabled: off by selection or not meant for this target; not applicable: an optional package it patches
# (torchft) is not installed; pending: trigger not imported yet;
# reverted: was applied, then undone (applies again at the next import of its trigger).
STATES = ("applied", "skipped", "failed", "disabled", "not applicable", "pending", "reverted")


@dataclass
class PatchRecord:
    state: str
    reason: str = ""
    fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    apply_ms: float = 0.0
    trigger: str = ""


@dataclass
class Report:
    target: str
    strict: bool
    rank: int
    versions: dict[str, str | None] = field(default_factory=dict)
    patches: dict[str, PatchRecord] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    registry_sources: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    def ids(self, state: str) -> list[str]:
        return [patch_id for patch_id, record in self.patches.items() if record.state == state]

    def summary_line(self) -> str:
        parts = [f"npu_inject: target={self.target}"]
        torch_npu = self.versions.get("torch_npu")
        if torch_npu:
            parts.append(f"torch_npu={torch_npu}")
        for state in ("applied", "failed", "skipped", "pending", "reverted", "disabled", "not applicable"):
            ids = self.ids(state)
            if not ids:
                continue
            if state in ("failed", "skipped"):
                shown = ", ".join(f"{i} ({self.patches[i].reason})" for i in ids)
            elif state == "not applicable":  # the same reason for every patch of one package: said once
                reasons = dict.fromkeys(self.patches[i].reason for i in ids)
                shown = f"{', '.join(ids)} ({'; '.join(reasons)})"
            else:
                shown = ", ".join(ids)
            parts.append(f"{state} {len(ids)}: {shown}")
        fallbacks = [f"{i}: {f}" for i, r in self.patches.items() for f in r.fallbacks]
        if fallbacks:
            parts.append(f"fallbacks: {'; '.join(fallbacks)}")
        return " | ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"report_rank{self.rank}.json")
        temporary = f"{path}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(self.to_json(), handle, indent=2, sort_keys=True)
        os.replace(temporary, path)  # readers never see half a report
        return path

"""What the environment asks of the runtime.

Stdlib only: this module is imported from the ``.pth`` bootstrap path once the
runtime is enabled, before torch or torchtitan are imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from npu_inject.errors import ConfigError

ENV_TARGET = "TORCHTITAN_NPU"
ENV_PATCHES = "TORCHTITAN_NPU_PATCHES"
ENV_REGISTRY = "TORCHTITAN_NPU_REGISTRY"
ENV_STRICT = "TORCHTITAN_NPU_STRICT"
ENV_REPORT_DIR = "TORCHTITAN_NPU_REPORT_DIR"
ENV_FAULTS = "TORCHTITAN_NPU_FAULTS"
ENV_SDC_EVERY = "TORCHTITAN_NPU_SDC_EVERY"

# Faults the inject_faults patch can cause, and what each does at its step.
FAULT_KINDS = {
    "nan_loss": "the model's output times NaN on the chosen ranks, so the loss and every gradient are NaN",
    "loss_spike": "the model's output times 50 on the chosen ranks: a finite batch that throws the loss and the "
                  "gradient norm far up (what patch spikes catches)",
    "bitflip_param": "one exponent bit of the first element of the rank's first parameter flipped after step K's "
                     "update (the value halves or doubles: finite, silent), so its replica drifts from the others "
                     "(what patch replica_check catches)",
    "sdc_matmul": "one finite wrong value in one matmul result of step K on the chosen ranks (the model's first "
                  "checked linear, its forward product's first element x becomes 1024 x + 1024), as a chip that "
                  "miscomputes leaves it (what patch matmul_checks catches; the step must be a checked one)",
    "sdc_expert": "as sdc_matmul, in each grouped product's result of the model's first MoE experts in step K's "
                  "forward on the chosen ranks (what patch matmul_checks catches in the experts' grouped products)",
    "kill": "the rank's process SIGKILLs itself as the step starts (a dead process: node loss, the OOM killer), "
            "in the launcher's first attempt only, so a restarted rank trains on",
    "hang": "the rank stops inside the step and never returns (a hung device or collective): its peers' next "
            "collective times out; first attempt only",
    "kill_in_forward": "as kill, but in the rank's forward, after the step's torchft quorum began: its peers meet "
                       "the loss inside a collective (their own group's, torchft's cross-group all-reduce)",
    "hang_in_forward": "as hang, but in the rank's forward: its peers wait inside a collective until its timeout",
    "uce_in_forward": "a device memory error (UCE) in the rank's forward, as the device reports it (the CANN "
                      "emulation only): in memory the step's temporaries use, which uce_repair repairs",
    "uce_in_state": "as uce_in_forward, on the memory of the rank's first parameter (the job's state, which no step "
                    "retry repairs; the CANN emulation only)",
    "uce_in_update": "as uce_in_forward, as step K's optimizer begins (its update may be cut; the CANN emulation only)",
    "link_error": "the rank's next HCCL collective after step K's forward began fails as a broken link does (the CANN "
                  "emulation only): its peers wait in that collective (what step_repair repairs)",
    "stuck_collective": "the rank's next HCCL collective after step K's forward began never completes, stuck on the "
                        "device until stop_device (the CANN emulation only; what step_repair repairs)",
}
FAULT_FORM = "KIND@STEP or KIND@STEP:rank=R, comma-separated"

# Values of TORCHTITAN_NPU and the target each one selects (None: runtime off).
TARGET_VALUES = {"": None, "0": None, "1": "npu", "npu": "npu", "cpu": "cpu"}
_BOOL_VALUES = {"": False, "0": False, "1": True}


def parse_target(raw: str | None) -> str | None:
    """Map a TORCHTITAN_NPU value to "npu", "cpu" or None (disabled)."""
    value = (raw or "").strip().lower()
    if value not in TARGET_VALUES:
        valid = ", ".join(repr(v) for v in TARGET_VALUES if v)
        raise ConfigError(
            f"{ENV_TARGET}={raw!r} is not valid; use one of {valid} "
            f"(1/npu: real Ascend NPU, cpu: CPU rehearsal, 0 or unset: off)"
        )
    return TARGET_VALUES[value]


def parse_flag(name: str, raw: str | None) -> bool:
    value = (raw or "").strip()
    if value not in _BOOL_VALUES:
        raise ConfigError(f"{name}={raw!r} is not valid; use 1 (on) or 0 (off)")
    return _BOOL_VALUES[value]


@dataclass(frozen=True)
class Fault:
    """One fault to inject: ``kind`` at training step ``step`` on ``rank`` (None: every rank)."""

    kind: str
    step: int
    rank: int | None = None

    @property
    def item(self) -> str:
        """The fault as TORCHTITAN_NPU_FAULTS spells it."""
        return f"{self.kind}@{self.step}" + ("" if self.rank is None else f":rank={self.rank}")


def parse_faults(raw: str | None) -> tuple[Fault, ...]:
    """TORCHTITAN_NPU_FAULTS (``nan_loss@3,nan_loss@7:rank=1``) as Faults; raises ConfigError naming the item."""
    faults = []
    for item in (part.strip() for part in (raw or "").split(",")):
        if not item:
            continue
        head, _, rank_part = item.partition(":")
        kind, at, step = head.partition("@")
        rank = None
        problem = ""
        if kind not in FAULT_KINDS:
            problem = f"unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})"
        elif not at or not step.isdigit() or int(step) < 1:
            problem = "the step must be a training step >= 1"
        elif rank_part:
            name, _, value = rank_part.partition("=")
            if name != "rank" or not value.isdigit():
                problem = f"{rank_part!r} is not rank=R"
            else:
                rank = int(value)
        if problem:
            raise ConfigError(f"{ENV_FAULTS}: {item!r}: {problem}; use {FAULT_FORM}")
        faults.append(Fault(kind, int(step), rank))
    return tuple(faults)


@dataclass(frozen=True)
class Settings:
    """The runtime's view of the environment, validated."""

    target: str | None  # "npu", "cpu" or None when the runtime is off
    patches: str  # raw TORCHTITAN_NPU_PATCHES selection, parsed against the registry
    registry_path: str | None  # user registry merged over the packaged one
    strict: bool
    report_dir: str | None  # where the report goes until torchtitan's dump folder is known
    faults: tuple[Fault, ...] = ()  # what the inject_faults patch causes (TORCHTITAN_NPU_FAULTS)
    sdc_every: int | None = None  # matmul_checks checks every N-th step (TORCHTITAN_NPU_SDC_EVERY; None: its option)

    @property
    def enabled(self) -> bool:
        return self.target is not None

    @property
    def rehearsal(self) -> bool:
        return self.target == "cpu"


def load(environ: os._Environ | dict | None = None) -> Settings:
    """Read and validate every TORCHTITAN_NPU* variable; raises ConfigError."""
    env = os.environ if environ is None else environ
    registry_path = env.get(ENV_REGISTRY) or None
    if registry_path is not None and not os.path.isfile(registry_path):
        problem = "a directory, not a file" if os.path.isdir(registry_path) else "no such file"
        raise ConfigError(
            f"{ENV_REGISTRY}={registry_path!r}: {problem}; "
            "point it at a JSON registry file or unset it"
        )
    return Settings(
        target=parse_target(env.get(ENV_TARGET)),
        patches=env.get(ENV_PATCHES, "").strip(),
        registry_path=registry_path,
        strict=parse_flag(ENV_STRICT, env.get(ENV_STRICT)),
        report_dir=env.get(ENV_REPORT_DIR) or None,
        faults=parse_faults(env.get(ENV_FAULTS)),
        sdc_every=parse_every(env.get(ENV_SDC_EVERY)),
    )


def parse_every(raw: str | None) -> int | None:
    """TORCHTITAN_NPU_SDC_EVERY as a step interval >= 1 (None when unset); raises ConfigError naming it."""
    value = (raw or "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{ENV_SDC_EVERY}={raw!r} is not valid; use a whole number of steps >= 1 (patch "
                          "matmul_checks checks every that many steps), or unset it for the registry's option")
    return int(value)

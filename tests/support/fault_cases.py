"""Issue 57's faults caused on purpose, each with the patch that catches it and the run it must end like.

One definition for every target (the rehearsal's own tests are in tests/e2e/test_matmul_checks.py,
test_spikes.py and test_replica_check.py; these cases run them on the simulated NPU and on the real torch_npu over
the CANN emulation). Each case is two runs of upstream llama3 debug on 2 ranks: the faulted run with the patch
on, and a reference that never had the fault (for the spike: a run whose spiked step was kept out for a NaN by
finite_steps, i.e. one that skipped that batch). The faulted run must print the line that names the fault, and
every step's loss (but the spike's step) must be the reference's, to the printed digit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
        "--metrics.log_freq", "1"]


@dataclass(frozen=True)
class FaultCase:
    name: str
    steps: int
    patches: str  # TORCHTITAN_NPU_PATCHES of the faulted run
    fault: str
    caught: str  # printed by the faulted run
    reference_fault: str = ""  # the reference run's fault, with +inject_faults alone
    options: dict = field(default_factory=dict)  # registry.json options, per patch
    extra_args: tuple = ()
    extra_env: tuple = ()  # (name, value) pairs of the faulted run
    excluded_step: int | None = None  # the step whose loss differs by design (the spike, logged as it happened)

    def args(self, steps: int | None = None) -> list[str]:
        return [*ARGS, "--training.steps", str(steps or self.steps), *self.extra_args]

    def env(self, folder: Path) -> dict[str, str]:
        registry = folder / f"{self.name}_registry.json"
        registry.write_text(json.dumps({"patches": {patch: {"options": options}
                                                    for patch, options in self.options.items()}}))
        return {"TORCHTITAN_NPU_PATCHES": self.patches, "TORCHTITAN_NPU_FAULTS": self.fault,
                "TORCHTITAN_NPU_REGISTRY": str(registry), **dict(self.extra_env)}

    def reference_env(self) -> dict[str, str]:
        if not self.reference_fault:
            return {}
        return {"TORCHTITAN_NPU_PATCHES": "+inject_faults", "TORCHTITAN_NPU_FAULTS": self.reference_fault}

    def compared(self, losses: dict[int, float]) -> dict[int, float]:
        return {step: loss for step, loss in losses.items() if step != self.excluded_step}


CASES = {
    "sdc_matmul": FaultCase(
        "sdc_matmul", steps=5, patches="+inject_faults,+matmul_checks", fault="sdc_matmul@3:rank=1",
        extra_env=(("TORCHTITAN_NPU_SDC_EVERY", "1"),),
        caught="npu_inject matmul_checks: step 3 attempt 1: matmul results failed their checksums on rank 1 ("),
    "loss_spike": FaultCase(
        "loss_spike", steps=10, patches="+inject_faults,+spikes", fault="loss_spike@8:rank=1",
        reference_fault="nan_loss@8:rank=1", options={"spikes": {"window": 5, "warmup": 5}}, excluded_step=8,
        caught="npu_inject spikes: step 8: gradient norm spike"),
    "bitflip_param": FaultCase(
        "bitflip_param", steps=6, patches="+inject_faults,+replica_check", fault="bitflip_param@4:rank=1",
        options={"replica_check": {"every": 3}},
        extra_args=("--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree",
                    "2"),
        caught="every rank rolled back to step 3 (the last verified) and trained steps 4..6 again on the same "
               "batches; the replicas agree"),
}

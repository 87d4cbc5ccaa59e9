"""Issue 57's faults through the real torch_npu 2.14.0 on the CANN emulation: caught, named, trained on as without.

The cases of tests/support/fault_cases.py: a loss spike (spikes skips the batch) and a flipped bit in one of two
DDP replicas (replica_check rolls both back to the last verified step, over HCCL's all-gather and the snapshot
in host memory). The wrong matmul element is tests/cann_emu/test_matmul_checks_emulated.py's (through torch_npu's
own matmul_checksum on the emulated kernel). What the emulation cannot show: an NPU's timing and its real
kernels' rounding (it computes each aclnn operator with ATen's CPU kernels).

    .venv/bin/python -m pytest -m cann_emu_long tests/cann_emu/test_faults_emulated.py -n 0
"""

from __future__ import annotations

import pytest

from fault_cases import CASES
from test_train import emulated, steps_of
from testkit import parse_losses


@pytest.mark.cann_emu_long
@pytest.mark.parametrize("name", ["loss_spike", "bitflip_param"])
def test_a_fault_on_the_real_wheel_is_caught_and_the_run_ends_as_without_it(tmp_path, name):
    case = CASES[name]
    faulted, _ = emulated(case.args(), tmp_path / "faulted", extra_env=case.env(tmp_path))
    assert faulted.returncode == 0, faulted.stdout[-4000:]
    reference, _ = emulated(case.args(), tmp_path / "reference", extra_env=case.reference_env())
    assert reference.returncode == 0, reference.stdout[-4000:]
    losses, expected = parse_losses(faulted.stdout), parse_losses(reference.stdout)
    print(f"{name}: faulted {losses}\nreference {expected}")
    assert case.caught in faulted.stdout, faulted.stdout[-3000:]
    assert sorted(losses) == list(range(1, case.steps + 1))
    assert case.compared(losses) == case.compared(expected)


@pytest.mark.cann_emu_long
def test_replica_checks_add_at_most_one_host_synchronisation_per_checked_step(tmp_path):
    """The cost the issue bounds, from the emulation's own counts: 2 DDP replicas, 4 steps, checked every 2 steps
    (each check verifies and leaves the rollback snapshot, queued on the stream), against the same run without
    replica_check: at most one more stream synchronisation per checked step, over the whole run (the checks run
    after torchtitan's train_step returns, which the emulation's step marks count outside the steps)."""
    case = CASES["bitflip_param"]
    registry = tmp_path / "every2.json"
    registry.write_text('{"patches": {"replica_check": {"options": {"every": 2}}}}')
    checked, checked_counts = emulated(case.args(steps=4), tmp_path / "checked", extra_env={
        "TORCHTITAN_NPU_PATCHES": "+replica_check", "TORCHTITAN_NPU_REGISTRY": str(registry)})
    assert checked.returncode == 0, checked.stdout[-4000:]
    plain, plain_counts = emulated(case.args(steps=4), tmp_path / "plain")
    assert plain.returncode == 0, plain.stdout[-4000:]
    assert parse_losses(checked.stdout) == parse_losses(plain.stdout)
    assert "step 4: 180 tensors agree across 2 replicas" in checked.stdout + (
        tmp_path / "checked" / "npu_inject" / "report_rank0.json").read_text()

    def total(counts: dict, kind: str) -> dict[str, int]:
        summed: dict[str, int] = {}
        for row in counts["steps"].values():
            for name, count in row[kind].items():
                summed[name] = summed.get(name, 0) + count
        return summed

    def more(on: dict, off: dict) -> dict[str, int]:
        """What ``on`` counted more (or less) than ``off``, by name; the watchdog's error polls aside."""
        return {name: count - off.get(name, 0) for name, count in on.items()
                if count != off.get(name, 0) and name != "HcclGetCommAsyncError"}

    for rank in (0, 1):
        extra = {kind: more(total(checked_counts[rank], kind), total(plain_counts[rank], kind))
                 for kind in ("syncs", "hccl", "aclnn")}
        print(f"rank {rank}, the run's 2 checked steps: host waits {extra['syncs']}, collectives {extra['hccl']}, "
              f"aclnn launches +{sum(extra['aclnn'].values())}")
        assert extra["syncs"].get("aclrtSynchronizeStream", 0) <= 2
        assert extra["hccl"].get("HcclAllGather", 0) == 2  # the fingerprints, once per check

"""Issue 57's faults on 2 simulated NPUs (verification/sim_npu): caught, named, and trained on as without them.

The cases (tests/support/fault_cases.py): a wrong matmul element (matmul_checks retrains the step), a loss
spike (spikes skips the batch) and a flipped bit in one of two DDP replicas (replica_check rolls both back to the
last verified step). What the simulated NPU cannot show: a real NPU's kernels (its products run on CPU
kernels), so the checks' cost here says nothing of an NPU's.

    cd tests && ../.venv/bin/python -m pytest -m e2e_long e2e/test_faults_sim_npu.py
"""

from __future__ import annotations

import pytest

from fault_cases import CASES
from testkit import parse_losses, sim_npu_env, torchrun


@pytest.mark.e2e_long
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_fault_on_simulated_npus_is_caught_and_the_run_ends_as_without_it(tmp_path, name):
    case = CASES[name]
    faulted = torchrun([*case.args(), "--dump_folder", str(tmp_path / "faulted")], sim_npu_env(**case.env(tmp_path)))
    assert faulted.returncode == 0, faulted.stdout[-4000:]
    reference = torchrun([*case.args(), "--dump_folder", str(tmp_path / "reference")],
                         sim_npu_env(**case.reference_env()))
    assert reference.returncode == 0, reference.stdout[-4000:]
    assert "npu_inject: target=npu" in faulted.stdout
    losses, expected = parse_losses(faulted.stdout), parse_losses(reference.stdout)
    print(f"{name}: faulted {losses}\nreference {expected}")
    assert case.caught in faulted.stdout, faulted.stdout[-3000:]
    assert sorted(losses) == list(range(1, case.steps + 1))
    assert case.compared(losses) == case.compared(expected)

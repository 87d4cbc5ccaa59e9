"""torchft's LocalSGD and DiLoCo on the real torch_npu 2.14.0 over the CANN emulation, through torchft's HCCL group.

Upstream's ``llama3_torchft_debugmodel`` (DiLoCo with 2 fragments, as upstream configures it; or LocalSGD),
a lighthouse that waits for both groups at every quorum, two replica groups of 2 ranks, a synchronisation every
2 steps, 6 steps. The groups read different data, so what they hold after the last synchronisation says
whether it ran over HCCL:

* LocalSGD averages the whole model: every parameter equal, tensor for tensor, across the groups; each
  group's inner Adam moments stay its own (they differ).
* DiLoCo (streaming, 2 fragments) synchronises one fragment per step, in turn: after step 6 the fragment
  synchronised there is equal across the groups, the other one has trained a step on its own data since.

Every synchronisation commits (``should_commit=True`` on both ranks, never False). The losses against the
CPU rehearsal's (gloo) run of the same command are in docs/fault-tolerance.md (within 4.2e-4).

CI runs DiLoCo, upstream's setting (78 s under CI's load); LocalSGD is marked cann_emu_long:

    .venv/bin/python -m pytest -m "cann_emu or cann_emu_long" tests/cann_emu/test_torchft_semi_sync.py -n 0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_checkpoint_resume import read_plain  # noqa: E402
from test_torchft import check_synchronised  # noqa: E402
from tools.bench_failover import run_failover, semi_sync_args  # noqa: E402

pytest.importorskip("torchft")

STEPS, SYNC_STEPS = 6, 2
SYNCHRONISATIONS = {"local_sgd": STEPS // SYNC_STEPS, "diloco": STEPS}  # DiLoCo: a fragment every step


@pytest.mark.parametrize("method", [pytest.param("local_sgd", marks=pytest.mark.cann_emu_long), "diloco"])
def test_semi_sync_training_commits_and_synchronises_over_hccl(tmp_path, method):
    run = run_failover(tmp_path, STEPS, fault=None, target="cann", min_replicas=2, timeout=600,
                       extra_args=semi_sync_args(method, SYNC_STEPS))
    assert run.returncodes == [0, 0], run.logs[0][-3000:] + run.logs[1][-3000:]
    for log in run.logs:
        assert "should_commit=False" not in log, log[-3000:]
        assert log.count("should_commit=True enough_replicas=True") == 2 * SYNCHRONISATIONS[method], log[-3000:]
    for dump in run.dumps:  # upstream's nccl, on the runtime's HCCL group
        notes = json.loads((dump / "npu_inject" / "report_rank0.json").read_text())["patches"]["torchft_npu"]["notes"]
        assert any("runs on torchft's HCCL group" in note for note in notes), notes

    group0, group1 = read_plain(tmp_path, *(dump / "checkpoint" / f"step-{STEPS}" for dump in run.dumps))
    check_synchronised(group0, group1, method)

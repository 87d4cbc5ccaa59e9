"""torchft's failover on the real torch_npu 2.14.0 over the CANN emulation: torchft's HCCL group (torch_npu's own
ProcessGroupHCCL, a new communicator per quorum), two replica groups of 2 ranks, rank 1 of group 1 killed as step
4 starts; group 0 trains on, group 1 restarts, heals from group 0's live state and ends bitwise equal.

    .venv-cann/bin/python -m pytest -m cann_emu tests/cann_emu/test_torchft_failover.py -n 0
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_torchft import check_failover  # noqa: E402

pytest.importorskip("torchft")


def test_a_killed_replica_group_heals_from_the_live_one_over_hccl(tmp_path):
    check_failover(tmp_path, "cann", steps=40, kill_at=4)  # group 0 must still train when group 1 returns

"""torchft's failover on the real torch_npu 2.14.0 over the CANN emulation: torchft's HCCL group (torch_npu's own
ProcessGroupHCCL, a new communicator per quorum), two replica groups of 2 ranks, rank 1 of group 1 killed as step
4 starts; group 0 trains on, group 1 restarts, heals from group 0's live state and ends bitwise equal. And a
hung rank: rank 1 of group 1 hangs as step 8 starts, its rank 0 waits in an HCCL collective (there its training
thread waits for torch_npu's task queue holding the GIL: no Python thread runs), torchft_leave's watchdog (a C
thread) ends both after the train timeout and group 0 goes on (2026-11-27: stalled 18.2 s at step 8, group 1
healed and rejoined; 120 s). The kill again under LocalSGD and DiLoCo (a synchronisation every 2 steps): after
the heal the groups synchronise again (2026-11-28, DiLoCo: group 1 rejoined at step 8; after step 24 the fragment
synchronised there equal across the groups, 29 of 57 parameters; 333 s).

    .venv/bin/python -m pytest -m cann_emu_long tests/cann_emu/test_torchft_failover.py -n 0

Marked cann_emu_long, outside CI's selection: its 8 processes of the real torch_npu beside CI's other worker
made the survivor start late and heal from the group about to be killed (a fresh-clone run, 2026-11-27);
CI runs the same failover on the rehearsal and the simulated NPU (tests/e2e/test_torchft.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_torchft import check_failover, check_hang  # noqa: E402

pytest.importorskip("torchft")


@pytest.mark.cann_emu_long
def test_a_killed_replica_group_heals_from_the_live_one_over_hccl(tmp_path):
    check_failover(tmp_path, "cann", steps=40, kill_at=4)  # group 0 must still train when group 1 returns


@pytest.mark.cann_emu_long
@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_a_replica_group_killed_during_semi_sync_training_heals_and_synchronises_again(tmp_path, method):
    check_failover(tmp_path, "cann", steps=24, kill_at=4, semi_sync=method)


@pytest.mark.cann_emu_long
def test_a_hung_rank_takes_its_group_out_of_the_quorum_and_the_other_goes_on(tmp_path):
    check_hang(tmp_path, "cann", steps=40)

"""torch_npu's own ProcessGroupHCCL between processes on the CANN emulation's HCCL (issue 20).

Each module fixture runs ``torchrun --standalone`` with tests/cann_emu/hccl_worker.py in the
emulation's venv (skipped, saying why, when it or the built libraries are absent); the ranks
compare what the collectives returned with plain CPU PyTorch math and write one JSON per rank.
``CANN_EMU_COUNTS`` records the HCCL calls each process made.

    .venv-cann/bin/python -m pytest -m cann_emu tests/cann_emu/test_hccl.py
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cann_emu_child import PYTHON, REPO
from verification.cann_emu import cann_env

WORKER = Path(__file__).with_name("hccl_worker.py")

# What a healthy run never prints: torch_npu's watchdog giving up or aborting, a C++ abort, an HCCL
# call failing, a CANN function the emulation lacks.
BAD_OUTPUT = ("watchdog thread terminated", "Watchdog caught", "terminate called", "HCCL function error",
              "is not implemented by the CANN emulation", "Aborted")


def run_ranks(tmp: Path, world: int, mode: str, hccl_timeout: float | None = None, async_streams: bool = False) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    env = cann_env({k: v for k, v in os.environ.items() if not k.startswith("CANN_EMU_")}, devices=world)
    if async_streams:
        env["CANN_EMU_ASYNC_STREAMS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["CANN_EMU_COUNTS"] = str(tmp / "counts-{pid}.json")
    if hccl_timeout is not None:
        env["CANN_EMU_HCCL_TIMEOUT"] = str(hccl_timeout)
    if mode != "collectives":
        # The failure tests read the error where the HCCL call returns it. torch_npu's watchdog (on by default,
        # TORCH_HCCL_ASYNC_ERROR_HANDLING=1) polls the same communicator's sticky error and ends the process
        # without the message; a loaded CI machine once let it win that race (rank 1, SIGABRT).
        env["TORCH_HCCL_ASYNC_ERROR_HANDLING"] = "0"
    result = subprocess.run(
        [str(PYTHON), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
         str(WORKER), mode, str(tmp)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{output[-8000:]}"
    # None for a rank that wrote nothing (the one that exits early in the failure tests).
    ranks = [json.loads(p.read_text()) if (p := tmp / f"rank{r}.json").exists() else None for r in range(world)]
    # The agent process writes empty counts; the workers are the ones that made HCCL calls.
    counts = [c["hccl"] for p in sorted(tmp.glob("counts-*.json")) if (c := json.loads(p.read_text()))["hccl"]]
    return {"ranks": ranks, "counts": counts, "output": output}


# The last: the same checks with collectives running on their streams' own threads (CANN_EMU_ASYNC_STREAMS=1),
# so what follows each one on the compute stream is queued behind it and must still read its result.
@pytest.fixture(scope="module", params=[(2, False), (4, False), (2, True)], ids=["2ranks", "4ranks", "2ranks_async"])
def collectives(request, tmp_path_factory) -> dict:
    world, async_streams = request.param
    out = run_ranks(tmp_path_factory.mktemp(f"hccl{world}"), world, "collectives", async_streams=async_streams)
    out["world"] = world
    return out


def test_collectives_equal_cpu_math(collectives):
    world = collectives["world"]
    expected = {f"all_reduce_{op}" for op in ("sum_float32", "sum_bfloat16", "sum_float16", "sum_int32",
                                               "sum_int64", "sum_int8", "max_float32", "max_bfloat16",
                                               "min_float32", "product_float32")}
    expected |= {"broadcast", "all_gather_into_tensor_float32", "all_gather_into_tensor_uint8",
                 "reduce_scatter_tensor", "all_to_all_single_uneven", "send_recv_ring", "batch_isend_irecv_ring",
                 "world_after_groups"}
    for rank, result in enumerate(collectives["ranks"]):
        assert result is not None, f"rank {rank} wrote no result"
        checks = {k: v for k, v in result.items() if not k.startswith("barrier_")}
        in_group = {"new_group_all_reduce", "new_group_all_gather"} if rank < 2 or world == 4 else set()
        assert set(checks) == expected | in_group, f"rank {rank}"
        failed = {k: v for k, v in checks.items() if v is not True}
        assert not failed, f"rank {rank}: {failed}"


def test_barrier_holds_every_rank_until_the_last_arrives(collectives):
    # Rank 0 sleeps 1 s before the barrier, so it comes last.
    came = collectives["ranks"][0]["barrier_entered_at"]
    for rank, result in enumerate(collectives["ranks"][1:], start=1):
        assert result["barrier_left_at"] >= came, f"rank {rank} left {came - result['barrier_left_at']:.3f} s before rank 0 came"


def test_watchdog_polls_and_every_communicator_is_destroyed(collectives):
    bad = [line for line in collectives["output"].splitlines() if any(b in line for b in BAD_OUTPUT)]
    assert not bad, "\n".join(bad[:20])
    counts = collectives["counts"]
    assert len(counts) == collectives["world"]
    for hccl in counts:
        # torch_npu's watchdog asks each communicator for its asynchronous error while work is in flight.
        assert hccl.get("HcclGetCommAsyncError", 0) > 0, hccl
        made = hccl.get("HcclCommInitRootInfoConfig", 0) + hccl.get("HcclCommInitRootInfo", 0)
        assert made >= 2 and hccl.get("HcclCommDestroy", 0) == made, hccl  # world, point-to-point, sub-group
        # batch_isend_irecv: HcclSend/HcclRecv between HcclGroupStart and HcclGroupEnd.
        assert hccl.get("HcclGroupStart", 0) == hccl.get("HcclGroupEnd", 0) > 0, hccl


def test_a_rank_that_exits_makes_the_others_fail_at_once_naming_it(tmp_path):
    out = run_ranks(tmp_path, 4, "exit", hccl_timeout=60)
    for rank, result in enumerate(out["ranks"][:3]):
        assert result["first_all_reduce"] is True
        error = result["error"]
        assert error and "HcclAllReduce on communicator" in error, f"rank {rank}: {error}"
        assert "rank 3 of communicator" in error and "closed its connection" in error, f"rank {rank}: {error}"
        if rank:
            assert "rank 0 reports" in error, f"rank {rank}: {error}"  # relayed by rank 0
        assert result["failed_after_s"] < 30, f"rank {rank} waited {result['failed_after_s']:.1f} s"


def test_a_rank_that_never_joins_times_out_with_hccl_e_timeout(tmp_path):
    out = run_ranks(tmp_path, 2, "hang", hccl_timeout=3)
    result = out["ranks"][0]
    assert result["first_all_reduce"] is True
    error = result["error"]
    assert error and "timed out after 3 s (CANN_EMU_HCCL_TIMEOUT)" in error and "rank 1 of communicator" in error, error
    assert "(status 9)" in out["output"]  # HCCL_E_TIMEOUT
    assert 2.5 < result["failed_after_s"] < 15, result["failed_after_s"]


def test_stop_device_aborts_a_waiting_collective_and_restart_device_recovers(tmp_path):
    # torch_npu's device recovery (npu._recovery): stop_device calls aclrtDeviceTaskAbort, which ends the HCCL call
    # blocked on a peer that never joins; operators fail with FORCE STOP until restart_device; then the device and a
    # new communicator work, all within the HCCL timeout the call would otherwise have waited for.
    out = run_ranks(tmp_path, 2, "stop", hccl_timeout=10)
    result = out["ranks"][0]
    assert result["first_all_reduce"] is True
    assert result["stopped_after_s"] < 5, result
    assert result["after_stop"] and result["after_stop"].startswith("FORCE STOP"), result
    assert result["op_after_restart"] is True and result["new_communicator_after_restart"] is True, result
    assert "aborted by aclrtDeviceTaskAbort" in out["output"]


def test_a_collective_waiting_on_its_own_stream_leaves_the_host_free_until_stop_device(tmp_path):
    # CANN_EMU_ASYNC_STREAMS=1, as a device: the all_reduce's launch returns while it waits for the silent peer;
    # torch_npu's task queue empties (it would not while the collective held its thread), a host synchronisation
    # waits without the GIL, so another Python thread beats and stops the device; the wait ends with FORCE STOP,
    # and restart_device brings back the device and a new communicator.
    # The silent peer lives 2 x the HCCL timeout: 10 s keeps the run short and still far above the 5 s bounds.
    out = run_ranks(tmp_path / "first", 2, "stop_while_waiting", hccl_timeout=10, async_streams=True)
    result = out["ranks"][0]
    if result["unresumed"] is None:
        # Seen once in a loaded fresh-clone CI run (2026-11-30): the emulation refused the unresumed communicator's
        # call (its line printed) and torch_npu's task queue never raised it in 60 s of synchronisations; run the
        # scenario once more, saying so, and require every check of that run.
        print(f"the unresumed communicator's refusal did not come back to Python; once more. First run: {result}")
        out = run_ranks(tmp_path / "again", 2, "stop_while_waiting", hccl_timeout=10, async_streams=True)
        result = out["ranks"][0]
    assert result["first_all_reduce"] is True
    assert result["host_went_on_after_s"] < 5, result
    assert result["after_stop"] and "FORCE STOP, error code is 107022" in result["after_stop"], result
    assert result["synchronize_ended_after_stop_s"] < 5, result
    assert result["heartbeats_while_waiting"] >= 10, result  # 1 s of 50 ms beats before the stop
    assert result["op_after_restart"] is True and result["new_communicator_after_restart"] is True, result
    assert "aborted by aclrtDeviceTaskAbort" in out["output"]
    # as HCCL's task-abort handler: every communicator suspended (error 22) until HcclCommResume
    assert result["idle_after_resume"] is True, result
    assert "suspended since aclrtDeviceTaskAbort" in out["output"], out["output"][-4000:]  # the emulation refused
    assert result["unresumed"], result  # and torch_npu's task queue brought the refusal back to Python
    assert result["cut_resume"] and "the emulation resumes only a communicator that had no call cut" in out["output"], result

"""torch_npu's debugging outputs from a run on the CANN emulation, read back by the tools that read
real ones (issue 20).

One two-rank torchtitan run (the unmodified upstream command, ``TORCHTITAN_NPU=1``) on the emulation
with ``--profiler.enable-memory-snapshot``; rank 1 stalls before step 3 (``stall_rank/``), so rank 0
waits in that step's first collective as behind a hung peer. What the real torch_npu writes:

- memory snapshots (torchtitan's pickles of ``torch.npu.memory._snapshot()``, recorded by torch_npu's
  caching allocator), read by torch's own reader ``torch.cuda._memory_viz`` in the main venv, where
  torch_npu is not installed;
- the HCCL flight recorder: torch_npu's watchdog times the collective out (``--comm.train_timeout_seconds``),
  signals every rank through the store, and each dumps to ``TORCH_HCCL_DEBUG_INFO_TEMP_FILE``, which
  the ``collectives`` patch set from ``--comm.save_traces_folder``. Read by torch's flight recorder
  loader and by ``npu-inject flight-recorder``; torch's analyser (``fr_trace``) cannot analyse torch_npu
  2.14.0's dumps (pinned below).

Plus ``torch.npu.memory._dump_snapshot``'s per-component CSV (``aclrtGetMemUsageInfo``).

    .venv/bin/python -m pytest -m cann_emu tests/cann_emu/test_debug_outputs.py -n 0
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cann_emu_child import PYTHON, REPO, child_json
from testkit import clean_env, parse_losses
from verification.cann_emu import cann_env

HERE = Path(__file__).resolve().parent
STALL_STEP = 3
RUN = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "4", "--training.seq_len", "128",
       "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
       "--profiler.enable-memory-snapshot", "--profiler.profile_freq", "2",
       "--comm.trace_buf_size", "2000", "--comm.train_timeout_seconds", "5"]


def _kill_ranks_of(dump: Path) -> None:
    """torchrun starts its ranks in sessions of their own, so they outlive its process group; their command
    lines name the run's dump folder."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            arguments = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if str(dump).encode() in arguments and b"torchtitan.train" in arguments:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run_until_every_rank_dumped(dump: Path, run_args: list[str]) -> str:
    """A 2-rank run on the emulation whose rank 1 stalls before step STALL_STEP; returns its output. It
    does not end by itself (rank 0 waits in HCCL until HCCL's own execution timeout, as on an NPU); once
    both ranks have dumped, it is killed, as a scheduler kills a hung job."""
    env = cann_env(clean_env(TORCHTITAN_NPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                             CANN_EMU_TEST_STALL=f"1:{STALL_STEP}:600"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "stall_rank"), env.get("PYTHONPATH")]))
    command = [str(PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "torchtitan.train", *run_args, "--dump-folder", str(dump)]
    traces = [dump / "comm_traces" / f"rank_{rank}" for rank in (0, 1)]
    log = dump / "run.log"
    with log.open("w") as out:
        run = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while not all(t.exists() for t in traces) and run.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            time.sleep(3)  # each dump is one write; let the second rank's finish
        finally:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:  # the whole group already exited (the test then fails on what it left)
                pass
            run.wait()
            _kill_ranks_of(dump)
    return log.read_text()


@pytest.fixture(scope="module")
def stalled_run(tmp_path_factory) -> tuple[str, Path]:
    dump = tmp_path_factory.mktemp("stalled_run")
    return _run_until_every_rank_dumped(dump, RUN), dump


def test_the_stalled_rank_makes_the_watchdog_time_out_and_every_rank_dump(stalled_run):
    output, dump = stalled_run
    assert sorted(parse_losses(output)) == [1, 2], output[-4000:]
    assert "Watchdog caught collective operation timeout" in output, output[-4000:]
    for rank in (0, 1):
        assert f"dumping hccl trace to {dump / 'comm_traces' / f'rank_{rank}'}" in output, output[-4000:]


def _read_with_torch(module: str, *args: str) -> str:
    """torch's reader in the main venv (no torch_npu there): what a user runs on a real dump."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    result = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_memory_snapshots_read_back_with_torchs_memory_viz(stalled_run):
    _, dump = stalled_run
    snapshots = sorted((dump / "profiling" / "memory_snapshot").rglob("*.pickle"))
    assert [p.name for p in snapshots] == ["000000_step_2.pickle", "000001_step_2.pickle"]
    stats = _read_with_torch("torch.cuda._memory_viz", "stats", str(snapshots[0]))
    assert "total_reserved:" in stats and "total_allocated:" in stats, stats
    trace = _read_with_torch("torch.cuda._memory_viz", "trace", str(snapshots[0]))
    assert "Device 0" in trace, trace[:2000]

    snapshot = pickle.loads(snapshots[0].read_bytes())
    events = snapshot["device_traces"][0]
    actions = {event["action"] for event in events}
    assert {"segment_alloc", "alloc", "free_requested", "free_completed"} <= actions, actions
    # The allocator's stacks reach torchtitan's training step (Python frames recorded by torch_npu).
    assert any(frame["name"] == "train_step" for event in events for frame in event["frames"])
    # Segments are aclrtMalloc'd blocks; the live blocks lie inside them.
    segments = snapshot["segments"]
    assert segments and all(s["device"] == 0 for s in segments)
    for segment in segments:
        assert sum(block["size"] for block in segment["blocks"]) == segment["total_size"]


def _flight_recorder_dumps(dump: Path, into: Path) -> Path:
    """The ranks' dumps alone, in a folder of their own: torch_npu also writes ``<prefix><rank>_py_traceback``
    (text) beside each dump, which torch's loader, reading every file that starts with the prefix,
    cannot parse (``int('1_py_traceback')``)."""
    into.mkdir()
    for rank in (0, 1):
        shutil.copy(dump / "comm_traces" / f"rank_{rank}", into / f"rank_{rank}")
    return into


def _load(folder: Path):
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    args = JobConfig().parse_args([str(folder), "-p", "rank_"])
    return (args, *read_dir(args))


def test_flight_recorder_dumps_read_back_show_the_collective_rank_0_waits_in(stalled_run, tmp_path):
    _, dump = stalled_run
    assert "train_step" in (dump / "comm_traces" / "rank_0_py_traceback").read_text()
    _, details, version = _load(_flight_recorder_dumps(dump, tmp_path / "dumps"))
    assert sorted(details) == ["rank_0", "rank_1"], sorted(details)
    assert version == "2.4"
    waiting, stalled = details["rank_0"], details["rank_1"]
    world = next(iter(waiting["pg_config"]))
    rank0_world = [e for e in waiting["entries"] if e["process_group"][0] == world]
    rank1_world = [e for e in stalled["entries"] if e["process_group"][0] == world]
    # Rank 0 entered one more collective of the world group than rank 1, and it never completed.
    last = rank0_world[-1]
    assert last["state"] == "scheduled", last
    assert last["collective_seq_id"] == rank1_world[-1]["collective_seq_id"] + 1
    assert all(e["state"] == "completed" for e in rank0_world[:-1] + rank1_world)
    # What a user reads first: the Python stack that issued the waiting collective.
    assert any(frame["name"] == "train_step" for frame in last["frames"]), last["frames"]


def test_npu_inject_flight_recorder_names_the_rank_behind(stalled_run):
    """The product's reader on the real torch_npu's dumps, in place (the _py_traceback files beside them)."""
    _, dump = stalled_run
    result = subprocess.run([sys.executable, "-m", "npu_inject", "flight-recorder", str(dump / "comm_traces"),
                             "--frames", "30"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 dumps (ranks [0, 1])" in result.stdout
    diverged = next(line for line in result.stdout.splitlines() if "DIVERGED" in line)
    assert "entered by ranks [0], not by ranks [1]" in diverged, result.stdout
    assert "rank 0: scheduled" in result.stdout
    assert "train_step (" in result.stdout


@pytest.mark.cann_emu_long
def test_flight_recorder_under_expert_parallel_names_the_rank_behind_and_no_mismatch(tmp_path):
    """deepseek_v3 EP 2: its token all-to-alls pass different sizes on each rank (20 of ~130 collectives
    in 3 steps), which must not read as a mismatched call."""
    output = _run_until_every_rank_dumped(tmp_path, [
        "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--parallelism.expert_parallel_degree", "2",
        "--training.steps", "4", "--training.seq_len", "128", "--training.local_batch_size", "1",
        "--validator.no-enable", "--checkpoint.no-enable", "--comm.trace_buf_size", "5000",
        "--comm.train_timeout_seconds", "5"])
    assert "Watchdog caught collective operation timeout" in output, output[-4000:]
    dumps = {rank: pickle.loads((tmp_path / "comm_traces" / f"rank_{rank}").read_bytes()) for rank in (0, 1)}
    sizes = [{e["collective_seq_id"]: str(e["input_sizes"]) for e in dumps[rank]["entries"]} for rank in (0, 1)]
    assert any(sizes[0][seq] != sizes[1][seq] for seq in set(sizes[0]) & set(sizes[1]))  # uneven all-to-alls
    result = subprocess.run([sys.executable, "-m", "npu_inject", "flight-recorder", str(tmp_path / "comm_traces")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DIVERGED at collective" in result.stdout and "not by ranks [1]" in result.stdout
    assert "MISMATCH" not in result.stdout, result.stdout


def test_torchs_flight_recorder_analyser_cannot_read_torch_npu_2_14_dumps(stalled_run, tmp_path):
    """A known incompatibility, pinned so that a fixed torch_npu shows up here: torch_npu 2.14.0
    records an empty ``profiling_name`` for every collective (ProcessGroupHCCL::collective calls
    ``initWork(..., "", ...)``), which torch's analyser (``fr_trace``) parses as ``<backend>:<op>``."""
    from torch.distributed.flight_recorder.components.builder import build_db

    _, dump = stalled_run
    args, details, version = _load(_flight_recorder_dumps(dump, tmp_path / "dumps"))
    assert {e["profiling_name"] for d in details.values() for e in d["entries"]} == {""}
    with pytest.raises(ValueError, match="not enough values to unpack"):
        build_db(details, args, version)


def test_dump_snapshot_writes_the_per_component_usage_of_aclrtGetMemUsageInfo(tmp_path):
    """_dump_snapshot asks CANN for each component's current and peak device memory and writes a CSV
    beside the OOM snapshot path; the emulation's one component is aclrtMalloc, whose figures are the
    caching allocator's reserved bytes."""
    out = child_json(
        f"""
        import json, os, torch, torch_npu
        os.chdir({str(tmp_path)!r})
        x = torch.empty(3 << 20, dtype=torch.uint8, device="npu")
        y = torch.empty(5 << 20, dtype=torch.uint8, device="npu")
        peak = torch.npu.memory_reserved()
        del y
        torch.npu.empty_cache()
        torch.npu.memory._dump_snapshot("snapshot.pickle")
        print(json.dumps({{"peak": peak, "reserved": torch.npu.memory_reserved()}}))
        """
    )
    [csv] = tmp_path.glob("device_0_memUsageInfo_*.csv")
    header, *rows = csv.read_text().splitlines()
    assert header == "moduleName,curMemSize(MB),memPeakSize(MB)"
    assert len(rows) == 1
    name, current, peak = rows[0].split(",")
    assert name == "aclrtMalloc"
    assert float(current) == pytest.approx(out["reserved"] / 2**20, abs=1e-4)
    assert float(peak) >= out["peak"] / 2**20 - 1e-4
    assert (tmp_path / "snapshot.pickle").exists()

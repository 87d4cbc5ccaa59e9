"""The debugging tools in real runs: tools/bench_train.py + memory snapshots in the rehearsal, and
profiling, memory snapshots, determinism and the flight recorder on 2 simulated NPUs.

One short run per target (seq_len 256, batch 2): the rehearsal through bench_train (its
table, labelled as rehearsal figures, and the memory-snapshot note instead of upstream's
AttributeError); the simulated NPU with every tool switched on at once, its trace folders and
memory snapshots checked against what the real torch_npu writes (read from its wheel).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import torch_npu_source
from testkit import REPO, SHORT_RUN, clean_env, parse_losses, sim_npu_env, torchrun
from verification.sim_npu import torch_npu_wheel


def _report(dump: str, rank: int = 0) -> dict:
    with open(os.path.join(dump, "npu_inject", f"report_rank{rank}.json"), encoding="utf-8") as handle:
        return json.load(handle)["patches"]


def test_bench_train_rehearsal_with_memory_snapshot(tmp_path):
    dump = str(tmp_path / "bench")
    command = [sys.executable, os.path.join(REPO, "tools", "bench_train.py"), "--steps", "3", "--warmup", "1",
               "--dump-folder", dump, "--json", str(tmp_path / "bench.json"), "--",
               *SHORT_RUN, "--profiler.enable-memory-snapshot", "--profiler.profile-freq", "2"]
    result = subprocess.run(command, env=clean_env(TORCHTITAN_NPU="cpu"), cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "REHEARSAL FIGURES" in result.stdout
    assert "| model | devices | tokens/s/device | TFLOPS/device | MFU | peak memory (GiB) |" in result.stdout
    assert "| llama3 llama3_debugmodel | 2 x CPU rehearsal |" in result.stdout
    assert "% (of the host's measured peak)" in result.stdout
    bench = json.load(open(tmp_path / "bench.json"))
    assert bench["rehearsal"] is True and bench["summary"]["tps"] > 0 and bench["summary"]["steps"] == [2, 3]
    log = open(os.path.join(dump, "bench_train.log"), encoding="utf-8").read()
    assert "AttributeError" not in log and "mfu: nan%" not in log and "mfu: " in log
    report = _report(dump)
    assert any("no snapshot in the CPU rehearsal" in note for note in report["profiling"]["notes"])
    assert any("MFU in the CPU rehearsal is against the host matmul peak" in note
               for note in report["metrics"]["notes"])


def test_profiler_snapshots_determinism_and_flight_recorder_on_simulated_npus(tmp_path):
    dump = str(tmp_path / "sim")
    args = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "2", *SHORT_RUN,
            "--training.mixed_precision_param", "float32", "--debug.seed", "42", "--debug.deterministic",
            "--checkpoint.no-enable", "--dump_folder", dump, "--comm.trace_buf_size", "100",
            "--profiler.enable-profiling", "--profiler.profile-freq", "2", "--profiler.profiler-warmup", "0",
            "--profiler.profiler-active", "1",
            "--profiler.enable-memory-snapshot", "--profiler.memory-snapshot-freq", "2"]
    result = torchrun(args, sim_npu_env())
    assert result.returncode == 0, result.stdout[-4000:]
    assert sorted(parse_losses(result.stdout)) == [1, 2]
    assert "mfu: nan%" in result.stdout  # the simulated part is in no peak table
    # What the real torch_npu writes, read from its wheel: the trace folder, file and JSON form, the snapshot's keys.
    wheel = torch_npu_source.WheelAPI(torch_npu_wheel.wheel(), set())
    layout = torch_npu_source.profiler_trace_layout(wheel)
    snapshot_fields, _ = torch_npu_source.memory_snapshot_fields(wheel)
    for rank in (0, 1):
        problems = torch_npu_source.trace_problems(layout, os.path.join(dump, "profiling", "traces"), f"rank{rank}")
        snapshot_path = os.path.join(dump, "profiling", "memory_snapshot", "step_000000000002",
                                     f"{rank:06d}_step_2.pickle")  # torchtitan's naming
        with open(snapshot_path, "rb") as handle:
            problems += torch_npu_source.snapshot_problems(pickle.load(handle), snapshot_fields)
        assert not problems, f"rank {rank}: " + "\n".join(problems)
        report = _report(dump, rank)
        assert "set HCCL_DETERMINISTIC=true (deterministic HCCL reductions)" in report["determinism"]["notes"]
        assert "set TORCH_HCCL_TRACE_BUFFER_SIZE=100" in report["collectives"]["notes"]
        assert f"set TORCH_HCCL_DEBUG_INFO_TEMP_FILE={os.path.join(dump, 'comm_traces', 'rank_')}" in \
            report["collectives"]["notes"]
        assert any("torch_npu.profiler" in note for note in report["profiling"]["notes"])
        assert any("Ascend910B-sim" in fallback for fallback in report["metrics"]["fallbacks"])

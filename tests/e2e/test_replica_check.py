"""A bit flipped in one replica's weights (inject_faults' bitflip_param) is caught by replica_check, naming the rank.

CPU rehearsal, 3 ranks as 3 DDP replicas (--parallelism.data_parallel_replicate_degree 3), upstream torchtitan,
checks every 2nd step: step 2's check finds the replicas bitwise equal (parameters and Adam's states); rank 2's
first parameter loses or gains a factor 2 in one element after step 3's update; step 4's check names that
tensor and rank 2 as the minority, and every rank stops with that one line.
"""

from __future__ import annotations

import json

from testkit import clean_env, torchrun

ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--debug.seed", "42", "--training.steps", "5",
        "--parallelism.data_parallel_replicate_degree", "3", "--parallelism.data_parallel_shard_degree", "1"]


def test_a_flipped_bit_in_one_replica_stops_the_job_naming_the_rank_and_the_tensor(tmp_path):
    registry = tmp_path / "every2.json"
    registry.write_text(json.dumps({"patches": {"replica_check": {"options": {"every": 2}}}}))
    dump = tmp_path / "dump"
    run = torchrun([*ARGS, "--dump_folder", str(dump)], clean_env(
        TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults,+replica_check",
        TORCHTITAN_NPU_REGISTRY=str(registry), TORCHTITAN_NPU_FAULTS="bitflip_param@3:rank=2"), nproc=3)
    assert run.returncode != 0, run.stdout[-4000:]
    stops = [line for line in run.stdout.splitlines() if "npu_inject replica_check: step 4:" in line]
    assert len(stops) == 3 and len(set(line[line.index("npu_inject"):] for line in stops)) == 1, run.stdout[-4000:]
    line = stops[0]
    assert "the replicas' tok_embeddings.weight differ (1 of " in line, line
    assert "rank 2 (" in line and "disagrees with the majority (0, 1): drain its device" in line, line
    assert "the last verified step is 2" in line, line
    assert "npu_inject inject_faults: step 3: bitflip_param on rank 2" in run.stdout
    for rank in (0, 1):  # the rank that stopped first may not have written its report: the others did at step 2
        report = json.loads((dump / "npu_inject" / f"report_rank{rank}.json").read_text())["patches"]
        assert any(note.startswith("step 2: ") and "agree across 3 replicas" in note
                   for note in report["replica_check"]["notes"]), report["replica_check"]

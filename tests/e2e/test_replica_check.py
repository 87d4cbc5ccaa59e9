"""A bit flipped in one replica's weights (inject_faults' bitflip_param) is caught by replica_check and rolled back.

CPU rehearsal, upstream torchtitan llama3 debug, DDP replicas (--parallelism.data_parallel_replicate_degree).
3 replicas, checks every step: rank 2's first parameter loses or gains a factor 2 in one element after step 2's
update; step 2's check names that tensor and rank 2 as the minority, every rank rolls back to step 1's snapshot
and trains step 2 again, and the job trains on: every loss must be that of a run without the flip, to the
printed digit. Flipped at steps 2 and 3 with stop_after 2, every rank stops at step 3 with one line: drain rank
1's device. 2 replicas (no majority), checks every 3 steps: flipped after step 4's update, steps 5 and 6 train on
it, step 6's check rolls back to step 3 and trains 4 to 6 again: the losses logged last for each step are those
of a run without the flip. CI runs the two-replica case; the three-replica one and the stop after stop_after strikes run under
-m e2e_long.
"""

from __future__ import annotations

import json

import pytest

from testkit import clean_env, parse_losses, torchrun

ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--debug.seed", "42", "--metrics.log_freq", "1"]


def _run(tmp_path, name: str, faults: str, stop_after: int = 3, replicas: int = 3, every: int = 1, steps: int = 4,
         shards: int = 1):
    registry = tmp_path / f"{name}.json"
    registry.write_text(json.dumps({"patches": {"replica_check": {"options": {"every": every,
                                                                              "stop_after": stop_after}}}}))
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults,+replica_check",
                    TORCHTITAN_NPU_REGISTRY=str(registry))
    if faults:
        env["TORCHTITAN_NPU_FAULTS"] = faults
    args = [*ARGS, "--parallelism.data_parallel_replicate_degree", str(replicas),
            "--parallelism.data_parallel_shard_degree", str(shards), "--training.steps", str(steps)]
    return torchrun([*args, "--dump_folder", str(tmp_path / name)], env, nproc=replicas * shards)


@pytest.mark.e2e_long
def test_a_flipped_bit_in_one_replica_is_repaired_from_the_majority_and_the_losses_are_those_without_it(tmp_path):
    flipped, clean = _run(tmp_path, "flipped", "bitflip_param@2:rank=2"), _run(tmp_path, "clean", "")
    assert flipped.returncode == 0, flipped.stdout[-4000:]
    assert clean.returncode == 0, clean.stdout[-4000:]
    print(f"flipped and repaired {parse_losses(flipped.stdout)}\nwithout the flip {parse_losses(clean.stdout)}")
    assert parse_losses(flipped.stdout) == parse_losses(clean.stdout) and len(parse_losses(clean.stdout)) == 4
    assert "npu_inject inject_faults: step 2: bitflip_param on rank 2" in flipped.stdout
    for rank in (0, 1, 2):
        notes = json.loads((tmp_path / "flipped" / "npu_inject" / f"report_rank{rank}.json").read_text())[
            "patches"]["replica_check"]["notes"]
        repaired = [note for note in notes if "disagreed with the majority" in note]
        assert len(repaired) == 1 and repaired[0].startswith(
            "step 2: the replicas' tok_embeddings.weight differ (1 of 180 tensors): rank 2 ("), notes
        assert ("every rank rolled back to step 1 (the last verified) and trained steps 2..2 again on the same "
                "batches; the replicas agree (strike 1 of 3") in repaired[0], repaired
        assert sum("agree across 3 replicas" in note for note in notes) == 3  # steps 1, 3, 4


@pytest.mark.e2e_long
def test_a_rank_overruled_stop_after_times_stops_every_rank_naming_it(tmp_path):
    run = _run(tmp_path, "twice", "bitflip_param@2:rank=1,bitflip_param@3:rank=1", stop_after=2)
    assert run.returncode != 0, run.stdout[-4000:]
    stops = {line[line.index("npu_inject replica_check"):] for line in run.stdout.splitlines()
             if "npu_inject replica_check: step 3:" in line}
    assert len(stops) == 1, run.stdout[-4000:]
    line = stops.pop()
    assert "rank 1 (" in line and "disagreed with the majority 2 times (stop_after): drain its device" in line, line
    assert "the last verified step is 2" in line, line


def _two_replicas_roll_back(tmp_path, shards: int):
    flipped = _run(tmp_path, "two", "bitflip_param@4:rank=1", replicas=2, every=3, steps=6, shards=shards)
    clean = _run(tmp_path, "two_clean", "", replicas=2, every=3, steps=6, shards=shards)
    assert flipped.returncode == 0, flipped.stdout[-4000:]
    assert clean.returncode == 0, clean.stdout[-4000:]
    losses, reference = parse_losses(flipped.stdout), parse_losses(clean.stdout)  # the last logged line of each step
    print(f"flipped at 4, rolled back at 6 {losses}\nwithout the flip {reference}")
    assert losses == reference and len(reference) == 6
    first = 0 if shards == 1 else 1  # rank 1's replica group: ranks 0 and 1 (DDP), ranks 1 and 3 (HSDP's 2 x 2)
    line = (f"npu_inject replica_check: step 6: the replicas' tok_embeddings.weight differ (1 of 180 tensors): "
            f"rank {first} (")
    assert line in flipped.stdout, flipped.stdout[-3000:]
    assert ("disagree and no majority says which is wrong; every rank rolled back to step 3 (the last verified) and "
            "trained steps 4..6 again on the same batches; the replicas agree") in flipped.stdout
    notes = json.loads((tmp_path / "two" / "npu_inject" / "report_rank0.json").read_text())["patches"][
        "replica_check"]["notes"]
    assert any(note.startswith("rollback snapshot at each verified step: ") for note in notes), notes


def test_two_replicas_that_drift_apart_roll_back_to_the_last_verified_step_and_train_on_as_without_the_flip(tmp_path):
    _two_replicas_roll_back(tmp_path, shards=1)


@pytest.mark.e2e_long
def test_two_hsdp_replicas_of_two_shards_that_drift_apart_roll_back_as_ddp_replicas_do(tmp_path):
    """HSDP: 4 ranks, 2 replicas of 2 FSDP shards; rank 1's shard is compared with its counterpart rank 3's."""
    _two_replicas_roll_back(tmp_path, shards=2)


@pytest.mark.e2e_long
def test_torchft_replica_groups_that_drift_apart_stop_with_one_line_without_a_majority(tmp_path):
    """Two torchft replica groups of 2 ranks (tools/bench_failover.py), checks every 2 steps: rank 1 of group 1
    flips a bit after step 3's update; step 4's check, through torchft's all-reduce, finds the groups' rank 1
    shards differ and no majority: rank 1 of both groups stops with the same line naming the tensor, both
    groups and the last verified step (torchrun then restarts the groups, which have no checkpoint here)."""
    pytest.importorskip("torchft")
    from tools.bench_failover import run_failover

    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"patches": {"replica_check": {"options": {"every": 2}}}}))
    (tmp_path / "run").mkdir()
    # min_replicas 2: both groups in every quorum from the first (a group joining late heals, and its step count
    # jumps past the fault's step)
    run = run_failover(tmp_path / "run", steps=6, fault="bitflip_param@3:rank=1", timeout=600, min_replicas=2,
                       extra_env={"TORCHTITAN_NPU_PATCHES": "+replica_check", "TORCHTITAN_NPU_REGISTRY": str(registry)})
    stops = [[line.removeprefix("[default1]:") for line in log.splitlines()
              if line.startswith("[default1]:npu_inject replica_check: ")] for log in run.logs]
    print(stops)
    assert stops[0] and stops[0][0] == stops[1][0], stops
    assert stops[0][0].startswith("npu_inject replica_check: step 4: the torchft replica groups' ")
    assert ("differ) and no majority says which group is wrong (replica group 0, replica group 1)" in stops[0][0]
            and "the last verified step is 2" in stops[0][0])
    assert not any(line.startswith("[default0]:npu_inject replica_check: ") for log in run.logs for line in log.splitlines())

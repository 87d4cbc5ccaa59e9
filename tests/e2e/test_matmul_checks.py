"""A matmul result corrupted on purpose (inject_faults' sdc_matmul) is caught by matmul_checks and its step retrained.

CPU rehearsal, 2 ranks, upstream torchtitan llama3 debug, fixed seed, every step checked
(TORCHTITAN_NPU_SDC_EVERY=1). Rank 1's first checked linear returns one element x as 1024 x + 1024 in step 3;
the step's verdicts name rank 1, the update is not applied, and the step runs again on the same batches. The
reference is a run without the checks: every step's loss must be its loss, to the printed digit (the checks
change no bit, and the retried step is the step that never had the fault). The same rank caught at steps 2 and
3 with stop_after 2 stops every rank at step 3 with one line: drain rank 1's device.

FSDP in CI; pipeline degree 2, --compile.enable, tensor parallel degree 2 (eager and compiled) and two torchft
replica groups under -m e2e_long.
"""

from __future__ import annotations

import json
import re

import pytest

from testkit import clean_env, parse_losses, torchrun

ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--debug.seed", "42", "--metrics.log_freq", "1",
        "--training.steps", "5"]
PIPELINE = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
COMPILE = ["--compile.enable", "--compile.backend", "aot_eager"]
TENSOR_PARALLEL = ["--parallelism.tensor_parallel_degree", "2"]


def _checked(tmp_path, name: str, faults: str, extra=(), stop_after: int = 3, ranks: int = 2):
    registry = tmp_path / f"{name}.json"
    registry.write_text(json.dumps({"patches": {"matmul_checks": {"options": {"stop_after": stop_after}}}}))
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults,+matmul_checks",
                    TORCHTITAN_NPU_SDC_EVERY="1", TORCHTITAN_NPU_FAULTS=faults, TORCHTITAN_NPU_REGISTRY=str(registry))
    return torchrun([*ARGS, *extra, "--dump_folder", str(tmp_path / name)], env, nproc=ranks)


def _losses(log: str) -> dict[int, float]:
    """step -> loss; a pipeline's first stage logs -1 for the loss it does not see"""
    return parse_losses(re.sub(r"loss:\s*-1\.00000", "", log))


def _unchecked(tmp_path, extra=(), ranks: int = 2):
    run = torchrun([*ARGS, *extra, "--dump_folder", str(tmp_path / "unchecked")], clean_env(TORCHTITAN_NPU="cpu"),
                   nproc=ranks)
    assert run.returncode == 0, run.stdout[-4000:]
    return _losses(run.stdout)


def _caught_and_retrained(tmp_path, extra=(), ranks: int = 2):
    checked = _checked(tmp_path, "checked", "sdc_matmul@3:rank=1", extra, ranks=ranks)
    assert checked.returncode == 0, checked.stdout[-4000:]
    losses, reference = _losses(checked.stdout), _unchecked(tmp_path, extra, ranks)
    print(f"checked, corrupted at step 3 {losses}\nunchecked, never corrupted {reference}")
    assert losses == reference and len(losses) == 5
    line = "npu_inject matmul_checks: step 3 attempt 1: matmul results failed their checksums on rank 1 ("
    assert line in checked.stdout and "step 3 attempt 2" not in checked.stdout
    for rank in (0, 1):
        report = json.loads((tmp_path / "checked" / "npu_inject" / f"report_rank{rank}.json").read_text())
        notes = report["patches"]["matmul_checks"]["notes"]
        assert any(note.startswith("step 3 attempt 1: matmul results failed their checksums on rank 1 (")
                   and note.endswith("the step runs again on the same batches") for note in notes), notes
        assert not [note for note in notes if "failed their checksums" in note and not note.startswith("step 3 ")]
        assert not [note for note in notes if "ran unchecked" in note or "; not checked: " in note], notes


def test_a_corrupted_matmul_is_caught_and_its_step_retrained_to_the_losses_of_a_run_without_it(tmp_path):
    _caught_and_retrained(tmp_path)


def test_a_rank_caught_stop_after_times_stops_every_rank_naming_it(tmp_path):
    run = _checked(tmp_path, "drained", "sdc_matmul@2:rank=1,sdc_matmul@3:rank=1", stop_after=2)
    assert run.returncode != 0
    assert "step 3 attempt 1: matmul results failed their checksums on rank 1 (" in run.stdout
    assert "rank 1 (" in run.stdout and "failed 2 times in 100 steps (stop_after, window): drain its device; the " \
        "weights are those of step 2, the last update (verified at step 2)" in run.stdout, run.stdout[-3000:]
    assert set(parse_losses(run.stdout)) == {1, 2}


@pytest.mark.e2e_long
def test_a_corrupted_matmul_is_caught_and_retrained_in_a_pipelined_job(tmp_path):
    _caught_and_retrained(tmp_path, PIPELINE)


@pytest.mark.e2e_long
def test_a_corrupted_matmul_is_caught_and_retrained_in_a_compiled_job(tmp_path):
    _caught_and_retrained(tmp_path, COMPILE)


DTENSOR = ["--parallelism.spmd_backend", "partial_dtensor"]
FULL_DTENSOR = ["--parallelism.spmd_backend", "full_dtensor", "--parallelism.data_parallel_shard_degree", "2"]


@pytest.mark.e2e_long
@pytest.mark.parametrize("extra", [(), tuple(DTENSOR + COMPILE)], ids=["spmd_types", "dtensor_compiled"])
def test_a_corrupted_matmul_is_caught_and_retrained_under_tensor_parallelism(tmp_path, extra):
    """TP 2 with sequence parallel, rank 1's shard of the first column-wise product corrupted at step 3. Under
    torchtitan's default spmd_types backend the linears see local tensors inside torchtitan's redistributing
    forward; under its DTensor backend they are DTensors, checked on their local shards."""
    _caught_and_retrained(tmp_path, [*TENSOR_PARALLEL, *extra])


@pytest.mark.e2e_long
def test_a_corrupted_matmul_is_caught_and_retrained_under_fsdp_and_tensor_parallelism_on_dtensors(tmp_path):
    """4 ranks, FSDP 2 x TP 2, torchtitan's full DTensor backend: a 2-D mesh, the batch sharded over FSDP's
    dimension (each rank's weight gradient partial there), the features over TP's."""
    _caught_and_retrained(tmp_path, [*TENSOR_PARALLEL, *FULL_DTENSOR], ranks=4)


@pytest.mark.e2e_long
def test_with_torchft_committing_every_step_a_corrupted_step_is_kept_out_on_every_replica_group(tmp_path):
    """Two torchft replica groups of 2 ranks (tools/bench_failover.py), every second step checked, rank 1 of group
    1 corrupted at step 4. The attempt's gradients were averaged across the groups before the check, so no group
    may apply it and none would wait for a retry: torchft's should_commit refuses step 4 on both groups. The
    reference is the same run with step 4 made non-finite on that rank instead (finite_steps keeps it out
    through the same refusal): every other step's loss, on both groups, must be the reference's."""
    pytest.importorskip("torchft")
    from tools.bench_failover import run_failover

    checks = {"TORCHTITAN_NPU_PATCHES": "+matmul_checks", "TORCHTITAN_NPU_SDC_EVERY": "2"}
    (tmp_path / "caught").mkdir()
    (tmp_path / "reference").mkdir()
    caught = run_failover(tmp_path / "caught", steps=6, fault="sdc_matmul@4:rank=1", timeout=600, extra_env=checks,
                          min_replicas=2)
    reference = run_failover(tmp_path / "reference", steps=6, fault="nan_loss@4:rank=1", timeout=600, extra_env=checks,
                             min_replicas=2)
    assert caught.returncodes == [0, 0] and reference.returncodes == [0, 0], caught.logs[1][-4000:]
    assert "Traceback" not in caught.logs[0] + caught.logs[1], caught.logs[0][-4000:]
    for group in (0, 1):
        losses, expected = caught.losses(group), reference.losses(group)
        print(f"group {group}: caught {losses}\nreference {expected}")
        assert sorted(losses) == list(range(1, 7))
        assert {step: loss for step, loss in losses.items() if step != 4} == {
            step: loss for step, loss in expected.items() if step != 4}
        assert "should_commit=False" in caught.logs[group] and caught.logs[group].count("should_commit=False") == 2
    assert "step 4 attempt 1: matmul results failed their checksums on rank 1 (" in caught.logs[1]
    assert "the update was not applied on any replica group (torchft refuses the step)" in caught.logs[1]


@pytest.mark.e2e_long
@pytest.mark.parametrize("extra", [(), tuple(COMPILE)], ids=["eager", "compiled"])
def test_a_corrupted_expert_product_under_expert_parallelism_is_caught_and_retrained(tmp_path, extra):
    """deepseek_v3 debug, 2 ranks, expert parallel degree 2, every step checked, sdc_expert@3 on rank 1 (its first
    experts' first grouped product): the experts' grouped products are checked with the linears (the note says
    so), step 3 is caught on rank 1 and retrained, and every loss is the unchecked eager run's, eager and compiled."""
    args = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", *ARGS[4:],
            "--parallelism.expert_parallel_degree", "2"]
    checked = torchrun([*args, *extra, "--dump_folder", str(tmp_path / "checked")], clean_env(
        TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+matmul_checks,+inject_faults", TORCHTITAN_NPU_SDC_EVERY="1",
        TORCHTITAN_NPU_FAULTS="sdc_expert@3:rank=1"))
    assert checked.returncode == 0, checked.stdout[-4000:]
    plain = torchrun([*args, "--dump_folder", str(tmp_path / "plain")], clean_env(TORCHTITAN_NPU="cpu"))
    assert plain.returncode == 0, plain.stdout[-4000:]
    losses, reference = parse_losses(checked.stdout), parse_losses(plain.stdout)
    print(f"checked {losses}\nunchecked {reference}")
    assert losses == reference and len(losses) == 5
    assert "step 3 attempt 1: matmul results failed their checksums on rank 1 (" in checked.stdout
    notes = json.loads((tmp_path / "checked" / "npu_inject" / "report_rank0.json").read_text())["patches"][
        "matmul_checks"]["notes"]
    assert "5 MoE experts' grouped products (the torch check)" in notes[0], notes
    assert notes[1].startswith("step 1: ") and notes[1].endswith("all correct"), notes

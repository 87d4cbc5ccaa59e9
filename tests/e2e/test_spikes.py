"""A loss spike caused on purpose (inject_faults' loss_spike) is caught by patch spikes and its batch skipped.

CPU rehearsal, 2 ranks, FSDP, upstream torchtitan, fixed seed. Rank 1's output times 50 at step 8 throws the
loss and the job's gradient norm up; spikes keeps the update out. The reference is independent of spikes: the
same step made non-finite (nan_loss) and kept out by finite_steps, a run that skipped that batch. Every other
step's loss must be the reference's, to the printed digit. Both watches name the spike, the loss watch with
torchtitan's logged loss of that step (its own sum over the ranks).

Under -m e2e_long: pipeline degree 2 with the loss watch alone (only the last stage holds a loss), and two torchft
replica groups committing every step (both refuse a spike one group saw).
"""

from __future__ import annotations

import json
import re

import pytest
from testkit import clean_env, parse_losses, torchrun

ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--debug.seed", "42", "--metrics.log_freq", "1",
        "--training.steps", "10"]
SPIKE_STEP = 8


def _spiked_and_skipped(tmp_path, args: list[str], options: dict):
    """The run with rank 1's spike at SPIKE_STEP under spikes (``options``: a short window, so a 10-step run is
    judged from step 6), and the reference whose SPIKE_STEP is made non-finite on rank 1 (kept out by
    finite_steps: a run that skipped that batch)."""
    registry = tmp_path / "spikes.json"
    registry.write_text(json.dumps({"patches": {"spikes": {"options": options}}}))
    spiked = torchrun([*args, "--dump_folder", str(tmp_path / "spike")], clean_env(
        TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults,+spikes", TORCHTITAN_NPU_REGISTRY=str(registry),
        TORCHTITAN_NPU_FAULTS=f"loss_spike@{SPIKE_STEP}:rank=1"))
    assert spiked.returncode == 0, spiked.stdout[-4000:]
    skipped = torchrun([*args, "--dump_folder", str(tmp_path / "skipped")], clean_env(
        TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults", TORCHTITAN_NPU_FAULTS=f"nan_loss@{SPIKE_STEP}:rank=1"))
    assert skipped.returncode == 0, skipped.stdout[-4000:]
    return spiked, skipped


def test_a_spike_is_skipped_and_the_run_trains_on_as_one_that_skipped_that_batch(tmp_path):
    spiked, skipped = _spiked_and_skipped(tmp_path, ARGS, {"window": 5, "warmup": 5})
    dump = tmp_path / "spike"
    spike_losses, reference = parse_losses(spiked.stdout), parse_losses(skipped.stdout)
    print(f"spike run {spike_losses}\nreference (step {SPIKE_STEP} not applied) {reference}")
    assert f"npu_inject spikes: step {SPIKE_STEP}: gradient norm spike" in spiked.stdout
    # the loss watch's own sum over the ranks is torchtitan's logged loss of that step
    assert f"; loss spike: {spike_losses[SPIKE_STEP]:.4g} is " in spiked.stdout, spiked.stdout[-3000:]
    assert spike_losses[SPIKE_STEP] > 3 * spike_losses[SPIKE_STEP - 1]  # the spike, logged as it happened
    assert {step: loss for step, loss in spike_losses.items() if step != SPIKE_STEP} == reference

    for rank in (0, 1):
        report = json.loads((dump / "npu_inject" / f"report_rank{rank}.json").read_text())["patches"]
        notes = report["spikes"]["notes"]
        assert len(notes) == 1 and notes[0].startswith(f"step {SPIKE_STEP}: gradient norm spike"), notes
        assert "; loss spike: " in notes[0], notes
        assert not any("not finite" in note for note in report["finite_steps"]["notes"])


PIPELINE = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]


def _stage_losses(stdout: str) -> dict[int, float]:
    """step -> loss of the last stage (the first logs -1 for the loss it does not see)"""
    return parse_losses(re.sub(r"loss:\s*-1\.00000", "", stdout))


@pytest.mark.e2e_long
def test_the_loss_watch_alone_skips_a_spike_of_a_pipelined_job(tmp_path):
    spiked, skipped = _spiked_and_skipped(tmp_path, [*ARGS, *PIPELINE], {"window": 5, "warmup": 5, "watch": "loss"})
    spike_losses, reference = _stage_losses(spiked.stdout), _stage_losses(skipped.stdout)
    print(f"spike run {spike_losses}\nreference (step {SPIKE_STEP} not applied) {reference}")
    assert f"npu_inject spikes: step {SPIKE_STEP}: loss spike: {spike_losses[SPIKE_STEP]:.4g} is " in spiked.stdout
    assert "gradient norm spike" not in spiked.stdout
    assert {step: loss for step, loss in spike_losses.items() if step != SPIKE_STEP} == reference


@pytest.mark.e2e_long
def test_with_torchft_committing_every_step_a_spike_in_one_group_is_kept_out_on_every_group(tmp_path):
    """Two torchft replica groups of 2 ranks (tools/bench_failover.py); group 1's rank 1 spikes at step 8. The
    gradients are averaged across the groups and should_commit answers for one group, so both groups must judge
    the same (averaged) loss and both refuse step 8; the reference is the same run with step 8 made non-finite on
    that rank (refused on both through the NaN the average carries)."""
    pytest.importorskip("torchft")
    from tools.bench_failover import run_failover

    registry = tmp_path / "spikes.json"
    registry.write_text(json.dumps({"patches": {"spikes": {"options": {"window": 5, "warmup": 5, "watch": "loss"}}}}))
    env = {"TORCHTITAN_NPU_PATCHES": "+spikes", "TORCHTITAN_NPU_REGISTRY": str(registry)}
    runs = {}
    for name, fault in (("caught", f"loss_spike@{SPIKE_STEP}:rank=1"), ("reference", f"nan_loss@{SPIKE_STEP}:rank=1")):
        (tmp_path / name).mkdir()
        # min_replicas 2: both groups in every quorum (a group joining late heals past the fault's step)
        runs[name] = run_failover(tmp_path / name, steps=10, fault=fault, timeout=600, extra_env=env, min_replicas=2)
        assert runs[name].returncodes == [0, 0], runs[name].logs[1][-4000:]
    caught, reference = runs["caught"], runs["reference"]
    for group in (0, 1):
        losses, expected = caught.losses(group), reference.losses(group)
        print(f"group {group}: caught {losses}\nreference {expected}")
        assert sorted(losses) == list(range(1, 11))
        assert {step: loss for step, loss in losses.items() if step != SPIKE_STEP} == {
            step: loss for step, loss in expected.items() if step != SPIKE_STEP}
        assert f"npu_inject spikes: step {SPIKE_STEP}: loss spike: " in caught.logs[group]
        assert caught.logs[group].count("should_commit=False") == 2  # both ranks, step 8 only

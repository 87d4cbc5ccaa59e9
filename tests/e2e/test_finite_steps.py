"""Steps that never corrupt the weights (finite_steps), with a NaN caused on purpose (inject_faults).

CPU rehearsal, 2 ranks, FSDP, upstream torchtitan: a NaN output on rank 1 at step 3 makes every rank's
gradients NaN; the step is not applied, so the checkpoint after step 3 holds the parameters and
optimizer state of the one after step 2, tensor for tensor, read by plain DCP without the runtime.
"""

from __future__ import annotations

import json

import torch

from test_checkpoint_resume import read_plain
from testkit import clean_env, parse_losses, torchrun

ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
        "--training.local_batch_size", "1", "--validator.no-enable", "--debug.seed", "42", "--metrics.log_freq", "1"]
EVERY_STEP_SAVED = ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]


def _weights_and_optimizer(entries: dict) -> dict:
    """The parameters (top-level keys), optimizer state and learning-rate schedule: not the step counter or the
    data loader's position, which move on with every step, applied or not."""
    return {key: value for key, value in entries.items() if not key.startswith(("train_state", "dataloader"))}


def _is_parameter(key: str) -> bool:
    return not key.startswith(("optimizer.", "lr_scheduler"))


def test_a_nan_step_leaves_weights_and_optimizer_state_of_the_step_before(tmp_path):
    dump = tmp_path / "dump"
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults",
                    TORCHTITAN_NPU_FAULTS="nan_loss@3:rank=1")
    result = torchrun([*ARGS, *EVERY_STEP_SAVED, "--training.steps", "4", "--dump_folder", str(dump)], env)
    assert result.returncode == 0, result.stdout[-4000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == [1, 2, 4], losses  # step 3 logged no loss: it was not applied
    assert "npu_inject finite_steps: step 3: gradient norm not finite, the update was not applied" in result.stdout

    folder = dump / "checkpoint"
    step1, step2, step3 = (_weights_and_optimizer(entries) for entries in
                           read_plain(tmp_path, folder / "step-1", folder / "step-2", folder / "step-3"))
    assert sorted(step3) == sorted(step2)
    tensors = [key for key, value in step2.items() if isinstance(value, torch.Tensor)]
    assert any(key.startswith("optimizer.") for key in tensors) and any(map(_is_parameter, tensors))
    for key in tensors:
        assert torch.equal(step3[key], step2[key]), key
    assert any(not torch.equal(step1[key], step2[key]) for key in tensors if _is_parameter(key))

    for rank in (0, 1):
        report = json.loads((dump / "npu_inject" / f"report_rank{rank}.json").read_text())
        skipped = [note for note in report["patches"]["finite_steps"]["notes"] if "not finite" in note]
        assert len(skipped) == 1 and skipped[0].startswith("step 3:"), report["patches"]["finite_steps"]
    injected = json.loads((dump / "npu_inject" / "report_rank1.json").read_text())["patches"]["inject_faults"]
    assert injected["notes"] == ["step 3: nan_loss injected on rank 1"]


def test_nan_steps_in_a_row_stop_every_rank_with_one_line(tmp_path):
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="+inject_faults",
                    TORCHTITAN_NPU_FAULTS="nan_loss@2,nan_loss@3,nan_loss@4")
    result = torchrun([*ARGS, "--checkpoint.no-enable", "--training.steps", "6",
                       "--dump_folder", str(tmp_path / "dump")], env)
    assert result.returncode != 0
    stops = [line for line in result.stdout.splitlines() if line.startswith("npu_inject finite_steps: steps 2, 3, 4")]
    assert len(stops) == 2, result.stdout[-4000:]  # one per rank, the same
    assert "the weights are those of step 1, the last applied" in stops[0]
    assert sorted(parse_losses(result.stdout)) == [1]

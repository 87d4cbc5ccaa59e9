"""Checkpoints through the runtime with upstream torchtitan (CPU rehearsal, 2 ranks, FSDP).

* every async mode saves; resuming at step k reproduces the uninterrupted run's later
  losses (deterministic mode) and its final checkpoint, tensor for tensor;
* a checkpoint written through the runtime is read by plain torch.distributed.checkpoint
  in a process that never loaded the runtime, re-written there, and the runtime resumes
  from that plain-written checkpoint to the same losses and tensors;
* a seed checkpoint starts the run and reads back without the runtime;
  ``last_save_model_only`` in fp32 and with a bf16 export dtype;
* ranks SIGKILLed in the middle of writing a checkpoint leave the last good one in
  place, and the resumed run continues from it exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from sim_audit import assert_audit_saw_training, load_audits
from testkit import REPO, clean_env, parse_losses, sim_env, torchrun

STEPS = 6
RESUME_ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "128",
               "--training.local_batch_size", "1", "--validator.no-enable", "--debug.seed", "42",
               "--debug.deterministic", "--checkpoint.enable", "--checkpoint.interval", "2",
               "--checkpoint.keep_latest_k", "0"]


def ckpt_train(dump, steps=STEPS, extra=(), env=None, nproc=2, expect_ok=True):
    args = [*RESUME_ARGS, "--training.steps", str(steps), "--dump_folder", str(dump), *extra]
    result = torchrun(args, env or clean_env(TORCHTITAN_NPU="cpu"), nproc=nproc)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-4000:]
    return parse_losses(result.stdout), result


def plain_dcp(code: str, *paths):
    """Run ``code`` (``paths`` in sys.argv[1:]) in a fresh interpreter with no TORCHTITAN_NPU*:
    the runtime stays inert there."""
    script = textwrap.dedent("""
        import sys, torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    """) + textwrap.dedent(code) + textwrap.dedent("""
        assert "npu_inject.runtime" not in sys.modules, "the runtime was loaded"
    """)
    done = subprocess.run([sys.executable, "-c", script, *map(str, paths)],
                          env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def read_plain(scratch, *checkpoints) -> list[dict]:
    """Every entry of each DCP checkpoint, read by plain DCP in one process without the
    runtime, flattened to dotted keys."""
    outputs = [os.path.join(scratch, f"plain{index}.pt") for index in range(len(checkpoints))]
    plain_dcp("""
        for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
            dcp_to_torch_save(src, dst)
    """, *[path for pair in zip(checkpoints, outputs) for path in pair])
    return [flatten_entries(torch.load(out, weights_only=False)) for out in outputs]


def flatten_entries(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_entries(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def assert_same_entries(expected: dict, actual: dict):
    """Same keys; tensors equal in dtype and every element; other entries equal."""
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        other = actual[key]
        if isinstance(value, torch.Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), key
        else:
            assert value == other, key


def keep_only(folder, step):
    for name in os.listdir(folder):
        if name != f"step-{step}":
            shutil.rmtree(os.path.join(folder, name))


NON_MODEL = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A seed checkpoint (1 rank), then 6 steps from it: checkpoints at 2 and 4 through
    async_with_pinned_mem, a full final checkpoint at 6."""
    dump = tmp_path_factory.mktemp("uninterrupted")
    ckpt_train(dump / "seed", steps=1, nproc=1, extra=[
        "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1"])
    losses, result = ckpt_train(dump, extra=[
        "--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.no-last_save_model_only",
        "--checkpoint.initial_load_path", str(dump / "seed" / "checkpoint" / "step-0")])
    assert f"Loading the checkpoint from {dump / 'seed' / 'checkpoint' / 'step-0'}" in result.stdout
    assert sorted(losses) == list(range(1, STEPS + 1))
    folder = dump / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6"]
    seed, final = read_plain(dump, dump / "seed" / "checkpoint" / "step-0", folder / "step-6")
    return losses, dump, final, seed


def test_seed_checkpoint_reads_back_without_the_runtime(uninterrupted):
    _, _, final, seed = uninterrupted
    # llama3_debugmodel sets last_save_model_only=False, so the seed holds the full initial state.
    assert seed["train_state.step"] == 0
    model = {k: v for k, v in seed.items() if not k.startswith(NON_MODEL)}
    assert sorted(model) == sorted(k for k in final if not k.startswith(NON_MODEL))
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in model.values())
    assert any(not torch.equal(v, final[k]) for k, v in model.items()), "training moved the weights"


def test_resume_in_async_mode_reproduces_losses_and_final_checkpoint(uninterrupted, tmp_path):
    losses, dump, final, _ = uninterrupted
    shutil.copytree(dump / "checkpoint", tmp_path / "checkpoint")
    keep_only(tmp_path / "checkpoint", 2)
    resumed, result = ckpt_train(tmp_path, extra=["--checkpoint.async_mode", "async",
                                                  "--checkpoint.no-last_save_model_only"])
    assert "Training starts at step 3" in result.stdout
    assert resumed == {s: losses[s] for s in range(3, STEPS + 1)}
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4", "step-6"]
    mine, four_pinned, four_thread = read_plain(
        tmp_path, tmp_path / "checkpoint" / "step-6", dump / "checkpoint" / "step-4", tmp_path / "checkpoint" / "step-4")
    assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg") for k in final)
    assert final["train_state.step"] == STEPS
    assert_same_entries(final, mine)
    # step-4 of each run went through a different async mode; same tensors.
    assert_same_entries(four_pinned, four_thread)


def test_plain_written_checkpoint_resumes_through_the_runtime(uninterrupted, tmp_path):
    """runtime -> plain DCP read + re-write (no runtime) -> runtime resume, sync mode, model-only last save."""
    losses, dump, final, _ = uninterrupted
    (tmp_path / "checkpoint").mkdir()
    plain_dcp("""
        dcp_to_torch_save(sys.argv[1], sys.argv[2])
        torch_save_to_dcp(sys.argv[2], sys.argv[3])
    """, dump / "checkpoint" / "step-4", tmp_path / "step4.pt", tmp_path / "checkpoint" / "step-4")
    resumed, result = ckpt_train(tmp_path, extra=["--checkpoint.async_mode", "disabled",
                                                  "--checkpoint.last_save_model_only"])
    assert "Training starts at step 5" in result.stdout
    assert resumed == {5: losses[5], 6: losses[6]}
    model_only, = read_plain(tmp_path, tmp_path / "checkpoint" / "step-6")
    assert_same_entries({k: v for k, v in final.items() if not k.startswith(NON_MODEL)}, model_only)


SITECUSTOMIZE = '''
import os, signal
if os.environ.get("CKPT_TEST_KILL_RANKS", "").split(",").count(os.environ.get("RANK", "")):
    import wrapt

    def _arm(filesystem):
        original = filesystem._write_item
        written = []

        def write_item(transforms, stream, *args, **kwargs):
            if os.environ["CKPT_TEST_KILL_IN"] in getattr(stream, "name", ""):
                written.append(1)
                if len(written) > 3:
                    stream.write(b"torn")
                    stream.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(transforms, stream, *args, **kwargs)

        filesystem._write_item = write_item

    wrapt.register_post_import_hook(_arm, "torch.distributed.checkpoint.filesystem")
'''


def test_ranks_killed_mid_save_keep_last_good_checkpoint_and_resume_is_exact(uninterrupted, tmp_path):
    losses, dump, final, _ = uninterrupted
    from_seed = ["--checkpoint.initial_load_path", str(dump / "seed" / "checkpoint" / "step-0")]
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = clean_env(TORCHTITAN_NPU="cpu", CKPT_TEST_KILL_RANKS="0,1", CKPT_TEST_KILL_IN="step_4",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])))
    _, result = ckpt_train(tmp_path, env=env, expect_ok=False, extra=from_seed)
    assert result.returncode != 0
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == [".saving-step_4", "step-2"], os.listdir(folder)
    # Both ranks die inside their data file (a rank left waiting in a collective would only
    # be reaped by torchrun's timeout).
    assert "Signal 9" in result.stdout or "SIGKILL" in result.stdout, result.stdout[-3000:]

    resumed, result = ckpt_train(tmp_path, extra=[*from_seed, "--checkpoint.last_save_model_only",
                                                  "--checkpoint.export_dtype", "bfloat16"])
    assert "Training starts at step 3" in result.stdout
    assert resumed == {s: losses[s] for s in range(3, STEPS + 1)}
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6"]
    exported, = read_plain(tmp_path, folder / "step-6")
    assert_same_entries({k: v.to(torch.bfloat16) for k, v in final.items() if not k.startswith(NON_MODEL)},
                        exported)


def test_a_resume_that_finds_no_complete_checkpoint_stops_before_training(tmp_path):
    """Upstream would log "fresh start", train from step 1 and overwrite step-2 (exit 0)."""
    folder = tmp_path / "checkpoint"
    (folder / "step-4").mkdir(parents=True)
    (folder / "step-4" / "__0_0.distcp").write_bytes(b"torn")  # no .metadata: the save did not finish
    (folder / "step-2").mkdir()
    (folder / "step-2" / ".metadata").write_bytes(b"")  # truncated to nothing
    losses, result = ckpt_train(tmp_path, expect_ok=False,
                                env=clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_STRICT="1"))
    assert result.returncode != 0, result.stdout[-3000:]
    stop = [line for line in result.stdout.splitlines()
            if line.startswith(f"npu_inject checkpoint_publish: {folder} holds checkpoints but none is complete")]
    assert stop and stop[0].startswith(
        f"npu_inject checkpoint_publish: {folder} holds checkpoints but none is complete "
        "(step-4: no .metadata (the save did not finish); step-2: .metadata cannot be read ("), result.stdout[-3000:]
    assert stop[0].endswith("To start fresh on purpose, move that folder away, or pass another "
                            "--checkpoint.folder or --dump_folder"), stop[0]
    assert losses == {} and "fresh start" not in result.stdout
    assert sorted(os.listdir(folder)) == ["step-2", "step-4"]
    assert os.listdir(folder / "step-2") == [".metadata"] and (folder / "step-2" / ".metadata").read_bytes() == b""


@pytest.mark.parametrize("sum_deleted", [False, True], ids=["summed", "sum_deleted"])
def test_a_shard_overwritten_in_place_stops_every_rank_naming_it_and_the_newest_intact_one(tmp_path, sum_deleted):
    """Same size, other bytes (a bad disk, a partial copy between storage tiers): upstream loads it without a
    word and trains on from garbage. Rank 1 verifies that file (the ranks split the files), both stop. With
    that shard's checksum file deleted too, the stop names the missing sum (the other shard has its own)."""
    ckpt_train(tmp_path, steps=4)
    folder = tmp_path / "checkpoint"
    shard = folder / "step-4" / "__1_0.distcp"
    if sum_deleted:
        (folder / "step-4" / ".__1_0.distcp.checksum.json").unlink()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    losses, result = ckpt_train(tmp_path, steps=6, expect_ok=False)
    assert result.returncode != 0 and losses == {}, result.stdout[-3000:]
    stops = [line for line in result.stdout.splitlines() if line.startswith("npu_inject checkpoint_publish: checkpoint")]
    assert len(stops) == 2 and stops[0] == stops[1], result.stdout[-3000:]  # every rank, the same line
    if sum_deleted:
        assert stops[0].startswith(
            f"npu_inject checkpoint_publish: checkpoint {folder / 'step-4'} cannot be verified: checksum file "
            ".__1_0.distcp.checksum.json is missing (the checkpoint was written with checksums: __0_0.distcp has "
            "its own), so __1_0.distcp cannot be checked."), stops[0]
    else:
        assert stops[0].startswith(f"npu_inject checkpoint_publish: checkpoint {folder / 'step-4'} is damaged: "
                                   "__1_0.distcp changed since it was written (CRC-32 "), stops[0]
    assert stops[0].endswith("The newest intact checkpoint is step-2: resume from it with --checkpoint.load_step 2, "
                             "or move step-4 away"), stops[0]


def sim_npu_env(**overrides):
    """2 simulated NPUs with the audit on (stream order of pinned staging and swapped states)."""
    return sim_env(clean_env(TORCHTITAN_NPU="1", TORCHTITAN_NPU_SIM_AUDIT="1", **overrides), devices=2)


def test_simulated_npu_swap_optimizer_resumes_a_plain_checkpoint_exactly(tmp_path):
    """On the simulated NPU (hccl, pinned staging, FSDP DTensors): an unswapped run's
    checkpoint is resumed with the Swap Optimizer (DCP loads into host-resident DTensor
    states); losses and the swapped run's final checkpoint equal the unswapped run's."""
    common = ["--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.no-last_save_model_only"]
    plain, _ = ckpt_train(tmp_path / "plain", steps=4, env=sim_npu_env(), extra=common)
    assert sorted(plain) == [1, 2, 3, 4]
    report = (tmp_path / "plain" / "npu_inject" / "report_rank0.json").read_text()
    assert "pinned host buffers from the npu allocator" in report

    registry = tmp_path / "swap.json"
    registry.write_text('{"schema": 1, "patches": {"swap_optimizer": {"options": {"slices": 2}}}}')
    swapped_env = sim_npu_env(TORCHTITAN_NPU_PATCHES="+swap_optimizer", TORCHTITAN_NPU_REGISTRY=str(registry))
    shutil.copytree(tmp_path / "plain" / "checkpoint", tmp_path / "swapped" / "checkpoint")
    keep_only(tmp_path / "swapped" / "checkpoint", 2)
    resumed, result = ckpt_train(tmp_path / "swapped", steps=4, env=swapped_env, extra=common)
    assert "Training starts at step 3" in result.stdout
    assert resumed == {3: plain[3], 4: plain[4]}
    report = (tmp_path / "swapped" / "npu_inject" / "report_rank0.json").read_text()
    assert "pinned host memory, streamed to npu on a side stream" in report
    for run, trained in (("plain", [1, 2, 3, 4]), ("swapped", [3, 4])):
        for audit in load_audits(str(tmp_path / run)):
            assert_audit_saw_training(audit, trained, f"{run} rank {audit['rank']}")
            assert audit["stream_findings"] == [], (run, audit["stream_findings"])
    without, with_swap = read_plain(tmp_path, tmp_path / "plain" / "checkpoint" / "step-4",
                                    tmp_path / "swapped" / "checkpoint" / "step-4")
    assert any(k.endswith(".exp_avg_sq") for k in with_swap)
    assert_same_entries(without, with_swap)

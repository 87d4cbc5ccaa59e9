"""A device memory error (UCE) on the real torch_npu 2.14.0 over the CANN emulation, repaired in the job.

``uce_in_forward@3`` (inject_faults) has the emulation mark a block of torch_npu's allocator bad during step
3's forward; the next aclnn launch fails as a device reports a UCE (ACL_ERROR_RT_DEVICE_MEM_ERROR, then
aclrtGetMemUceInfo), torch_npu's task queue stops with "UCE ERROR", and uce_repair asks torch_npu where it
lies (check_uce_in_memory: temporary memory), calls restart_device and trains step 3 again on its batches,
with synchronous launches (ASCEND_LAUNCH_BLOCKING=1): the losses must equal an uninjected run's, every step.
With torch_npu's task queue on it stops in one line instead (see uce_repair). One rank: a job of several would need every rank to
stop and retry together (not built; uce_repair stops them with one line).

    .venv/bin/python -m pytest -m cann_emu tests/cann_emu/test_uce.py -n 0
"""

from __future__ import annotations

import json
import subprocess

from cann_emu_child import PYTHON, REPO
from testkit import clean_env, parse_losses
from verification.cann_emu import cann_env

RUN = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "5", "--training.seq_len", "128",
       "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
       "--debug.deterministic", "--training.mixed_precision_param", "float32"]


def _train(dump, **environment):
    env = cann_env(clean_env(TORCHTITAN_NPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **environment))
    command = [str(PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "-m", "torchtitan.train", *RUN, "--dump-folder", str(dump)]
    return subprocess.run(command, env=env, cwd=REPO, timeout=600, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


def test_a_uce_in_temporary_memory_is_repaired_and_the_losses_equal_an_uninjected_runs(tmp_path):
    clean = _train(tmp_path / "clean")
    injected = _train(tmp_path / "uce", TORCHTITAN_NPU_PATCHES="+inject_faults",
                      TORCHTITAN_NPU_FAULTS="uce_in_forward@3", ASCEND_LAUNCH_BLOCKING="1")
    assert clean.returncode == 0, clean.stdout[-3000:]
    assert injected.returncode == 0, injected.stdout[-3000:]
    assert "reason=[device mem error]" in injected.stdout  # the emulated device's report
    losses, expected = parse_losses(injected.stdout), parse_losses(clean.stdout)
    print(f"injected {losses}\nclean {expected}")
    assert sorted(expected) == [1, 2, 3, 4, 5] and losses == expected
    report = json.loads((tmp_path / "uce" / "npu_inject" / "report_rank0.json").read_text())["patches"]
    assert report["inject_faults"]["notes"] == ["step 3: device memory error (UCE) injected on rank 0"], report
    assert report["uce_repair"]["notes"] == ["step 3: device memory error (UCE) in temporary memory repaired "
                                             "(torch_npu restart_device), step trained again on the same batches"]


def test_with_the_task_queue_on_a_uce_stops_in_one_line_instead_of_a_retry(tmp_path):
    """On the emulation a step retried with torch_npu's task queue on began from changed weights (uce_repair's
    docstring): the patch stops there rather than train on from them."""
    run = _train(tmp_path / "uce", TORCHTITAN_NPU_PATCHES="+inject_faults", TORCHTITAN_NPU_FAULTS="uce_in_forward@3")
    assert run.returncode != 0, run.stdout[-3000:]
    assert "npu_inject uce_repair: step 3: a device memory error (UCE) in temporary memory, repairable, but not " \
           "retried with torch_npu's task queue on" in run.stdout, run.stdout[-3000:]
    assert "step:  3" not in run.stdout

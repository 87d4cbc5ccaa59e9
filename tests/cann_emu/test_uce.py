"""A device memory error (UCE) on the real torch_npu 2.14.0 over the CANN emulation, repaired in the job.

``uce_in_forward@3`` (inject_faults) has the emulation mark a block of torch_npu's allocator bad during step
3's forward; the next aclnn launch fails as a device reports a UCE (ACL_ERROR_RT_DEVICE_MEM_ERROR, then
aclrtGetMemUceInfo), torch_npu's task queue stops with "UCE ERROR", and uce_repair asks torch_npu where it
lies (check_uce_in_memory: temporary memory), calls restart_device, resets FSDP to before the step and trains
step 3 again on its batches: the losses must equal an uninjected run's, every step, with torch_npu's task queue
on (its default) and with synchronous launches (ASCEND_LAUNCH_BLOCKING=1), which report the error at different
operators. One rank: a job of several would need every rank to stop and retry together (not built; uce_repair
stops them with one line).

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
    assert clean.returncode == 0, clean.stdout[-3000:]
    expected = parse_losses(clean.stdout)
    assert sorted(expected) == [1, 2, 3, 4, 5]
    for launches, environment in (("task queue on", {}), ("synchronous", {"ASCEND_LAUNCH_BLOCKING": "1"})):
        dump = tmp_path / launches.replace(" ", "_")
        injected = _train(dump, TORCHTITAN_NPU_PATCHES="+inject_faults", TORCHTITAN_NPU_FAULTS="uce_in_forward@3",
                          **environment)
        assert injected.returncode == 0, (launches, injected.stdout[-3000:])
        assert "reason=[device mem error]" in injected.stdout  # the emulated device's report
        losses = parse_losses(injected.stdout)
        print(f"{launches}: injected {losses}\nclean {expected}")
        assert losses == expected, launches
        report = json.loads((dump / "npu_inject" / "report_rank0.json").read_text())["patches"]
        assert report["inject_faults"]["notes"] == ["step 3: device memory error (UCE) injected on rank 0"], report
        assert report["uce_repair"]["notes"] == ["step 3: device memory error (UCE) in temporary memory repaired "
                                                 "(torch_npu restart_device), step trained again on the same batches"]

"""Silent corruption caught through the real torch_npu 2.14.0 on the CANN emulation (issue 57).

1. torch_npu's own ``matmul_checksum`` (Ascend's Python: it probes ``_npu_matmul_abft_verify``, calls it through
   op-plugin and parses its packed verdicts) on the emulated ``aclnnMatmulAbftVerify``: a correct product is
   clean and one wrong element is caught, bf16 and fp32. The truth is the product itself (torch's CPU matmul)
   and Ascend's parser, not the emulation.
2. Training: upstream llama3 debug, 2 ranks, every second step checked, ``sdc_matmul@2:rank=1``: step 2 is
   caught on rank 1 and retrained, the losses are those of a run without the checks, and the checked steps
   read the verdicts with one more host synchronisation than the unchecked ones.

CI runs 1; 2 runs under -m cann_emu_long (80 s of a CI worker):

    .venv/bin/python -m pytest -m "cann_emu or cann_emu_long" tests/cann_emu/test_matmul_checks_emulated.py -n 0
"""

from __future__ import annotations

import json

import pytest

from cann_emu_child import child_json
from test_train import emulated, steps_of
from testkit import parse_losses

RUN = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "4", "--training.seq_len", "128",
       "--training.local_batch_size", "1", "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "42",
       "--metrics.log_freq", "1"]


def test_torch_npus_matmul_checksum_runs_on_the_emulated_kernel_and_catches_one_wrong_element():
    result = child_json(
        """
        import json
        import torch, torch_npu
        from torch_npu.asd import checksum
        out = {"available": checksum._npu_matmul_abft_verify_available()}
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(0)
            a = torch.randn(100, 1024).to(dtype)
            b = (torch.randn(1024, 600) / 32).to(dtype)
            c = a @ b
            wrong = c.clone()
            wrong[37, 300] = wrong[37, 300] * 1024 + 1024
            out[str(dtype)] = [bool(checksum._matmul_checksum(a.npu(), b.npu(), c.npu())),
                               bool(checksum._matmul_checksum(a.npu(), b.npu(), wrong.npu()))]
        print(json.dumps(out))
        """)
    assert result == {"available": True, "torch.bfloat16": [False, True], "torch.float32": [False, True]}


@pytest.mark.cann_emu_long
def test_a_corrupted_matmul_is_caught_and_retrained_on_the_real_wheel(tmp_path):
    checked, counts = emulated(RUN, tmp_path / "checked", extra_env={
        "TORCHTITAN_NPU_PATCHES": "+matmul_checks,+inject_faults", "TORCHTITAN_NPU_SDC_EVERY": "2",
        "TORCHTITAN_NPU_FAULTS": "sdc_matmul@2:rank=1"})
    assert checked.returncode == 0, checked.stdout[-4000:]
    plain, _ = emulated(RUN, tmp_path / "plain")
    assert plain.returncode == 0, plain.stdout[-4000:]
    losses, reference = parse_losses(checked.stdout), parse_losses(plain.stdout)
    print(f"checked {losses}\nunchecked {reference}")
    assert losses == reference and len(losses) == 4
    assert "step 2 attempt 1: matmul results failed their checksums on rank 1 (" in checked.stdout
    report = json.loads((tmp_path / "checked" / "npu_inject" / "report_rank0.json").read_text())
    assert not report["patches"]["matmul_checks"]["fallbacks"]  # the emulated kernel, not the torch check
    steps = steps_of(counts[0])
    syncs = {step: row["syncs"].get("aclrtSynchronizeStream", 0) for step, row in steps.items()}
    launches = {step: sum(row["aclnn"].values()) for step, row in steps.items()}
    kernels = {step: row["aclnn"].get("aclnnMatmulAbftVerify", 0) for step, row in steps.items()}
    print(f"rank 0 stream synchronisations per step {syncs}, aclnn launches {launches}, of them the V-ABFT "
          f"kernel's {kernels}")
    assert syncs[4] == syncs[3] + 1  # checked step 4 against unchecked step 3: the verdicts' one read
    assert kernels[4] > 0 and kernels[3] == 0  # products of K >= 1024 on the kernel (the output projection's)

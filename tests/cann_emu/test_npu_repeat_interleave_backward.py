"""The repeat_interleave_grad patch on the real torch_npu over the CANN emulation.

gpt_oss's expert biases (``b.repeat_interleave(counts, dim=0, output_size=R)``), differentiated eagerly
and under ``torch.compile`` (aot_eager), with the patch applied by the runtime as a training run applies
it: the gradient against CPU autograd of the same call, and no aclnnRepeatInterleaveGrad launched (CANN
documents it for Ascend 950 only; the emulation, a 910B2, has none).

    .venv-cann/bin/python -m pytest -m cann_emu tests/cann_emu/test_npu_repeat_interleave_backward.py
"""

from __future__ import annotations

import json

import torch

from cann_emu_child import child_json


def test_gpt_oss_bias_gradient_eager_and_compiled(tmp_path):
    counts_file = tmp_path / "counts.json"
    out = child_json(
        """
        import json, os
        import torch, torch_npu
        from npu_inject import runtime
        rt = runtime.activate({**os.environ, "TORCHTITAN_NPU": "1", "TORCHTITAN_NPU_PATCHES": "repeat_interleave_grad"})
        import torchtitan.models.gpt_oss.moe  # the patch's trigger
        record = rt.report.patches["repeat_interleave_grad"]
        torch.manual_seed(0)
        bias, weights = torch.randn(5, 6), torch.randn(8, 6)
        counts = torch.tensor([3, 0, 2, 1, 2])
        def loss(b, c, w):
            return (b.repeat_interleave(c, dim=0, output_size=8) * w).sum()
        def gradient(fn, device):
            b = bias.to(device).requires_grad_()
            fn(b, counts.to(device), weights.to(device)).backward()
            return b.grad.cpu().tolist()
        print(json.dumps({"state": record.state, "reason": record.reason, "notes": list(record.notes),
                          "eager": gradient(loss, "npu"),
                          "compiled": gradient(torch.compile(loss, backend="aot_eager", fullgraph=True), "npu"),
                          "expected": gradient(loss, "cpu")}))
        """,
        extra_env={"CANN_EMU_COUNTS": str(counts_file)},
    )
    assert out["state"] == "applied" and not out["notes"], out
    expected = torch.tensor(out["expected"])
    torch.testing.assert_close(torch.tensor(out["eager"]), expected)
    torch.testing.assert_close(torch.tensor(out["compiled"]), expected)
    launched = json.loads(counts_file.read_text())["aclnn"]
    assert "aclnnRepeatInterleaveGrad" not in launched and launched.get("aclnnIndexAdd", 0) >= 2, launched

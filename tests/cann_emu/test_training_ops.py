"""A training step's operators through the real torch_npu on the CANN emulation (issue 20).

Each check runs torch_npu's own entry points (aten ops routed by op-plugin to aclnn, and the npu_*
fused ops) in a child process of the emulation's venv and compares with plain CPU PyTorch computing the
same math independently (autograd of the textbook formulas), never with the emulation itself.

    .venv-cann/bin/python -m pytest -m cann_emu tests/cann_emu/test_training_ops.py -n 0
"""

from __future__ import annotations

import json

import pytest

from cann_emu_child import child_json


@pytest.fixture(scope="module")
def mlp_step(tmp_path_factory) -> dict:
    """Two AdamW steps of a small MLP with a cross-entropy loss, on npu and on cpu from one seed."""
    counts = tmp_path_factory.mktemp("cann_emu") / "counts.json"
    return child_json(
        """
        import json, ctypes
        import torch, torch_npu
        mark = ctypes.CDLL("libcann_emu.so").cann_emu_mark_step
        mark.argtypes = [ctypes.c_int64]

        def run(device, marks):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 24), torch.nn.SiLU(),
                                        torch.nn.Linear(24, 32)).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=device != "cpu")
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, 32, (4, 8), generator=g)
            losses = []
            for step in (1, 2):
                if marks: mark(step)
                logits = model(tokens.to(device))
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten().to(device))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if marks: mark(-1)
            return losses, [p.detach().cpu().tolist() for p in model.parameters()]

        npu_losses, npu_params = run("npu", True)
        cpu_losses, cpu_params = run("cpu", False)
        print(json.dumps({"npu_losses": npu_losses, "cpu_losses": cpu_losses,
                          "max_param_diff": max(abs(a - b) for pa, pb in zip(npu_params, cpu_params)
                                                for ra, rb in zip(torch.tensor(pa).flatten().tolist(),
                                                                  torch.tensor(pb).flatten().tolist())
                                                for a, b in [(ra, rb)])}))
        """,
        extra_env={"CANN_EMU_COUNTS": str(counts)},
    ) | {"counts": json.loads(counts.read_text())}


def test_mlp_training_matches_cpu(mlp_step):
    """Same losses and parameters as CPU PyTorch: the aclnn operators compute ATen's math (the fused
    AdamW as aclnnApplyAdamWV2, clipping as aclnnForeachNorm + foreach multiply)."""
    assert mlp_step["npu_losses"] == pytest.approx(mlp_step["cpu_losses"], rel=1e-6)
    assert mlp_step["npu_losses"][1] < mlp_step["npu_losses"][0]
    assert mlp_step["max_param_diff"] < 1e-6


def test_counts_per_step(mlp_step):
    """CANN_EMU_COUNTS has each marked step's aclnn calls and host syncs (loss.item() per step)."""
    steps = mlp_step["counts"]["steps"]
    assert {"1", "2", "outside steps"} <= set(steps)
    for step in ("1", "2"):
        ops = steps[step]["aclnn"]
        assert ops["aclnnApplyAdamWV2"] == 5  # one per parameter tensor: the embedding, two weights, two biases
        assert ops["aclnnEmbedding"] == 1 and ops["aclnnEmbeddingDenseBackward"] == 1
        assert steps[step]["syncs"].get("aclrtMemcpy device to host", 0) + steps[step]["syncs"].get(
            "aclrtSynchronizeStream", 0) >= 1
    assert mlp_step["counts"]["aclop"] == {}


def test_fused_block_operators_match_plain_pytorch():
    """npu_rms_norm, npu_rotary_mul (half and interleave), npu_swiglu and their backward through autograd,
    against the formulas of torch_npu's documents written in plain PyTorch, fp32 and bf16."""
    result = child_json(
        """
        import json
        import torch, torch_npu
        torch.manual_seed(0)
        out = {}
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            x = torch.randn(2, 6, 4, 8, dtype=dtype, requires_grad=True)
            gamma = (torch.rand(8) + 0.5).to(dtype).requires_grad_()
            cos, sin = torch.randn(1, 6, 1, 8, dtype=dtype), torch.randn(1, 6, 1, 8, dtype=dtype)
            gate = torch.randn(3, 16, dtype=dtype, requires_grad=True)

            def rms(x, gamma):
                xf = x.float()
                return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.float()).to(x.dtype)
            def rot(x, cos, sin, mode):
                xf = x.float()
                if mode == "half":
                    a, b = xf.chunk(2, -1); r = torch.cat((-b, a), -1)
                else:
                    p = xf.unflatten(-1, (-1, 2)); r = torch.stack((-p[..., 1], p[..., 0]), -1).flatten(-2)
                return (xf * cos.float() + r * sin.float()).to(x.dtype)
            def swiglu(t):
                a, b = t.float().chunk(2, -1)
                return (torch.nn.functional.silu(a) * b).to(t.dtype)

            cases = {
                "rms_norm": (lambda x, g, t: torch_npu.npu_rms_norm(x, g)[0], lambda x, g, t: rms(x, g)),
                "rotary_half": (lambda x, g, t: torch_npu.npu_rotary_mul(x, cos.npu(), sin.npu(), rotary_mode="half"),
                                lambda x, g, t: rot(x, cos, sin, "half")),
                "rotary_interleave": (lambda x, g, t: torch_npu.npu_rotary_mul(x, cos.npu(), sin.npu(), rotary_mode="interleave"),
                                      lambda x, g, t: rot(x, cos, sin, "interleave")),
                "swiglu": (lambda x, g, t: torch_npu.npu_swiglu(t, dim=-1), lambda x, g, t: swiglu(t)),
            }
            for name, (on_npu, on_cpu) in cases.items():
                leaves = [x, gamma, gate]
                dev = [l.detach().npu().requires_grad_() for l in leaves]
                y_npu = on_npu(*dev)
                y_cpu = on_cpu(*leaves)
                w = torch.randn(y_cpu.shape, dtype=dtype)
                (y_npu.float() * w.npu().float()).sum().backward()
                (y_cpu.float() * w.float()).sum().backward()
                errs = [(y_npu.cpu().float() - y_cpu.float()).abs().max().item()]
                for d, l in zip(dev, leaves):
                    if l.grad is not None:
                        errs.append((d.grad.cpu().float() - l.grad.float()).abs().max().item() / (l.grad.float().abs().max().item() + 1e-6))
                        l.grad = None
                out[f"{name}/{dtype}"] = (max(errs), tol)
        print(json.dumps(out))
        """
    )
    for case, (err, tol) in result.items():
        assert err < tol, f"{case}: max error {err} (tolerance {tol})"


def test_legacy_aclop_path_fails_by_op_type():
    """An operator torch_npu sends down the aclop path fails naming its op type, counted as aclop."""
    result = child_json(
        """
        import json, torch, torch_npu
        try:
            torch_npu.npu_format_cast(torch.ones(4, 4).npu(), 29)
            torch.npu.synchronize()  # torch_npu's task queue may report the launch's failure here
            print(json.dumps({"error": "no error"}))
        except RuntimeError as error:
            print(json.dumps({"error": str(error)}))
        """
    )
    assert "took the legacy aclop path" in result["error"], result["error"]

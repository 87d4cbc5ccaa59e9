"""overrides_kernels: torchtitan's --override.imports SwiGLU ops on the rehearsal, against independent math.

Expected values come from ``F.silu(gate) * up`` and torch autograd on it (and plain matmuls for
the modules), never from npu_inject's glue or reference kernels. Rows from ``offsets[-1]`` on are
the ones upstream's Triton kernels never write; the patch defines them as zeros.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
import torch.nn.functional as F

from testkit import clean_env, run_python, sim_env
from npu_inject import runtime
from npu_inject import model_checks


@pytest.fixture
def fused_swiglu():
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="overrides_kernels"))
    module = importlib.import_module("torchtitan.overrides.fused_swiglu")
    report = rt.report.patches["overrides_kernels"]
    assert report.state == "applied", report.reason
    return module


def _leaf(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def _expected(gate, up, grad):
    """(output, d gate, d up) of F.silu(gate) * up in float32, by autograd."""
    gate32, up32 = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    out = F.silu(gate32) * up32
    out.backward(grad.float())
    return out.detach(), gate32.grad, up32.grad


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, {}), (torch.bfloat16, {"atol": 2e-2, "rtol": 2e-2})])
def test_silu_and_mul_and_its_gradients_match_f_silu_times_up(fused_swiglu, dtype, tolerance):
    # As FusedGroupedExperts passes them: strided views of one (R, F, 2) tensor.
    gate_up_RF2 = _leaf(7, 12, 2, seed=0, dtype=dtype)
    gate_RF, up_RF = gate_up_RF2.unbind(-1)
    out = fused_swiglu.silu_and_mul_op(gate_RF, up_RF)
    grad = torch.randn(7, 12, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad)
    expected, d_gate, d_up = _expected(gate_RF, up_RF, grad)
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), expected, **tolerance)
    torch.testing.assert_close(gate_up_RF2.grad.float(), torch.stack([d_gate, d_up], dim=-1), **tolerance)


def test_rows_from_the_last_offset_on_are_zero_in_the_output_and_both_gradients(fused_swiglu):
    gate_RF, up_RF = _leaf(8, 5, seed=2), _leaf(8, 5, seed=3)
    with torch.no_grad():  # the rows past the offsets hold whatever grouped_mm left there
        gate_RF[6:] = float("nan")
        up_RF[6:] = float("inf")
    offsets_E = torch.tensor([2, 2, 6], dtype=torch.int32)
    out = fused_swiglu.silu_and_mul_op(gate_RF, up_RF, offsets_E)
    grad = torch.randn(8, 5, generator=torch.Generator().manual_seed(4))
    out.backward(grad)
    expected, d_gate, d_up = _expected(gate_RF[:6], up_RF[:6], grad[:6])
    torch.testing.assert_close(out[:6], expected)
    torch.testing.assert_close((gate_RF.grad[:6], up_RF.grad[:6]), (d_gate, d_up))
    for tail in (out[6:], gate_RF.grad[6:], up_RF.grad[6:]):
        assert torch.equal(tail, torch.zeros_like(tail))


def test_offsets_covering_every_row_change_nothing_and_empty_offsets_are_refused(fused_swiglu):
    gate_RF, up_RF = _leaf(4, 3, seed=5), _leaf(4, 3, seed=6)
    out = fused_swiglu.silu_and_mul_op(gate_RF, up_RF, torch.tensor([1, 4], dtype=torch.int32))
    torch.testing.assert_close(out, F.silu(gate_RF) * up_RF)
    with pytest.raises(ValueError, match="offsets must be non-empty"):
        fused_swiglu.silu_and_mul_op(gate_RF, up_RF, torch.tensor([], dtype=torch.int32))


def test_compiled_call_traces_the_op_and_computes_the_same(fused_swiglu):
    offsets_E = torch.tensor([3, 5], dtype=torch.int32)

    def swiglu_sum(gate_RF, up_RF):
        return fused_swiglu.silu_and_mul_op(gate_RF, up_RF, offsets_E).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(swiglu_sum, backend="aot_eager", fullgraph=True)
    gate_RF, up_RF = _leaf(6, 4, seed=7), _leaf(6, 4, seed=8)
    compiled(gate_RF, up_RF).backward()
    gate_ref, up_ref = gate_RF.detach().clone().requires_grad_(), up_RF.detach().clone().requires_grad_()
    (F.silu(gate_ref[:5]) * up_ref[:5]).square().sum().backward()
    torch.testing.assert_close((gate_RF.grad, up_RF.grad), (gate_ref.grad, up_ref.grad))


def test_fused_swiglu_module_matches_the_three_matmul_ffn(fused_swiglu):
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear

    config = fused_swiglu.fused_swiglu(FeedForward.Config(
        w1=Linear.Config(in_features=8, out_features=16), w2=Linear.Config(in_features=16, out_features=8),
        w3=Linear.Config(in_features=8, out_features=16)))
    ffn = config.build()
    w1, w3, w2 = (torch.randn(16, 8, generator=torch.Generator().manual_seed(s)) for s in (9, 10, 11))
    with torch.no_grad():
        ffn.w13.copy_(torch.stack([w1, w3], dim=1))
        ffn.w2.weight.copy_(w2.T)
    x = _leaf(2, 3, 8, seed=12)
    torch.testing.assert_close(ffn(x), (F.silu(x @ w1.T) * (x @ w3.T)) @ w2)


def test_reverting_removes_the_kernels(fused_swiglu):
    gate_RF = torch.randn(2, 3)
    fused_swiglu.silu_and_mul_op(gate_RF, gate_RF)
    runtime.deactivate()
    with pytest.raises(NotImplementedError, match="torchtitan::silu_and_mul"):
        fused_swiglu.silu_and_mul_op(gate_RF, gate_RF)


# On the simulated NPU (PrivateUse1): the kernels are the NPU's fused ones, counted where torch_npu exposes them.
ON_SIMULATED_NPU = """
import collections
import torch, torch.nn.functional as F, torch_npu
import torchtitan.overrides.fused_swiglu as fused_swiglu
calls = collections.Counter()
for name in ("npu_swiglu", "npu_swiglu_backward"):
    def counted(*args, _name=name, _kernel=getattr(torch_npu, name), **kwargs):
        calls[_name] += 1
        return _kernel(*args, **kwargs)
    setattr(torch_npu, name, counted)
generator = torch.Generator().manual_seed(0)
gate, up, grad = (torch.randn(6, 4, generator=generator) for _ in range(3))
gate_npu, up_npu = (t.to("npu").requires_grad_() for t in (gate, up))
out = fused_swiglu.silu_and_mul_op(gate_npu, up_npu, torch.tensor([1, 4], dtype=torch.int32, device="npu"))
out.backward(grad.to("npu"))
gate, up = gate.requires_grad_(), up.requires_grad_()
expected = F.silu(gate[:4]) * up[:4]
expected.backward(grad[:4])
assert out.device.type == "npu" and out[4:].eq(0).all() and gate_npu.grad[4:].eq(0).all()
torch.testing.assert_close(out[:4].cpu(), expected.detach())
torch.testing.assert_close((gate_npu.grad[:4].cpu(), up_npu.grad[:4].cpu()), (gate.grad[:4], up.grad[:4]))
print(dict(calls))
"""


def test_on_the_simulated_npu_the_ops_run_npu_swiglu_and_its_backward():
    result = run_python(ON_SIMULATED_NPU, sim_env(clean_env(TORCHTITAN_NPU="1",
                                                            TORCHTITAN_NPU_PATCHES="overrides_kernels"), devices=1))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "{'npu_swiglu': 1, 'npu_swiglu_backward': 1}"


def test_fused_mla_off_cuda_is_the_stock_attention_and_calls_no_triton_op():
    """Why overrides_kernels registers nothing for fused_mla: its ops have no CPU kernel (calling one
    would raise NotImplementedError) and upstream's forward takes the stock path for CPU tensors."""
    runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="none"))
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3.model import Attention
    from torchtitan.overrides.fused_mla import fused_mla

    config = Attention.Config(
        n_heads=2, dim=16, inner_attention=ScaledDotProductAttention.Config(),
        wq=Linear.Config(in_features=16, out_features=2 * 12),
        wkv_a=Linear.Config(in_features=16, out_features=8 + 4),
        wkv_b=Linear.Config(in_features=8, out_features=2 * (8 + 8)),
        wo=Linear.Config(in_features=2 * 8, out_features=16),
        q_lora_rank=0, kv_lora_rank=8,
        q_norm=RMSNorm.Config(normalized_shape=1), kv_norm=RMSNorm.Config(normalized_shape=8),
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope=ComplexRoPE.Config(dim=4, max_seq_len=16))
    torch.manual_seed(0)
    stock = config.build()
    for parameter in stock.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    fused = fused_mla(config).build()
    fused.load_state_dict(stock.state_dict())
    x = _leaf(2, 5, 16, seed=13)
    assert type(fused).__name__ == "FusedMLAAttention"
    torch.testing.assert_close(fused(x, None), stock(x, None))
    with pytest.raises(NotImplementedError, match="torchtitan::fused_mla_k_rope"):
        torch.ops.torchtitan.fused_mla_k_rope(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 2),
                                              torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.int32), 0)


@pytest.mark.parametrize("entry,package", [
    ("torchtitan.overrides.helion_rope.helion_cos_sin_rope", "helion"),
    (("torchtitan.overrides.fused_swiglu.fused_grouped_experts", {}), "triton"),
    ("torchtitan.overrides.fused_mla.fused_mla", "triton"),
])
def test_an_override_whose_kernel_package_is_missing_stops_naming_it(monkeypatch, entry, package):
    config = types.SimpleNamespace(override=types.SimpleNamespace(imports=["my_pkg.rope.rope", entry]))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(model_checks.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real_find_spec(name, *a))
    name = entry if isinstance(entry, str) else entry[0]
    problem = model_checks.override_problem(config, "npu")
    assert problem.startswith(f"--override.imports {name} needs {package}, which is not installed ("), problem
    assert "target npu: " in problem
    monkeypatch.undo()
    if package == "triton":  # importable here: the module imports, overrides_kernels serves its ops
        assert model_checks.override_problem(config, "npu") is None


def test_helion_override_stops_at_parse_args_in_one_line():
    if importlib.util.find_spec("helion") is not None:
        pytest.skip("helion is installed here: the override falls back to PyTorch RoPE off CUDA")
    runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="model_guard"))
    from torchtitan.config import ConfigManager

    with pytest.raises(SystemExit) as stopped:
        ConfigManager().parse_args(["--module", "qwen3", "--config", "qwen3_debugmodel", "--override.imports",
                                    "torchtitan.overrides.helion_rope.helion_cos_sin_rope"])
    assert str(stopped.value).startswith(
        "npu_inject model_guard: --override.imports torchtitan.overrides.helion_rope.helion_cos_sin_rope needs "
        "helion, which is not installed (Helion is a Triton-based kernel DSL for CUDA GPUs with no NPU backend)")

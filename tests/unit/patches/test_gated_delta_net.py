"""qwen3_5's gated delta-net on npu_inject: the fla stand-in's kernels against independent math, and the patch.

* causal_conv1d against ``F.conv1d`` run on each document separately (zero left padding);
* chunk_gated_delta_rule (fla layout, l2-normalised q/k) against the token-by-token
  recurrence of tests/unit/ops/test_gated_delta_rule.py, with q/k normalised by F.normalize;
* the patch: torchtitan's qwen3_5 GatedDeltaNet layer runs forward and backward on the
  rehearsal with packed documents, each document independent of the ones before it;
  model_guard lets qwen3_5 through only while the stand-in serves ``fla``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npu_inject.ops import gated_delta_net as gdn
from kernelkit import recurrent_oracle
from testkit import REPO, clean_env, run_python


def conv_per_document(x_BTD, weight_DK, lengths, activation):
    K = weight_DK.shape[1]
    outs, start = [], 0
    for length in lengths:
        doc_BDT = x_BTD[:, start:start + length].transpose(1, 2)
        out = F.conv1d(F.pad(doc_BDT, (K - 1, 0)), weight_DK.unsqueeze(1), groups=weight_DK.shape[0])
        outs.append(out.transpose(1, 2))
        start += length
    out_BTD = torch.cat(outs, dim=1)
    return F.silu(out_BTD) if activation else out_BTD


@pytest.mark.parametrize("lengths", [[13], [1, 2, 9, 3, 1], [4, 4]])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_restarts_at_documents_like_conv1d_per_document(lengths, activation):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(lengths), 6, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, final = gdn.causal_conv1d(x=x, weight=weight, bias=None, activation=activation, backend="triton",
                                   cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens)
    expected = conv_per_document(x, weight, lengths, activation)
    assert final is None
    torch.testing.assert_close(out, expected)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, weight), grad_out)
    want = torch.autograd.grad(expected, (x, weight), grad_out)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want)


def test_causal_conv1d_without_offsets_treats_each_batch_row_as_one_sequence():
    x = torch.randn(2, 7, 3, dtype=torch.float64)
    weight = torch.randn(3, 4, dtype=torch.float64)
    out, _ = gdn.causal_conv1d(x, weight, activation="silu")
    for row in range(2):
        torch.testing.assert_close(out[row:row + 1], conv_per_document(x[row:row + 1], weight, [7], "silu"))


def test_unused_arguments_raise_rather_than_being_ignored():
    x, weight = torch.randn(1, 4, 2), torch.randn(2, 4)
    with pytest.raises(NotImplementedError, match="initial_state"):
        gdn.causal_conv1d(x, weight, initial_state=torch.zeros(1, 2, 3))
    q = torch.randn(1, 4, 1, 3)
    with pytest.raises(NotImplementedError, match="output_final_state"):
        gdn.chunk_gated_delta_rule(q, q, q, q[..., 0], q[..., 0], output_final_state=True)


@pytest.mark.parametrize("packed", [True, False])
def test_chunk_gated_delta_rule_matches_the_recurrence_in_fla_layout(packed):
    lengths = [70, 5, 131] if packed else [67, 67]
    H, Dk, Dv = 3, 8, 5
    generator = torch.Generator().manual_seed(2)
    T = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)

    q, k, v = rand(T, H, Dk), rand(T, H, Dk), rand(T, H, Dv)
    g_raw, beta_raw = rand(T, H), rand(T, H)
    g, beta = -F.softplus(g_raw), torch.sigmoid(beta_raw)
    if packed:
        cu_seqlens = torch.tensor([0, 70, 75, 206], dtype=torch.int32)
        out, final = gdn.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                                cu_seqlens_cpu=cu_seqlens)
        out = out[0]
    else:
        B, L = 2, lengths[0]
        out, final = gdn.chunk_gated_delta_rule(*(t.reshape(B, L, *t.shape[1:]) for t in (q, k, v, g, beta)),
                                                use_qk_l2norm_in_kernel=True)
        out = out.reshape(T, H, Dv)
    assert final is None
    zero_state = torch.zeros(len(lengths), H, Dv, Dk, dtype=torch.float64)
    expected, _ = recurrent_oracle(F.normalize(q, dim=-1, eps=0), F.normalize(k, dim=-1, eps=0), v, beta, g,
                                   zero_state, lengths, Dk ** -0.5)
    # The stand-in computes in float32 (fla does too): compare at float32 precision.
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    grad_out = torch.randn_like(expected)
    leaves = (q, k, v, g_raw, beta_raw)
    got = torch.autograd.grad(out, leaves, grad_out, retain_graph=True)  # g and beta are shared
    want = torch.autograd.grad(expected, leaves, grad_out)
    for name, g_got, g_want in zip("q k v g beta".split(), got, want):
        torch.testing.assert_close(g_got, g_want, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"d{n}: {m}")


LAYER = """
import torch
from torchtitan.models.common.attention import create_varlen_metadata_for_document
from torchtitan.models.qwen3_5 import _qwen35_deltanet_config
from npu_inject import runtime

torch.manual_seed(0)
layer = _qwen35_deltanet_config(dim=32, n_key_heads=2, n_value_heads=4, key_head_dim=16, value_head_dim=8,
                                layer_id=0).build()
for p in layer.parameters():
    torch.nn.init.normal_(p, std=0.2)
B, L = 2, 40
positions = torch.cat([torch.arange(25), torch.arange(15)]).repeat(B, 1)  # two documents per row
masks = create_varlen_metadata_for_document(positions, include_host_offsets=True)
x = torch.randn(B, L, 32, requires_grad=True)
out = layer(x, masks)
out.sum().backward()
# Changing the first document must not change the second (conv and state restart).
x2 = x.detach().clone()
x2[:, :25] += 1.0
out2 = layer(x2, masks)
same = torch.allclose(out[:, 25:], out2[:, 25:], atol=1e-6)
changed = not torch.allclose(out[:, :25], out2[:, :25])
grads = all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
print("RESULT", tuple(out.shape), same, changed, grads, bool(torch.isfinite(x.grad).all()))
print("FALLBACK", runtime.current().report.patches["gated_delta_net"].fallbacks)
"""


def test_qwen3_5_gated_delta_net_layer_trains_on_the_rehearsal_with_document_resets():
    result = run_python(LAYER, env=clean_env(TORCHTITAN_NPU="cpu"), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT (2, 40, 32) True True True True" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "chunked PyTorch reference (torch_npu has no chunked backward)" in result.stdout


GUARD = """
from npu_inject import model_checks
import torchtitan
print("PROBLEM", model_checks.family_problem("qwen3_5", "cpu"))
"""


@pytest.mark.parametrize("patches,expected", [
    ("", "needs torchvision"),  # fla is served: what is left is the data loader's package
    ("-gated_delta_net", "enable patch gated_delta_net"),
])
def test_model_guard_stops_qwen3_5_only_without_the_stand_in(patches, expected):
    env = clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=patches)
    result = run_python(GUARD, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    if expected == "needs torchvision":
        import importlib.util

        if importlib.util.find_spec("torchvision") is not None:
            expected = "PROBLEM None"
    assert expected in line, line

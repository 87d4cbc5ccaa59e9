"""Selective activation checkpointing keeps the fused attention's output (patch selective_ac).

Measured on torchtitan's own llama3 debug model (2 layers) in the CPU rehearsal:
fused-attention forward calls per training step, counted where the kernel
computes (the reference npu_fusion_attention, outside the backward op), with
torchtitan's SelectiveAC applied. Upstream's policy recomputes the attention in
backward (2 calls per layer); with the patch it is saved (1 call per layer).
Gradients are compared with the same model run without any checkpointing.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from testkit import clean_env
from npu_inject import runtime

LAYERS = 2


def _train_step_counting_kernel(patches: str, checkpointing: bool):
    """(kernel forward calls, loss, gradients) of one step of a 2-layer llama3 debug model."""
    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES=patches), install_hooks=False)
    try:
        for module in ("torchtitan.tools.utils", "torchtitan.models.common.decoder",
                       "torchtitan.distributed.activation_checkpoint"):
            importlib.import_module(module)
        for patch_id in patches.split(","):
            assert rt.apply(patch_id), rt.report.patches[patch_id]
        from torchtitan.distributed.activation_checkpoint import SelectiveAC
        from torchtitan.models.llama3 import model_registry

        from npu_inject.ops.reference import fusion_attention

        config = model_registry("debugmodel").model
        config.layers = config.layers[:LAYERS]
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        if checkpointing:
            SelectiveAC(SelectiveAC.Config()).apply(model)

        calls = []
        kernel = fusion_attention.npu_fusion_attention

        def counting_kernel(*args, **kwargs):
            # The patch's backward op recomputes inside backward (as npu_fusion_attention_grad
            # does on the NPU); only forward launches count.
            if sys._getframe(1).f_code.co_name != "_backward":
                calls.append(1)
            return kernel(*args, **kwargs)

        from npu_inject.ops import reference

        # The plain kernel is reached through the package (unpatched) or through the
        # patch's dispatcher op, which calls the module's function.
        package_kernel = reference.npu_fusion_attention
        fusion_attention.npu_fusion_attention = counting_kernel
        if package_kernel is kernel:
            reference.npu_fusion_attention = counting_kernel
        try:
            tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
            positions = torch.arange(64).repeat(2, 1)
            masks = model.get_attention_masks(positions)
            loss = model(tokens, attention_masks=masks).float().pow(2).mean()
            loss.backward()
        finally:
            fusion_attention.npu_fusion_attention = kernel
            reference.npu_fusion_attention = package_kernel
        grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                 for name, p in model.named_parameters()}
        return len(calls), loss.item(), grads
    finally:
        rt.revert_all()


@pytest.fixture(scope="module")
def uncheckpointed():
    return _train_step_counting_kernel("device,attention", checkpointing=False)


def test_selective_ac_saves_fused_attention(uncheckpointed):
    calls, loss, grads = _train_step_counting_kernel("device,attention,selective_ac", checkpointing=True)
    upstream_calls, _, _ = _train_step_counting_kernel("device,attention", checkpointing=True)
    print(f"\nfused-attention forward calls per step, {LAYERS} layers, selective AC: "
          f"upstream policy {upstream_calls}, with selective_ac {calls}")
    assert upstream_calls == 2 * LAYERS  # the gap the patch closes
    assert calls == LAYERS
    reference_calls, reference_loss, reference_grads = uncheckpointed
    assert reference_calls == LAYERS
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_reverting_restores_the_reference_kernel():
    from npu_inject.ops import reference
    from npu_inject.ops.reference import fusion_attention

    _train_step_counting_kernel("device,attention,selective_ac", checkpointing=True)
    assert reference.npu_fusion_attention is fusion_attention.npu_fusion_attention


def test_a_linear_reaching_the_policy_as_matmul_is_saved_every_other_time_like_mm():
    """torch_npu registers aten.matmul as a kernel of its own, so on an NPU each nn.Linear reaches the
    selective-AC policy as aten.matmul (seen on the real torch_npu 2.14.0, tests/cann_emu). Upstream's
    policy knows aten.mm and aten.linear only: every linear was recomputed. With the patch, matmul gets
    upstream's own mm answer, call by call (save, recompute, save, ...), forced shapes included."""
    from torch.utils.checkpoint import CheckpointPolicy

    rt = runtime.activate(clean_env(TORCHTITAN_NPU="cpu", TORCHTITAN_NPU_PATCHES="device,attention,selective_ac"),
                          install_hooks=False)
    try:
        for module in ("torchtitan.tools.utils", "torchtitan.models.common.decoder",
                       "torchtitan.distributed.activation_checkpoint"):
            importlib.import_module(module)
        import torchtitan.distributed.activation_checkpoint as titan_ac

        captured = []
        real_contexts = titan_ac.create_selective_checkpoint_contexts
        # Stands for torch's function, beneath the patch's wrapper once it applies.
        titan_ac.create_selective_checkpoint_contexts = lambda policy, *a, **k: captured.append(policy)

        def policy_of_a_wrapped_block():
            wrapped = titan_ac.SelectiveAC(titan_ac.SelectiveAC.Config())._wrap_block(torch.nn.Linear(4, 8))
            wrapped.checkpoint_fn.keywords["context_fn"]()
            return captured[-1]

        policies = {False: policy_of_a_wrapped_block()}
        for patch_id in ("device", "attention", "selective_ac"):
            assert rt.apply(patch_id), rt.report.patches[patch_id]
        policies[True] = policy_of_a_wrapped_block()
        ctx = type("Ctx", (), {"is_recompute": False})()
        x, w_t = torch.zeros(2, 3, 4), torch.zeros(4, 8)
        upstream_mm = [policies[False](ctx, torch.ops.aten.mm.default, x.view(6, 4), w_t) for _ in range(4)]
        upstream_matmul = [policies[False](ctx, torch.ops.aten.matmul.default, x, w_t) for _ in range(2)]
        patched_matmul = [policies[True](ctx, torch.ops.aten.matmul.default, x, w_t) for _ in range(4)]
    finally:
        rt.revert_all()
        titan_ac.create_selective_checkpoint_contexts = real_contexts
    assert upstream_mm == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 2
    assert upstream_matmul == [CheckpointPolicy.PREFER_RECOMPUTE] * 2  # the NPU's loss before the patch
    assert patched_matmul == upstream_mm


def test_the_dispatcher_op_takes_gpt_oss_sinks_with_their_gradient():
    """gpt_oss under selective AC: the dispatcher op passes the sink and returns its gradient, against the
    explicit softmax over the scores and an appended sink column (dropped before v)."""
    from npu_inject.ops import sac_dispatch

    generator = torch.Generator().manual_seed(3)
    B, S, N, N_KV, D = 2, 12, 4, 2, 8
    q = torch.randn(B, S, N, D, generator=generator, requires_grad=True)
    k, v = (torch.randn(B, S, N_KV, D, generator=generator, requires_grad=True) for _ in range(2))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out = sac_dispatch.npu_fusion_attention(q, k, v, N, "BSND", atten_mask=compressed, sparse_mode=2, scale=0.3,
                                            sink=sinks)[0]
    scores = (q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    column = sinks.view(1, N, 1, 1).expand(B, N, S, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    expected = (probs @ v.transpose(1, 2).repeat_interleave(2, 1)).transpose(1, 2)
    weights = torch.randn(out.shape, generator=generator)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v, sinks))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)

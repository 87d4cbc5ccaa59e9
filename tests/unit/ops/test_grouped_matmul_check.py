"""MoE's grouped expert products checked (npu_inject.ops.matmul_check's grouped check) against upstream's own
``torch._grouped_mm``: no verdict fails on correct products, the gradients are bitwise those of the unchecked
call, and one wrong element in the result or in either gradient is caught. The truth is torch._grouped_mm."""

from __future__ import annotations

import pytest
import torch

from npu_inject.ops.matmul_check import Ledger, grouped_checkable

# rows sorted by expert; group 2 is empty; rows 37..39 are padding past the last offset (judged by no one)
OFFSETS = [9, 21, 21, 37]
ROWS, INNER, COLUMNS = 40, 304, 520  # not multiples of 256 (partial segments); rows of 16-byte multiples


def _operands(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(ROWS, INNER, generator=generator).to(dtype).requires_grad_()
    w = (torch.randn(len(OFFSETS), COLUMNS, INNER, generator=generator) / INNER ** 0.5).to(dtype).requires_grad_()
    grad = torch.randn(ROWS, COLUMNS, generator=generator).to(dtype)
    return a, w, grad


def _upstream(a, b_t, offsets):
    return torch._grouped_mm(a, b_t, offs=offsets)


def _run(dtype, grouped_mm=_upstream, seed=0):
    a, w, grad = _operands(dtype, seed)
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    ledger = Ledger("cpu")
    ledger.reset()
    b_t = w.transpose(-2, -1)  # as GroupedExperts passes it: a transposed view
    assert grouped_checkable(a, b_t, offsets)
    out = ledger.grouped_mm(grouped_mm, a, b_t, offsets)
    out.backward(grad)
    forward, backward = ledger.forward.tolist(), ledger.sink.grad.tolist()
    return out.detach(), a.grad, w.grad, forward, backward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correct_grouped_products_pass_and_train_bit_for_bit_as_unchecked(dtype, seed):
    out, grad_a, grad_w, forward, backward = _run(dtype, seed=seed)
    assert forward == [0.0, 1.0] and backward == [0.0, 1.0]
    a, w, grad = _operands(dtype, seed)
    plain = _upstream(a, w.transpose(-2, -1), torch.tensor(OFFSETS, dtype=torch.int32))
    plain.backward(grad)
    assert torch.equal(out[:OFFSETS[-1]], plain.detach()[:OFFSETS[-1]])
    # torch._grouped_mm leaves the padding rows of its result and of grad_a unwritten (garbage, inf among it)
    assert torch.equal(grad_a[:OFFSETS[-1]], a.grad[:OFFSETS[-1]]) and torch.equal(grad_w, w.grad)


class _Wrong(torch.autograd.Function):
    """torch._grouped_mm with one wrong element in its result or in one of its gradients."""

    @staticmethod
    def forward(ctx, a, b_t, offsets, where):
        ctx.save_for_backward(a, b_t, offsets)
        ctx.where = where
        out = torch._grouped_mm(a, b_t, offs=offsets)
        if where == "result":
            out[30, 400] = out[30, 400] * 1024 + 1024
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b_t, offsets = ctx.saved_tensors
        grad_a = torch._grouped_mm(grad, b_t.transpose(-2, -1), offs=offsets)
        grad_b_t = torch._grouped_mm(grad.t(), a, offs=offsets).transpose(-2, -1)
        if ctx.where == "grad_a":
            grad_a[12, 100] = grad_a[12, 100] * 1024 + 1024
        if ctx.where == "grad_b":
            grad_b_t[3, 250, 17] = grad_b_t[3, 250, 17] * 1024 + 1024
        return grad_a, grad_b_t, None, None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where, caught_in", [("result", "forward"), ("grad_a", "backward"), ("grad_b", "backward")])
def test_one_wrong_element_of_the_result_or_of_either_gradient_is_caught(dtype, where, caught_in):
    _, _, _, forward, backward = _run(dtype, lambda a, b_t, offsets: _Wrong.apply(a, b_t, offsets, where))
    failures = {"forward": forward[0], "backward": backward[0]}
    assert failures[caught_in] >= 1, (forward, backward)
    assert failures["backward" if caught_in == "forward" else "forward"] == 0
    assert forward[1] == 1.0 and backward[1] == 1.0


def test_padding_rows_past_the_last_offset_are_not_judged_whatever_they_hold():
    def garbage_in_padding(a, b_t, offsets):
        out = torch._grouped_mm(a, b_t, offs=offsets)
        return torch.cat([out[:OFFSETS[-1]], torch.full_like(out[OFFSETS[-1]:], float("inf"))])

    a, w, grad = _operands(torch.bfloat16)
    with torch.no_grad():
        a[OFFSETS[-1]:] = float("nan")
        grad[OFFSETS[-1]:] = float("inf")
    ledger = Ledger("cpu")
    ledger.reset()
    out = ledger.grouped_mm(garbage_in_padding, a, w.transpose(-2, -1), torch.tensor(OFFSETS, dtype=torch.int32))
    out.backward(grad)
    assert ledger.forward.tolist() == [0.0, 1.0] and ledger.sink.grad.tolist() == [0.0, 1.0]

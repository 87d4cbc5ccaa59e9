"""The matmul checks: the V-ABFT reference's layout, no false verdict on correct products, every corruption caught,
and a checked linear that trains bit for bit as ``F.linear`` (eager, compiled, under activation checkpointing).

Correct products come from torch's own matmul (the same kernels the model runs), corrupted ones from moving one
element; bit equality is against plain ``F.linear`` and autograd.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from npu_inject.ops.matmul_check import CORRUPTION_SCALE, Ledger, failed_verdicts, product_failures
from npu_inject.ops.reference import matmul_abft_verify as abft


def _product(m, k, n, dtype, generator, scale=1.0, dominant=False):
    a = torch.randn(m, k, generator=generator) * scale
    if dominant:  # rows of tiny values and one large one (the gradient rows that failed the kernel's arithmetic)
        a = a * 1e-4
        a[:, 0] = -4e-3
    b = torch.randn(k, n, generator=generator) / math.sqrt(k)
    a, b = a.to(dtype), b.to(dtype)
    return a, b, a @ b  # torch's matmul: fp32 accumulation, rounded once to dtype


def test_the_reference_packs_verdicts_eight_rows_to_a_byte_segment_major_lsb_first():
    """comp_row[j * ceil(M/8) + i // 8] bit i % 8 is row i of column segment j (the op's doc; checksum.py)."""
    generator = torch.Generator().manual_seed(0)
    a, b, c = _product(13, 64, 600, torch.float32, generator)  # 3 segments: 256, 256, 88 columns
    c = c.clone()
    c[3, 300] += 100.0  # row 3, segment 1
    c[10, 599] += 100.0  # row 10, segment 2 (the short one)
    comp_row = abft._npu_matmul_abft_verify(a, b, c, torch.ones(600), e_max=2e-5)
    assert comp_row.dtype == torch.uint8 and comp_row.shape == (3 * 2,)
    valid_high = (1 << (13 - 8)) - 1  # rows 8..12 in each segment's second byte
    assert comp_row.tolist() == [255, valid_high, 255 & ~(1 << 3), valid_high, 255, valid_high & ~(1 << 2)]
    assert failed_verdicts(comp_row, 13).item() == 2  # (row 3, segment 1) and (row 10, segment 2)


def test_failed_verdicts_ignores_the_bits_past_the_last_row():
    """The kernel leaves them undefined (torch_npu masks them too)."""
    comp_row = torch.tensor([255, 0b11100000 | 0b00001111], dtype=torch.uint8)  # rows 12..15 garbage
    assert failed_verdicts(comp_row, 12).item() == 0
    assert failed_verdicts(torch.tensor([255, 0b11100111], dtype=torch.uint8), 12).item() == 1
    # counted by bytes (eight rows of one segment): two wrong rows in one byte count once
    assert failed_verdicts(torch.tensor([0b11110011, 255, 255, 0], dtype=torch.uint8), 16).item() == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n, dominant", [(128, 16, 256, True), (16, 256, 2048, False), (300, 96, 520, False),
                                               (2048, 16, 256, True), (64, 1024, 768, False), (7, 3, 5, False)])
def test_the_torch_check_passes_every_correct_product(dtype, m, k, n, dominant):
    generator = torch.Generator().manual_seed(m * k + n)
    for trial in range(4):
        a, b, c = _product(m, k, n, dtype, generator, scale=10.0 ** (trial - 2), dominant=dominant)
        assert product_failures(a, b, c, device_kernel=False).item() == 0, (trial, dtype)
        # the transposed forms the backward checks take (grad_weight = grad^T @ input)
        assert product_failures(c.t(), a, (c.t() @ a), device_kernel=False).item() == 0


def test_the_kernels_arithmetic_fails_correct_bf16_products_of_small_inner_dimension():
    """Why products with K below KERNEL_MIN_INNER take the torch check even where the kernel is available."""
    generator = torch.Generator().manual_seed(1)
    a, b, c = _product(2048, 16, 256, torch.bfloat16, generator, dominant=True)
    b = b * 40  # segment sums of tens, as the output projection's activations give
    c = a @ b
    comp_row = abft._npu_matmul_abft_verify(a, b, c.float(), torch.ones(256, dtype=torch.bfloat16), e_max=1e-3)
    assert failed_verdicts(comp_row, 2048).item() > 0
    assert product_failures(a, b, c, device_kernel=False).item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_arithmetic_passes_correct_products_from_its_reference_inner_dimension(dtype):
    generator = torch.Generator().manual_seed(2)
    for k in (1024, 4096):
        a, b, c = _product(256, k, 512, dtype, generator)
        comp_row = abft._npu_matmul_abft_verify(a, b, c.float(), torch.ones(512, dtype=dtype),
                                                e_max={torch.float32: 2e-5, torch.bfloat16: 1e-3}[dtype])
        assert failed_verdicts(comp_row, 256).item() == 0, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", [(0, 0), (37, 300), (99, 511)])
def test_one_wrong_element_is_caught_wherever_it_is(dtype, where):
    generator = torch.Generator().manual_seed(3)
    a, b, c = _product(100, 256, 512, dtype, generator)
    wrong = c.clone()
    wrong[where] = wrong[where] * CORRUPTION_SCALE + CORRUPTION_SCALE
    assert product_failures(a, b, wrong, device_kernel=False).item() == 1
    # a subtler one: 64 times the row's largest element (a value moved by about its own size is within the
    # threshold in bf16: V-ABFT catches what moves a row's checksum beyond its rounding, not every flipped bit)
    moved = c.clone()
    moved[where] += 64 * c[where[0]].abs().max()
    assert product_failures(a, b, moved, device_kernel=False).item() == 1


def test_rows_of_non_finite_operands_are_not_judged_but_a_non_finite_result_of_finite_ones_is():
    generator = torch.Generator().manual_seed(4)
    a, b, c = _product(16, 64, 256, torch.float32, generator)
    a_nan = a.clone()
    a_nan[2, 5] = float("nan")
    assert product_failures(a_nan, b, a_nan @ b, device_kernel=False).item() == 0
    c_inf = c.clone()
    c_inf[4, 4] = float("inf")
    assert product_failures(a, b, c_inf, device_kernel=False).item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 64, 256), (300, 96), (4, 33, 520)])
def test_a_checked_linear_trains_bit_for_bit_as_f_linear(dtype, shape):
    generator = torch.Generator().manual_seed(5)
    features = shape[-1]
    x = torch.randn(*shape, generator=generator).to(dtype)
    w = (torch.randn(384, features, generator=generator) / math.sqrt(features)).to(dtype)
    ledger = Ledger("cpu")
    x_checked, w_checked = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_checked = ledger.linear(x_checked, w_checked)
    grad = torch.randn(y_checked.shape, generator=generator).to(dtype)
    y_checked.backward(grad)
    x_plain, w_plain = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_plain = F.linear(x_plain, w_plain)
    y_plain.backward(grad)
    assert torch.equal(y_checked, y_plain)
    assert torch.equal(x_checked.grad, x_plain.grad) and torch.equal(w_checked.grad, w_plain.grad)
    assert ledger.local_counts().tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]  # failures fwd, bwd; checks fwd, bwd; unchecked


class _Block(torch.nn.Module):
    def __init__(self, ledger, checked):
        super().__init__()
        self.ledger, self.checked = ledger, checked
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        if not self.checked:
            return self.down(F.silu(self.up(x)))
        hidden = F.silu(self.ledger.linear(x, self.up.weight, corruptible=True))
        return self.ledger.linear(hidden, self.down.weight)


@pytest.mark.parametrize("recompute", [False, True], ids=["no_ac", "ac"])
def test_a_compiled_checked_block_is_one_graph_counts_and_catches_as_eager(recompute, monkeypatch):
    """torchtitan compiles each block whole (fullgraph=True), around its activation checkpoint, with forward side
    effects skipped in the recomputation (torchtitan.distributed.compile sets the flag this test sets)."""
    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", True)
    ledger = Ledger("cpu")
    blocks = []
    for checked in (True, False):
        torch.manual_seed(0)
        block = _Block(ledger, checked).to(torch.bfloat16)
        run = (lambda x, block=block: checkpoint(block, x, use_reentrant=False)) if recompute else block
        blocks.append((block, torch.compile(run, backend="aot_eager", fullgraph=True)))
    x = torch.randn(4, 16, 64).to(torch.bfloat16)
    torch._dynamo.reset()
    try:
        for attempt in range(3):
            ledger.reset()
            ledger.corruption.fill_(1.0 if attempt == 1 else 0.0)
            (checked, compiled_checked), (plain, compiled_plain) = blocks
            y_checked, y_plain = compiled_checked(x), compiled_plain(x)
            y_checked.float().sum().backward()
            y_plain.float().sum().backward()
            counts = ledger.local_counts().tolist()
            if attempt == 1:  # the corrupted attempt: caught in the forward
                assert counts == [1.0, 0.0, 2.0, 2.0, 0.0]
            else:
                assert torch.equal(y_checked, y_plain)
                assert torch.equal(checked.up.weight.grad, plain.up.weight.grad)
                assert counts == [0.0, 0.0, 2.0, 2.0, 0.0]
            checked.zero_grad()
            plain.zero_grad()
    finally:
        torch._dynamo.reset()

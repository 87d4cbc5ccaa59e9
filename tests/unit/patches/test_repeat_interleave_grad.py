"""repeat_interleave_grad's kernel math against autograd of torch's own ``repeat_interleave`` on the CPU.

The NPU registration itself is checked through the real torch_npu on the CANN emulation
(tests/cann_emu/test_npu_repeat_interleave_backward.py); here, the function it registers: every case a
``repeat_interleave(Tensor repeats)`` backward can take (a dim or the flattened input, one count
broadcast, empty counts, gpt_oss's expert biases with ``output_size``), and the fake's shape.
"""

from __future__ import annotations

import pytest
import torch

from npu_inject.patches.repeat_interleave_grad import repeat_interleave_backward, repeat_interleave_backward_fake

CASES = [  # (input shape, repeats, dim)
    ((5, 3), [2, 0, 3, 1, 4], 0),  # gpt_oss's biases: a row per expert, some experts without tokens
    ((2, 4), [1, 3, 0, 2], 1),
    ((2, 3), [2, 1, 1, 0, 3, 1], None),  # flattened
    ((4, 2), [3], 0),  # one count for every row
    ((3,), [2, 2, 2], -1),
]


@pytest.mark.parametrize("shape, repeats, dim", CASES)
def test_the_kernel_is_autograd_of_repeat_interleave(shape, repeats, dim):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor(repeats)
    y = x.repeat_interleave(counts, dim=dim)
    grad_y = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    (expected,) = torch.autograd.grad(y, x, grad_y)
    got = repeat_interleave_backward(grad_y, x.detach(), counts, dim)
    torch.testing.assert_close(got, expected)
    fake = repeat_interleave_backward_fake(grad_y, x.detach(), counts, dim)
    assert fake.shape == x.shape and fake.dtype == grad_y.dtype


def test_gpt_oss_bias_with_output_size_and_tail_slack():
    # b has E experts plus a zero row for the tail slack; the counts sum to R exactly (upstream pads them).
    b = torch.randn(4 + 1, 6, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 2, 1, 2])
    rows = int(counts.sum())
    y = b.repeat_interleave(counts, dim=0, output_size=rows)
    grad_y = torch.randn(rows, 6, dtype=torch.float64)
    (expected,) = torch.autograd.grad(y, b, grad_y)
    torch.testing.assert_close(repeat_interleave_backward(grad_y, b.detach(), counts, 0), expected)

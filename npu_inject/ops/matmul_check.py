"""The model's matmuls checked on the device, forward and backward, with one host read per checked step.

:class:`CheckedLinear` computes ``nn.Linear``'s result (bias-free) and its two gradients with the very
operators autograd uses for ``F.linear`` (so the checks change no bit of the training), and checks each of the
three products with CANN's V-ABFT row checksums (:func:`product_failures`): torch_npu's
``_npu_matmul_abft_verify`` kernel where the device has it, :mod:`npu_inject.ops.reference.matmul_abft_verify`
(the same algorithm in torch) elsewhere. Nothing is read on the host here: each check leaves a count of
failed (row, segment) verdicts on the device, and :class:`Ledger` collects them.

* Forward verdicts are added, in place, to :attr:`Ledger.forward` as the forward runs. Eager activation
  checkpointing adds its recomputation's too; under torch.compile torchtitan skips forward side effects in the
  recomputation (``skip_fwd_side_effects_in_bwd_under_checkpoint``). Either way the verdict of the forward
  that fed the loss is among them.
* Backward verdicts reach the host as a gradient: every checked matmul takes :attr:`Ledger.sink` (a leaf of
  two elements) as an input, and its backward returns (failures, 1) as the sink's gradient, which autograd
  sums over every matmul, microbatch and pipeline stage into ``sink.grad``. This stays traceable under
  torch.compile (no side effect in a backward) and cannot be lost silently: the second element counts the
  backward checks that ran, and a checked step whose forward checks ran but none of whose backward checks did
  stops the job (a pipeline schedule that computes weight gradients apart would do that).

Shapes follow torchtitan's suffixes: M the flattened tokens, K the input features, N the output features.
"""

from __future__ import annotations

import torch

from npu_inject.ops.reference.matmul_abft_verify import abft_correct

# torch_npu's recommended sensitivities (torch_npu/asd/checksum.py; the operator's doc); fp16 has none there
E_MAX = {torch.bfloat16: 0.001, torch.float16: 0.001, torch.float32: 0.00002}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
KERNEL_MIN_INNER = 1024  # the K V-ABFT's threshold is scaled from (e' = e_max 6 sqrt(K / 1024)); below it, the torch check
CORRUPTION_SCALE = 1024.0  # sdc_matmul: the element x becomes 1024 x + 1024


def failed_verdicts(comp_row: torch.Tensor, rows: int) -> torch.Tensor:
    """How many bytes of ``comp_row`` (eight rows of one segment each) hold a verdict that says wrong, as a float32
    0-dim tensor; bits of rows past ``rows`` are undefined and masked, as torch_npu does. Bytes, not bits:
    counting bits needs a table of bit weights, which would be copied from the host (torch_npu synchronises
    after such a copy) or made by operators not every SoC runs."""
    row_bytes = (rows + 7) // 8
    bits = comp_row.view(-1, row_bytes).to(torch.int32)
    last = (1 << (rows % 8)) - 1 if rows % 8 else 255
    position = torch.arange(row_bytes, device=comp_row.device)
    masks = torch.where(position == row_bytes - 1, last, 255).to(torch.int32)
    return ((bits & masks) != masks).sum(dtype=torch.float32)


class Ledger:
    """Where one process's checks leave their verdicts between a checked step's start and its read."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.sink = torch.zeros(2, device=self.device, requires_grad=True)
        self.forward = torch.zeros(2, device=self.device)  # (failures, checks) of the forward products
        self.checking = False  # this step's matmuls are checked
        # sdc_matmul: 1 while the product of :attr:`corruptible` gets one wrong element. A tensor, not a Python
        # flag: an activation checkpoint's recomputation must run the graph the forward ran under torch.compile
        self.corruption = torch.zeros((), device=self.device)
        self.device_kernel = False  # torch_npu's _npu_matmul_abft_verify, once probed on the device

    def reset(self) -> None:
        self.forward.zero_()
        self.sink.grad = None

    def local_counts(self) -> torch.Tensor:
        """(forward failures, backward failures, forward checks, backward checks) on the device."""
        forward = self.forward
        backward = self.sink.grad if self.sink.grad is not None else torch.zeros(2, device=self.device)
        return torch.cat([forward[:1], backward[:1], forward[1:], backward[1:]])

    def linear(self, input_MK: torch.Tensor, weight_NK: torch.Tensor, corruptible: bool = False) -> torch.Tensor:
        """``F.linear(input, weight)``, checked; the forward verdict joins :attr:`forward`. ``corruptible``: the one
        product sdc_matmul corrupts while :attr:`corruption` is 1."""
        corruption = self.corruption if corruptible else None
        output, verdict = CheckedLinear.apply(input_MK, weight_NK, self.sink, corruption, self.device_kernel)
        # in place: an append would be a side effect torch.compile cannot trace inside an activation checkpoint
        self.forward.add_(verdict)
        return output


def product_failures(a_MK: torch.Tensor, b_KN: torch.Tensor, c_MN: torch.Tensor, device_kernel: bool) -> torch.Tensor:
    """The failed verdicts of ``c_MN`` = ``a_MK`` @ ``b_KN`` (a float32 0-dim tensor on the device).

    torch_npu's kernel when ``device_kernel`` and the inner dimension is at least :data:`KERNEL_MIN_INNER`;
    else the torch check: V-ABFT's segments and threshold, with BE kept in fp32 and the rounding of a
    half-precision ``c_MN`` admitted (the kernel's threshold shrinks with sqrt(K) and rounds BE to the input
    dtype: on a bf16 product of K 16, torchtitan llama3 debug's output projection's weight gradient, 2 of 256
    correct verdicts failed in the kernel's arithmetic, as npu_inject.ops.reference reproduces it).

    A row whose operands are not finite is not judged: its product is not finite either way, which is
    finite_steps' business, and a pipeline stage infers its shapes on the first step by a forward and backward
    of uninitialised buffers (torch.distributed.pipelining's metadata inference), NaN among them."""
    if device_kernel and a_MK.shape[1] >= KERNEL_MIN_INNER:
        a, b = a_MK.contiguous(), b_KN.contiguous()
        weight = torch.ones(b.shape[1], dtype=a.dtype, device=a.device)  # all ones: plain row checksums
        comp_row = torch.ops.npu._npu_matmul_abft_verify(a, b, c_MN.float().contiguous(), weight, e_max=E_MAX[a.dtype])
        operands_finite = torch.isfinite(a).all() & torch.isfinite(b).all()  # as the torch check: not judged
        return failed_verdicts(comp_row, a.shape[0]) * operands_finite
    correct = abft_correct(a_MK, b_KN, c_MN, None, E_MAX[a_MK.dtype], output_unit=UNIT_ROUNDOFF[c_MN.dtype])
    return (~correct).sum(dtype=torch.float32)


def corrupt(product: torch.Tensor, corruption: torch.Tensor) -> torch.Tensor:
    """``product`` where ``corruption`` is 0 (bit for bit, infinities too); where it is 1, with one finite wrong
    value: its first element x becomes 1024 x + 1024, far beyond rounding. A new tensor: selective activation
    checkpointing may keep the product itself for the backward, which an in-place write would corrupt too."""
    flat = product.reshape(-1)
    first = torch.where(corruption > 0, flat[:1] * CORRUPTION_SCALE + CORRUPTION_SCALE, flat[:1])
    return torch.cat([first, flat[1:]]).view(product.shape)


class CheckedLinear(torch.autograd.Function):
    """``F.linear(input, weight)`` whose forward and backward products are checked (see the module). Returns the
    output and the forward's verdict (failures, 1); free of side effects, so torch.compile traces it whole."""

    @staticmethod
    def forward(ctx, input_MK, weight_NK, sink, corruption, device_kernel: bool):
        output = torch.nn.functional.linear(input_MK, weight_NK)
        if corruption is not None:
            output = corrupt(output, corruption)
        features = weight_NK.shape[1]
        failures = product_failures(input_MK.reshape(-1, features), weight_NK.t(),
                                    output.reshape(-1, weight_NK.shape[0]), device_kernel)
        verdict = torch.stack([failures, torch.ones_like(failures)])
        ctx.mark_non_differentiable(verdict)
        ctx.save_for_backward(input_MK, weight_NK)
        ctx.device_kernel = device_kernel
        return output, verdict

    @staticmethod
    def backward(ctx, grad_output, grad_verdict):
        input_MK, weight_NK = ctx.saved_tensors
        input_2d = input_MK.reshape(-1, weight_NK.shape[1])
        grad_2d = grad_output.reshape(-1, weight_NK.shape[0])
        # autograd's formulas for mm(input, weight.t()) (mm_mat1_backward, mm_mat2_backward for a row-major input
        # and weight), so the gradients are bitwise those of F.linear
        grad_input = grad_2d.mm(weight_NK)
        grad_weight = grad_2d.t().mm(input_2d)
        failures = (product_failures(grad_2d, weight_NK, grad_input, ctx.device_kernel)
                    + product_failures(grad_2d.t(), input_2d, grad_weight, ctx.device_kernel))
        grad_sink = torch.stack([failures, torch.ones_like(failures)])
        return grad_input.view(input_MK.shape), grad_weight, grad_sink, None, None


def checkable(input_MK: torch.Tensor, weight_NK: torch.Tensor, bias) -> bool:
    """Whether CheckedLinear computes this call exactly as ``F.linear`` would (else the call runs unchecked)."""
    return (bias is None and not hasattr(weight_NK, "to_local") and not hasattr(input_MK, "to_local")
            and weight_NK.dim() == 2 and weight_NK.is_contiguous() and input_MK.is_contiguous()
            and input_MK.dtype == weight_NK.dtype and input_MK.dtype in E_MAX
            and input_MK.shape[-1] > 1 and torch.is_grad_enabled())



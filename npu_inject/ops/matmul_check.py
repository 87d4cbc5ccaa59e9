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

import math

import torch

from npu_inject.ops.reference.matmul_abft_verify import (
    SEGMENT, abft_correct, abft_threshold, judge, row_stats, segment_stats, segment_widths, segments_of)

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
        # linear calls of a checked step that ran unchecked (a layout, dtype or stride the check does not take)
        self.unchecked = torch.zeros(1, device=self.device)
        self.checking = False  # this step's matmuls are checked
        # sdc_matmul: 1 while the product of :attr:`corruptible` gets one wrong element. A tensor, not a Python
        # flag: an activation checkpoint's recomputation must run the graph the forward ran under torch.compile
        self.corruption = torch.zeros((), device=self.device)
        self.expert_corruption = torch.zeros((), device=self.device)  # sdc_expert, in the first experts' products
        self.device_kernel = False  # torch_npu's _npu_matmul_abft_verify, once probed on the device

    def reset(self) -> None:
        self.forward.zero_()
        self.unchecked.zero_()
        self.sink.grad = None

    def local_counts(self) -> torch.Tensor:
        """(forward failures, backward failures, forward checks, backward checks, unchecked calls) on the device."""
        forward = self.forward
        backward = self.sink.grad if self.sink.grad is not None else torch.zeros(2, device=self.device)
        return torch.cat([forward[:1], backward[:1], forward[1:], backward[1:], self.unchecked])

    def skip(self) -> None:
        """Count one linear call of a checked step that runs unchecked (in place: traceable, as :attr:`forward`)."""
        self.unchecked.add_(1.0)

    def linear(self, input_MK: torch.Tensor, weight_NK: torch.Tensor, corruptible: bool = False) -> torch.Tensor:
        """``F.linear(input, weight)``, checked; the forward verdict joins :attr:`forward`. ``corruptible``: the one
        product sdc_matmul corrupts while :attr:`corruption` is 1."""
        corruption = self.corruption if corruptible else None
        output, verdict = CheckedLinear.apply(input_MK, weight_NK, self.sink, corruption, self.device_kernel)
        # in place: an append would be a side effect torch.compile cannot trace inside an activation checkpoint
        self.forward.add_(verdict)
        return output

    def linear_tensor_parallel(self, input, weight, layout, corruptible: bool = False):
        """``F.linear`` of DTensors (``layout`` from :func:`tensor_parallel_layout`), checked on the local shards:
        the local products DTensor would run, so no bit changes; returns the DTensor ``F.linear`` would."""
        from torch.distributed.tensor import DTensor

        output_placements, input_grad_placements, weight_grad_placements = layout
        output_local = self.linear(input.to_local(grad_placements=input_grad_placements),
                                   weight.to_local(grad_placements=weight_grad_placements), corruptible)
        shape = (*input.shape[:-1], weight.shape[0])
        stride = tuple(math.prod(shape[dim + 1:]) for dim in range(len(shape)))
        return DTensor.from_local(output_local, weight.device_mesh, output_placements, run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def grouped_mm(self, grouped_mm, a_RK: torch.Tensor, b_GKN: torch.Tensor, offsets_G: torch.Tensor,
                   corruptible: bool = False) -> torch.Tensor:
        """``grouped_mm(a, b, offsets)`` (the model's own grouped product, its backward untouched), its result and
        both gradients checked; the forward verdict joins :attr:`forward`, the backward's the sink."""
        groups_RG = row_groups(offsets_G, a_RK.shape[0])
        a_in, b_in, link = GroupedEnter.apply(a_RK, b_GKN, self.sink, groups_RG)
        out = grouped_mm(a_in, b_in, offsets_G)
        # sdc_expert: the products of the experts chosen at install (not spent in place after one call: an
        # activation checkpoint's recomputation must see the value the forward saw)
        corruption = self.expert_corruption if corruptible else None
        out, verdict = GroupedExit.apply(out, link, a_RK, b_GKN, groups_RG, corruption)
        self.forward.add_(verdict)
        return out


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


def is_dtensor(tensor: torch.Tensor) -> bool:
    """isinstance, which torch.compile traces (its hasattr on a DTensor answered False for to_local)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def checkable(input_MK: torch.Tensor, weight_NK: torch.Tensor, bias) -> bool:
    """Whether CheckedLinear computes this call exactly as ``F.linear`` would (else the call runs unchecked)."""
    return (bias is None and not is_dtensor(weight_NK) and not is_dtensor(input_MK)
            and weight_NK.dim() == 2 and weight_NK.is_contiguous() and input_MK.is_contiguous()
            and input_MK.dtype == weight_NK.dtype and input_MK.dtype in E_MAX
            and input_MK.shape[-1] > 1 and torch.is_grad_enabled())


def tensor_parallel_layout(input_MK, weight_NK):
    """For ``F.linear`` of two DTensors on one mesh (torchtitan's DTensor backends: a tensor-parallel linear, FSDP's
    unsharded weight, a batch sharded over the data-parallel dimensions): the placements (of the result, of the
    input's gradient, of the weight's gradient) under which each rank's local products are the whole of the work,
    so that checking them checks the product. Per mesh dimension, (input, weight) is one of:

    * replicated, rows sharded (column-wise): result sharded on its last dimension, input gradient partial;
    * sharded on its last dimension, columns sharded (row-wise): result partial;
    * replicated, replicated (torchtitan's NoParallel);
    * sharded on a leading (batch or sequence) dimension, replicated: weight gradient partial.

    None for anything else (the call runs unchecked and is counted)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not (isinstance(input_MK, DTensor) and isinstance(weight_NK, DTensor)):
        return None
    if input_MK.device_mesh != weight_NK.device_mesh or weight_NK.dim() != 2:
        return None
    last = input_MK.dim() - 1

    def shard_dim(placement, ndim: int):
        return placement.dim % ndim if type(placement) is Shard else None  # not _StridedShard and the like

    output, input_grad, weight_grad = [], [], []
    for x, w in zip(input_MK.placements, weight_NK.placements):
        x_dim, w_dim = shard_dim(x, input_MK.dim()), shard_dim(w, 2)
        if x.is_replicate() and w_dim == 0:
            layout = Shard(last), Partial(), w
        elif x_dim == last and w_dim == 1:
            layout = Partial(), x, w
        elif x.is_replicate() and w.is_replicate():
            layout = Replicate(), Replicate(), Replicate()
        elif x_dim is not None and x_dim < last and w.is_replicate():
            layout = x, x, Partial()
        else:
            return None
        for placements, placement in zip((output, input_grad, weight_grad), layout):
            placements.append(placement)
    return tuple(output), tuple(input_grad), tuple(weight_grad)


# -- grouped products: MoE's experts (torchtitan's GroupedExperts._grouped_mm) --------------------------------------
#
# out_RN = A_RK @ B_t[g(r)] for each row r of group g (rows sorted by expert, ``offs`` their cumulative ends); its
# gradients grad_A_RK = grad_out_RN @ B_t[g(r)]^T (grouped along the rows again) and grad_B_t[g] = A_g^T @ grad_out_g
# (grouped along the inner dimension). The torch check only (torch_npu's kernel takes one dense product). The
# products themselves are whatever the model's _grouped_mm computes (upstream's torch._grouped_mm, or
# npu_grouped_matmul through patch moe_dispatch) with its own backward: the check wraps them in two identity
# functions, so no bit changes. :class:`GroupedExit`'s backward, which sees grad_out, computes the expected row
# checksums and thresholds of both gradients and hands them as the gradient of a ``link`` tensor to
# :class:`GroupedEnter`'s backward, which sees the gradients and judges them. A group's rows are picked by a
# one-hot [R, G] matrix: every step is a dense operator, no host read of the offsets.


def row_groups(offsets_G: torch.Tensor, rows: int) -> torch.Tensor:
    """[R, G] float32: 1 where row r belongs to group g; rows past the last offset belong to none."""
    ends_G = offsets_G.to(torch.int64)
    position_R1 = torch.arange(rows, device=offsets_G.device).unsqueeze(1)
    starts_G = torch.cat([ends_G.new_zeros(1), ends_G[:-1]])
    return ((position_R1 >= starts_G) & (position_R1 < ends_G)).to(torch.float32)


def row_grouped_reference(a_RK, b_GKN, groups_RG, e_max: float):
    """Expected row checksums and thresholds [R, S] of c_RN = a_RK @ b_GKN[g(r)], segments of N."""
    rows, inner = a_RK.shape
    encoded_GKS, widths_S, b_mean_abs_GS, b_mean_sq_GS, b_spread_GS = segment_stats(b_GKN.float())
    experts, _, segments = encoded_GKS.shape
    a32_RK = torch.where(groups_RG.sum(1, keepdim=True) > 0, a_RK.float(), 0.0)  # rows past the last offset: zeros
    every_RGS = (a32_RK @ encoded_GKS.permute(1, 0, 2).reshape(inner, experts * segments)).view(rows, experts, segments)
    expected_RS = (every_RGS * groups_RG.unsqueeze(2)).sum(1)
    a_mean_R1, a_spread_R1 = row_stats(a32_RK)
    threshold_RS = abft_threshold(inner, widths_S, a_mean_R1, a_spread_R1, groups_RG @ b_mean_abs_GS,
                                  groups_RG @ b_mean_sq_GS, groups_RG @ b_spread_GS, e_max)
    return expected_RS, threshold_RS


def inner_grouped_reference(a_RK, z_RN, groups_RG, e_max: float):
    """Expected row checksums and thresholds [G, K, S] of c_GKN[g] = a_RK[rows of g]^T @ z_RN[rows of g], segments
    of N. Each row (g, k)'s spread is taken from column k's extremes over all groups' rows, not its group's alone:
    a wider threshold (never a correct product failed for it), with no segmented maximum that not every
    device has."""
    rows, inner = a_RK.shape
    # rows past the last offset hold whatever (upstream leaves them unwritten, infinities among it): zeros, not
    # products with the one-hot matrix's zeros, which would make them NaN
    in_group_R1 = groups_RG.sum(1, keepdim=True) > 0
    a32_RK = torch.where(in_group_R1, a_RK.float(), 0.0)
    z32_RN = torch.where(in_group_R1, z_RN.float(), 0.0)
    encoded_RS = segments_of(z32_RN, 0.0).sum(-1)
    segments = encoded_RS.shape[1]
    widths_S = segment_widths(z_RN.shape[1], z_RN.device)
    scaled_RS = encoded_RS / widths_S
    spread_RS = (segments_of(z32_RN, -math.inf).amax(-1) - scaled_RS) * (scaled_RS - segments_of(z32_RN, math.inf).amin(-1))
    groups_GR = groups_RG.t()
    b_mean_abs_GS, b_mean_sq_GS = groups_GR @ scaled_RS.abs(), groups_GR @ scaled_RS.square()
    b_spread_GS = (groups_GR @ spread_RS).abs().sqrt()
    experts = groups_RG.shape[1]
    encoded_by_group_RGS = (encoded_RS.unsqueeze(1) * groups_RG.unsqueeze(2)).reshape(rows, experts * segments)
    expected_GKS = (a32_RK.t() @ encoded_by_group_RGS).view(inner, experts, segments).permute(1, 0, 2)
    counts_G = groups_GR.sum(1)
    a_mean_GK = (groups_GR @ a32_RK) / counts_G.clamp(min=1.0).unsqueeze(1)
    a_max_1K = torch.where(in_group_R1, a32_RK, -math.inf).amax(0, keepdim=True)
    a_min_1K = torch.where(in_group_R1, a32_RK, math.inf).amin(0, keepdim=True)
    a_spread_GK = ((a_max_1K - a_mean_GK) * (a_mean_GK - a_min_1K)).abs().sqrt()
    a_spread_GK = torch.where(torch.isfinite(a_spread_GK), a_spread_GK, 0.0)  # no row in any group
    threshold_GKS = abft_threshold(counts_G.view(-1, 1, 1), widths_S, a_mean_GK.unsqueeze(2), a_spread_GK.unsqueeze(2),
                                   b_mean_abs_GS.unsqueeze(1), b_mean_sq_GS.unsqueeze(1), b_spread_GS.unsqueeze(1), e_max)
    return expected_GKS, threshold_GKS


def grouped_failures(c_XN, expected_XS, threshold_XS, judged_X1=None) -> torch.Tensor:
    """Failed verdicts (float32 0-dim) of c's rows [..., N] against their expected checksums and thresholds
    [..., S]; rows whose expected checksum is not finite, or not ``judged_X1``, are not judged."""
    columns = c_XN.shape[-1]
    c_XSW = segments_of(c_XN.float().reshape(-1, columns), 0.0).view(*expected_XS.shape, SEGMENT)
    correct = judge(c_XSW, expected_XS, threshold_XS, UNIT_ROUNDOFF[c_XN.dtype]) | ~torch.isfinite(expected_XS)
    if judged_X1 is not None:
        correct = correct | ~judged_X1
    return (~correct).sum(dtype=torch.float32)


class GroupedEnter(torch.autograd.Function):
    """Identity on a grouped product's operands; its backward judges their gradients with the expected checksums
    :class:`GroupedExit`'s backward sends through ``link`` (see above), and returns (failures, 1) to the sink."""

    @staticmethod
    def forward(ctx, a_RK, b_GKN, sink, groups_RG):
        rows, inner = a_RK.shape
        experts, _, columns = b_GKN.shape
        ctx.shapes = (rows, inner, experts, columns)
        ctx.save_for_backward(groups_RG)
        link = torch.zeros(link_size(rows, inner, experts, columns), device=a_RK.device)
        return a_RK.view_as(a_RK), b_GKN.view_as(b_GKN), link

    @staticmethod
    def backward(ctx, grad_a_RK, grad_b_GKN, grad_link):
        (groups_RG,) = ctx.saved_tensors
        rows, inner, experts, columns = ctx.shapes
        a_segments, b_segments = math.ceil(inner / SEGMENT), math.ceil(columns / SEGMENT)
        first = rows * a_segments
        second = experts * inner * b_segments
        expected_a, threshold_a, expected_b, threshold_b = torch.split(grad_link, (first, first, second, second))
        judged_R1 = groups_RG.sum(1, keepdim=True) > 0
        failures = grouped_failures(grad_a_RK, expected_a.view(rows, a_segments), threshold_a.view(rows, a_segments),
                                    judged_R1)
        failures = failures + grouped_failures(grad_b_GKN, expected_b.view(experts, inner, b_segments),
                                               threshold_b.view(experts, inner, b_segments))
        return grad_a_RK, grad_b_GKN, torch.stack([failures, torch.ones_like(failures)]), None


def link_size(rows: int, inner: int, experts: int, columns: int) -> int:
    return 2 * rows * math.ceil(inner / SEGMENT) + 2 * experts * inner * math.ceil(columns / SEGMENT)


class GroupedExit(torch.autograd.Function):
    """Identity on a grouped product's result (sdc_matmul's corruption aside); returns its forward verdict
    (failures, 1), and its backward sends the gradients' expected checksums to :class:`GroupedEnter` as
    ``link``'s gradient."""

    @staticmethod
    def forward(ctx, out_RN, link, a_RK, b_GKN, groups_RG, corruption):
        if corruption is not None:
            out_RN = corrupt(out_RN, corruption)
        expected_RS, threshold_RS = row_grouped_reference(a_RK, b_GKN, groups_RG, E_MAX[a_RK.dtype])
        failures = grouped_failures(out_RN, expected_RS, threshold_RS, groups_RG.sum(1, keepdim=True) > 0)
        verdict = torch.stack([failures, torch.ones_like(failures)])
        ctx.mark_non_differentiable(verdict)
        ctx.save_for_backward(a_RK, b_GKN, groups_RG)
        return out_RN.view_as(out_RN), verdict

    @staticmethod
    def backward(ctx, grad_out_RN, grad_verdict):
        a_RK, b_GKN, groups_RG = ctx.saved_tensors
        e_max = E_MAX[a_RK.dtype]
        expected_a, threshold_a = row_grouped_reference(grad_out_RN, b_GKN.transpose(-2, -1), groups_RG, e_max)
        expected_b, threshold_b = inner_grouped_reference(a_RK, grad_out_RN, groups_RG, e_max)
        link = torch.cat([expected_a.reshape(-1), threshold_a.reshape(-1), expected_b.reshape(-1),
                          threshold_b.reshape(-1)])
        return grad_out_RN, link, None, None, None, None


def grouped_checkable(a_RK: torch.Tensor, b_GKN: torch.Tensor, offsets) -> bool:
    """Whether the checked grouped product applies to this call (else it runs unchecked)."""
    return (offsets is not None and a_RK.dim() == 2 and b_GKN.dim() == 3 and not is_dtensor(a_RK)
            and not is_dtensor(b_GKN) and a_RK.dtype == b_GKN.dtype and a_RK.dtype in E_MAX
            and a_RK.shape[1] == b_GKN.shape[1] and torch.is_grad_enabled()
            and (a_RK.requires_grad or b_GKN.requires_grad))

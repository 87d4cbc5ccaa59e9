"""Reference for torch_npu's ``_npu_matmul_abft_verify``: CANN's V-ABFT check of a finished matmul, in torch.

torch_npu 2.14.0 exposes CANN's ``aclnnMatmulAbftVerify`` (hicann/ops-ras, ``reliability/matmul_abft_verify``;
Atlas A2 and A3) as ``torch.ops.npu._npu_matmul_abft_verify(a, b, c, checksum_weight, *, e_max=0.001)`` and
calls it from ``torch_npu.matmul_checksum`` with an all-ones weight. It checks ``c`` = ``a`` @ ``b`` by row
checksums over column segments of 256: for row i and segment j, the observed sum of c's row segment against
``a[i] @ BE[:, j]`` (BE, b's segment summed with the weight, held in the input dtype as the kernel does), with
a threshold the kernel adapts to each row's and segment's spread (the formula is the kernel's, read from
``tile_threshold_robust.hpp`` and ``op_host/matmul_abft_verify_tiling.cpp``: ``e' = e_max * 6 *
sqrt(K / 1024)``; no absolute floor). The result is one bit per (row, segment), 1 where the row is correct,
packed eight rows to a byte, LSB first: ``comp_row[j * ceil(M/8) + i // 8]`` bit ``i % 8``; bits of rows past
M are left 0 here (the kernel leaves them undefined). A NaN or inf fails the comparison, so it is flagged.

Contract as the op's doc and meta state it: ``a`` [M, K] and ``b`` [K, N] of one dtype (bf16, fp16 or fp32),
``c`` [M, N] fp32, ``checksum_weight`` [N] of a's dtype. The kernel sums c's segment without the weight (the
weight is applied on b's side only), so only an all-ones weight is self-consistent; this follows the kernel.
"""

from __future__ import annotations

import math

import torch

SEGMENT = 256  # columns per checksum segment (the kernel's splitN = ceil(N / 256))
ROWS_PER_BYTE = 8
ROUNDING_SIGMAS = 8.0  # the torch check's allowance for the rounding of a half-precision result


def segments_of(tensor_RN: torch.Tensor, fill: float) -> torch.Tensor:
    """[R, N] as [R, S, SEGMENT], the last segment padded with ``fill``."""
    rows, columns = tensor_RN.shape
    count = math.ceil(columns / SEGMENT)
    if columns % SEGMENT == 0:
        return tensor_RN.reshape(rows, count, SEGMENT)
    padded = torch.nn.functional.pad(tensor_RN, (0, count * SEGMENT - columns), value=fill)
    return padded.view(rows, count, SEGMENT)


def _npu_matmul_abft_verify(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, checksum_weight: torch.Tensor,
                            *, e_max: float = 0.001) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2 or c.dim() != 2 or a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"_npu_matmul_abft_verify: a [M, K], b [K, N], c [M, N] expected, got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(c.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or c.dtype != torch.float32:
        raise TypeError(f"_npu_matmul_abft_verify: a and b of one dtype (bf16, fp16, fp32) and c fp32 expected, got "
                        f"{a.dtype}, {b.dtype}, {c.dtype}")
    # the reference checksum uses BE as the cube unit reads it: in the input dtype
    return pack_rows(abft_correct(a, b, c, checksum_weight, e_max, encoded_dtype=a.dtype, judge_nonfinite=True))


def abft_correct(a, b, c, checksum_weight, e_max: float, encoded_dtype=torch.float32,
                 output_unit: float = 0.0, judge_nonfinite: bool = False) -> torch.Tensor:
    """V-ABFT's verdicts, [S, M] bool (True: correct). ``encoded_dtype``: the dtype BE is rounded to before the
    reference product (the kernel: the input dtype). ``output_unit``: the unit roundoff of the dtype c was
    rounded to, whose rounding the threshold then also admits (the kernel: 0, it takes c in fp32).
    ``judge_nonfinite``: a row whose reference checksum is not finite (its operands are not) fails, as in the
    kernel, instead of being left unjudged (True: correct)."""
    inner = a.shape[1]
    b32_KN = b.float()
    weighted_KN = b32_KN if checksum_weight is None else b32_KN * checksum_weight.float()
    encoded_KS, widths_S, b_mean_abs_S, b_mean_sq_S, b_spread_S = segment_stats(b32_KN, weighted_KN)
    a32_MK = a.float()
    encoded_ref_KS = encoded_KS if encoded_dtype == torch.float32 else encoded_KS.to(encoded_dtype).float()
    expected_MS = a32_MK @ encoded_ref_KS
    a_mean_M1, a_spread_M1 = row_stats(a32_MK)
    threshold_MS = abft_threshold(inner, widths_S, a_mean_M1, a_spread_M1, b_mean_abs_S, b_mean_sq_S, b_spread_S,
                                  e_max)
    c_MSW = segments_of(c.float(), 0.0)
    correct_MS = judge(c_MSW, expected_MS, threshold_MS, output_unit)
    if judge_nonfinite:
        return correct_MS.t()
    return (correct_MS | ~torch.isfinite(expected_MS)).t()


def segment_stats(b32_KN: torch.Tensor, weighted_KN: torch.Tensor | None = None):
    """The B side of V-ABFT for ``b32_KN`` [..., K, N] (fp32; leading dims batch): BE [..., K, S] (the segments'
    sums, of ``weighted_KN`` where given), the segments' widths [S], and per segment [..., S] the mean absolute
    value, the mean square and the spread of its scaled rows, as the kernel's threshold takes them."""
    *batch, inner, columns = b32_KN.shape
    flat_RN = b32_KN.reshape(-1, columns)
    weighted_RN = flat_RN if weighted_KN is None else weighted_KN.reshape(-1, columns)
    count = math.ceil(columns / SEGMENT)
    encoded_KS = segments_of(weighted_RN, 0.0).sum(-1).view(*batch, inner, count)
    b_max_KS = segments_of(flat_RN, -math.inf).amax(-1).view(*batch, inner, count)
    b_min_KS = segments_of(flat_RN, math.inf).amin(-1).view(*batch, inner, count)
    widths_S = segment_widths(columns, b32_KN.device)
    scaled_KS = encoded_KS / widths_S
    b_mean_abs_S = scaled_KS.abs().sum(-2)
    b_mean_sq_S = (scaled_KS * scaled_KS).sum(-2)
    b_spread_S = ((b_max_KS - scaled_KS) * (scaled_KS - b_min_KS)).sum(-2).abs().sqrt()
    return encoded_KS, widths_S, b_mean_abs_S, b_mean_sq_S, b_spread_S


def segment_widths(columns: int, device) -> torch.Tensor:
    """The widths of the column segments of ``columns`` columns, [S] (the last one short), or, where every segment
    is whole, one 0-dim CPU tensor: a scalar to the device's operators."""
    if columns % SEGMENT == 0:
        return torch.tensor(float(SEGMENT))
    count = math.ceil(columns / SEGMENT)
    widths_S = torch.full((count,), float(SEGMENT), device=device)
    widths_S[-1] = columns - SEGMENT * (count - 1)
    return widths_S


def row_stats(a32_MK: torch.Tensor):
    """The A side of V-ABFT: each row's mean and spread, [M, 1] each."""
    a_mean_M1 = a32_MK.mean(1, keepdim=True)
    a_spread_M1 = ((a32_MK.amax(1, keepdim=True) - a_mean_M1) * (a_mean_M1 - a32_MK.amin(1, keepdim=True))).abs().sqrt()
    return a_mean_M1, a_spread_M1


def abft_threshold(inner, widths_S, a_mean, a_spread, b_mean_abs, b_mean_sq, b_spread, e_max: float):
    """The kernel's adaptive threshold per (row, segment), every argument broadcast to [M, S]; ``inner`` (K) a
    number or a tensor broadcast the same way."""
    scale = math.sqrt(inner / 1024.0) if isinstance(inner, (int, float)) else (inner / 1024.0).sqrt()
    e_scaled = e_max * 6.0 * scale
    return e_scaled * (
        widths_S * a_mean.abs() * b_mean_abs
        + (16.0 * widths_S * b_spread.square() * a_mean.square()
           + 16.0 * widths_S.square() * b_mean_sq * a_spread.square()).abs().sqrt()
        + widths_S.sqrt() * b_spread * a_spread)


def judge(c_MSW: torch.Tensor, expected_MS: torch.Tensor, threshold_MS: torch.Tensor, output_unit: float) -> torch.Tensor:
    """[M, S] True where the observed segment sums of ``c_MSW`` are within the threshold of the expected."""
    observed_MS = c_MSW.sum(-1)
    if output_unit:
        # each element of c is within output_unit |c| of the exact sum: the segment's sum within that times
        # sum |c| for certain, and within ROUNDING_SIGMAS standard deviations of independent roundings
        # (u |c| / sqrt(3) each) but for a chance below 1e-15
        certain_MS = output_unit * c_MSW.abs().sum(-1)
        likely_MS = ROUNDING_SIGMAS / math.sqrt(3.0) * output_unit * c_MSW.square().sum(-1).sqrt()
        threshold_MS = threshold_MS + torch.minimum(certain_MS, likely_MS)
    return (observed_MS - expected_MS).abs() - threshold_MS <= 0


def pack_rows(correct_SM: torch.Tensor) -> torch.Tensor:
    """[S, M] verdicts as the kernel's ``comp_row``: eight rows to a byte, LSB first, segment-major."""
    segments, rows = correct_SM.shape
    row_bytes = math.ceil(rows / ROWS_PER_BYTE)
    padded_SR = torch.nn.functional.pad(correct_SM, (0, row_bytes * ROWS_PER_BYTE - rows), value=False)
    weights = torch.tensor([1 << bit for bit in range(ROWS_PER_BYTE)], dtype=torch.int32, device=correct_SM.device)
    packed = (padded_SR.view(segments, row_bytes, ROWS_PER_BYTE).to(torch.int32) * weights).sum(-1)
    return packed.to(torch.uint8).reshape(-1)

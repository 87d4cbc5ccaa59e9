"""The selftest's comparison: one row per (case, dtype), device tensors against the reference's.

Shared by the single-device cases (:mod:`npu_inject.commands.selftest`) and the collective ones
(:mod:`npu_inject.commands.selftest_mc2`): the seed, the tolerances, the row a case produces and the
one loop that compares its (name, device, reference) tensor pairs into that row.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

SEED = 1234
# (rtol, atol) per dtype for |device - reference| <= atol + rtol * |reference|, elementwise.
# The reference computes half precision in float32 and rounds once; a device kernel may
# accumulate in another order, so bf16 allows a few units in the last place (2^-8).
TOLERANCES = {"float32": (1e-4, 1e-5), "bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3)}
ALL_DTYPES = tuple(TOLERANCES)


@dataclass
class Row:
    case: str
    dtype: str
    status: str  # PASS, MISMATCH, ERROR, SKIP; FAIL: a SKIP that EXPECTED_SKIPS does not list
    worst: float = 0.0  # largest |dev - ref| / (atol + rtol |ref|) over compared tensors
    max_abs: float = 0.0
    detail: str = ""
    compared: list[str] = field(default_factory=list)


def compare_tensors(name: str, device_value, reference_value, dtype: str, scale: float) -> tuple[float, float, str]:
    """(worst bound ratio, max abs error, problem or '') for one tensor pair."""
    import torch

    got = device_value.detach().cpu()
    want = reference_value.detach().cpu()
    if got.shape != want.shape:
        return math.inf, math.inf, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    if not want.is_floating_point():
        equal = torch.equal(got, want)
        return (0.0 if equal else math.inf), (0.0 if equal else math.inf), ("" if equal else f"{name}: integers differ")
    rtol, atol = TOLERANCES[dtype]
    got64, want64 = got.double(), want.double()
    same_nonfinite = (~torch.isfinite(want64)) & (got64 == want64)
    error = (got64 - want64).abs().masked_fill(same_nonfinite, 0.0).nan_to_num(math.inf)
    bound = scale * (atol + rtol * want64.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0))
    ratio = float((error / bound).max()) if error.numel() else 0.0
    max_abs = float(error.max()) if error.numel() else 0.0
    return ratio, max_abs, ("" if ratio <= 1.0 else f"{name}: max |err| {max_abs:.3g}, {ratio:.2f}x the tolerance")


def compare_into(row: Row, pairs: Iterable[tuple[str, Any, Any]], scale: float, where: str = "") -> Row:
    """Compare each (name, device tensor, reference tensor) pair in ``row.dtype``'s tolerance times ``scale``:
    the row's worst ratio and error, what it compared, and MISMATCH with every problem (each prefixed
    by ``where``, e.g. the rank) when any pair is off."""
    problems = []
    for name, got, want in pairs:
        ratio, max_abs, problem = compare_tensors(name, got, want, row.dtype, scale)
        row.worst, row.max_abs = max(row.worst, ratio), max(row.max_abs, max_abs)
        row.compared.append(name)
        if problem:
            problems.append(f"{where}{problem}")
    if problems:
        row.status, row.detail = "MISMATCH", "; ".join(problems)
    return row

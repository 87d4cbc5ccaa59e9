"""``npu-inject selftest``: every torch_npu kernel npu_inject calls, on the device, against the reference.

A kit for the first session on a real NPU: each case calls one torch_npu op with the
arguments a patch passes (``npu_inject/ops/*.py``), on the device, and the same op of
``npu_inject.ops.reference`` (plain PyTorch following torch_npu's documented semantics) on
the host with the same inputs, forward and -- where torch_npu registers autograd for the
op -- backward. Outputs and gradients must agree within the dtype's tolerance
(``TOLERANCES``, scaled per case; :mod:`npu_inject.commands.selftest_compare` compares). It
prints one row per (case, dtype), the counts, and exits 2 when any row mismatches, fails, or
skips without being expected to.

On the simulated NPU (verification/sim_npu) the device ops *are* the reference kernels run on
the simulated device, so a pass proves the harness (inputs, transfers, comparisons), not
Ascend's kernels; the output says so.

Adding a case: append a ``Case`` to ``CASES`` with a ``make(dtype)`` that returns the
op's host arguments ``(args, kwargs)``. Float tensors in ``args`` (also inside lists)
take part in the backward when ``backward`` is set; ``outputs`` picks which outputs are
compared (integer outputs must match exactly). Inputs come from a generator seeded per
case, so every run sees the same numbers. A case that cannot run on a target SKIPs; only the
skips ``EXPECTED_SKIPS`` lists for that target, with their reason, pass.

The MC2 kernels (collective + GEMM) need a process group: their cases live in
:mod:`npu_inject.commands.selftest_mc2` and run on ``--ranks`` devices (default 2; 0 leaves them out).

Nothing here imports torch at import time (the CLI lists commands without torch).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

from npu_inject.commands.selftest_compare import ALL_DTYPES, SEED, TOLERANCES, Row, compare_into

EXIT_OK, EXIT_MISMATCH = 0, 2
SIMULATED_NOTE = (
    "SIMULATED NPU (verification/sim_npu): the device ops are npu_inject's reference kernels run on the "
    "simulated device. This run proves the harness, not Ascend's kernels: run it on a real NPU."
)


@dataclass(frozen=True)
class Case:
    """One kernel call as a patch makes it."""

    name: str  # what the row says: kernel, layout/mode
    op: str  # torch_npu attribute, also looked up in npu_inject.ops.reference
    make: Callable[[Any], tuple[tuple, dict]]  # dtype -> host (args, kwargs)
    outputs: tuple[int, ...] = (0,)  # indices into the flattened outputs to compare
    backward: bool = True  # torch_npu has autograd for the op: compare input gradients
    grad_outputs: tuple[int, ...] = (0,)  # outputs the backward flows from (kernel statistics carry none)
    host_reference: Callable[..., Any] | None = None  # independent math where the reference lacks the mode
    dtypes: tuple[str, ...] = ALL_DTYPES
    tolerance_scale: float = 1.0  # for long reductions (attention backward)
    used_by: str = ""  # which ops/ module calls it this way
    host_kwargs: tuple[str, ...] = ()  # tensor arguments torch_npu reads on the host: never moved to the device
    grad_kwargs: tuple[str, ...] = ()  # keyword tensors whose gradients are compared too (attention's sink)


# -- inputs ---------------------------------------------------------------------------------

def _randn(*shape, dtype, scale: float = 1.0):
    import torch

    return (torch.randn(*shape) * scale).to(dtype)


def _compressed_mask():
    from npu_inject.ops.attention import COMPRESSED_MASK_SIZE
    import torch

    ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool)
    return torch.triu(ones, diagonal=1)


B, L, N, N_KV, H = 2, 128, 4, 2, 64  # GQA: 2 key/value heads serve 4 query heads
WINDOW = 32
DOCUMENT_ENDS = [40, 128, 200, 256]  # cumulative ends over B*L = 256 packed tokens


def _sink(sink: bool) -> dict:
    import torch

    # gpt_oss's attention sinks: one float32 logit per query head, whatever the inputs' dtype.
    return {"sink": torch.randn(N, dtype=torch.float32)} if sink else {}


def _attention_bsnd(sparse: dict, sink: bool = False):
    def make(dtype):
        q, k, v = (_randn(B, L, heads, H, dtype=dtype) for heads in (N, N_KV, N_KV))
        kwargs = {"scale": 1.0 / math.sqrt(H), "atten_mask": _compressed_mask(), **sparse, **_sink(sink)}
        return (q, k, v, N, "BSND"), kwargs

    return make


def _attention_tnd(sparse: dict, lengths_as_tensor: bool = False, sink: bool = False):
    def make(dtype):
        import torch

        T = B * L
        q, k, v = (_randn(T, heads, H, dtype=dtype) for heads in (N, N_KV, N_KV))
        # v3 takes the lengths as a CPU int64 tensor (torch_npu reads it on the host), v1 as a list.
        ends = torch.tensor(DOCUMENT_ENDS, dtype=torch.int64) if lengths_as_tensor else DOCUMENT_ENDS
        kwargs = {"scale": 1.0 / math.sqrt(H), "atten_mask": _compressed_mask(),
                  "actual_seq_qlen": ends, "actual_seq_kvlen": ends, "softmax_layout": "TND", **sparse,
                  **_sink(sink)}
        return (q, k, v, N, "TND"), kwargs

    return make


E, ROWS, I_DIM, O_DIM = 4, 96, 64, 48
GROUP_ENDS = [20, 20, 70, 96]  # cumulative rows per expert; expert 1 gets none


def _gmm_along_m(dtype):
    import torch

    x = _randn(ROWS, I_DIM, dtype=dtype)
    w = _randn(E, I_DIM, O_DIM, dtype=dtype, scale=0.1)
    kwargs = {"group_list": torch.tensor(GROUP_ENDS, dtype=torch.int64), "group_list_type": 0,
              "group_type": 0, "split_item": 3}
    return ([x], [w]), kwargs


def _gmm_along_k(dtype):
    import torch

    # CANN's GroupedMatmul takes x transposed when group_type is 2 and x is one tensor (as ops/moe.py
    # passes x_RI.transpose(0, 1)); a row-major x is refused with 161002.
    x_IR = _randn(ROWS, I_DIM, dtype=dtype).transpose(0, 1)
    dy_RO = _randn(ROWS, O_DIM, dtype=dtype)
    kwargs = {"group_list": torch.tensor(GROUP_ENDS, dtype=torch.int64), "group_list_type": 0,
              "group_type": 2, "split_item": 3}
    return ([x_IR], [dy_RO]), kwargs


TOKENS, TOP_K, DIM = 32, 2, 64


def _topk_expert_ids():
    import torch

    return torch.rand(TOKENS, E).argsort(dim=1)[:, :TOP_K]  # distinct experts per token


def _permute(dtype):
    return (_randn(TOKENS, DIM, dtype=dtype), _topk_expert_ids()), {}


def _grouped_matmul_along_k_math(x, weight, *, group_list, **_):
    """out[g] = x[:, rows of g] @ weight[rows of g]: torch_npu's group_type=2, written out per group."""
    import torch

    (x_IR,), (y_RO,) = x, weight
    ends = group_list.tolist()
    starts = [0] + ends[:-1]
    return [torch.stack([x_IR[:, s:e].float() @ y_RO[s:e].float() for s, e in zip(starts, ends)]).to(x_IR.dtype)]


def _unpermute_with_probs(dtype):
    import torch

    row_of_slot = torch.randperm(TOKENS * TOP_K).to(torch.int32)
    probs = torch.rand(TOKENS, TOP_K).to(dtype)
    return (_randn(TOKENS * TOP_K, DIM, dtype=dtype), row_of_slot, probs), {}


def _unpermute_rows(dtype):
    import torch

    return (_randn(TOKENS, DIM, dtype=dtype), torch.randperm(TOKENS).to(torch.int32)), {}


def _rms_norm(dtype):
    return (_randn(B, L, DIM, dtype=dtype), 1.0 + _randn(DIM, dtype=dtype, scale=0.1)), {"epsilon": 1e-6}


def _rotary(mode: str):
    def make(dtype):
        import torch

        angles = torch.randn(1, L, 1, H // 2) * 3
        if mode == "half":
            angles = torch.cat([angles, angles], dim=-1)
        else:
            angles = angles.repeat_interleave(2, dim=-1)
        return (_randn(B, L, N, H, dtype=dtype), angles.cos().to(dtype), angles.sin().to(dtype)), \
            {"rotary_mode": mode}

    return make


def _swiglu(dtype):
    return (_randn(ROWS, 2, I_DIM, dtype=dtype),), {"dim": -2}


def _swiglu_stacked_first(dtype):
    return (_randn(2, ROWS, I_DIM, dtype=dtype),), {"dim": 0}


CASES: list[Case] = [
    Case("fusion_attention BSND causal (sparse_mode 2), GQA", "npu_fusion_attention",
         _attention_bsnd({"sparse_mode": 2}), outputs=(0, 1, 2), tolerance_scale=2.0, used_by="ops/attention.py"),
    Case("fusion_attention BSND sliding window (sparse_mode 4)", "npu_fusion_attention",
         _attention_bsnd({"sparse_mode": 4, "pre_tockens": WINDOW - 1, "next_tockens": 0}),
         outputs=(0, 1, 2), tolerance_scale=2.0, used_by="ops/attention.py"),
    Case("fusion_attention BSND full (sparse_mode 0, no mask)", "npu_fusion_attention",
         _attention_bsnd({"sparse_mode": 0, "atten_mask": None}), outputs=(0, 1, 2), tolerance_scale=2.0,
         used_by="ops/attention.py"),
    Case("fusion_attention TND documents (sparse_mode 3)", "npu_fusion_attention",
         _attention_tnd({"sparse_mode": 3}), outputs=(0, 1, 2), tolerance_scale=2.0, used_by="ops/cp.py"),
    Case("fusion_attention TND documents + window (sparse_mode 4)", "npu_fusion_attention",
         _attention_tnd({"sparse_mode": 4, "pre_tockens": WINDOW - 1, "next_tockens": 0}),
         outputs=(0, 1, 2), tolerance_scale=2.0, used_by="ops/cp.py"),
    Case("fusion_attention_v3 TND documents (sparse_mode 3), lengths as a CPU tensor", "npu_fusion_attention_v3",
         _attention_tnd({"sparse_mode": 3}, lengths_as_tensor=True), outputs=(0, 1, 2), tolerance_scale=2.0,
         used_by="ops/attention.py", host_kwargs=("actual_seq_qlen", "actual_seq_kvlen")),
    Case("fusion_attention_v3 TND documents + window (sparse_mode 4)", "npu_fusion_attention_v3",
         _attention_tnd({"sparse_mode": 4, "pre_tockens": WINDOW - 1, "next_tockens": 0}, lengths_as_tensor=True),
         outputs=(0, 1, 2), tolerance_scale=2.0, used_by="ops/attention.py",
         host_kwargs=("actual_seq_qlen", "actual_seq_kvlen")),
    Case("fusion_attention BSND sliding window + sink (gpt_oss)", "npu_fusion_attention",
         _attention_bsnd({"sparse_mode": 4, "pre_tockens": WINDOW - 1, "next_tockens": 0}, sink=True),
         outputs=(0, 1, 2), tolerance_scale=2.0, used_by="ops/attention.py", grad_kwargs=("sink",)),
    Case("fusion_attention_v3 TND documents (sparse_mode 3) + sink (gpt_oss)", "npu_fusion_attention_v3",
         _attention_tnd({"sparse_mode": 3}, lengths_as_tensor=True, sink=True), outputs=(0, 1, 2),
         tolerance_scale=2.0, used_by="ops/attention.py", host_kwargs=("actual_seq_qlen", "actual_seq_kvlen"),
         grad_kwargs=("sink",)),
    Case("grouped_matmul group_type 0 (experts forward, dx)", "npu_grouped_matmul", _gmm_along_m,
         backward=False, used_by="ops/moe.py"),
    Case("grouped_matmul group_type 2 (expert weight gradient)", "npu_grouped_matmul", _gmm_along_k,
         backward=False, host_reference=_grouped_matmul_along_k_math, used_by="ops/moe.py"),
    Case("moe_token_permute (top-k slots by expert)", "npu_moe_token_permute", _permute,
         outputs=(0, 1), used_by="ops/moe.py"),
    Case("moe_token_unpermute with probs (combine)", "npu_moe_token_unpermute", _unpermute_with_probs,
         used_by="ops/moe.py"),
    Case("moe_token_unpermute without probs (EP rows)", "npu_moe_token_unpermute", _unpermute_rows,
         used_by="ops/moe.py"),
    Case("rms_norm", "npu_rms_norm", _rms_norm, outputs=(0, 1), used_by="npu_inject/patches/rms_norm.py"),
    Case("rotary_mul half (CosSinRoPE)", "npu_rotary_mul", _rotary("half"), used_by="ops/rotary.py"),
    Case("rotary_mul interleave (ComplexRoPE)", "npu_rotary_mul", _rotary("interleave"), used_by="ops/rotary.py"),
    Case("swiglu dim -2 (gate, up stacked)", "npu_swiglu", _swiglu, used_by="ops/swiglu.py"),
    Case("swiglu dim 0 (the experts' gate, up stacked first)", "npu_swiglu", _swiglu_stacked_first,
         used_by="npu_inject/patches/swiglu.py"),
]

# Cases allowed to SKIP, per target ("simulated": verification/sim_npu's stand-in, "npu": a real NPU),
# with why. A SKIP not listed here fails the run: a case that newly skips (an op the stand-in
# dropped, a mode it no longer implements, a case without a reference) is a check lost, not passed.
EXPECTED_SKIPS: dict[str, dict[str, str]] = {
    "simulated": {},
    "npu": {},
}


# -- running one case ---------------------------------------------------------------------

def _flatten(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


def _map_tensors(value, fn):
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(item, fn) for item in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    return value


def run_case(case: Case, dtype_name: str, device, torch_npu, reference, simulated: bool = False,
             tolerance_scale: float = 1.0) -> Row:
    """Compare one case in one dtype. On the simulated NPU, what the stand-in does not
    offer (a missing op, a NotImplementedError) is a SKIP; on a real NPU it is an ERROR."""
    import torch

    device_op = getattr(torch_npu, case.op, None)
    reference_op = case.host_reference or getattr(reference, case.op, None)
    if reference_op is None:
        return Row(case.name, dtype_name, "SKIP", detail=f"npu_inject.ops.reference has no {case.op} yet")
    if device_op is None:
        status = "SKIP" if simulated else "ERROR"
        return Row(case.name, dtype_name, status, detail=f"torch_npu has no {case.op}")
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(SEED + CASES.index(case))
    args, kwargs = case.make(dtype)

    def leaf(tensor):
        copy = tensor.detach().clone()
        return copy.requires_grad_(case.backward and copy.is_floating_point())

    host_args = _map_tensors(args, leaf)
    device_args = _map_tensors(host_args, lambda t: t.detach().to(device).requires_grad_(t.requires_grad))
    host_kwargs = {name: leaf(value) if name in case.grad_kwargs else value for name, value in kwargs.items()}
    device_kwargs = {name: value if name in case.host_kwargs else
                     _map_tensors(value, lambda t: t.detach().to(device).requires_grad_(t.requires_grad))
                     for name, value in host_kwargs.items()}
    try:
        reference_out = _flatten(reference_op(*host_args, **host_kwargs))
    except Exception as exc:  # the host reference itself cannot run this case: the table says so
        return Row(case.name, dtype_name, "ERROR", detail=f"host reference: {type(exc).__name__}: {exc}"[:160])
    try:
        device_out = _flatten(device_op(*device_args, **device_kwargs))
    except NotImplementedError as exc:
        status = "SKIP" if simulated else "ERROR"
        return Row(case.name, dtype_name, status, detail=f"device: NotImplementedError: {exc}".splitlines()[0][:160])
    except Exception as exc:  # a kernel that rejects the call is a finding, reported in its row
        return Row(case.name, dtype_name, "ERROR", detail=f"device: {type(exc).__name__}: {exc}".splitlines()[0][:160])
    pairs = [(f"out{i}", device_out[i], reference_out[i]) for i in case.outputs]
    if case.backward:
        host_leaves = [t for t in _flatten(host_args) if isinstance(t, torch.Tensor) and t.requires_grad]
        device_leaves = [t for t in _flatten(device_args) if isinstance(t, torch.Tensor) and t.requires_grad]
        host_leaves += [host_kwargs[name] for name in case.grad_kwargs]
        device_leaves += [device_kwargs[name] for name in case.grad_kwargs]
        float_outputs = list(case.grad_outputs)
        weights = [torch.randn(reference_out[i].shape) for i in float_outputs]
        try:
            reference_loss = sum((reference_out[i].float() * w).sum() for i, w in zip(float_outputs, weights))
            device_loss = sum((device_out[i].float() * w.to(device)).sum() for i, w in zip(float_outputs, weights))
            reference_grads = torch.autograd.grad(reference_loss, host_leaves, allow_unused=True)
            device_grads = torch.autograd.grad(device_loss, device_leaves, allow_unused=True)
        except Exception as exc:  # as above: a backward the device cannot run is this row's finding
            return Row(case.name, dtype_name, "ERROR", detail=f"backward: {type(exc).__name__}: {exc}".splitlines()[0][:160])
        for number, (got, want) in enumerate(zip(device_grads, reference_grads)):
            if want is None and got is None:
                continue
            if want is None or got is None:
                return Row(case.name, dtype_name, "MISMATCH", math.inf, math.inf,
                           f"grad{number}: one side has no gradient")
            pairs.append((f"grad{number}", got, want))
    return compare_into(Row(case.name, dtype_name, "PASS"), pairs, case.tolerance_scale * tolerance_scale)


# -- the command ------------------------------------------------------------------------

def _print_table(rows: list[Row]) -> None:
    width = max(len(row.case) for row in rows)
    print(f"{'case':{width}}  {'dtype':8}  {'result':8}  {'worst/tol':>9}  {'max|err|':>9}  compared / detail")
    for row in rows:
        worst = "-" if row.status in ("SKIP", "ERROR", "FAIL") else f"{row.worst:9.3f}"
        max_abs = "-" if row.status in ("SKIP", "ERROR", "FAIL") else f"{row.max_abs:9.2e}"
        detail = row.detail or ",".join(row.compared)
        print(f"{row.case:{width}}  {row.dtype:8}  {row.status:8}  {worst:>9}  {max_abs:>9}  {detail}")


def cmd_selftest(args) -> int:
    try:
        import torch
        import torch_npu
    except ImportError as exc:
        print(f"npu-inject selftest: cannot import torch_npu ({exc}). It needs Ascend's CANN and torch_npu; "
              "to try the harness on the simulated NPU, build verification/sim_npu and set its environment "
              "(python -c 'from verification.sim_npu import shell_exports; print(shell_exports())').",
              file=sys.stderr)
        return EXIT_MISMATCH
    from npu_inject.ops import reference

    device = torch.device(args.device)
    simulated = bool(getattr(torch_npu, "__simulated__", False))
    print(f"npu-inject selftest on {device} ({torch.npu.get_device_name(device.index or 0)}), "
          f"torch {torch.__version__}, torch_npu {getattr(torch_npu, '__version__', '?')}")
    if simulated:
        print(SIMULATED_NOTE)
    dtypes = args.dtype.split(",") if args.dtype else list(ALL_DTYPES)
    unknown = [name for name in dtypes if name not in TOLERANCES]
    if unknown:
        print(f"npu-inject selftest: unknown --dtype {', '.join(unknown)}; choose from {', '.join(ALL_DTYPES)}",
              file=sys.stderr)
        return EXIT_MISMATCH
    cases = [case for case in CASES if not args.case or args.case.lower() in case.name.lower()]
    if args.ranks < 0 or args.ranks == 1:
        print(f"npu-inject selftest: --ranks must be 0 (no collective cases) or 2 or more, got {args.ranks}",
              file=sys.stderr)
        return EXIT_MISMATCH
    if not cases and not (args.ranks and _collective_case_matches(args.case)):
        print(f"npu-inject selftest: no case matches {args.case!r}", file=sys.stderr)
        return EXIT_MISMATCH
    if args.tolerance_scale <= 0:
        print(f"npu-inject selftest: --tolerance-scale must be > 0, got {args.tolerance_scale}", file=sys.stderr)
        return EXIT_MISMATCH
    rows = [run_case(case, dtype, device, torch_npu, reference, simulated, args.tolerance_scale)
            for case in cases for dtype in dtypes if dtype in case.dtypes]
    if args.ranks:
        from npu_inject.commands import selftest_mc2

        collective = [case for case in selftest_mc2.CASES if not args.case or args.case.lower() in case.name.lower()]
        if collective:
            rows += selftest_mc2.run_all(args.ranks, dtypes, args.tolerance_scale, collective)
    if not rows:
        print(f"npu-inject selftest: no case runs in --dtype {','.join(dtypes)}", file=sys.stderr)
        return EXIT_MISMATCH
    target = "simulated" if simulated else "npu"
    rows = fail_unexpected_skips(rows, target)
    _print_table(rows)
    counts = {status: sum(row.status == status for row in rows) for status in ("PASS", "SKIP")}
    failed = len(rows) - counts["PASS"] - counts["SKIP"]
    for case in dict.fromkeys(row.case for row in rows if row.status == "SKIP"):
        print(f"expected SKIP on target {target}: {case}: {EXPECTED_SKIPS[target][case]}")
    for case in dict.fromkeys(row.case for row in rows if row.status != "SKIP" and row.case in EXPECTED_SKIPS[target]):
        print(f"note: {case} ran, though EXPECTED_SKIPS[{target!r}] (npu_inject/commands/selftest.py) lists it: "
              "remove it from that list")
    print(f"{counts['PASS']} PASS, {counts['SKIP']} SKIP, {failed} FAIL "
          f"(tolerances rtol/atol: " + ", ".join(f"{d} {r:g}/{a:g}" for d, (r, a) in TOLERANCES.items())
          + (f", scaled x{args.tolerance_scale:g}" if args.tolerance_scale != 1 else "") + ")")
    if simulated:
        print("(simulated NPU: harness check only)")
    return EXIT_MISMATCH if failed else EXIT_OK


def _collective_case_matches(text: str | None) -> bool:
    from npu_inject.commands import selftest_mc2

    return any(not text or text.lower() in case.name.lower() for case in selftest_mc2.CASES)


def fail_unexpected_skips(rows: list[Row], target: str) -> list[Row]:
    """The rows, a SKIP that ``EXPECTED_SKIPS[target]`` does not list turned into a FAIL saying so."""
    expected = EXPECTED_SKIPS[target]
    return [Row(row.case, row.dtype, "FAIL",
                detail=f"unexpected SKIP, not in EXPECTED_SKIPS[{target!r}]: {row.detail}"[:200])
            if row.status == "SKIP" and row.case not in expected else row
            for row in rows]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``selftest`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "selftest",
        help="run every torch_npu kernel npu_inject calls on the NPU against the host reference",
        description=(
            "Calls each torch_npu op the patches use (fusion attention in every mode, grouped matmul "
            "incl. group_type 2, MoE permute/unpermute, rms_norm, rotary_mul, swiglu; the MC2 "
            "collective+GEMM kernels on --ranks devices) "
            "on the device and npu_inject's reference on the host, forward and backward, and compares "
            "them with per-dtype tolerances. Prints a table and the counts (N PASS, M SKIP, K FAIL); "
            "exit 0 when all agree, 2 on a mismatch, an error, or a SKIP that the target's list of "
            "expected skips (EXPECTED_SKIPS) does not hold. On the simulated NPU it checks the harness "
            "only, and says so."
        ),
    )
    parser.add_argument("--device", default="npu:0", help="device to test (default npu:0)")
    parser.add_argument("--dtype", default=None,
                        help=f"comma-separated dtypes (default all: {','.join(ALL_DTYPES)})")
    parser.add_argument("--case", default=None, help="only cases whose name contains this text")
    parser.add_argument("--ranks", type=int, default=2,
                        help="devices (one process each, hccl) for the MC2 collective cases (default 2; 0: leave "
                             "them out; they run in bfloat16 and float16 only)")
    parser.add_argument("--tolerance-scale", type=float, default=1.0,
                        help="multiply every tolerance (default 1); the worst/tol column shows how far off a row is")
    parser.set_defaults(run=cmd_selftest)
    return parser

"""The real torch_npu 2.14.0 wheel on the CANN emulation (verification/cann_emu, issue 20).

Every check runs in a child process of the emulation's venv (``.venv-cann``, or ``$CANN_EMU_VENV``)
under ``cann_env`` (tests/support/cann_emu_child.py); the tests skip, saying why, when that venv or the
built libraries are absent (make both with ``bash verification/cann_emu/setup.sh``; tests/cann_emu/conftest.py). Expected values come from plain CPU
PyTorch math or from CANN's documents, never from the emulation itself.

    .venv-cann/bin/python -m pytest -m cann_emu tests/cann_emu
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cann_emu_child import PYTHON, REPO, child_json
from verification.cann_emu import BUILD_DIR


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> dict:
    """One child process: import, device set-up, tensors, aclnn operators, the expected failures;
    "counts" holds the operator counts the emulation wrote when the child exited (CANN_EMU_COUNTS)."""
    counts = tmp_path_factory.mktemp("cann_emu") / "counts.json"
    out = child_json(
        """
        import json, os, sysconfig
        import torch, torch_npu
        out = {"file": torch_npu.__file__, "version": torch_npu.__version__,
               "purelib": sysconfig.get_paths()["purelib"], "count": torch.npu.device_count()}
        x = torch.ones(4, device="npu")
        out["ones"] = x.cpu().tolist()
        out["allocated"] = torch.npu.memory_allocated()
        torch.npu.synchronize()
        out["name"] = torch.npu.get_device_name(0)
        free, total = torch.npu.mem_get_info()
        out["total"] = total
        a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        b = torch.tensor([10.0, 20.0, 30.0])
        out["add"] = torch.add(a.npu(), b.npu(), alpha=2).cpu().tolist()
        out["add_expected"] = torch.add(a, b, alpha=2).tolist()
        out["add_bf16"] = (a.npu().bfloat16() + b.npu().bfloat16()).float().cpu().tolist()
        out["add_bf16_expected"] = (a.bfloat16() + b.bfloat16()).float().tolist()
        # UINT32 is in aclnnInplaceFillScalar's list (CANN's current document), FLOAT8_E4M3FN is not.
        out["fill_uint32"] = torch.empty(3, dtype=torch.uint32, device="npu").fill_(5).cpu().long().tolist()
        try:
            torch.empty(3, dtype=torch.float8_e4m3fn, device="npu").fill_(5)
            out["float8"] = "no error"
        except RuntimeError as error:
            out["float8"] = str(error)
        torch.manual_seed(0)
        linear = torch.nn.Linear(8, 4)
        x = torch.randn(2, 8)
        out["linear_expected"] = linear(x).tolist()
        out["linear"] = linear.npu()(x.npu()).cpu().tolist()
        out["mul"] = torch.mul(a.npu(), b.npu()).cpu().tolist()
        out["mul_expected"] = torch.mul(a, b).tolist()
        # rsub: scalar - tensor (aclnnRsubs; torch's CP load balancer computes 2 * world - 1 - index) and
        # tensor - alpha * tensor (aclnnRsub), integer and float
        index = torch.arange(4)
        out["rsubs"] = [(7 - index.npu()).cpu().tolist(), torch.rsub(a.npu(), 1.5, alpha=2).cpu().tolist()]
        out["rsubs_expected"] = [(7 - index).tolist(), torch.rsub(a, 1.5, alpha=2).tolist()]
        out["rsub"] = torch.rsub(a.npu(), b.npu(), alpha=3).cpu().tolist()
        out["rsub_expected"] = torch.rsub(a, b, alpha=3).tolist()
        # torch.randint / Tensor.random_ (aclnnInplaceRandom): [low, high - 1], the CPU generator's numbers for
        # the same seed (the emulation's documented stand-in for Ascend's Philox stream)
        torch.manual_seed(7)
        out["randint"] = [torch.randint(3, 10, (64,), device="npu").cpu().tolist(),
                          torch.empty(16, dtype=torch.bfloat16, device="npu").random_(0, 4).float().cpu().tolist()]
        torch.manual_seed(7)
        out["randint_expected"] = [torch.randint(3, 10, (64,)).tolist(),
                                   torch.empty(16, dtype=torch.bfloat16).random_(0, 4).float().tolist()]
        # upstream's RoPE precompute and rotation (the rotary patch off): ~, torch.polar, a complex multiply
        angle = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 3
        out["complex"] = [(~(angle.npu() < 1)).cpu().tolist(),
                          torch.view_as_real(torch.polar(torch.ones_like(angle).npu(), angle.npu())).cpu().tolist(),
                          torch.view_as_real(torch.view_as_complex(a.npu().reshape(3, 2)) *
                                             torch.polar(torch.ones(3).npu(), angle[0].npu())).cpu().tolist()]
        out["complex_expected"] = [(~(angle < 1)).tolist(),
                                   torch.view_as_real(torch.polar(torch.ones_like(angle), angle)).tolist(),
                                   torch.view_as_real(torch.view_as_complex(a.reshape(3, 2)) *
                                                      torch.polar(torch.ones(3), angle[0])).tolist()]
        # torch's AdamW moments: Tensor.lerp_ (aclnnInplaceLerps) and torch._foreach_lerp_ (aclnnForeachLerpScalar)
        start, end = torch.arange(4.0), torch.full((4,), 10.0)
        lerped = [start.npu().lerp_(end.npu(), 0.25)]
        moments = [start.npu(), end.npu()]
        torch._foreach_lerp_(moments, [end.npu(), start.npu()], 0.5)
        out["lerp"] = [t.cpu().tolist() for t in lerped + moments]
        out["lerp_expected"] = [start.clone().lerp_(end, 0.25).tolist(), start.lerp(end, 0.5).tolist(),
                                end.lerp(start, 0.5).tolist()]
        # torch.nn.functional.layer_norm forward and backward (aclnnLayerNorm, aclnnLayerNormBackward: qwen3_5's
        # vision blocks), torch.searchsorted (aclnnSearchSorted: gpt_oss), torch.linspace (aclnnLinspace: muse_glimmer)
        torch.manual_seed(3)
        x, w, bias, dy = torch.randn(2, 3, 8), torch.randn(8), torch.randn(8), torch.randn(2, 3, 8)
        def layer_norm_grads(device):
            leaves = [t.to(device).requires_grad_() for t in (x, w, bias)]
            y = torch.nn.functional.layer_norm(leaves[0], (8,), leaves[1], leaves[2], 1e-5)
            y.backward(dy.to(device))
            return [y.detach().cpu().tolist()] + [leaf.grad.cpu().tolist() for leaf in leaves]
        out["layer_norm"], out["layer_norm_expected"] = layer_norm_grads("npu"), layer_norm_grads("cpu")
        edges, values = torch.tensor([[0.0, 1.0, 2.0, 4.0]]), torch.tensor([[-1.0, 1.0, 1.5, 4.0, 9.0]])
        def searched(device):
            return [torch.searchsorted(edges.to(device), values.to(device), right=right, out_int32=int32).cpu().tolist()
                    for right in (False, True) for int32 in (False, True)]
        out["searchsorted"], out["searchsorted_expected"] = searched("npu"), searched("cpu")
        grid = torch.tensor([[1, 2, 3], [4, 5, 6]])  # aclnnProdDim: qwen3_5's vision grid sizes
        out["prod"] = [torch.prod(grid.npu(), 1).cpu().tolist(), torch.prod(grid.float().npu(), 0, keepdim=True).cpu().tolist()]
        out["prod_expected"] = [torch.prod(grid, 1).tolist(), torch.prod(grid.float(), 0, keepdim=True).tolist()]
        scores = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 5  # aclnnLogSumExp: gpt_oss's sinks
        out["logsumexp"] = torch.logsumexp(scores.npu(), dim=-1).cpu().tolist()
        out["logsumexp_expected"] = torch.logsumexp(scores, dim=-1).tolist()
        out["linspace"] = torch.linspace(-1, 2, 7, device="npu").cpu().tolist()
        out["linspace_expected"] = torch.linspace(-1, 2, 7).tolist()
        try:
            a.npu().erfinv()
            out["erfinv"] = "no error"
        except RuntimeError as error:
            out["erfinv"] = str(error)
        torch.npu.set_device(1)
        y = torch.ones(1000, device="npu:1")
        out["allocated_1"] = torch.npu.memory_allocated(1)
        print(json.dumps(out))
        """,
        devices=2,
        extra_env={"CANN_EMU_COUNTS": str(counts)},
    )
    out["counts"] = json.loads(counts.read_text())
    return out


@pytest.fixture(scope="module")
def later_operators(tmp_path_factory) -> dict:
    """A second child (the first one's operator counts stay as its tests state them): operators the suite's
    model families reached later, and the model scopes the step marks use; "counts" as in ``session``."""
    counts = tmp_path_factory.mktemp("cann_emu") / "counts.json"
    out = child_json(
        """
        import json
        import torch, torch_npu
        out = {}
        torch.manual_seed(3)
        scores = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 5
        # softplus forward and backward (aclnnSoftplus, aclnnSoftplusBackward: qwen3_5's linear attention; beta and
        # threshold chosen so both branches run), nan_to_num (aclnnNanToNum, aclnnInplaceNanToNum: gpt_oss),
        # grid_sample forward and backward (aclnnGridSampler2D, aclnnGridSampler2DBackward: muse_glimmer)
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5])
        image, sample_at = torch.randn(1, 2, 4, 5), torch.rand(1, 3, 3, 2) * 2.4 - 1.2
        def resized(device):
            results = []
            for align in (False, True):
                leaf = image.to(device, copy=True).requires_grad_()
                z = torch.nn.functional.interpolate(leaf, size=(3, 7), mode="bilinear", align_corners=align)
                (z * torch.arange(z.numel(), dtype=z.dtype, device=device).reshape(z.shape)).sum().backward()
                results.append([z.detach().cpu().tolist(), leaf.grad.cpu().tolist()])
            return results
        def activations(device):
            leaf = scores.to(device, copy=True).requires_grad_()  # copy: on the CPU .to() is the same tensor
            y = torch.nn.functional.softplus(leaf - 1, beta=2.0, threshold=1.0)
            y.backward(torch.ones_like(y))
            cleaned = special.to(device).clone().nan_to_num_(nan=0.5)
            sampled = []
            for mode, padding in (("bilinear", "zeros"), ("nearest", "border"), ("bilinear", "reflection")):
                leaves = [image.to(device, copy=True).requires_grad_(), sample_at.to(device, copy=True).requires_grad_()]
                z = torch.nn.functional.grid_sample(*leaves, mode=mode, padding_mode=padding, align_corners=False)
                z.backward(torch.ones_like(z))
                sampled.append([z.detach().cpu().tolist()] + [leaf.grad.cpu().tolist() for leaf in leaves])
            return {"softplus": [y.detach().cpu().tolist(), leaf.grad.cpu().tolist()],
                    "nan_to_num": [torch.nan_to_num(special.to(device), posinf=9.0).cpu().tolist(),
                                   cleaned.cpu().tolist()],
                    "grid_sample": sampled,
                    # bilinear resize forward and backward (aclnnUpsampleBilinear2d(BackwardV2): qwen3_5's vision
                    # position embeddings), both corner modes
                    "upsample": resized(device),
                    # torch.isfinite (aclnnIsFinite: gpt_oss's gradient clipping checks)
                    "isfinite": torch.isfinite(special.to(device)).cpu().tolist(),
                    # torch.eye (aclnnEye: qwen3_5), torch.addcmul (aclnnAddcmul: gpt_oss), broadcast
                    "eye_addcmul": [torch.eye(3, 4, device=device).cpu().tolist(),
                                    torch.addcmul(scores.to(device), scores[0].to(device), scores[:, :1].to(device),
                                                  value=0.5).cpu().tolist()]}
        out["activations"], out["activations_expected"] = activations("npu"), activations("cpu")
        # triangular solves (aclnnTriangularSolve: qwen3_5's gated delta net): upper and lower, transposed (torch's
        # triangular_solve, whose cloned coefficient is mOut), unitriangular, right-hand (torch_npu transposes both),
        # and batch dimensions that broadcast ((2, 1) against (3,)); the in-place logical and (aclnnInplaceLogicalAnd:
        # gpt_oss) on BOOL with a broadcast other and on FLOAT; boolean-mask indexing, whose indices come from
        # aclnnNonzeroV2's (rank, count) layout (muse_glimmer), with some, none and every element selected
        lower = torch.randn(4, 4).tril() + 4 * torch.eye(4)
        rhs, batched_a, batched_b = torch.randn(4, 3), torch.randn(2, 1, 4, 4) + 4 * torch.eye(4), torch.randn(3, 4, 2)
        flags, floats = torch.tensor([[True, False, True], [True, True, False]]), torch.tensor([[0.0, 2.0, -1.5]])
        masks = [torch.randn(3, 5) > 0, torch.randn(2, 3, 4) > 0.5, torch.zeros(2, 3, dtype=torch.bool),
                 torch.ones(2, 3, dtype=torch.bool)]
        def linalg(device):
            a, b = lower.to(device), rhs.to(device)
            solves = [torch.linalg.solve_triangular(a, b, upper=False), torch.linalg.solve_triangular(a.mT, b, upper=True),
                      torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True),
                      torch.linalg.solve_triangular(a, b.mT, upper=False, left=False),
                      torch.linalg.solve_triangular(batched_a.to(device).triu(), batched_b.to(device), upper=True)]
            solves += [part for upper in (True, False) for transpose in (False, True)
                       for part in torch.triangular_solve(b, (a.mT if upper else a), upper=upper, transpose=transpose)]
            anded = [flags.to(device, copy=True).logical_and_(flags[1].to(device, copy=True)),
                     floats.to(device, copy=True).logical_and_(floats.to(device) < 1)]
            picked = [torch.arange(m.numel(), dtype=torch.float32).reshape(m.shape).to(device)[m.to(device)] for m in masks]
            # qwen3_5's multimodal RoPE: columns picked behind a full slice, then rows by position, and written back
            # the same way (torch_npu passes the None slice as an empty tensor of the table's dtype)
            table, columns = torch.arange(24, dtype=torch.float32).reshape(6, 4).to(device), torch.tensor([1, 3])
            rows = torch.tensor([[5, 0, 2], [1, 1, 4]])
            picked_columns = table[:, columns.to(device)][rows.to(device)]
            written = torch.zeros(2, 3, 4, device=device)
            written[..., columns.to(device)] = picked_columns
            return {"solve": [t.cpu().tolist() for t in solves], "logical_and": [t.cpu().tolist() for t in anded],
                    "mask_index": [t.cpu().tolist() for t in picked],
                    "slice_index": [picked_columns.cpu().tolist(), written.cpu().tolist()]}
        out["linalg"], out["linalg_expected"] = linalg("npu"), linalg("cpu")
        try:  # unitriangular takes FLOAT only (the document), a DOUBLE solve with it fails in phase one
            torch.linalg.solve_triangular(lower.double().npu(), rhs.double().npu(), upper=False, unitriangular=True)
            out["unitriangular_double"] = "no error"
        except RuntimeError as error:
            out["unitriangular_double"] = str(error)
        # FLOAT16/BFLOAT16 matrix products (aclnnMm, aclnnBatchMatMul, aclnnMatmul, aclnnAddmm): the cube's FP32
        # accumulator rounded once, against CPU PyTorch's FP32 products of the same rounded inputs, rounded once
        def products(dtype):
            a, b, bias = torch.randn(33, 70).to(dtype), torch.randn(70, 17).to(dtype), torch.randn(17).to(dtype)
            left, right = torch.randn(3, 9, 40).to(dtype), torch.randn(3, 40, 5).to(dtype)
            got = [torch.mm(a.npu(), b.npu()), torch.bmm(left.npu(), right.npu()), torch.matmul(left.npu(), right[0].npu()),
                   torch.addmm(bias.npu(), a.npu(), b.npu())]
            f = lambda t: t.float()
            want = [f(a) @ f(b), torch.bmm(f(left), f(right)), f(left) @ f(right[0]), f(bias) + f(a) @ f(b)]
            # each element's distance from the expected one, in units of the dtype's spacing at the expected value
            spacing, rows = 2.0 ** -(7 if dtype == torch.bfloat16 else 10), []
            for g, w in zip(got, want):
                expected = f(w.to(dtype))
                steps = (f(g.cpu()) - expected).abs() / (expected.abs() * spacing).clamp_min(1e-30)
                rows.append([g.dtype == dtype, steps.max().item()])
            return rows
        out["half_products"] = {str(dtype): products(dtype) for dtype in (torch.bfloat16, torch.float16)}
        # model scopes (the step marks' cann_emu_mark_scope): 50 adds dispatched under "first" and not yet
        # synchronised when "second" is marked still count under "first" (the scope is read at GetWorkspaceSize)
        import ctypes
        mark_scope = ctypes.CDLL("libcann_emu.so").cann_emu_mark_scope
        mark_scope.argtypes = [ctypes.c_char_p]
        z = torch.zeros(64, device="npu")
        mark_scope(b"first")
        for _ in range(50):
            z = z + 1
        mark_scope(b"second")
        z = z * 2
        torch.npu.synchronize()
        mark_scope(b"")
        print(json.dumps(out))
        """,
        extra_env={"CANN_EMU_COUNTS": str(counts), "CANN_EMU_LAUNCH_SITES": "aclnnMuls"},
    )
    out["counts"] = json.loads(counts.read_text())
    return out


def test_the_wheel_from_pypi_is_what_imports(session):
    assert session["version"] == "2.14.0"
    assert Path(session["file"]).is_relative_to(Path(session["purelib"]))
    assert not Path(session["file"]).resolve().is_relative_to(REPO / "verification")


def test_installed_wheel_files_are_unmodified():
    """Every file pip installed from the wheel still has the hash the wheel's RECORD gives."""
    result = child_json(
        """
        import base64, hashlib, json
        from importlib.metadata import distribution
        dist = distribution("torch_npu")
        changed, checked = [], 0
        for f in dist.files:
            if not f.hash or f.hash.mode != "sha256":
                continue
            digest = base64.urlsafe_b64encode(hashlib.sha256(f.locate().read_bytes()).digest()).rstrip(b"=").decode()
            checked += 1
            if digest != f.hash.value:
                changed.append(str(f))
        print(json.dumps({"checked": checked, "changed": changed}))
        """
    )
    assert result["checked"] > 1000
    assert result["changed"] == []


def test_device_count_soc_and_capacity(session):
    assert session["count"] == 2
    assert session["name"] == "Ascend910B2"
    assert session["total"] == 64 * 2**30


def test_ones_on_npu_copy_back_memory_and_synchronize(session):
    assert session["ones"] == [1.0, 1.0, 1.0, 1.0]
    assert session["allocated"] >= 4 * 4  # the caching allocator rounds the 16 bytes up to a block
    assert session["allocated_1"] >= 1000 * 4


def test_aclnn_add_two_phases_through_torch_npu(session):
    assert session["add"] == session["add_expected"]
    assert session["add_bf16"] == session["add_bf16_expected"]


def test_operator_counts_are_the_calls_torch_npu_made(session):
    calls = session["counts"]["aclnn"]
    assert calls["aclnnAddmm"] == 1  # one nn.Linear forward
    assert calls["aclnnMul"] == 2  # torch.mul, and the complex multiply of upstream's RoPE
    assert calls["aclnnAdd"] >= 2  # torch.add twice (float32, bfloat16)
    assert calls["aclnnInplaceFillScalar"] == 1  # the UINT32 fill; the FLOAT8 one failed in phase one
    assert session["counts"]["aicpu"] == {}  # no operator of the table runs on AI CPU


def test_unsupported_dtype_fails_as_cann_with_the_operators_name(session):
    # FLOAT8_E4M3FN is outside aclnnInplaceFillScalar's Atlas A2 list, UINT32 inside (hicann/ops-math
    # conversion/fill/docs/aclnnInplaceFillScalar.md; its English page, older, lacked UINT16/32/64).
    assert "161002" in session["float8"]
    # CANN's text (opbase's OP_CHECK_DTYPE_NOT_SUPPORT under EZ1001), after the operator's name.
    assert ("aclnnInplaceFillScalar: AclNN_Parameter_Error(EZ1001): Tensor selfRef not implemented for "
            "DT_FLOAT8_E4M3FN, should be in dtype support list [DT_FLOAT,") in session["float8"]
    assert session["fill_uint32"] == [5, 5, 5]


def test_aten_backed_operators_through_torch_npu(session):
    """nn.Linear (aclnnAddmm) and torch.mul (aclnnMul), computed by ATen's CPU kernels on host buffers."""
    assert session["linear"] == session["linear_expected"]
    assert session["mul"] == session["mul_expected"]
    assert session["rsubs"] == session["rsubs_expected"]
    assert session["rsub"] == session["rsub_expected"]
    assert session["randint"] == session["randint_expected"]
    assert session["lerp"] == session["lerp_expected"]
    assert session["complex"] == session["complex_expected"]  # aclnnBitwiseNot, aclnnPolar, aclnnMul on COMPLEX64
    assert min(session["randint"][0]) >= 3 and max(session["randint"][0]) <= 9
    assert session["searchsorted"] == session["searchsorted_expected"]
    assert session["prod"] == session["prod_expected"]
    assert session["logsumexp"] == pytest.approx(session["logsumexp_expected"], rel=1e-6)
    assert session["linspace"] == pytest.approx(session["linspace_expected"], abs=1e-6)


def test_softplus_nan_to_num_and_grid_sample_through_torch_npu(later_operators):
    """aclnnSoftplus(Backward), aclnnNanToNum, aclnnInplaceNanToNum, aclnnGridSampler2D(Backward), aclnnEye,
    aclnnAddcmul, aclnnIsFinite, aclnnUpsampleBilinear2d(BackwardV2) against torch's CPU functions and autograd (float32; three interpolation/padding pairs)."""
    got, expected = later_operators["activations"], later_operators["activations_expected"]
    assert got["nan_to_num"] == expected["nan_to_num"]
    assert got["isfinite"] == expected["isfinite"] == [False, False, False, True]
    for (z, dz), (z_cpu, dz_cpu) in zip(got["upsample"], expected["upsample"]):
        assert torch.allclose(torch.tensor(z), torch.tensor(z_cpu), atol=1e-6)
        assert torch.allclose(torch.tensor(dz), torch.tensor(dz_cpu), atol=1e-5)
    assert got["eye_addcmul"] == expected["eye_addcmul"]
    pairs = list(zip(got["softplus"], expected["softplus"]))
    pairs += [pair for sampled in zip(got["grid_sample"], expected["grid_sample"]) for pair in zip(*sampled)]
    for index, (a, b) in enumerate(pairs):  # forward outputs, then gradients
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6), (index, a, b)


def test_half_precision_matrix_products_accumulate_in_fp32_and_round_once(later_operators):
    """mm, bmm, matmul and addmm in bf16 and fp16 through torch_npu: within one step of the dtype's spacing of
    CPU PyTorch's FP32 products rounded once (the summation order may differ; the rounding is one)."""
    for dtype, rows in later_operators["half_products"].items():
        for (same_dtype, steps), op in zip(rows, ("mm", "bmm", "matmul", "addmm")):
            assert same_dtype, (dtype, op)
            assert steps <= 1.0, (dtype, op, steps)


def test_triangular_solve_logical_and_and_mask_indexing_through_torch_npu(later_operators):
    """aclnnTriangularSolve (upper, lower, transposed, unitriangular, right-hand, broadcast batches; xOut and mOut),
    aclnnInplaceLogicalAnd and aclnnNonzeroV2 (through boolean-mask indexing) against torch's CPU functions."""
    got, expected = later_operators["linalg"], later_operators["linalg_expected"]
    assert len(got["solve"]) == 5 + 8
    for index, (a, b) in enumerate(zip(got["solve"], expected["solve"])):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6), (index, a, b)
    assert got["logical_and"] == expected["logical_and"]
    assert got["mask_index"] == expected["mask_index"]
    assert got["mask_index"][2] == [] and len(got["mask_index"][3]) == 6
    assert got["slice_index"] == expected["slice_index"]  # aclnnIndex / aclnnIndexPutImpl with a None slice
    error = later_operators["unitriangular_double"]
    assert "161002" in error and "aclnnTriangularSolve: with unitriangular" in error and "not DOUBLE" in error
    calls = later_operators["counts"]["aclnn"]
    assert calls["aclnnTriangularSolve"] == 5 + 4  # the DOUBLE one failed in phase one and was not launched
    assert calls["aclnnInplaceLogicalAnd"] == 2
    assert calls["aclnnNonzeroV2"] == 4
    # CANN runs MatrixTriangularSolve on AI CPU only (op_api triangular_solve.cpp); the audit counts it
    assert later_operators["counts"]["aicpu"] == {"aclnnTriangularSolve": 9}


def test_operators_count_under_the_scope_current_when_dispatched(later_operators):
    """With torch_npu's task queue on, an operator counts under the scope marked when it was dispatched (its
    GetWorkspaceSize), not when the queue launched it: what makes the audit's launches by model scope hold."""
    scopes = later_operators["counts"]["steps"]["outside steps"]["scope_ops"]
    assert scopes["first | aclnnAdds"] == 50
    assert scopes["second | aclnnMuls"] == 1
    assert not any(key.startswith("second | aclnnAdds") for key in scopes)


def test_launch_sites_name_the_python_line_that_prepared_the_operator(later_operators):
    """CANN_EMU_LAUNCH_SITES=aclnnMuls: the one multiply counts under its scope with the child's own line as its
    caller (owner "other": neither npu_inject nor torchtitan); the adds, not named, record no site."""
    sites = later_operators["counts"]["steps"]["outside steps"]["launch_sites"]
    (key,) = sites
    scope, operator, owner, caller, _via = key.split(" | ")
    assert (scope, operator, owner, sites[key]) == ("second", "aclnnMuls", "other", 1), key
    assert caller.startswith("<string>:") and caller.endswith(" <module>"), key


def test_layer_norm_forward_and_backward_through_torch_npu(session):
    """aclnnLayerNorm and aclnnLayerNormBackward against torch's CPU layer_norm and autograd (float32)."""
    for got, expected in zip(session["layer_norm"], session["layer_norm_expected"]):
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_unimplemented_operator_fails_loudly_by_name(session):
    assert "aclnnErfinv" in session["erfinv"]
    assert "not implemented by the CANN emulation" in session["erfinv"]


def test_out_of_memory_where_the_capacity_ends():
    result = child_json(
        """
        import json, torch, torch_npu
        try:
            torch.empty(2 * 1024**3, dtype=torch.uint8, device="npu")
            print(json.dumps({"error": None}))
        except torch.OutOfMemoryError as error:
            print(json.dumps({"error": str(error)}))
        """,
        memory_gb=1,
    )
    assert result["error"] and "NPU out of memory" in result["error"]


def test_two_phase_api_without_torch():
    """aclnnAdd straight through ctypes: GetWorkspaceSize, then execute, on host buffers."""
    result = child_json(
        f"""
        import ctypes, json, struct
        lib = ctypes.CDLL("{BUILD_DIR / 'libopapi.so'}")
        lib.aclCreateTensor.restype = ctypes.c_void_p
        lib.aclCreateScalar.restype = ctypes.c_void_p
        lib.aclGetRecentErrMsg.restype = ctypes.c_char_p
        assert lib.aclrtSetDevice(0) == 0
        def device(values):
            size = 4 * len(values)
            ptr = ctypes.c_void_p()
            assert lib.aclrtMalloc(ctypes.byref(ptr), ctypes.c_size_t(size), 0) == 0
            data = struct.pack(f"{{len(values)}}f", *values)
            assert lib.aclrtMemcpy(ptr, ctypes.c_size_t(size), data, ctypes.c_size_t(size), 1) == 0
            return ptr
        def tensor(ptr, shape, dtype):
            dims = (ctypes.c_int64 * len(shape))(*shape)
            return ctypes.c_void_p(lib.aclCreateTensor(dims, ctypes.c_uint64(len(shape)), dtype, None,
                                   ctypes.c_int64(0), 2, dims, ctypes.c_uint64(len(shape)), ptr))
        a, b, o = device([1, 2, 3, 4]), device([10, 20]), device([0, 0, 0, 0])
        alpha_value = ctypes.c_float(2.0)
        alpha = ctypes.c_void_p(lib.aclCreateScalar(ctypes.byref(alpha_value), 0))
        ws, ex = ctypes.c_uint64(7), ctypes.c_void_p()
        prepare = lib.aclnnAddGetWorkspaceSize(tensor(a, [2, 2], 0), tensor(b, [2], 0), alpha,
                                               tensor(o, [2, 2], 0), ctypes.byref(ws), ctypes.byref(ex))
        run = lib.aclnnAdd(None, ctypes.c_uint64(0), ex, None)
        host = ctypes.create_string_buffer(16)
        lib.aclrtMemcpy(host, ctypes.c_size_t(16), o, ctypes.c_size_t(16), 2)
        bad = lib.aclnnAddGetWorkspaceSize(tensor(a, [4], 8), tensor(a, [4], 8), alpha, tensor(o, [4], 8),
                                           ctypes.byref(ws), ctypes.byref(ex))
        bad_msg = lib.aclGetRecentErrMsg().decode()
        print(json.dumps({{"prepare": prepare, "workspace": ws.value, "run": run,
                          "out": struct.unpack("4f", host.raw), "bad": bad, "bad_msg": bad_msg}}))
        """
    )
    assert (result["prepare"], result["workspace"], result["run"]) == (0, 0, 0)
    assert result["out"] == [1 + 2 * 10, 2 + 2 * 20, 3 + 2 * 10, 4 + 2 * 20]
    # UINT32 is outside aclnnAdd's Atlas A2 list (hicann/ops-math aclnnAdd&aclnnInplaceAdd.md).
    assert result["bad"] == 161002 and "aclnnAdd" in result["bad_msg"]


def test_torch_symbols_the_wheel_needs_resolve_in_this_torch():
    result = subprocess.run([str(PYTHON), "verification/cann_emu/abi_check.py"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 unresolved" in result.stdout


def test_env_py_points_at_the_build_and_clears_the_stand_in():
    result = subprocess.run([str(PYTHON), "verification/cann_emu/env.py"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"export LD_LIBRARY_PATH={BUILD_DIR}" in result.stdout
    assert "TORCHTITAN_NPU_SIM" in result.stdout.splitlines()[0]  # the unset line


def test_op_table_lists_exactly_the_computed_operators():
    """op_table.json has a row for every aclnn operator the library computes, and no row without one."""
    sys.path.insert(0, str(REPO / "verification" / "cann_emu"))
    from build import load_op_table  # verification/cann_emu/build.py

    table = load_op_table()
    nm = subprocess.run(["nm", "-D", "--defined-only", str(BUILD_DIR / "libcann_emu.so")],
                        capture_output=True, text=True, check=True).stdout
    stubs = set((BUILD_DIR / "stub_names.txt").read_text().split())
    computed = {line.split()[-1] for line in nm.splitlines()
                if line.split()[-1].startswith("aclnn") and line.split()[-1] not in stubs}
    operators = {name for name in computed if not name.endswith("GetWorkspaceSize")}
    assert {f"{name}GetWorkspaceSize" for name in operators} <= computed
    assert operators == set(table)
    assert table["aclnnAdd"]["verified"] and table["aclnnAdd"]["engine"] == "AiCore"

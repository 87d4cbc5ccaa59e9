"""``npu-inject selftest``: the harness catches wrong outputs and wrong gradients, and runs on the simulated NPU.

The harness is exercised in this process with the host as "device" and a stand-in
kernel namespace whose ops are the reference ops, or the reference with an error put
in; the simulated-NPU run checks the command end to end (table, banner, exit status).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from npu_inject.commands import selftest
from npu_inject.ops import reference
from testkit import REPO, clean_env, sim_env

CPU = torch.device("cpu")


def _case(op: str) -> selftest.Case:
    return next(case for case in selftest.CASES if case.op == op)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


def test_reference_against_itself_passes_every_case_it_has():
    rows = {row.case: row for row in (selftest.run_case(case, "float32", CPU, reference, reference, simulated=True)
                                      for case in selftest.CASES)}
    for case in selftest.CASES:
        row = rows[case.name]
        if not hasattr(reference, case.op):
            assert row.status == "SKIP" and "has no" in row.detail, row
        elif case.host_reference is not None:  # a mode the reference kernel does not implement
            assert row.status == "SKIP" and "NotImplementedError" in row.detail, row
        else:
            assert row.status == "PASS" and row.worst == 0.0, row
    real_npu_row = selftest.run_case(_case_named("group_type 2"), "float32", CPU, reference, reference)
    assert real_npu_row.status == "ERROR", "on a real NPU a kernel mode that raises is a failure"


def _case_named(text: str) -> selftest.Case:
    return next(case for case in selftest.CASES if text in case.name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_output_off_by_more_than_the_tolerance_is_a_mismatch(dtype):
    rtol, atol = selftest.TOLERANCES[dtype]
    for error, expected in ((0.5 * atol, "PASS"), (4 * (atol + rtol * 10), "MISMATCH")):
        device = types.SimpleNamespace(npu_swiglu=lambda x, dim=-1, e=error: reference.npu_swiglu(x, dim=dim) + e)
        row = selftest.run_case(_case("npu_swiglu"), dtype, CPU, device, reference)
        assert row.status == expected, row
    relaxed = selftest.run_case(_case("npu_swiglu"), dtype, CPU, device, reference, tolerance_scale=2 * error / atol)
    assert relaxed.status == "PASS" and relaxed.worst <= 1.0, relaxed


def test_a_wrong_gradient_is_a_mismatch_even_with_right_outputs():
    def permute_with_wrong_backward(tokens, indices, *args, **kwargs):
        return reference.npu_moe_token_permute(_ScaleGradient.apply(tokens), indices, *args, **kwargs)

    device = types.SimpleNamespace(npu_moe_token_permute=permute_with_wrong_backward)
    row = selftest.run_case(_case("npu_moe_token_permute"), "float32", CPU, device, reference)
    assert row.status == "MISMATCH" and row.detail.startswith("grad0"), row


def test_wrong_integer_outputs_are_a_mismatch():
    def permute_with_wrong_indices(tokens, indices):
        permuted, sorted_indices = reference.npu_moe_token_permute(tokens, indices)
        return permuted, sorted_indices.flip(0)

    device = types.SimpleNamespace(npu_moe_token_permute=permute_with_wrong_indices)
    row = selftest.run_case(_case("npu_moe_token_permute"), "float32", CPU, device, reference)
    assert row.status == "MISMATCH" and "out1: integers differ" in row.detail


def test_a_device_error_is_reported_not_raised():
    def broken(*args, **kwargs):
        raise RuntimeError("aclnnFusedInferAttentionScore failed, error code 561103")

    device = types.SimpleNamespace(npu_fusion_attention=broken)
    row = selftest.run_case(selftest.CASES[0], "float32", CPU, device, reference)
    assert row.status == "ERROR" and "561103" in row.detail
    assert selftest.run_case(selftest.CASES[0], "float32", CPU, types.SimpleNamespace(), reference).status == "ERROR"


def test_group_type_2_reference_is_the_weight_gradient_of_group_type_0():
    """The host math for the backward's group_type=2 equals autograd's weight gradient of the forward."""
    (x_list, w_list), kwargs = selftest._gmm_along_m(torch.float32)
    x, w = x_list[0], w_list[0].requires_grad_()
    (y,) = reference.npu_grouped_matmul([x], [w], **kwargs)
    dy = torch.randn_like(y)
    (dw,) = torch.autograd.grad(y, w, dy)
    (out,) = selftest._grouped_matmul_along_k_math([x.t()], [dy], group_list=kwargs["group_list"])
    torch.testing.assert_close(out, dw)


def test_without_torch_npu_it_says_how_to_get_one(capsys):
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu already imported in this process")
    args = selftest.add_parser(__import__("argparse").ArgumentParser().add_subparsers()).parse_args([])
    assert selftest.cmd_selftest(args) == selftest.EXIT_MISMATCH
    assert "cannot import torch_npu" in capsys.readouterr().err


def test_cli_lists_selftest_without_importing_torch():
    code = "import sys, npu_inject.commands.cli as c; c.build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


def test_selftest_runs_on_the_simulated_npu_and_says_what_it_proves():
    env = sim_env(clean_env(PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))),
                  devices=1)
    result = subprocess.run([sys.executable, "-m", "npu_inject", "selftest", "--dtype", "float32,bfloat16"],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert selftest.SIMULATED_NOTE in result.stdout
    for case in selftest.CASES:
        assert case.name in result.stdout
    assert "PASS" in result.stdout and "0 failed" in result.stdout


def test_every_case_calls_torch_npu_with_its_real_parameter_names():
    """Each case's op and keywords exist in torch_npu 2.14.0's schemas (the cached wheel, read as a zip)."""
    import re

    from verification.sim_npu import torch_npu_wheel

    text = torch_npu_wheel.wheel().read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()
    schemas: dict[str, list[list[str]]] = {}
    for match in re.finditer(r"func:\s*(\w+)(?:\.\w+)?\((.*?)\)\s*->", text):
        names = [argument.split("=")[0].split()[-1] for argument in match.group(2).split(",")
                 if argument.split("=")[0].strip() not in ("", "*")]
        schemas.setdefault(match.group(1), []).append(names)
    for case in selftest.CASES:
        args, kwargs = case.make(torch.float32)
        assert case.op in schemas, f"{case.name}: torch_npu has no {case.op}"
        assert any(set(kwargs) <= set(names) and len(args) <= len(names) for names in schemas[case.op]), (
            f"{case.name}: {case.op}({len(args)} positional, {sorted(kwargs)}) fits none of {schemas[case.op]}")

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

from npu_inject.commands import selftest, selftest_compare, selftest_mc2
from npu_inject.ops import reference
from gloo import run_on_gloo_ranks
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
        elif case.host_reference is not None:  # compared with independent host math, not with itself
            assert row.status == "PASS", row
        else:
            assert row.status == "PASS" and row.worst == 0.0, row


def test_a_kernel_mode_the_device_lacks_skips_on_the_simulated_npu_and_is_an_error_on_a_real_one():
    def without_k_grouping(x, weight, **kwargs):
        raise NotImplementedError("group_type=2 is not implemented here")

    device = types.SimpleNamespace(npu_grouped_matmul=without_k_grouping)
    case = _case_named("group_type 2")
    simulated_row = selftest.run_case(case, "float32", CPU, device, reference, simulated=True)
    assert simulated_row.status == "SKIP" and "NotImplementedError" in simulated_row.detail, simulated_row
    real_npu_row = selftest.run_case(case, "float32", CPU, device, reference)
    assert real_npu_row.status == "ERROR", "on a real NPU a kernel mode that raises is a failure"


def _case_named(text: str) -> selftest.Case:
    return next(case for case in selftest.CASES if text in case.name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_output_off_by_more_than_the_tolerance_is_a_mismatch(dtype):
    rtol, atol = selftest_compare.TOLERANCES[dtype]
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
                  devices=2)
    result = subprocess.run([sys.executable, "-m", "npu_inject", "selftest", "--dtype", "float32,bfloat16"],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert selftest.SIMULATED_NOTE in result.stdout
    # One row per case and dtype: "<case>  <dtype>  <result>  ..."; the skipped ones are exactly
    # those EXPECTED_SKIPS lists for the simulated NPU, in both dtypes.
    results = {}
    for line in result.stdout.splitlines():
        for case in selftest.CASES:
            fields = line[len(case.name):].split()
            if line.startswith(case.name + " ") and fields[0] in ("float32", "bfloat16"):
                results[case.name, fields[0]] = fields[1]
    assert len(results) == 2 * len(selftest.CASES), result.stdout
    # The MC2 cases run on two simulated devices, in bfloat16 only of the two dtypes asked for.
    collective = {(case.name, *line[len(case.name):].split()[:2]) for case in selftest_mc2.CASES
                  for line in result.stdout.splitlines() if line.startswith(case.name + " ")}
    assert collective == {(case.name, "bfloat16", "PASS") for case in selftest_mc2.CASES}, result.stdout
    skipped = sorted(key for key, status in results.items() if status == "SKIP")
    assert skipped == sorted((case, dtype) for case in selftest.EXPECTED_SKIPS["simulated"]
                             for dtype in ("float32", "bfloat16")), result.stdout
    assert set(results.values()) <= {"PASS", "SKIP"}, result.stdout
    passed = sum(status == "PASS" for status in results.values()) + len(selftest_mc2.CASES)
    assert f"{passed} PASS, {len(skipped)} SKIP, 0 FAIL " in result.stdout, result.stdout
    for case, reason in selftest.EXPECTED_SKIPS["simulated"].items():
        assert f"expected SKIP on target simulated: {case}: {reason}" in result.stdout


def test_expected_skips_name_existing_cases_with_a_reason():
    names = {case.name for case in selftest.CASES}
    assert set(selftest.EXPECTED_SKIPS) == {"simulated", "npu"}
    for target, skips in selftest.EXPECTED_SKIPS.items():
        for case, reason in skips.items():
            assert case in names and reason, (target, case)


def _fake_torch_npu_without(monkeypatch, op: str):
    """A simulated torch_npu whose ops are the reference's, less ``op``, on the host as "device"."""
    ops = {name: getattr(reference, name) for name in {case.op for case in selftest.CASES}
           if name != op and hasattr(reference, name)}
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(__simulated__=True, __version__="fake", **ops))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(get_device_name=lambda index: "host"), raising=False)


def test_a_case_that_newly_skips_fails_the_command(monkeypatch, capsys):
    parser = selftest.add_parser(__import__("argparse").ArgumentParser().add_subparsers())
    args = parser.parse_args(["--device", "cpu", "--dtype", "float32", "--case", "swiglu dim -2"])
    _fake_torch_npu_without(monkeypatch, "npu_grouped_matmul")  # swiglu is still there
    assert selftest.cmd_selftest(args) == selftest.EXIT_OK
    assert "1 PASS, 0 SKIP, 0 FAIL " in capsys.readouterr().out

    _fake_torch_npu_without(monkeypatch, "npu_swiglu")  # the stand-in lost an op: its case skips
    assert selftest.cmd_selftest(args) == selftest.EXIT_MISMATCH
    out = capsys.readouterr().out
    assert "0 PASS, 0 SKIP, 1 FAIL " in out, out
    name = "swiglu dim -2 (gate, up stacked)"
    row = next(line for line in out.splitlines() if line.startswith(name))
    assert row[len(name):].split()[:2] == ["float32", "FAIL"] and ("unexpected SKIP, not in EXPECTED_SKIPS['simulated']: "
                                         "torch_npu has no npu_swiglu") in row, row

    # A listed skip passes; the same case skipping on a real NPU's list (none) would not.
    monkeypatch.setitem(selftest.EXPECTED_SKIPS, "simulated", {name: "the stand-in has no npu_swiglu (this test)"})
    assert selftest.cmd_selftest(args) == selftest.EXIT_OK
    out = capsys.readouterr().out
    assert "0 PASS, 1 SKIP, 0 FAIL " in out, out
    rows = selftest.fail_unexpected_skips([selftest_compare.Row("grouped_matmul group_type 2 (expert weight gradient)",
                                                                "float32", "SKIP", detail="x")], "npu")
    assert rows[0].status == "FAIL" and "EXPECTED_SKIPS['npu']" in rows[0].detail


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



def _collective_case_ratios(rank: int, summing_twice: bool) -> dict[str, float]:
    """Each collective case on a gloo rank, the reference kernels standing in for torch_npu (hcom: the c10d
    group name, which they accept), or with a reduce-scatter that sums twice: its worst error over the tolerance."""
    import torch.distributed as dist

    torch_npu = reference
    if summing_twice:
        torch_npu = types.SimpleNamespace(npu_all_gather_base_mm=reference.npu_all_gather_base_mm,
                                          npu_mm_reduce_scatter_base=_reduce_scatter_summing_twice)
    ratios = {}
    for number, case in enumerate(selftest_mc2.CASES):
        pairs = case.run(rank, 2, torch.bfloat16, CPU, torch_npu, dist.group.WORLD.group_name,
                         selftest_compare.SEED + number)
        ratios[case.name] = max(selftest_compare.compare_tensors(name, got, want, "bfloat16", 1.0)[0]
                                for name, got, want in pairs)
    return ratios


def _reduce_scatter_summing_twice(*args, **kwargs):
    return 2 * reference.npu_mm_reduce_scatter_base(*args, **kwargs)


def test_collective_cases_pass_the_reference_and_catch_a_wrong_reduce_scatter():
    """The column- and row-parallel cases' independent math (cat / sum of per-rank products, autograd) agrees
    with the MC2 reference kernels, and a reduce-scatter that sums twice fails both (forward or backward)."""
    honest = run_on_gloo_ranks(_collective_case_ratios, 2, (False,))
    assert all(ratio <= 1.0 for ratios in honest.values() for ratio in ratios.values()), honest
    broken = run_on_gloo_ranks(_collective_case_ratios, 2, (True,))
    assert all(ratio > 1.0 for ratios in broken.values() for ratio in ratios.values()), broken

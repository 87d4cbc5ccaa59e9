"""A contract with the real torch_npu 2.14.0: what we call exists there, with the names we pass.

The wheel is downloaded once with ``pip download --no-deps`` (cached in
``$NPU_INJECT_WHEEL_CACHE`` or ``~/.cache/npu_inject/wheels``) and read as a zip:
never installed, never imported (that needs Ascend's CANN libraries). Op schemas
come from ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``; Python
APIs from the package's own sources, parsed with :mod:`ast`.

Our side is read from source too: every ``<anything>.npu_*(...)`` call in the
runtime, the patches and the simulated NPU's stand-in, every ``npu_*`` the
stand-in defines, and the reference kernels' parameter lists.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import sys
import zipfile

import pytest

from testkit import REPO

sys.path.insert(0, REPO)
from verification.sim_npu import torch_npu_wheel  # noqa: E402

OUR_SOURCES = glob.glob(os.path.join(REPO, "npu_inject", "**", "*.py"), recursive=True)
STAND_IN_SOURCES = glob.glob(os.path.join(REPO, "verification", "sim_npu", "site", "torch_npu", "**", "*.py"), recursive=True)
# A moved folder must not leave the contract checking nothing.
assert any(os.sep + "patches" + os.sep in path for path in OUR_SOURCES) and STAND_IN_SOURCES, (OUR_SOURCES, STAND_IN_SOURCES)
# torch.npu calls made by torchtitan 0.3.0 (tools/utils.py, components/metrics.py,
# distributed/utils.py, trainer.py) and by the patches, through the device module.
DEVICE_MODULE_CALLS = {
    "is_available", "device_count", "current_device", "set_device", "synchronize", "get_device_name",
    "get_device_properties", "memory_stats", "reset_peak_memory_stats", "empty_cache", "manual_seed",
    "Stream", "Event", "current_stream", "stream", "memory_allocated", "max_memory_allocated",
}


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    return torch_npu_wheel.wheel()


@pytest.fixture(scope="module")
def schemas(wheel) -> dict[str, list[list[str]]]:
    """op name -> parameter-name lists, one per overload."""
    text = wheel.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()
    overloads: dict[str, list[list[str]]] = {}
    for match in re.finditer(r"func:\s*(\w+)(?:\.\w+)?\((.*?)\)\s*->", text):
        parameters = []
        for argument in match.group(2).split(","):
            argument = argument.split("=")[0].strip()
            if argument and argument != "*":
                parameters.append(argument.split()[-1])
        overloads.setdefault(match.group(1), []).append(parameters)
    assert "npu_fusion_attention" in overloads, "schema file format changed"
    return overloads


def _calls(paths):
    """(file:line, op name, positional count or None if starred, keyword names) of every .npu_*() call."""
    for path in paths:
        tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("npu_"):
                starred = any(isinstance(a, ast.Starred) for a in node.args)
                keywords = [k.arg for k in node.keywords if k.arg is not None]
                yield f"{os.path.relpath(path, REPO)}:{node.lineno}", node.func.attr, None if starred else len(node.args), keywords


def test_every_npu_op_we_call_exists_with_the_names_we_pass(schemas):
    calls = list(_calls(OUR_SOURCES + STAND_IN_SOURCES))
    called = {name for _, name, _, _ in calls}
    assert {"npu_fusion_attention", "npu_fusion_attention_v3", "npu_grouped_matmul", "npu_moe_token_permute",
            "npu_moe_token_unpermute", "npu_rms_norm", "npu_rms_norm_backward", "npu_rotary_mul",
            "npu_rotary_mul_backward", "npu_swiglu", "npu_swiglu_backward"} <= called
    problems = []
    for where, name, positional, keywords in calls:
        if name not in schemas:
            problems.append(f"{where}: torch_npu has no op {name}")
            continue
        fits = [params for params in schemas[name]
                if set(keywords) <= set(params) and (positional is None or positional <= len(params))]
        if not fits:
            problems.append(f"{where}: {name} has no overload taking keywords {sorted(keywords)}"
                            f" after {positional} positional arguments; overloads: {schemas[name]}")
    assert not problems, "\n".join(problems)


def test_stand_in_ops_exist_in_torch_npu(schemas):
    defined = set()
    for path in STAND_IN_SOURCES:
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("npu_"):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined |= {t.id for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("npu_")}
    missing = sorted(name for name in defined if name not in schemas)
    assert not missing, f"the stand-in defines ops the real torch_npu lacks: {missing}"


def test_reference_kernels_accept_only_real_parameter_names(schemas):
    functions = []
    for path in glob.glob(os.path.join(REPO, "npu_inject", "ops", "reference", "*.py")):
        tree = ast.parse(open(path, encoding="utf-8").read())
        functions += [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("npu_")]
    assert {f.name for f in functions} >= {"npu_fusion_attention", "npu_fusion_attention_v3", "npu_grouped_matmul",
                                          "npu_moe_token_permute", "npu_moe_token_unpermute", "npu_rms_norm",
                                          "npu_rms_norm_backward",
                                          "npu_rotary_mul", "npu_rotary_mul_backward", "npu_swiglu",
                                          "npu_swiglu_backward"}
    for function in functions:
        arguments = function.args
        names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
        assert function.name in schemas, function.name
        assert any(set(names) <= set(params) for params in schemas[function.name]), (
            f"reference {function.name}{names} is not a subset of torch_npu's {schemas[function.name]}"
        )


def test_python_apis_we_use_exist(wheel):
    npu_module = torch_npu_wheel.module_names(wheel, "torch_npu/npu/__init__.py")
    missing = sorted(DEVICE_MODULE_CALLS - npu_module)
    assert not missing, f"torch.npu (torch_npu/npu/__init__.py) lacks {missing}"
    assert "NpuFusedAdamW" in torch_npu_wheel.module_names(wheel, "torch_npu/optim/__init__.py")
    assert "is_hccl_available" in torch_npu_wheel.module_names(wheel, "torch_npu/distributed/__init__.py")


# Kernels whose custom-op schema (npu_inject/ops/fakes.py) types every argument as torch_npu does.
# npu_grouped_matmul's is not checked: ours types split_item & co. as int, output_dtype as ScalarType?
# where torch_npu's are int? (the reference never receives None there).
SCHEMA_CHECKED_KERNELS = ("npu_fusion_attention", "npu_fusion_attention_v3", "npu_moe_token_permute",
                          "npu_moe_token_unpermute")


def test_kernel_schemas_match_torch_npus(wheel):
    """Every argument of our custom-op schemas has torch_npu's type and default: e.g.
    npu_fusion_attention_v3 takes its TND lengths as Tensor, v1 as int[]."""
    from npu_inject.ops import fakes

    text = wheel.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()
    theirs: dict[str, list[dict[str, tuple[str, str | None]]]] = {}
    for match in re.finditer(r"func:\s*(\w+)(?:\.(\w+))?\((.*?)\)\s*->", text):
        if match.group(1) not in fakes.KERNELS or match.group(2):  # .out overloads take the outputs too
            continue
        theirs.setdefault(match.group(1), []).append(_schema_arguments(match.group(3)))
    problems = []
    for name in SCHEMA_CHECKED_KERNELS:
        spec = fakes.KERNELS[name]
        ours = _schema_arguments(spec.schema[1:spec.schema.index(") ->")])
        if not any(all(theirs_overload.get(argument) == typed for argument, typed in ours.items())
                   for theirs_overload in theirs.get(name, [])):
            problems.append(f"{name}: ours {ours}\n  torch_npu's {theirs.get(name)}")
    assert not problems, "\n".join(problems)


def _schema_arguments(text: str) -> dict[str, tuple[str, str | None]]:
    """argument name -> (type, default) of a schema's argument list; SymInt reads as int (a tracing detail)."""
    arguments = {}
    for argument in re.split(r",(?![^\[]*\])", text):  # commas outside list defaults ("int[] x=[1, 1]")
        argument = argument.strip()
        if not argument or argument == "*":
            continue
        declaration, _, default = argument.partition("=")
        kind, name = declaration.rsplit(None, 1)
        arguments[name] = (kind.replace("SymInt", "int"), default.strip().rstrip(".") or None)
    return arguments

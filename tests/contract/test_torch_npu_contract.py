"""A contract with the real torch_npu 2.14.0: what we call exists there, with the names we pass,
and the simulated NPU's stand-in offers the same names and writes what torch_npu writes.

The wheel is downloaded once with ``pip download --no-deps`` (cached in
``$NPU_INJECT_WHEEL_CACHE`` or ``~/.cache/npu_inject/wheels``) and read as a zip:
never installed, never imported (that needs Ascend's CANN libraries). Op schemas
come from ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``; Python
APIs from the package's own sources, parsed with :mod:`ast` (tests/support/torch_npu_source.py).

Our side is read from source too: every name rooted at ``torch_npu``, ``torch.npu`` or
``torch.ops.npu`` in the runtime and the patches, however it is reached (aliases,
``getattr``, importlib strings, returns, arguments, ``python -c`` strings), with the keywords
of each call, ``**mapping`` keys included; and, through the device patch's
``ctx.replace(... device_module, torch.npu)``, every ``device_module.*`` use in the installed
torchtitan. Every ``<anything>.npu_*(...)`` call in the stand-in too, every ``npu_*`` the
stand-in defines, and the reference kernels' parameter lists.

The debug outputs: the trace folder that torch_npu's ``tensorboard_trace_handler`` makes is
computed by running the wheel's own path-creator code on a fixed pid, host and clock; the
output folder, file name and JSON form of the trace, and the keys of
``torch.npu.memory._snapshot()``, are read from the wheel's source. The stand-in must match.

What this cannot prove: that a name behaves as we assume (only that it exists and takes the
keywords); anything implemented in compiled code (``torch_npu._C``: an attribute of a compiled
object counts as present when the wheel's own Python reads it, and its parameters are not
checked); names computed at run time beyond the two forms read here (``getattr`` with a
non-constant name stands for the file's ``npu_*`` constants; a ``**mapping`` whose keys cannot
be derived fails the test rather than pass unchecked), such as selftest's per-case keyword
dicts passed through ``getattr(torch_npu, case.op)`` or torchtitan's ``torch.get_device_module``;
``device_module`` uses torchtitan would make in code not installed here; that the trace's
events or the snapshot's segments look like a real NPU's (the stand-in records host activity
and no allocator history); and what torch_npu writes besides ``trace_view.json``.
Dunder names probed with a default (``getattr(torch_npu, "__simulated__", False)``) need not be
in the wheel; names the code probes for and handles missing (``getattr``/``hasattr`` with a
default, ``find_spec``, a ``try`` catching the error) need not be in the stand-in.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import sys
import zipfile

import pytest

import torch_npu_source
from testkit import REPO, clean_env, sim_env

sys.path.insert(0, REPO)
from verification.sim_npu import torch_npu_wheel  # noqa: E402

OUR_SOURCES = glob.glob(os.path.join(REPO, "npu_inject", "**", "*.py"), recursive=True)
STAND_IN_SOURCES = glob.glob(os.path.join(REPO, "verification", "sim_npu", "site", "torch_npu", "**", "*.py"), recursive=True)
# A moved folder must not leave the contract checking nothing.
assert any(os.sep + "patches" + os.sep in path for path in OUR_SOURCES) and STAND_IN_SOURCES, (OUR_SOURCES, STAND_IN_SOURCES)
STAND_IN_PROFILER = os.path.join(REPO, "verification", "sim_npu", "site", "torch_npu", "profiler.py")


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


@pytest.fixture(scope="module")
def api(wheel, schemas) -> torch_npu_source.WheelAPI:
    return torch_npu_source.WheelAPI(wheel, set(schemas))


@pytest.fixture(scope="module")
def uses() -> list[torch_npu_source.Use]:
    import torchtitan

    return torch_npu_source.derive_uses(OUR_SOURCES, REPO, [os.path.dirname(torchtitan.__file__)])


def _op_problem(use: torch_npu_source.Use, schemas) -> str:
    name = use.chain[-1]
    if use.keywords is None:
        return ""
    fits = [params for params in schemas[name]
            if set(use.keywords) <= set(params) and (use.positional is None or use.positional <= len(params))]
    return "" if fits else (f"{use.where}: {name} has no overload taking keywords {list(use.keywords)} after "
                            f"{use.positional} positional arguments; overloads: {schemas[name]}")


def test_every_torch_npu_name_we_use_is_in_the_wheel(uses, api, schemas):
    """Each name our runtime and patches use (and torchtitan's device_module uses, which the device
    patch points at torch.npu) resolves in the wheel's sources; each call's keywords are accepted."""
    problems = []
    for use in uses:
        if use.optional and use.chain[-1].startswith("__"):
            continue  # a module metadata probe with a default, e.g. the stand-in's __simulated__ marker
        problem = torch_npu_source.check_in_wheel(use, api)
        if not problem and api.resolve(use.chain)[0].kind == "op":
            problem = _op_problem(use, schemas)
        if problem:
            problems.append(problem)
    assert not problems, "\n".join(sorted(set(problems)))


def test_a_name_the_wheel_lacks_fails_with_its_place(tmp_path, api):
    """The reader sees each way a name is reached, and a missing name or keyword is reported at its line."""
    source = tmp_path / "probe_module.py"
    source.write_text(
        "import importlib\n"
        "import torch\n"
        "import torch_npu.profiler as p\n"
        "def device():\n"
        "    return getattr(torch, 'npu')\n"
        "def run(module):\n"
        "    module.memory._snapshot(no_such_keyword=1)\n"
        "run(device())\n"
        "p.tensorboard_trace_handler('x', worker_name='w')\n"
        "p.no_such_profiler_name()\n"
        "importlib.import_module('torch_npu._no_such_module')\n"
        "settings = {'wait': 1}\n"
        "p.schedule(**settings)\n"
    )
    uses = torch_npu_source.derive_uses([str(source)], str(tmp_path), [])
    problems = {use.dotted: torch_npu_source.check_in_wheel(use, api) for use in uses}
    assert problems["torch_npu.profiler.tensorboard_trace_handler"] == ""
    assert problems["torch_npu.profiler.schedule"] == ""
    assert problems["torch.npu.memory._snapshot"].startswith("probe_module.py:7: torch.npu.memory._snapshot")
    assert "takes no keyword ['no_such_keyword']" in problems["torch.npu.memory._snapshot"]
    assert problems["torch_npu.profiler.no_such_profiler_name"].startswith(
        "probe_module.py:10: torch_npu.profiler.no_such_profiler_name: missing from torch_npu")
    assert "probe_module.py:11: torch_npu._no_such_module: missing" in problems["torch_npu._no_such_module"]


STAND_IN_PROGRAM = r"""
import importlib, inspect, json, sys
import torch, torch_npu
problems = []
for where, chain, keywords in json.load(sys.stdin):
    value, reached = (torch.npu, chain[:2]) if chain[:2] == ["torch", "npu"] else (torch_npu, chain[:1])
    for attribute in chain[len(reached):]:
        reached.append(attribute)
        if not hasattr(value, attribute) and inspect.ismodule(value):
            try:
                importlib.import_module(value.__name__ + "." + attribute)
            except ImportError:
                pass
        if not hasattr(value, attribute):
            problems.append(f"{where}: the stand-in's {'.'.join(reached[:-1])} has no {attribute}")
            break
        value = getattr(value, attribute)
    else:
        if keywords:
            parameters = inspect.signature(value).parameters.values()
            if not any(p.kind is p.VAR_KEYWORD for p in parameters):
                unknown = sorted(set(keywords) - {p.name for p in parameters if p.kind is not p.POSITIONAL_ONLY})
                if unknown:
                    problems.append(f"{where}: the stand-in's {'.'.join(chain)} takes no keyword {unknown}")
snapshot = torch.npu.memory._snapshot()
print(json.dumps({"problems": problems, "snapshot": snapshot}, default=repr))
"""


@pytest.fixture(scope="module")
def stand_in(uses) -> dict:
    """The stand-in, imported on one simulated NPU: the names we need that it lacks, and a memory snapshot."""
    import json
    import subprocess

    required = [(use.where, list(use.chain), list(use.keywords or ())) for use in uses
                if not use.optional and use.chain[:3] != ("torch", "ops", "npu")]
    result = subprocess.run([sys.executable, "-c", STAND_IN_PROGRAM], input=json.dumps(required),
                            env=sim_env(clean_env(), devices=1), cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_stand_in_offers_every_name_we_use(stand_in):
    assert not stand_in["problems"], "\n".join(stand_in["problems"])


def test_stand_in_memory_snapshot_has_torch_npus_keys(stand_in, api):
    fields, where = torch_npu_source.memory_snapshot_fields(api)
    problems = torch_npu_source.snapshot_problems(stand_in["snapshot"], fields)
    assert not problems, f"against torch.npu.memory._snapshot ({where}): " + "; ".join(problems)


def test_stand_in_trace_handler_writes_torch_npus_layout(api, tmp_path):
    """The stand-in's tensorboard_trace_handler (run here, on the host) against the layout read from the wheel."""
    import importlib.util
    import socket

    import torch

    spec = importlib.util.spec_from_file_location("stand_in_torch_npu_profiler", STAND_IN_PROFILER)
    profiler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profiler)
    layout = torch_npu_source.profiler_trace_layout(api)
    for worker, folder in (("rank3", tmp_path / "named"), (None, tmp_path / "default")):
        handler = profiler.tensorboard_trace_handler(str(folder), worker_name=worker)
        with profiler.profile(activities=[profiler.ProfilerActivity.CPU], on_trace_ready=handler):
            (torch.ones(4) * 2).sum()
        problems = torch_npu_source.trace_problems(layout, str(folder), worker or socket.gethostname(), os.getpid())
        assert not problems, "\n".join(problems)


def test_stand_in_optim_and_distributed_names_exist_in_torch_npu(wheel):
    """Names the stand-in offers for tests/sim beyond what the runtime uses."""
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

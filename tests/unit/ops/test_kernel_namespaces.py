"""Which namespace's kernels run, by target and by what runs the call (docs/development.md, "Kernel namespaces").

``npu_inject.ops.kernels()`` is the one place that chooses: torch_npu on an NPU target in every mode;
in the rehearsal the reference eagerly, the rehearsal's custom ops under torch.compile and spmd type
checking, the planning fakes under a FakeTensorMode.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from npu_inject import selection
from npu_inject.ops import kernels


@pytest.fixture
def target(request):
    def establish(name: str) -> None:
        selection.establish({"TORCHTITAN_NPU": name})

    request.addfinalizer(selection.forget)
    return establish


def _under_compile() -> str:
    names = []

    def step(x):
        names.append(kernels().__name__)  # runs while dynamo traces (a side effect it replays as Python)
        return x + 1

    torch.compile(step, backend="eager")(torch.ones(2))
    return names[0]


def _under_type_checking() -> str:
    from spmd_types.checker import typecheck

    with typecheck():
        return kernels().__name__


def test_the_rehearsal_picks_by_what_runs_the_call(target):
    target("cpu")
    assert kernels().__name__ == "npu_inject.ops.reference"
    assert _under_compile() == "npu_inject.ops.rehearsal"
    assert _under_type_checking() == "npu_inject.ops.rehearsal"
    with FakeTensorMode():
        assert kernels().__name__ == "npu_inject.ops.planning"


def test_an_npu_target_runs_torch_npu_in_every_mode(target, monkeypatch):
    stand_in = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    target("npu")
    assert kernels() is stand_in
    assert _under_compile() == "torch_npu"
    assert _under_type_checking() == "torch_npu"
    with FakeTensorMode():
        assert kernels() is stand_in


def test_without_a_selection_no_namespace_is_guessed():
    selection.forget()
    with pytest.raises(RuntimeError, match="no selection in this process"):
        kernels()

"""The planner's changes: upstream's functions as a patch changes them, this project's own code only
through the hooks it asks (npu_inject.ops.planner_hooks), removed when the recording ends."""

from __future__ import annotations

import types

import pytest

from npu_inject.ops import planner_hooks
from npu_inject.planner.interventions import planner_changes


def test_the_planner_targets_no_function_of_this_project_and_holds_its_hooks_until_restored():
    recorder = types.SimpleNamespace(kernel=lambda name, inputs, outputs: None, paused=0)
    context = planner_changes(recorder, fake_mode=None, config=None)
    try:
        assert [target for target in context.declared_targets if target.startswith("npu_inject")] == []
        assert [name for name in planner_hooks.HOOKS if getattr(planner_hooks, name) is None] == []
    finally:
        context.restore()
    assert [name for name in planner_hooks.HOOKS if getattr(planner_hooks, name) is not None] == []


def test_an_unknown_hook_is_refused_naming_the_hooks_there_are():
    with pytest.raises(ValueError, match=r"has no hook document_end \(hooks: announce, document_ends, "):
        planner_hooks.install(document_end=lambda positions_BL: ())
    assert planner_hooks.document_ends is None

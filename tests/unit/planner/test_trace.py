"""The planner's module tracker frees what training frees: a leaf input (torchtitan's chunked loss feeds lm_head
detached views of the final norm's output) dies with its last reference, as it does with no tracker at all."""

import gc
import weakref

import torch
from torch.distributed._tools.mod_tracker import ModTracker

from npu_inject.planner.trace import _UncheckedModTracker


def _hidden_states_alive(tracker_class, microbatches: int = 3) -> int:
    """How many microbatches' hidden states outlive the step, the chunked loss's shape in small: a leaf view of
    them goes through a module, its gradient is taken, every reference is dropped."""
    head = torch.nn.Linear(16, 32, bias=False)
    storages = []

    def step():
        for _ in range(microbatches):
            hidden = torch.randn(1, 8, 16) * 2
            storages.append(weakref.ref(hidden.untyped_storage()))
            chunk = hidden.detach().requires_grad_(True)
            head(chunk).sum().backward()

    if tracker_class is None:
        step()
    else:
        with tracker_class() as tracker:
            step()
            assert tracker.parents == {"Global"}, tracker.parents  # every module popped in backward
    gc.collect()
    return sum(storage() is not None for storage in storages)


def test_a_leaf_input_dies_as_it_does_untracked():
    assert _hidden_states_alive(None) == 0
    assert _hidden_states_alive(_UncheckedModTracker) == 0


def test_torchs_tracker_still_keeps_leaf_inputs_alive():
    """Why the planner's tracker overrides the forward pre-hook. When this fails, torch frees them itself:
    the override in npu_inject/planner/trace.py can go."""
    assert _hidden_states_alive(ModTracker) == 3


def test_a_non_leaf_input_pops_the_module_after_its_gradient():
    head = torch.nn.Linear(16, 16)
    seen = []
    with _UncheckedModTracker() as tracker:
        x = torch.randn(2, 16, requires_grad=True) * 1.0
        y = head(x)
        y.register_hook(lambda grad: seen.append(set(tracker.parents)))
        y.sum().backward()
        assert tracker.parents == {"Global"}
    assert seen and "Linear" in seen[0], seen


def test_of_two_active_modules_of_one_depth_an_op_belongs_to_the_one_entered_last():
    # In backward two layers can be in ModTracker's set at once; the pick used to follow the string hash.
    import types

    from npu_inject.planner.trace import Recorder

    tracker = _UncheckedModTracker()
    for name in ("Model", "Model.layers.10", "Model.layers.9"):
        tracker._get_append_fn(None, name, False)()
    recorder = types.SimpleNamespace(_modules=tracker)
    assert Recorder._module_of(recorder) == "layers.9"
    tracker._get_append_fn(None, "Model.layers.10", False)()  # entered again (recomputation)
    assert Recorder._module_of(recorder) == "layers.10"

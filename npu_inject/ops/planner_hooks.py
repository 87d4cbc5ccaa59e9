"""The planner's hooks: where ``npu-inject plan`` changes what this project's own code does under fake tensors.

Each hook is None outside a plan, and the code that asks for it does what it always does. While the
planner records a step (:mod:`npu_inject.planner.interventions`) it installs its own, and removes them
when the recording ends. A hook stands where the code reads a tensor's values back (a fake tensor has
none) or where the planner counts the NPU's kernels. Callers check ``if planner_hooks.NAME is not None``:
a module attribute, cheap on the hot path and traceable by torch.compile.

No imports beyond typing: the ops and the patches ask for these without pulling in the planner.
"""

from __future__ import annotations

from typing import Any, Callable

# npu_inject.ops.planning's kernels: called with (kernel name, input tensors, output tensors) at each launch.
announce: Callable[[str, tuple, tuple], None] | None = None

# npu_inject.ops.attention.document_ends_from_positions: the cumulative document ends of positions (B, L),
# which it otherwise reads back from the device.
document_ends: Callable[[Any], tuple[int, ...]] | None = None

# The context_parallel patch's position exchange: called with (this rank's positions (B, l), the CP mesh,
# the load balancer's name); returns (this rank's sequence positions, every rank's in rank order), which
# it otherwise reads back and all-gathers over the CP group.
cp_positions: Callable[[Any, Any, str], tuple[tuple[int, ...], tuple[int, ...]]] | None = None

# npu_inject.ops.gated_delta_net's sequence lengths for the gated delta rule: called with (the lengths (N,)
# it computed, the tokens over all sequences); returns the lengths the reference kernel's loop reads back.
gated_delta_rule_lengths: Callable[[Any, int], Any] | None = None

HOOKS = ("announce", "document_ends", "cp_positions", "gated_delta_rule_lengths")


def install(**hooks: Callable) -> Callable[[], None]:
    """Set the named hooks; returns the function that removes them again. A name not in HOOKS is an error."""
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        raise ValueError(f"npu_inject.ops.planner_hooks has no hook {', '.join(unknown)} (hooks: {', '.join(HOOKS)})")
    module = globals()
    module.update(hooks)

    def remove() -> None:
        module.update(dict.fromkeys(hooks))

    return remove

"""Swap Optimizer: Adam/AdamW/SGD states in pinned host memory, streamed to the device per slice (bit-identical).

Off by default (option ``slices``: how many parts the parameters are split into;
about 2/slices of the state is on the device during ``step()``, none between
steps). Wraps ``OptimizersContainer._post_init``, which torchtitan calls once all
optimizers of the container are built and before any LR scheduler wraps their
``step``; each Adam/AdamW/SGD optimizer then gets the swap machinery of
:mod:`npu_inject.features.swap_optimizer` (see there for the pipeline and why parameters
stay bit-identical). Other optimizers keep their state on the device, with a
fallback entry in the report.

On the CPU rehearsal host and device are the same memory: the swap still runs
(same slicing, staging buffers and state-dict handling, synchronous copies) so the
rehearsal exercises the code path, but it saves no memory.
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.components.optimizer.optimizer:OptimizersContainer._post_init",
)


def apply(ctx: PatchContext) -> None:
    from npu_inject.features import swap_optimizer

    slices = ctx.options["slices"]  # registry.json's option_rules keep it >= 1

    def post_init(original, container, *args, **kwargs):
        result = original(container, *args, **kwargs)
        from torchtitan.tools import utils

        for optimizer in container.optimizers:
            name = type(optimizer).__name__
            if not isinstance(optimizer, swap_optimizer.PER_PARAMETER_OPTIMIZERS):
                ctx.fallback(f"{name} keeps its state on the device: the swap handles only "
                             "per-parameter updates (Adam, AdamW, SGD)")
                continue
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if not params:
                continue
            device = params[0].device
            module = None if device.type == "cpu" else utils.device_module
            swap = swap_optimizer.install(optimizer, slices, device, module)
            where = ("host == device on the CPU rehearsal: staged per slice, no memory saved"
                     if module is None else f"pinned host memory, streamed to {device.type} on a side stream")
            ctx.note(f"swap optimizer: {name} states in {where}; {len(swap.slices)} slices "
                     f"(option slices={slices})")
        return result

    ctx.wrap("OptimizersContainer._post_init", post_init)

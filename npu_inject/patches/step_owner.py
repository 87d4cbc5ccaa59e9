"""The training step's one owner, which the patches that guard, repair or fault a step take part in.

Module ``torchtitan.trainer``: ``Trainer.train_step`` (and the overrides of torchft's, flux's and the graph
trainer's) and ``torchtitan.distributed.utils.clip_grad_norm_``, which ``train_step`` calls after the backward,
are wrapped once, by :class:`npu_inject.training_step.StepOwner`; the phases, their order and what a
participant may do are stated there. On by default; the step patches (finite_steps, inject_faults, uce_repair,
restart_progress, torchft_leave, torchft_recover, spikes, replica_check, matmul_checks) require it, so switching it off alone is refused
at start-up, naming them. A torch.optim step pre-hook records whether the step's update began (a failure after
that may have left part of it in the weights).

Cost: the step's batches are kept (host memory the loader filled anyway) until the step ends; one Python call
per phase. Nothing here runs under torch.compile (torchtitan compiles the model, not the step).
"""

from __future__ import annotations

from npu_inject.patching import PatchContext
from npu_inject.training_step import OWNER

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
    "torchtitan.distributed.utils:clip_grad_norm_",
)


def apply(ctx: PatchContext) -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def clip_grad_norm_(original, *args, **kwargs):
        grad_norm = original(*args, **kwargs)
        OWNER.clipped(grad_norm)
        return grad_norm

    hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: OWNER.optimizer_began())
    ctx.add_cleanup(hook.remove)
    ctx.wrap("clip_grad_norm_", clip_grad_norm_)
    ctx.wrap_overrides("Trainer.train_step", OWNER.train_step)

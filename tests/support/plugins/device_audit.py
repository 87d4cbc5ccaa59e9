"""TEST ONLY: after step 1, write where parameters, gradients and optimizer states live

Test-only patch: after the first training step, record where parameters, gradients and
optimizer states live, and the process group's backend, into <dump_folder>/device_audit_rank<N>.json.
"""

from __future__ import annotations

import json
import os

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)


def _device_of(tensor) -> str:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.device.type


def audit(trainer) -> dict:
    import torch
    import torch.distributed as dist

    devices = {"parameters": set(), "gradients": set(), "optimizer_states": set()}
    for model in trainer.model_parts:
        for parameter in model.parameters():
            devices["parameters"].add(_device_of(parameter))
            if parameter.grad is not None:
                devices["gradients"].add(_device_of(parameter.grad))
    for optimizer in trainer.optimizers.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    devices["optimizer_states"].add(_device_of(value))
    return {
        **{key: sorted(value) for key, value in devices.items()},
        "backend": dist.get_backend(),
        "device_type": trainer.device.type,
    }


def apply(ctx):
    def train_step(original, trainer, *args, **kwargs):
        result = original(trainer, *args, **kwargs)
        if trainer.step == 1:
            path = os.path.join(trainer.config.dump_folder, f"device_audit_rank{os.environ.get('RANK', '0')}.json")
            with open(path, "w") as handle:
                json.dump(audit(trainer), handle)
        return result

    ctx.wrap("torchtitan.trainer:Trainer.train_step", train_step)

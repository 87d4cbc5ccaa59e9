"""TEST ONLY: per training step, the torch.ops.npu operators called and any complex tensor on the device

Test-only patch: what a training step runs on the device, written to
<dump_folder>/fused_step_probe_rank<N>.json after every step:

* ``npu_ops``: per step, the count of each ``torch_npu.npu_*`` kernel called (the stand-in's
  module attributes, counted by wrapping them; forward calls);
* ``complex_on_device``: per step, complex tensors on a non-CPU device among module outputs
  and made by ``torch.view_as_complex`` / ``torch.polar`` / ``torch.complex`` (how upstream's
  complex RoPE makes its intermediates);
* ``complex_buffers``: model buffers/parameters of complex dtype on a non-CPU device.

No dispatch mode or saved-tensor hooks: the simulator's audit must stay the innermost mode,
and the functorch transforms inside kernels' backward take neither.
"""

from __future__ import annotations

import json
import os
from collections import Counter

TARGETS = (
    "torchtitan.trainer:Trainer.train_step",
)

KERNELS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention", "npu_fusion_attention_v3",
           "npu_grouped_matmul", "npu_moe_token_permute", "npu_moe_token_unpermute")


def apply(ctx):
    import functools

    import torch

    npu_ops: Counter = Counter()
    complex_seen: Counter = Counter()

    def count_kernels() -> None:
        import torch_npu

        for name in KERNELS:
            kernel = getattr(torch_npu, name, None)
            if kernel is None or getattr(kernel, "_fused_step_probe", False):
                continue

            def counted(*args, _kernel=kernel, _name=name, **kwargs):
                npu_ops[f"npu::{_name}"] += 1
                return _kernel(*args, **kwargs)

            counted._fused_step_probe = True
            setattr(torch_npu, name, functools.wraps(kernel)(counted))

    def note_complex(where: str, value) -> None:
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.is_complex() and tensor.device.type != "cpu":
                complex_seen[where] += 1

    def on_forward(module, args, output):
        note_complex(type(module).__name__, output)

    def complex_maker(name, function):
        def made(*args, **kwargs):
            out = function(*args, **kwargs)
            note_complex(f"torch.{name}", out)
            return out

        return made

    record = {"npu_ops": {}, "complex_on_device": {}, "complex_buffers": []}

    def train_step(original, trainer, *args, **kwargs):
        if ctx.device_kind == "npu":
            count_kernels()
        npu_ops.clear()
        complex_seen.clear()
        handle = torch.nn.modules.module.register_module_forward_hook(on_forward)
        makers = {name: getattr(torch, name) for name in ("view_as_complex", "polar", "complex")}
        for name, function in makers.items():
            setattr(torch, name, complex_maker(name, function))
        try:
            result = original(trainer, *args, **kwargs)
        finally:
            handle.remove()
            for name, function in makers.items():
                setattr(torch, name, function)
        record["npu_ops"][str(trainer.step)] = dict(sorted(npu_ops.items()))
        record["complex_on_device"][str(trainer.step)] = dict(complex_seen)
        record["complex_buffers"] = sorted(
            name
            for model in trainer.model_parts
            for name, tensor in [*model.named_buffers(), *model.named_parameters()]
            if tensor.is_complex() and tensor.device.type != "cpu"
        )
        path = os.path.join(trainer.config.dump_folder, f"fused_step_probe_rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w") as handle_file:
            json.dump(record, handle_file)
        return result

    ctx.wrap("torchtitan.trainer:Trainer.train_step", train_step)

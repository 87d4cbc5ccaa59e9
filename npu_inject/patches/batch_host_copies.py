"""The batch's host tensors stay beside their device copies, so reading them back copies nothing.

torchtitan's loader yields each batch on the host and ``Trainer.train_step`` copies its tensors to the
device (``input_dict[key] = value.to(self.device)``). Readers in the forward then want some of those
values on the host again: the attention kernel's document lengths (torch_npu takes them as host ints)
and RoPE's bounds check read the positions (:mod:`npu_inject.patches.positions_check`). Each such read
is a device-to-host copy and a stream synchronisation on the NPU, for values the host had a moment
earlier. This patch hands ``train_step`` each batch's dict as one that, when a host tensor is replaced
by its device copy, records the pair with :func:`npu_inject.ops.host_reads.remember`; the readers'
:func:`~npu_inject.ops.host_reads.host_copy` then returns the loader's tensor. A device tensor written
in place afterwards, or one made from the batch (context parallelism's shards), is copied back as
before. Nothing changes on the rehearsal (the batch stays on the host).
"""

from __future__ import annotations

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.trainer:Trainer.batch_generator",
)


def apply(ctx: PatchContext) -> None:
    import torch

    from npu_inject.ops import host_reads

    class BatchDict(dict):
        """The loader's input dict; a host tensor replaced by its device copy is remembered with it."""

        def __setitem__(self, key, value) -> None:
            previous = self.get(key)
            if (isinstance(previous, torch.Tensor) and isinstance(value, torch.Tensor)
                    and previous.device.type == "cpu" and value.device.type != "cpu"
                    and previous.shape == value.shape and previous.dtype == value.dtype):
                host_reads.remember(value, previous)  # upstream's `value.to(self.device)`
            super().__setitem__(key, value)

    def batch_generator(original, self, data_iterable):
        for input_dict, labels in original(self, data_iterable):
            yield (BatchDict(input_dict) if type(input_dict) is dict else input_dict), labels

    ctx.wrap("Trainer.batch_generator", batch_generator)
    ctx.add_cleanup(host_reads.clear)

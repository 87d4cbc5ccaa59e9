"""async_with_pinned_mem checkpoints on the target: staging in the device's pinned memory (npu), shared memory (cpu).

torchtitan's ``async_with_pinned_mem`` builds ``DefaultStager(StagingOptions(pinned,
shared, async staging, non-blocking copy))`` in ``torchtitan.components.checkpointer.dcp``.
torch's staging pins only through CUDA (``torch.cuda.is_available()`` +
``cudaHostRegister``): on an NPU pinning is dropped with a warning, and on the CPU
rehearsal the non-blocking option raises (no accelerator). ``DefaultStager`` is
replaced, for that module, by a factory:

- npu: device-to-host copies go on a staging stream into host buffers from the
  device's pinned allocator (``pin_memory=True`` through torch.accelerator), kept
  across saves; the checkpoint process then gets a shared-memory copy of them
  (torch offers no way to pin shared memory for a non-CUDA device, and handing it
  pinned buffers would silently turn them into unpinned shared memory).
- cpu: host == device, so staging is a background-thread copy into shared memory.

What is written is unchanged: plain DCP checkpoints, loadable without this runtime.
"""

from __future__ import annotations

import dataclasses

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.components.checkpointer.dcp:DefaultStager",
)


def make_stager_factory(ctx: PatchContext):
    import torch
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.checkpoint.staging import DefaultStager

    class DevicePinnedStateDictStager(StateDictStager):
        """Stages into host buffers from the accelerator's pinned allocator, reused across saves."""

        def __init__(self) -> None:
            super().__init__(pin_memory=False, share_memory=False)

        def _stage_untyped_storage(self, storage, non_blocking=False):
            cached = self._cached_storage_mapping.get(storage)
            if cached is None or cached.nbytes() != storage.nbytes():
                pin = storage.nbytes() >= self.pin_memory_min_bytes
                cached = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
                self._cached_storage_mapping[storage] = cached
            cached.copy_(storage, non_blocking=non_blocking)
            return cached

    class DevicePinnedStager(DefaultStager):
        """DefaultStager whose pinned buffers come from the target device, not from CUDA."""

        def __init__(self, options) -> None:
            super().__init__(dataclasses.replace(options, use_pinned_memory=False, use_shared_memory=False))
            if options.use_pinned_memory:
                self._state_dict_stager = DevicePinnedStateDictStager()
            self._shared_stager = StateDictStager(share_memory=True) if options.use_shared_memory else None

        def _stage(self, state_dict, **kwargs):
            staged = super()._stage(state_dict, **kwargs)
            if self._shared_stager is not None:
                # The checkpoint process reads shared memory; copy after the device copies finished.
                staged = self._shared_stager.stage(staged, non_blocking=False)
            return staged

        def close(self) -> None:
            super().close()
            if self._shared_stager is not None:
                self._shared_stager.close()

    def stager(options=None):
        from torch.distributed.checkpoint.staging import StagingOptions

        options = options if options is not None else StagingOptions()
        if ctx.device_kind == "cpu":
            ctx.note("async_with_pinned_mem on cpu: staging copies into shared host memory in a background "
                     "thread (host == device: nothing to pin, no device stream)")
            return DefaultStager(dataclasses.replace(options, use_pinned_memory=False, use_non_blocking_copy=False))
        ctx.note("async_with_pinned_mem: device->host staging on a staging stream into pinned host buffers from "
                 f"the {ctx.device_kind} allocator"
                 + (", then a shared-memory copy for the checkpoint process (host memory: twice the staged state)"
                    if options.use_shared_memory else ""))
        return DevicePinnedStager(options)

    return stager


def apply(ctx: PatchContext) -> None:
    ctx.replace("DefaultStager", make_stager_factory(ctx))

"""torchft on NPUs: an abortable, reconfigurable torchft process group over HCCL, and torchft's streams on npu.

Module ``torchtitan.experiments.torchft.manager`` (``--module torchft.* --fault_tolerance.enable``), npu target;
torchft 0.2.0 (PyPI), torch_npu's ``hccl`` backend.

* ``TorchFTManager.__init__`` builds torchft's process group from ``--fault_tolerance.process_group``: gloo
  (host tensors only), nccl (CUDA's) or mccl (torchcomms, CUDA). Here ``hccl`` names
  :class:`ProcessGroupHCCL` below, and upstream's ``nccl`` (``llama3_torchft_debugmodel``) runs on it, noted,
  as the device patch runs the main process group on HCCL.
* :class:`ProcessGroupHCCL` is torchft's reconfigurable wrapper around torch_npu's ``hccl`` backend, made
  through the backend torch_npu registered with ``torch.distributed`` (so the simulated NPU's stand-in is
  built the same way). Every quorum ``configure`` aborts the old communicator and builds a new one on the
  quorum's store. A collective that outlives ``--fault_tolerance.process_group_timeout_ms`` aborts the group
  from torchft's timer thread, as torchft's NCCL group does; ``errored()`` synchronises the device before it
  answers, so an error of a collective still queued is seen.
* Aborting a collective in flight: NCCL's ``ncclCommAbort`` ends the kernel and the stream goes on; HCCL has
  no such call (destroying the communicator waits for its call in flight, and a collective that fails by
  itself leaves torch_npu's task queue dead for the rest of the process). On NPUs torchft's abort therefore
  first stops the device's tasks (``torch_npu.npu.stop_device``: the hung collective and all work queued
  behind it end, HCCL suspends every communicator), then destroys the group's communicator. The training
  thread's next operator fails with torch_npu's "FORCE STOP"; torchft_recover restarts the device, resumes
  the other communicators and discards the step. Only the timers of the communicator in use stop the
  device: a late timer of one already aborted does not. (The simulated NPU's stop does nothing: its
  collectives block their caller, and the abort ends them.)
* torchft 0.2.0 picks stream contexts, events and synchronisation for CUDA or XPU only (``torchft.utils``):
  on any other accelerator its recovery and collective streams were entered as no-op contexts (their work
  ran on the training stream, the events torchft waits on recorded elsewhere) and ``synchronize()`` did
  nothing. Here they go through ``torch.accelerator``, as torchft's PR #344 does, in every torchft module
  that imported them by name.

Not covered: torchcomms (``mccl``) and torchft's subprocess groups (``ProcessGroupBaby*``) stay CUDA's; a
request to them stops at start-up in model_guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta

from npu_inject.patching import PatchContext

TARGETS = (
    "torchtitan.experiments.torchft.manager:TorchFTManager.__init__",
    "torchft:ProcessGroupNCCL",  # only while TorchFTManager.__init__ builds its group
    "torchft.utils:get_stream_context",
    "torchft.utils:record_event",
    "torchft.utils:synchronize",
    "torchft.manager:get_stream_context",
    "torchft.manager:synchronize",
    "torchft.process_group:get_stream_context",
    "torchft.process_group:record_event",
    "torchft.process_group:synchronize",
    "torchft.collectives:get_stream_context",
    "torchft.futures:get_stream_context",
    "torchft.local_sgd:get_stream_context",
)

HCCL = "hccl"
# torch_npu's watchdog takes the whole process down when a collective outlives the backend's timeout ("To avoid
# data inconsistency, we are taking the entire process down"; seen on the CANN emulation with the backend at
# torchft's 3 s). torchft's own timeout must abort the group first, so the backend gets torch's default (30
# min), as torchft's NCCL group leaves NCCL's, and is a backstop only.
BACKEND_TIMEOUT = timedelta(minutes=30)
WATCHDOG_STOPPED = 2  # torch_npu.npu._recovery.WATCHDOG_STATUS_STOP


def stream_context(stream):
    """torchft's ``get_stream_context`` for any accelerator: the stream made current, or nothing to do."""
    return contextlib.nullcontext() if stream is None else stream  # torch.Stream is a context manager


def record_event() -> None:
    import torch

    torch.accelerator.current_stream().record_event()


def synchronize() -> None:
    import torch

    if torch.accelerator.is_available():
        torch.accelerator.current_stream().synchronize()


class AbortOne:
    """What torchft's timers of one communicator call: abort the group only while that communicator is in use."""

    def __init__(self, group, generation: int) -> None:
        self.group, self.generation = group, generation

    def abort(self) -> None:
        self.group.abort_generation(self.generation)


def make_process_group_class():
    """torchft's ProcessGroupWrapper over the ``hccl`` backend registered with torch.distributed."""
    import torch
    import torch.distributed as dist
    import torch_npu
    from torch.distributed.distributed_c10d import _DistributedBackendOptions
    from torchft import process_group as ft_process_group

    class ProcessGroupHCCL(ft_process_group.ProcessGroupWrapper):
        """A reconfigurable HCCL group for torchft: a new communicator per quorum, aborted on timeout."""

        def __init__(self, timeout: timedelta = timedelta(seconds=60.0)) -> None:
            super().__init__(timeout)
            self._errored: Exception | None = None
            self._generation = 0  # communicators made so far
            self._device_index: int | None = None
            self.stopped_device: int | None = None  # the device an abort stopped; torchft_recover restarts it
            self.issued = 0  # collectives issued so far (torchft_recover: did this step use the group)

        def _create_pg(self, store, rank: int, world_size: int):
            self._errored = None
            self._generation += 1
            self._device_index = torch.accelerator.current_device_index()
            plugin = dist.Backend._plugins.get(HCCL.upper())
            if plugin is None:
                raise RuntimeError("torchft's HCCL group needs torch_npu's 'hccl' backend, and torch.distributed "
                                   "has none registered: is torch_npu imported?")
            if plugin.extended_api:
                options = _DistributedBackendOptions()
                options.store, options.group_rank, options.group_size = store, rank, world_size
                options.timeout = BACKEND_TIMEOUT
                options.group_id = f"torchft_quorum_{self._quorum_id}"
                options.global_ranks_in_group = list(self._global_ranks or range(world_size))
                backend = plugin.creator_fn(options, None)
            else:
                backend = plugin.creator_fn(store, rank, world_size, BACKEND_TIMEOUT)
            # torch_npu's watchdog takes the process down when a communicator reports an error: torchft's group
            # handles its own (abort, report to the manager, a new communicator at the next quorum)
            backend.set_watchdog_status(WATCHDOG_STOPPED)
            group = dist.ProcessGroup(store, rank, world_size)
            group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
            group._register_backend(torch.device("npu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
            return group

        def _opts_hook(self, opts):
            # a collective's own timeout would arm torch_npu's watchdog with it: clear it (torchft's applies)
            if hasattr(opts, "timeout"):
                opts.timeout = dist.AllreduceOptions().timeout
            return opts

        @contextlib.contextmanager
        def _run_context(self):
            # a collective that blocks its caller (the simulated NPU's) ends at the timeout
            timeout, this_one = self._timeout, AbortOne(self, self._generation)

            def on_timeout() -> None:
                ft_process_group.logger.error(f"aborting torchft's HCCL group after {timeout}")
                this_one.abort()

            with ft_process_group.context_timeout(on_timeout, timeout):
                yield

        def _wrap_work(self, work, opts):
            self.issued += 1
            timeout = self._timeout
            if getattr(opts, "timeout", None) is not None and opts.timeout.total_seconds() > 0:
                timeout = opts.timeout
            # torchft's timer calls .abort() on what it is given: this communicator's, not a later one's
            return ft_process_group._WorkAcceleratorTimeout(AbortOne(self, self._generation), work, timeout)

        def abort_generation(self, generation: int) -> None:
            if generation == self._generation and self._pg is not None:
                self.abort()

        def abort(self, errored: bool = True) -> None:
            # set before the abort: a collective the abort unblocks must see it in errored()
            self._errored = RuntimeError("torchft's HCCL group was aborted")
            if errored and self._pg is not None:
                self._stop_device()
            super().abort(errored=errored)

        def _stop_device(self) -> None:
            ft_process_group.logger.error(f"stopping NPU {self._device_index}'s tasks (torch_npu stop_device) to end "
                                          "torchft's HCCL collective: its next operator fails with FORCE STOP "
                                          "(torchft_recover restarts the device and discards the step)")
            self.stopped_device = self._device_index  # before the stop: the training thread's error may come first
            torch_npu.npu.stop_device(self._device_index)

        def errored(self) -> Exception | None:
            synchronize()
            return self._errored

        def getBackendName(self) -> str:  # noqa: N802 - torchft's name
            return "torchft-hccl"

    return ProcessGroupHCCL


def apply(ctx: PatchContext) -> None:
    import torchft

    process_group_class = make_process_group_class()

    def init(original, manager, config, *args, **kwargs):
        if not (config.enable and config.process_group in (HCCL, "nccl")):
            return original(manager, config, *args, **kwargs)
        if config.process_group == "nccl":
            ctx.note("--fault_tolerance.process_group nccl runs on torchft's HCCL group (torchft's NCCL group "
                     "needs CUDA GPUs: every quorum would fail and no step would commit)")
        # upstream builds torchft.ProcessGroupNCCL for "nccl": that name is the HCCL group while it builds
        cuda_group = torchft.ProcessGroupNCCL
        torchft.ProcessGroupNCCL = process_group_class
        try:
            return original(manager, dataclasses.replace(config, process_group="nccl"), *args, **kwargs)
        finally:
            torchft.ProcessGroupNCCL = cuda_group

    ctx.wrap("TorchFTManager.__init__", init)
    ctx.changed("torchft:ProcessGroupNCCL")
    for module in ("torchft.utils", "torchft.manager", "torchft.process_group", "torchft.collectives",
                   "torchft.futures", "torchft.local_sgd"):
        ctx.replace(f"{module}:get_stream_context", stream_context)
    for module in ("torchft.utils", "torchft.process_group"):
        ctx.replace(f"{module}:record_event", record_event)
    for module in ("torchft.utils", "torchft.manager", "torchft.process_group"):
        ctx.replace(f"{module}:synchronize", synchronize)

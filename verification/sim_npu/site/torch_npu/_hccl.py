"""Simulated "hccl" process-group backend for the "npu" device.

Each collective copies its npu tensors to host tensors, runs gloo on them,
copies the results back and returns an already-completed Work: collectives are
synchronous, like every other simulated kernel. Point-to-point send/recv are the
exception: like HCCL's isend/irecv they return at once and complete on wait()
(a recv copies into its npu tensors then), so two ranks that both send before
they receive -- 1F1B's crossing sends -- do not stall each other.

Reductions: SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR go to gloo; AVG (which
gloo lacks, and which FSDP2 uses for fp32/bf16 gradients) is a SUM followed by
a division by the group size. PREMUL_SUM is rejected as gloo rejects it; real
HCCL accepts it, so code that needs it must choose per backend.

Teardown: the inner gloo group owns C++ threads (a worker per group, a transport loop).
``shutdown()`` -- called by destroy_process_group, and at exit for a group never destroyed --
drops it on the calling thread, so its destructor joins them there. Left alive (a group
something still references after destroy_process_group), they met interpreter shutdown and
now and then took a rank down after training (`terminate called without an active exception`).
"""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from torch_npu._recovery import WATCHDOG_STATUS_RUN, WATCHDOG_STATUS_STOP

BACKEND_NAME = "hccl"


def _completed(result: object = None) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()


def _copy_back(targets: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for target, host in zip(targets, hosts):
            target.copy_(host)


def _check_reduce_op(op: dist.ReduceOp, collective: str) -> bool:
    """Returns True when op is AVG (run as SUM then divide); raises for PREMUL_SUM."""
    if op == dist.ReduceOp.PREMUL_SUM:
        raise ValueError(
            f"ReduceOp.PREMUL_SUM is not supported by the simulated hccl backend "
            f"({collective} runs through gloo, which rejects it). Use SUM and scale "
            "the tensor, or AVG."
        )
    return op == dist.ReduceOp.AVG


def _divide_for_average(hosts: Sequence[torch.Tensor], size: int, collective: str) -> None:
    for host in hosts:
        if host.is_floating_point() or host.is_complex():
            host.div_(size)
        else:
            raise ValueError(
                f"ReduceOp.AVG needs floating-point tensors ({collective} got {host.dtype})."
            )


class _P2PWork(dist.Work):
    """An in-flight gloo send/recv; wait() finishes it (once: waiting on a finished gloo
    send/recv again would block) and then runs `done`, e.g. a recv's copy into npu tensors."""

    def __init__(self, inner: dist.Work, backend: "HcclSimBackend", done=None) -> None:
        super().__init__()
        self._inner, self._done, self._finished = inner, done, False
        self._backend = backend
        backend._pending_p2p += 1

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._finished:
            self._inner.wait() if timeout is None else self._inner.wait(timeout)
            if self._done is not None:
                self._done()
            self._finished = True
            self._backend._pending_p2p -= 1
        return True

    def is_completed(self) -> bool:
        return self._finished


class HcclSimBackend(_C10dBackend):
    """Collectives for npu tensors, carried out by an inner gloo group on host copies."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._pending_p2p = 0  # send/recv not waited for yet
        self._gloo_group: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            dist.PrefixStore("hccl_sim_gloo/", store), rank, size, timeout
        )
        _LIVE_BACKENDS.add(self)

    @property
    def _gloo(self) -> dist.ProcessGroupGloo:
        if self._gloo_group is None:
            raise RuntimeError(
                "simulated hccl: collective on a process group that was shut down "
                "(destroy_process_group, or interpreter exit); create a new one with init_process_group/new_group"
            )
        return self._gloo_group

    def shutdown(self) -> None:
        """Join the inner gloo group's threads now (see the module docstring, Teardown)."""
        if self._gloo_group is None:
            return
        if self._pending_p2p:
            # A send/recv still in flight keeps a gloo worker busy until its peer answers or
            # it times out: joining would hang the exit of a run that already failed.
            return
        gloo, self._gloo_group = self._gloo_group, None
        gloo.shutdown()
        del gloo  # the last reference: ~ProcessGroupGloo joins its worker and transport threads here

    def abort(self) -> None:
        """Tear the communicator down now, as ProcessGroupHCCL's abort does (torchft aborts a group whose
        collective outlived its timeout, and the old group at every new quorum): a collective blocked in it
        fails, and any later one raises."""
        gloo, self._gloo_group = self._gloo_group, None
        if gloo is not None:
            gloo.abort()

    def set_watchdog_status(self, status: int) -> None:
        """ProcessGroupHCCL's watchdog switch (1 run, 2 stop); collectives here are synchronous and have none."""
        if status not in (WATCHDOG_STATUS_RUN, WATCHDOG_STATUS_STOP):
            raise ValueError(f"set_watchdog_status: status {status} is neither {WATCHDOG_STATUS_RUN} (run) nor "
                             f"{WATCHDOG_STATUS_STOP} (stop)")
        self.watchdog_status = status

    # -- identity ---------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - name fixed by c10d
        return BACKEND_NAME

    def get_hccl_comm_name(self, rankid: int, init_comm: bool = True) -> str:
        """The communicator's name, as ProcessGroupHCCL's (the MC2 kernels' ``hcom``); unique in the process."""
        return f"hccl_sim_{id(self):x}"

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_coalescing(self) -> bool:
        return False

    # -- helpers ----------------------------------------------------------

    def _reduce_op_for_gloo(self, op: dist.ReduceOp, collective: str) -> tuple[dist.ReduceOp, bool]:
        average = _check_reduce_op(op, collective)
        return (dist.ReduceOp.SUM if average else op), average

    def _run(self, work: dist.Work) -> None:
        work.wait()

    # -- collectives --------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: _c10d.AllreduceOptions) -> dist.Work:
        op, average = self._reduce_op_for_gloo(opts.reduceOp, "allreduce")
        hosts = [_to_host(t) for t in tensors]
        gloo_opts = _c10d.AllreduceOptions()
        gloo_opts.reduceOp = op
        self._run(self._gloo.allreduce(hosts, gloo_opts))
        if average:
            _divide_for_average(hosts, self._size, "allreduce")
        _copy_back(tensors, hosts)
        return _completed(tensors)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: _c10d.AllreduceCoalescedOptions
    ) -> dist.Work:
        single = _c10d.AllreduceOptions()
        single.reduceOp = opts.reduceOp
        for tensor in tensors:
            self.allreduce([tensor], single)
        return _completed(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: _c10d.ReduceOptions) -> dist.Work:
        # Every rank computes the reduction; only the root keeps it.
        op, average = self._reduce_op_for_gloo(opts.reduceOp, "reduce")
        hosts = [_to_host(t) for t in tensors]
        all_opts = _c10d.AllreduceOptions()
        all_opts.reduceOp = op
        self._run(self._gloo.allreduce(hosts, all_opts))
        if average:
            _divide_for_average(hosts, self._size, "reduce")
        if self._rank == opts.rootRank:
            _copy_back(tensors, hosts)
        return _completed(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: _c10d.BroadcastOptions) -> dist.Work:
        hosts = [_to_host(t) for t in tensors]
        gloo_opts = _c10d.BroadcastOptions()
        gloo_opts.rootRank = opts.rootRank
        gloo_opts.rootTensor = opts.rootTensor
        self._run(self._gloo.broadcast(hosts, gloo_opts))
        _copy_back(tensors, hosts)
        return _completed(tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: _c10d.AllgatherOptions,
    ) -> dist.Work:
        host_inputs = [_to_host(t) for t in input_tensors]
        host_outputs = [[_to_host(t) for t in outputs] for outputs in output_tensors]
        self._run(self._gloo.allgather(host_outputs, host_inputs, _c10d.AllgatherOptions()))
        for outputs, hosts in zip(output_tensors, host_outputs):
            _copy_back(outputs, hosts)
        return _completed(output_tensors)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: _c10d.AllgatherOptions
    ) -> dist.Work:
        host_input = _to_host(input)
        host_output = torch.empty(output.shape, dtype=output.dtype)
        self._run(self._gloo._allgather_base(host_output, host_input, _c10d.AllgatherOptions()))
        _copy_back([output], [host_output])
        return _completed([output])

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: _c10d.AllgatherOptions,
    ) -> dist.Work:
        # output_lists[rank][i] receives input_list[i] of `rank`.
        for index, tensor in enumerate(input_list):
            self.allgather([[outputs[index] for outputs in output_lists]], [tensor], opts)
        return _completed(output_lists)

    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: _c10d.AllgatherOptions,
    ) -> dist.Work:
        for output, tensor in zip(outputs, inputs):
            self.all_gather_single(output, tensor, opts)
        return _completed(outputs)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: _c10d.GatherOptions,
    ) -> dist.Work:
        host_inputs = [_to_host(t) for t in input_tensors]
        host_outputs = [[_to_host(t) for t in outputs] for outputs in output_tensors]
        gloo_opts = _c10d.GatherOptions()
        gloo_opts.rootRank = opts.rootRank
        self._run(self._gloo.gather(host_outputs, host_inputs, gloo_opts))
        for outputs, hosts in zip(output_tensors, host_outputs):
            _copy_back(outputs, hosts)
        return _completed(output_tensors)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: _c10d.ScatterOptions,
    ) -> dist.Work:
        host_outputs = [_to_host(t) for t in output_tensors]
        host_inputs = [[_to_host(t) for t in inputs] for inputs in input_tensors]
        gloo_opts = _c10d.ScatterOptions()
        gloo_opts.rootRank = opts.rootRank
        self._run(self._gloo.scatter(host_outputs, host_inputs, gloo_opts))
        _copy_back(output_tensors, host_outputs)
        return _completed(output_tensors)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: _c10d.ReduceScatterOptions,
    ) -> dist.Work:
        # Allreduce of this rank's inputs, keeping the own chunk: same result as
        # a reduce-scatter, and gloo supports allreduce for every dtype and op.
        op, average = self._reduce_op_for_gloo(opts.reduceOp, "reduce_scatter")
        for output, inputs in zip(output_tensors, input_tensors):
            stacked = torch.stack([_to_host(t) for t in inputs])
            gloo_opts = _c10d.AllreduceOptions()
            gloo_opts.reduceOp = op
            self._run(self._gloo.allreduce([stacked], gloo_opts))
            mine = stacked[self._rank]
            if average:
                _divide_for_average([mine], self._size, "reduce_scatter")
            _copy_back([output], [mine])
        return _completed(output_tensors)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: _c10d.ReduceScatterOptions
    ) -> dist.Work:
        op, average = self._reduce_op_for_gloo(opts.reduceOp, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self._size:
            raise ValueError(
                f"reduce_scatter_tensor needs an input with world_size ({self._size}) times "
                f"the output's elements: input has {input.numel()}, output {output.numel()}."
            )
        host_input = _to_host(input).reshape(-1)
        gloo_opts = _c10d.AllreduceOptions()
        gloo_opts.reduceOp = op
        self._run(self._gloo.allreduce([host_input], gloo_opts))
        chunk = output.numel()
        mine = host_input[self._rank * chunk : (self._rank + 1) * chunk].reshape(output.shape)
        if average:
            _divide_for_average([mine], self._size, "reduce_scatter_tensor")
        _copy_back([output], [mine])
        return _completed([output])

    def reduce_scatter_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: _c10d.ReduceScatterOptions,
    ) -> dist.Work:
        for output, tensor in zip(outputs, inputs):
            self.reduce_scatter_single(output, tensor, opts)
        return _completed(outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: _c10d.AllToAllOptions,
    ) -> dist.Work:
        host_input = _to_host(input)
        host_output = torch.empty(output.shape, dtype=output.dtype)
        self._run(
            self._gloo.alltoall_base(
                host_output, host_input, output_split_sizes, input_split_sizes, _c10d.AllToAllOptions()
            )
        )
        _copy_back([output], [host_output])
        return _completed([output])

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: _c10d.AllToAllOptions,
    ) -> dist.Work:
        host_outputs = [_to_host(t) for t in output_tensors]
        host_inputs = [_to_host(t) for t in input_tensors]
        self._run(self._gloo.alltoall(host_outputs, host_inputs, _c10d.AllToAllOptions()))
        _copy_back(output_tensors, host_outputs)
        return _completed(output_tensors)

    def _check_peer(self, peer: int, what: str) -> None:
        # Real HCCL takes group-local peers and rejects larger ones with this message; a
        # global rank passed on a sub-group must fail here too, not reach a wrong rank.
        if not 0 <= peer < self._size:
            raise RuntimeError(
                f"HCCL {what}: p2p rank id must be smaller than group size: got peer rank {peer} "
                f"on a group of size {self._size} (pass the peer's rank within the group, "
                "e.g. dist.get_group_rank(group, global_rank))"
            )

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work:
        self._check_peer(dst_rank, "send")
        # The gloo work keeps the host copies alive until the send completes.
        return _P2PWork(self._gloo.send([_to_host(t) for t in tensors], dst_rank, tag), self)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        self._check_peer(src_rank, "recv")
        hosts = [_to_host(t) for t in tensors]
        return _P2PWork(self._gloo.recv(hosts, src_rank, tag), self, lambda: _copy_back(tensors, hosts))

    def barrier(self, opts: _c10d.BarrierOptions) -> dist.Work:
        self._run(self._gloo.barrier(_c10d.BarrierOptions()))
        return _completed(None)


_LIVE_BACKENDS: "weakref.WeakSet[HcclSimBackend]" = weakref.WeakSet()


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> HcclSimBackend:
    return HcclSimBackend(store, rank, size, timeout)


def shutdown_all() -> None:
    """At exit, before interpreter shutdown: groups never destroyed join their threads too."""
    for backend in list(_LIVE_BACKENDS):
        backend.shutdown()


def register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["npu"])
    # Registered at torch_npu's import, so it runs after the exit hooks of what imports later
    # (the runtime's and the audit's report writers).
    atexit.register(shutdown_all)

"""Rank program: train-like work on 2 npu ranks, then exit; prints the threads left at the end.

Launched by tests/sim/test_distributed.py. ``destroy``: destroy_process_group first, as
torchtitan does; ``keep``: exit with the groups alive (the exit hook must end them).
The gloo threads the simulated hccl owns must be joined by then, not met by interpreter
shutdown (issue 19, item 10: `terminate called without an active exception` after training).
"""

from __future__ import annotations

import atexit
import os
import sys

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # ProcessGroupGloo's worker, gloo's tcp loop


def thread_names() -> list[str]:
    return sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))


# Registered before torch_npu's import: atexit runs it after the simulated hccl's exit hook.
atexit.register(lambda: print(f"threads at exit: {thread_names()}", flush=True))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_npu  # noqa: E402,F401 - registers the simulated npu and "hccl"


def main(mode: str) -> None:
    rank = int(os.environ["RANK"])
    torch.npu.set_device(rank)
    device = torch.device("npu", rank)
    dist.init_process_group("hccl", device_id=device)
    pair = dist.new_group([0, 1])  # a second gloo group, as EP/FSDP meshes make
    weight = torch.randn(32, 32, device=device, requires_grad=True)
    side = torch.npu.Stream()
    for _ in range(2):
        loss = (weight @ weight).square().mean()
        loss.backward()  # on the npu autograd thread
        grad = weight.grad.detach().clone()
        with torch.npu.stream(side):
            side.wait_stream(torch.npu.current_stream())
            dist.all_reduce(grad, group=pair)
        torch.npu.current_stream().wait_stream(side)
        dist.all_reduce(grad)
        weight.grad = None
    dist.barrier()
    print("Training completed", flush=True)
    if mode == "destroy":
        dist.destroy_process_group()
        left = [name for name in thread_names() if name in GLOO_THREADS]
        if left:
            raise AssertionError(f"gloo threads still running after destroy_process_group: {left}")
        print("Process group destroyed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

"""Run a function on N gloo ranks in spawned processes (file rendezvous) and collect what they report."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable


def _entry(rank: int, world: int, init_file: str, worker: Callable, args: tuple, results: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results[rank] = worker(rank, *args)
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(worker: Callable[..., Any], world: int = 2, args: tuple = ()) -> dict[int, Any]:
    """``{rank: worker(rank, *args)}`` over ``world`` spawned gloo ranks; ``worker`` is a module-level function."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_entry, args=(world, os.path.join(directory, "init"), worker, args, results), nprocs=world,
                 join=True)
        return dict(results)

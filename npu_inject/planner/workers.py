"""The processes that record roles: forked from one that has imported torch and torchtitan once.

Every role is recorded in a process of its own (a recording changes torchtitan's and torch's state:
patches, process groups, meshes), and importing torch and torchtitan takes about five seconds, more
than a small model's whole recording. So the planner starts a fork server (multiprocessing's
``forkserver``) that activates this runtime for the rehearsal target with the planner's patches
(:func:`npu_inject.planner.config.environment`) and imports torchtitan's trainer and the job's model
package; each recording is a fresh fork of it, which exits when done. A recording's output (torchtitan's
log lines) goes to a file, whose end is quoted when it fails.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

PRELOAD_ENV = "NPU_INJECT_PLAN_PRELOAD"  # comma-separated modules the fork server imports


def preload() -> None:
    """In the fork server: the runtime, torchtitan's trainer, the model packages."""
    import importlib

    from npu_inject import runtime

    runtime.activate()
    import torch  # noqa: F401
    import torchtitan.trainer  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401

    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        importlib.import_module(name)


def executor(*, selection: str, modules: list[str], processes: int | None = None) -> ProcessPoolExecutor:
    """A pool whose every task runs in a fresh fork of the preloaded server. The server is started here, once
    per process, with the recordings' environment (its patches are fixed then); this process's own environment
    is left as it was, so a caller (a rehearsal's rank, a test) does not become a runtime-enabled process."""
    from multiprocessing import forkserver

    from npu_inject.planner import config

    recording_env = {**config.environment(selection), PRELOAD_ENV: ",".join(modules),
                     # fake tensors compute nothing; forks stay thread-free
                     "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    saved = {name: os.environ.get(name) for name in recording_env}
    os.environ.update(recording_env)
    try:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["npu_inject.planner.preload"])
        forkserver.ensure_running()  # it copies the environment now
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return ProcessPoolExecutor(processes or max(1, os.cpu_count() or 1), mp_context=context, max_tasks_per_child=1)


def _logged(rank: int, world_size: int, work):
    """Run ``work()`` with this process's output going to a file; its end is quoted if ``work`` fails."""
    from npu_inject.planner.config import PlanError

    with tempfile.NamedTemporaryFile("w+", prefix=f"npu_inject_plan_rank{rank}_", suffix=".log") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            return work()
        except PlanError:
            raise
        except (AssertionError, ValueError) as exc:
            # torchtitan's own checks of a configuration (ParallelDims, the pipeline split, ...).
            raise PlanError(f"torchtitan refused the layout: {exc}") from None
        except Exception as exc:  # noqa: BLE001 -- anything else torchtitan raises: its message and the log's end
            sys.stderr.flush()
            log.seek(0)
            tail = "\n".join(log.read().strip().splitlines()[-20:])
            raise PlanError(f"rank {rank} of {world_size} could not be planned: "
                                    f"{type(exc).__name__}: {exc}\n{tail}") from None


def record(argv: list[str], world_size: int, rank: int, units: int | None, grow_to: int | None = None):
    """One role's recording (a task for :func:`executor`): its RoleResult, or PlanError."""
    from npu_inject.planner import session

    result = _logged(rank, world_size, lambda: session.run(argv, world_size=world_size, rank=rank, units=units,
                                                           grow_to=grow_to))
    for allocation in result.trace.allocations:
        allocation.__dict__.pop("_ref", None)
    return result


def describe(argv: list[str], world_size: int) -> dict:
    """The job's model and batch facts for the layout search (a task for :func:`executor`)."""
    from npu_inject.planner import config

    return _logged(0, world_size, lambda: config.describe(argv, world_size))

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

import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from npu_inject.planner.config import HEARTBEAT_S

PRELOAD_ENV = "NPU_INJECT_PLAN_PRELOAD"  # comma-separated modules the fork server imports
# The environment the running fork server copied when it started (multiprocessing keeps one per process, and
# ``ensure_running`` leaves a live one as it is): a pool asking for another restarts it.
_server_env: dict[str, str] | None = None


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


def executor(*, selection: str, modules: list[str], processes: int | None = None, progress=None,
             expert_load: str = "") -> ProcessPoolExecutor:
    """A pool whose every task runs in a fresh fork of the preloaded server. The server is started here, once
    per process, with the recordings' environment (its patches are fixed then); this process's own environment
    is left as it was, so a caller (a rehearsal's rank, a test) does not become a runtime-enabled process.
    With ``progress``, the pool's first worker is started here, saying what it waits for (:func:`_warm`);
    ``expert_load``: ``npu-inject plan --expert-load``'s value (:mod:`npu_inject.planner.expert_load`)."""
    from multiprocessing import forkserver

    from npu_inject.planner import config
    from npu_inject.planner.expert_load import ENV as EXPERT_LOAD_ENV

    recording_env = {**config.environment(selection), PRELOAD_ENV: ",".join(modules), EXPERT_LOAD_ENV: expert_load,
                     # fake tensors compute nothing; forks stay thread-free
                     "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    global _server_env
    saved = {name: os.environ.get(name) for name in recording_env}
    os.environ.update(recording_env)
    try:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["npu_inject.planner.preload"])
        # What the recordings read (not the preloaded modules, which only spare each fork an import).
        wanted = {name: value for name, value in recording_env.items() if name != PRELOAD_ENV}
        if _server_env is not None and _server_env != wanted:
            # A live server would fork every recording with the first pool's patches and --expert-load (a plan of
            # another expert load in the same process, as bench_plan's rows are, would silently plan the first's).
            forkserver._forkserver._stop()  # noqa: SLF001 -- multiprocessing has no public way to restart it
        forkserver.ensure_running()  # it copies the environment now
        _server_env = wanted
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    pool = ProcessPoolExecutor(processes or max(1, os.cpu_count() or 1), mp_context=context, max_tasks_per_child=1)
    if progress is not None:
        _warm(pool, progress)
    return pool


def _warm(pool: ProcessPoolExecutor, progress) -> None:
    """Start the pool's first worker. The first submission blocks until the fork server has imported torch,
    torchtitan and the model (30 s on a busy 2-core host), so it is made from a thread, and the wait is said."""
    progress("starting the planner's workers: their fork server imports torch, torchtitan and the model once")
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        submitted = thread.submit(pool.submit, os.getpid)
        for _ in wait_for([submitted], progress, lambda _, seconds: (
                f"starting the planner's workers ({seconds:.0f} s)")):
            submitted.result().result()


class Progress:
    """``npu-inject plan``'s progress: each line on stderr (stdout holds the plan alone) with the seconds since
    ``started``. The heartbeats (:func:`wait_for`, :func:`saying`, the search's) speak when nothing has been said
    for :data:`~config.HEARTBEAT_S`, whoever said the last line: two waits back to back stay under it too."""

    def __init__(self, started: float) -> None:
        self.started = self.last = started

    def __call__(self, line: str) -> None:
        print(f"  [{time.monotonic() - self.started:5.0f} s] {line}", file=sys.stderr, flush=True)
        self.last = time.monotonic()


def next_beat(progress) -> float:
    """Seconds until ``progress`` is due a heartbeat: a :class:`Progress` when it has been silent for
    :data:`~config.HEARTBEAT_S`, any other callable every :data:`~config.HEARTBEAT_S` of the wait."""
    if isinstance(progress, Progress):
        return max(HEARTBEAT_S - (time.monotonic() - progress.last), 0.0)
    return HEARTBEAT_S


@contextlib.contextmanager
def saying(progress, what):
    """While the block runs, ``progress`` gets ``what(elapsed seconds)`` when due (:func:`next_beat`), from a thread
    of its own: the planner's own work (a pipeline's memory replayed, its step played out) can take longer than
    that. Nothing is said without ``progress``."""
    if progress is None:
        yield
        return
    started, finished = time.monotonic(), threading.Event()

    def beat() -> None:
        while not finished.wait(next_beat(progress)):
            progress(what(time.monotonic() - started))

    thread = threading.Thread(target=beat, name="npu-inject plan progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()


def wait_for(futures, progress, what):
    """Yield ``futures`` as they finish; while none has and ``progress`` is due (:func:`next_beat`), it gets
    ``what(finished, elapsed seconds)``, so that a long wait is never silent."""
    started, left, finished = time.monotonic(), set(futures), 0
    while left:
        done, left = concurrent.futures.wait(left, timeout=next_beat(progress),
                                             return_when=concurrent.futures.FIRST_COMPLETED)
        if not done:
            progress(what(finished, time.monotonic() - started))
        for future in done:
            finished += 1
            yield future


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


def record(argv: list[str], world_size: int, rank: int, units: int | None,
           microbatches: tuple[int, int] | None = None):
    """One role's recording (a task for :func:`executor`): its RoleResult, or PlanError."""
    from npu_inject.planner import session

    result = _logged(rank, world_size, lambda: session.run(argv, world_size=world_size, rank=rank, units=units,
                                                           microbatches=microbatches))
    for allocation in result.trace.allocations:
        allocation.__dict__.pop("_ref", None)
    return result


def describe(argv: list[str], world_size: int) -> dict:
    """The job's model and batch facts for the layout search (a task for :func:`executor`)."""
    from npu_inject.planner import config

    return _logged(0, world_size, lambda: config.describe(argv, world_size))

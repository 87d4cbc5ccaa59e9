"""The planner's recording pool: its fork server gets the recordings' environment, the caller keeps its own."""

from __future__ import annotations

import os
from multiprocessing import forkserver

from npu_inject.planner import config, workers


def test_the_pool_starts_its_server_with_the_recordings_environment_and_leaves_the_callers_as_it_was(monkeypatch):
    # A planner called in-process (the host memory check's rank, a test's worker) used to keep
    # TORCHTITAN_NPU=cpu in its environment, and every process it started later ran the runtime.
    monkeypatch.delenv("TORCHTITAN_NPU", raising=False)
    monkeypatch.setenv("TORCHTITAN_NPU_PATCHES", "-metrics")
    monkeypatch.delenv(workers.PRELOAD_ENV, raising=False)
    before = dict(os.environ)
    seen = {}
    monkeypatch.setattr(forkserver, "ensure_running", lambda: seen.update(os.environ))
    pool = workers.executor(selection="+host_memory_check", modules=["torchtitan.models.llama3"], processes=1)
    pool.shutdown()
    assert dict(os.environ) == before
    assert {name: seen[name] for name in ("TORCHTITAN_NPU", "TORCHTITAN_NPU_PATCHES")} == \
        config.environment("+host_memory_check")
    assert seen[workers.PRELOAD_ENV] == "torchtitan.models.llama3"


def test_a_pool_asking_for_other_recordings_restarts_the_server_and_other_preloads_do_not(monkeypatch):
    """multiprocessing keeps one fork server per process and leaves a live one as it is: a second pool with another
    --expert-load (bench_plan's rows, one process) forked its recordings with the first's, planning it silently."""
    monkeypatch.setattr(workers, "_server_env", None)
    monkeypatch.setattr(forkserver, "ensure_running", lambda: None)
    stopped = []
    monkeypatch.setattr(forkserver._forkserver, "_stop", lambda: stopped.append(True))
    for expert_load, modules in (("", ["torchtitan.models.llama3"]), ("1.5", ["torchtitan.models.llama3"]),
                                 ("1.5", ["torchtitan.models.deepseek_v3"])):
        workers.executor(selection="", modules=modules, processes=1, expert_load=expert_load).shutdown()
    assert stopped == [True]  # for the new expert load only; a model's preload is an import the fork would make

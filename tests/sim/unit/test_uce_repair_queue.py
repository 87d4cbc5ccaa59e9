"""Patch uce_repair with torch_npu's task queue on (its default): a repairable UCE stops the job in one line.

In a process of its own: the patch reads the launch mode when it applies, and the other suite's runtimes
(applied with synchronous launches) leave wrapped Trainer subclasses behind in their process.
"""

from __future__ import annotations

import pytest

from npu_inject.errors import RunStopped
from test_uce_repair import _trainer, recovery  # noqa: F401 -- the fixture, shared


def test_with_the_task_queue_on_a_repairable_uce_stops_instead_of_retrying(recovery, monkeypatch, npu_patch):
    monkeypatch.delenv("ASCEND_LAUNCH_BLOCKING", raising=False)
    monkeypatch.delenv("TASK_QUEUE_ENABLE", raising=False)
    npu_patch("uce_repair")
    with pytest.raises(RunStopped, match="not retried with torch_npu's task queue on"):
        _trainer(["UCE ERROR, "]).train_step(iter([({}, 1), ({}, 2)]))
    assert recovery.restarted == []

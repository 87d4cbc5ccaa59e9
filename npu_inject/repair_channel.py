"""How the ranks of a job agree on repairing a device fault, through torchrun's store instead of HCCL.

A rank that meets a device fault publishes it (the first fault of a repair generation stands; later ones read
it); every rank's watcher thread looks at that key every second or so and stops its own device when it appears,
so that a rank whose collective waits on the failed one is freed within a second; after each rank has stopped,
restarted and dropped its communicators it writes its report and waits for every rank's; the first verdict
published stands for every rank. The store is the job's TCPStore (torchrun's, rank 0's agent serves
it), which does not depend on the failed communicator. While no fault happens the only traffic is each watcher's
look, one small store request per ``poll_s`` per rank.

torch is imported by the functions only (the runtime core imports no torch).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

logger = logging.getLogger("npu_inject")
PREFIX = "npu_inject/step_repair"


@dataclass
class RepairChannel:
    """One rank's end of the repair protocol on ``store`` (a ``torch.distributed.Store``)."""

    store: Any
    rank: int
    world: int
    generation: int = 0  # repairs done so far: each uses its own keys

    def key(self, name: str, generation: int | None = None) -> str:
        return f"{PREFIX}/{self.generation if generation is None else generation}/{name}"

    def publish(self, fault: dict) -> dict:
        """Publish ``fault`` unless a fault of this generation stands already; returns the one that stands."""
        stood = self.store.compare_set(self.key("fault"), "", json.dumps(fault, sort_keys=True))
        return json.loads(stood)

    def standing(self) -> dict | None:
        """The fault of this generation, if one was published."""
        key = self.key("fault")
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def stopped(self) -> None:
        """This rank's device is stopped (its collectives can no longer fail under torch_npu's watchdog)."""
        self.store.set(self.key(f"stopped/{self.rank}"), "1")

    def wait_stopped(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for every rank's device to be stopped; returns the ranks not stopped in time.
        A rank drops its communicators only then: dropped earlier, a peer's collective still running on one fails
        ("closed its connection") and the peer's watchdog ends its process before its device is stopped."""
        from torch.distributed import DistStoreError

        keys = [self.key(f"stopped/{rank}") for rank in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except DistStoreError:
            pass  # the ranks missing are named below
        return [rank for rank, key in enumerate(keys) if not self.store.check([key])]

    def reports(self, mine: dict, timeout_s: float) -> tuple[dict[int, dict], list[int]]:
        """Write this rank's report and wait up to ``timeout_s`` for every rank's; returns the reports by rank and
        the ranks that wrote none in time."""
        from torch.distributed import DistStoreError

        self.store.set(self.key(f"report/{self.rank}"), json.dumps(mine, sort_keys=True))
        keys = [self.key(f"report/{rank}") for rank in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except DistStoreError:
            pass  # the ranks missing are named below
        present = {rank: key for rank, key in enumerate(keys) if self.store.check([key])}
        values = self.store.multi_get(list(present.values())) if present else []
        reports = {rank: json.loads(value) for rank, value in zip(present, values)}
        return reports, [rank for rank in range(self.world) if rank not in reports]

    def settle(self, line: str | None) -> str | None:
        """Publish this rank's verdict (a stop line, or None: retry) unless one stands; returns the one that stands,
        so that a rank whose reports came late (a peer gave up waiting for it) stops with its peers' line."""
        stood = self.store.compare_set(self.key("verdict"), "", json.dumps({"line": line}))
        return json.loads(stood)["line"]


@dataclass
class Watcher:
    """A daemon thread that looks at the channel's fault key every ``poll_s`` seconds (on its own store
    connection: a blocked call would hold the training thread's) and calls ``on_fault(generation, fault)`` once
    per generation; between looks it asks ``overdue()`` for a fault to publish itself (a step that outlived its
    deadline). One store round trip per look, off the training thread; closed (and joined) at exit, before the
    interpreter tears down, so the thread is never inside the store's C++ then."""

    channel: RepairChannel  # its store: a clone, for this thread alone
    generation: Callable[[], int]  # the repair generation, as the training thread's channel counts it
    on_fault: Callable[[int, dict], None]
    overdue: Callable[[], dict | None]
    poll_s: float
    _seen: int = -1
    _thread: threading.Thread | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        import atexit

        self._thread = threading.Thread(target=self._run, name="npu_inject step_repair watcher", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 5)

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            generation = self.channel.generation = self.generation()  # a repair done moves it on: its keys
            if generation == self._seen:  # this generation's fault was handled; its repair is under way
                continue
            fault = self.channel.standing()
            if fault is None:
                fault = self.overdue()
                if fault is None:
                    continue
                fault = self.channel.publish(fault)
            if generation == self.generation():  # not a repair finished meanwhile: its fault is handled
                self._seen = generation
                self.on_fault(generation, fault)

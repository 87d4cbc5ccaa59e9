"""What the launcher (torchrun's elastic agent) tells a worker through its environment."""

from __future__ import annotations

import os


def attempt_store_prefix() -> str | None:
    """The key prefix that keeps this restart attempt's rendezvous keys apart from a dead attempt's, as
    torch had it before 2.14 dropped it (``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``); None outside
    torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"/worker/attempt_{attempt}" if attempt is not None else None

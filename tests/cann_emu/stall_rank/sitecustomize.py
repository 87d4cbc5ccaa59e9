"""Makes one rank of a torchtitan run stall before a training step (test tooling, CANN emulation).

On the PYTHONPATH of ``test_debug_outputs.py``'s run only. ``CANN_EMU_TEST_STALL=RANK:STEP:SECONDS``:
rank RANK sleeps SECONDS before its training step STEP, so the other ranks wait in that step's
first collective, as behind a hung or dead peer, until torch_npu's watchdog times the collective
out and the flight recorder dumps. torchtitan and torch_npu are not touched.
"""

from __future__ import annotations

import os
import time

import wrapt

_rank, _step, _seconds = (int(part) for part in os.environ["CANN_EMU_TEST_STALL"].split(":"))


@wrapt.when_imported("torchtitan.trainer")
def _stall(module) -> None:
    def train_step(wrapped, instance, args, kwargs):
        if int(os.environ.get("RANK", "0")) == _rank and instance.step == _step:
            time.sleep(_seconds)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "Trainer.train_step", train_step)

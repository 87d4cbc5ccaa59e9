"""How DTensor random ops draw on the simulated npu (TORCHTITAN_NPU_SIM_DTENSOR_RNG).

torch.npu has get/set_rng_state, so DTensor would by default create its
OffsetBasedRNGTracker for npu meshes (as on a real NPU): every random op on a
DTensor then starts each shard at a Philox-style offset. The CPU rehearsal
cannot do that (DTensor has no tracker for CPU meshes): there each rank draws
its local shard from its own default generator. The two inits differ, and so
would every loss after them.

"local" (default): the simulator installs a DTensor RNG tracker whose regions
are disabled, so DTensor random ops run exactly as on the CPU rehearsal --
each rank draws its local shard from the shared stream -- and losses can be
compared with the rehearsal.

"philox": leave DTensor alone; it creates its OffsetBasedRNGTracker, which
drives torch.npu.get/set_rng_state like on a real NPU (values still come from
the Mersenne Twister stream, so they match neither a real NPU nor the
rehearsal).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

MODE_VAR = "TORCHTITAN_NPU_SIM_DTENSOR_RNG"
MODES = ("local", "philox")


def mode() -> str:
    value = os.environ.get(MODE_VAR, "local") or "local"
    if value not in MODES:
        raise ValueError(f"{MODE_VAR} must be one of {', '.join(MODES)}; got {value!r}.")
    return value


def install() -> None:
    if mode() != "local" or not torch.distributed.is_available():
        return
    from torch.distributed.tensor import _random as dtensor_random

    class LocalShardRNGTracker(dtensor_random._RNGStateTracker):
        """Disabled regions: random ops on DTensors draw like on a CPU mesh."""

        def __init__(self) -> None:
            super().__init__(torch.device("npu"))
            self.distribute_region_enabled = False

        @contextlib.contextmanager
        def _distribute_region(self, spec: object, generator: object = None) -> Iterator[None]:
            yield

    if dtensor_random._rng_tracker is None:
        dtensor_random._rng_tracker = LocalShardRNGTracker()

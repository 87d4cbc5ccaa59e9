"""Test patch: fails on rank 1 only, so the ranks end up with different applied sets."""

import os

TARGETS = (
    "torchtitan.trainer:Trainer.close",
)


def apply(ctx):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("this patch does not apply on rank 1")
    ctx.wrap("torchtitan.trainer:Trainer.close", lambda original, trainer: original(trainer))

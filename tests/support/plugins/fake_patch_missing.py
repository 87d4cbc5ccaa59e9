"""Test patch: its second target does not exist in faketitan."""

TARGETS = (
    "faketitan.core:DEVICE",
    "faketitan.core:Engine.vanished",
)


def apply(ctx):
    ctx.replace("faketitan.core:DEVICE", "changed")
    ctx.wrap("faketitan.core:Engine.vanished", lambda original, *args, **kwargs: None)

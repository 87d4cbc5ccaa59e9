"""Test patch: its second target does not exist in faketitan."""

TRIGGERS = ("faketitan.core",)
TARGETS = ("faketitan.core:DEVICE", "faketitan.core:Engine.vanished")
SUPPORTS = {}
REQUIRES = ()


def apply(ctx):
    ctx.replace("faketitan.core:DEVICE", "changed")
    ctx.wrap("faketitan.core:Engine.vanished", lambda wrapped, instance, args, kwargs: None)

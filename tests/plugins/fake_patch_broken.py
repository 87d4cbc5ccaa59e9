"""Test patch: changes two things, then raises -- the runtime must restore both."""

TRIGGERS = ("faketitan.core",)
TARGETS = ("faketitan.core:DEVICE", "faketitan.core:Engine.run")
SUPPORTS = {}
REQUIRES = ()


def apply(ctx):
    ctx.replace("faketitan.core:DEVICE", "broken")
    ctx.wrap("faketitan.core:Engine.run", lambda wrapped, instance, args, kwargs: -1)
    raise RuntimeError("deliberate failure after two changes")

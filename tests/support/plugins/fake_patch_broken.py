"""Test patch: changes two things, then raises -- the runtime must restore both."""

TARGETS = (
    "faketitan.core:DEVICE",
    "faketitan.core:Engine.run",
)


def apply(ctx):
    ctx.replace("faketitan.core:DEVICE", "broken")
    ctx.wrap("faketitan.core:Engine.run", lambda original, engine, x: -1)
    raise RuntimeError("deliberate failure after two changes")

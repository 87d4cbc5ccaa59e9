"""Test patch: replaces methods of every descriptor kind on faketitan.core.Engine."""

TARGETS = (
    "faketitan.core:Engine.run",
    "faketitan.core:Engine.build",
    "faketitan.core:Engine.create",
    "faketitan.core:Engine.name",
)

def apply(ctx):
    ctx.wrap("faketitan.core:Engine.run", lambda original, engine, x: original(engine, x) + 1)
    ctx.replace("faketitan.core:Engine.build", staticmethod(lambda: "patched"))
    ctx.replace("faketitan.core:Engine.create", classmethod(lambda cls: "patched"))
    ctx.replace("faketitan.core:Engine.name", property(lambda self: "patched"))

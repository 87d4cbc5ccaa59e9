"""Test patch: replaces methods of every descriptor kind on faketitan.core.Engine."""

TRIGGERS = ("faketitan.other",)
TARGETS = ("faketitan.core:Engine.run", "faketitan.core:Engine.build",
           "faketitan.core:Engine.create", "faketitan.core:Engine.name")
SUPPORTS = {}
REQUIRES = ("fake_device",)


def apply(ctx):
    ctx.wrap("faketitan.core:Engine.run", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 1)
    ctx.replace("faketitan.core:Engine.build", staticmethod(lambda: "patched"))
    ctx.replace("faketitan.core:Engine.create", classmethod(lambda cls: "patched"))
    ctx.replace("faketitan.core:Engine.name", property(lambda self: "patched"))

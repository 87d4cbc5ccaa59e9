"""Test patch: sets faketitan.core.DEVICE to the target and wraps compute()."""

TRIGGERS = ("faketitan.core",)
TARGETS = ("faketitan.core:DEVICE", "faketitan.core:compute")
SUPPORTS = {}
REQUIRES = ()
APPLY_COUNT = 0


def apply(ctx):
    global APPLY_COUNT
    APPLY_COUNT += 1
    ctx.replace("faketitan.core:DEVICE", ctx.target)
    ctx.wrap("faketitan.core:compute", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) * 10)
    ctx.note(f"scale={ctx.options.get('scale')}")


def revert(ctx):
    pass

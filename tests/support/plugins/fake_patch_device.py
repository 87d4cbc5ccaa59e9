"""Test patch: sets faketitan.core.DEVICE to the target and wraps compute()."""

TARGETS = (
    "faketitan.core:DEVICE",
    "faketitan.core:compute",
)

APPLY_COUNT = 0


def apply(ctx):
    global APPLY_COUNT
    APPLY_COUNT += 1
    ctx.replace("faketitan.core:DEVICE", ctx.device_kind)
    ctx.wrap("faketitan.core:compute", lambda original, x: original(x) * 10)
    ctx.note(f"scale={ctx.options.get('scale')}")

"""One module per patch. Installed as ``npu_inject.patches``.

A patch module holds code only: ``apply(ctx)`` and, where a patch leaves state the
context cannot undo, an optional ``revert(ctx)``. What it triggers on, targets,
supports and requires lives in one place, its ``registry.json`` entry -- the catalog
that the runtime and the CLI read without importing any patch code. Every change goes
through the :class:`~npu_inject.patching.PatchContext`, which only lets a patch touch
the targets its entry declares, restores everything when ``apply`` fails, and gives the
exact originals back on revert.
"""

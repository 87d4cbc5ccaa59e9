"""One module per patch. Installed as ``npu_inject.patches``.

A patch module reads top to bottom: its docstring (the first line is the description
``npu-inject list`` shows; the rest says how it works), ``TARGETS`` (what it changes, in
order), then ``apply(ctx)`` and, where a patch leaves state the context cannot undo, an
optional ``revert(ctx)``. Its trigger modules, supported versions, requirements, default
and options are its entry in ``registry.json``, which the runtime and the CLI read without
importing any patch code. Every change goes through the
:class:`~npu_inject.patching.PatchContext`, which only lets a patch touch the targets it
declares, restores everything when ``apply`` fails, and gives the exact originals back on
revert.
"""

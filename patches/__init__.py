"""One module per patch. Installed as ``npu_inject.patches``; see registry.json for the catalog.

Each module reads top to bottom: what it targets (TRIGGERS, TARGETS), which
versions it supports (SUPPORTS), what it requires (REQUIRES), then ``apply`` and
``revert``. Every change goes through the PatchContext, so a failed apply is
restored and ``revert`` gives back the exact originals.
"""

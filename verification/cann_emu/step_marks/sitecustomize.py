"""Marks torchtitan's training steps for the CANN emulation's per-step counts (test tooling).

On the PYTHONPATH only when ``cann_env(..., counts=PATH)`` or ``env.py --counts PATH`` asked for the
counts. When ``torchtitan.trainer`` is imported, ``Trainer.train_step`` is wrapped to tell
libcann_emu.so (``cann_emu_mark_step``) which step the operators it counts belong to; nothing of
torch_npu is touched. Any sitecustomize this one shadows is run first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if entry and os.path.abspath(entry) != here:
            candidate = os.path.join(entry, "sitecustomize.py")
            if os.path.isfile(candidate):
                spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
                return


def _install() -> None:
    import wrapt

    @wrapt.when_imported("torchtitan.trainer")
    def _mark_steps(module) -> None:
        mark = ctypes.CDLL("libcann_emu.so").cann_emu_mark_step
        mark.argtypes = [ctypes.c_int64]
        mark.restype = None

        def train_step(wrapped, instance, args, kwargs):
            mark(int(instance.step))
            try:
                return wrapped(*args, **kwargs)
            finally:
                mark(-1)

        wrapt.wrap_function_wrapper(module, "Trainer.train_step", train_step)


_run_shadowed_sitecustomize()
if os.environ.get("CANN_EMU_COUNTS"):
    _install()

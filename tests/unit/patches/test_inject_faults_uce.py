"""uce_in_forward asked for where no CANN emulation is loaded: one line at start-up, never a fault silently not caused."""

from __future__ import annotations

import ctypes

import pytest

from npu_inject.errors import RunStopped
from npu_inject.patches import inject_faults


def test_a_memory_error_without_the_emulation_stops_naming_it(monkeypatch):
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(RunStopped, match="uce_in_forward needs the CANN emulation"):
        inject_faults._mem_uce_injector()


def test_a_libascendcl_without_the_emulations_entry_stops_too(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *args, **kwargs: object())  # a real CANN's library
    with pytest.raises(RunStopped, match="a real device's libascendcl has no such entry"):
        inject_faults._mem_uce_injector()

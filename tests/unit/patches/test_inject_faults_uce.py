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
        inject_faults._emulation_entry("libascendcl.so", "cann_emu_inject_mem_uce", "uce_in_forward",
                                       "a device memory error")


def test_a_libascendcl_without_the_emulations_entry_stops_too(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *args, **kwargs: object())  # a real CANN's library
    with pytest.raises(RunStopped, match="a real device's libascendcl.so has no such entry"):
        inject_faults._emulation_entry("libascendcl.so", "cann_emu_inject_mem_uce", "uce_in_forward",
                                       "a device memory error")


def test_link_error_without_the_emulation_stops_naming_it(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *args, **kwargs: object())
    with pytest.raises(RunStopped, match="link_error or stuck_collective needs the CANN emulation"):
        inject_faults._emulation_entry("libhccl.so", "cann_emu_inject_hccl_fault", "link_error or stuck_collective",
                                       "an HCCL collective's failure")

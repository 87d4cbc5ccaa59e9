"""Streams and events: synchronous, but API-compatible with FSDP2/DCP use."""

from __future__ import annotations

import pytest
import torch


def test_stream_creation_and_current_stream_context() -> None:
    default = torch.npu.default_stream()
    assert torch.npu.current_stream() == default
    side = torch.npu.Stream(priority=-1)
    assert isinstance(side, torch.npu.Stream) and isinstance(side, torch.Stream)
    assert side != default
    with torch.npu.stream(side):
        assert torch.npu.current_stream() == side
        assert torch.accelerator.current_stream() == side
    assert torch.npu.current_stream() == default
    with torch.npu.stream(None):
        assert torch.npu.current_stream() == default
    generic = torch.Stream(device="npu")
    with generic:
        assert torch.npu.current_stream().stream_id == generic.stream_id


def test_stream_ordering_calls() -> None:
    side = torch.npu.Stream()
    side.wait_stream(torch.npu.current_stream())
    event = side.record_event()
    torch.npu.current_stream().wait_event(event)
    event.wait()
    assert event.query()
    assert side.query()
    side.synchronize()
    torch.npu.synchronize()
    torch.accelerator.synchronize()


def test_event_timing() -> None:
    start = torch.npu.Event(enable_timing=True)
    end = torch.npu.Event(enable_timing=True)
    start.record()
    torch.ones(100, device="npu").sum()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    untimed = torch.npu.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        untimed.elapsed_time(end)


def test_generic_event_on_npu() -> None:
    event = torch.Event(device="npu", enable_timing=True)
    event.record()
    assert event.query()
    event.synchronize()


def test_accelerator_api_sees_the_npu() -> None:
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("npu")
    assert torch.accelerator.device_count() == torch.npu.device_count()
    torch.accelerator.set_device_index(1)
    assert torch.accelerator.current_device_index() == 1 == torch.npu.current_device()

"""The cost model's collectives: how the link a group spans and the family's algorithms set their time."""

from types import SimpleNamespace

import pytest

from npu_inject import hardware
from npu_inject.planner import costmodel

GIB = 2**30
EFF = {"comm": 1.0}


def _op(collective: str, ranks: list[int]):
    return SimpleNamespace(collective=collective, group=tuple(ranks), comm_bytes=GIB)


def test_within_a_node_a_collective_takes_one_latency_and_the_links_bandwidth():
    a2 = hardware.load().find("A2")
    layout = costmodel.Layout(world_size=16, pp=1, scale_up_devices=8)
    seconds = costmodel.collective_seconds(_op("all_gather", list(range(8))), a2, EFF, layout)
    assert seconds == pytest.approx(7 / 8 * GIB / (a2.scale_up.bandwidth_gbps * 1e9) + a2.scale_up.latency_us * 1e-6)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_across_ascend_nodes_only_a_node_share_of_the_data_crosses_the_nics(collective):
    a2 = hardware.load().find("A2")
    layout = costmodel.Layout(world_size=16, pp=1, scale_up_devices=8)
    hierarchical = costmodel.collective_seconds(_op(collective, list(range(16))), a2, EFF, layout)
    passes = 2 if collective == "all_reduce" else 1
    # Every byte through each NIC (a ring over all 16 ranks) would take this long:
    ring = passes * 15 / 16 * GIB / (a2.scale_out.bandwidth_gbps * 1e9)
    crossing = passes * 1 / 2 * GIB / 8 / (a2.scale_out.bandwidth_gbps * 1e9)
    assert crossing < hierarchical < ring / 3


def test_across_nvidia_nodes_the_ring_is_bound_by_each_gpus_nic():
    h100 = hardware.load().find("H100")
    layout = costmodel.Layout(world_size=16, pp=1, scale_up_devices=8)
    seconds = costmodel.collective_seconds(_op("all_gather", list(range(16))), h100, EFF, layout)
    assert seconds >= 15 / 16 * GIB / (h100.scale_out.bandwidth_gbps * 1e9)


def test_this_host_as_a_device_is_measured():
    """``--hardware cpu`` (planning the CPU rehearsal): the host's matmul peak and copy bandwidth, measured."""
    profile = hardware.measure_host()
    assert profile.family == "cpu" and profile.peak("float32") > 0 and profile.memory_bandwidth_gbps > 0
    assert profile.memory_gib > 0

"""The caching-allocator model against what torch_npu 2.14.0's allocator reported on the CANN emulation.

Each expected figure below was read from ``torch.npu.memory_stats()`` after the same requests on the
real torch_npu wheel (fresh process, default PYTORCH_NPU_ALLOC_CONF, Ascend910B2, CANN 9.1.0);
tests/cann_emu/test_planner_allocator.py replays longer random sequences against it live.
"""

from __future__ import annotations

import pytest

from npu_inject.planner.allocator import MiB, CachingAllocator, rounded_size

# (request bytes, block bytes the allocator accounted, segment it reserved for it or 0 when it was cut
# from a cached block), in order, on one stream.
MEASURED_SEQUENCE = [
    (512, 1024, 2 * MiB),
    (4, 512, 0),
    (480, 512, 0),
    (1 * MiB, 1049088, 20 * MiB),
    (4 * MiB, 4194816, 0),
    (100 * MiB, 104858112, 102 * MiB),
]
# Single requests in a fresh allocator: (request, block, reserved).
MEASURED_SINGLE = [
    (10 * MiB, 10486272, 12 * MiB),
    (64 * MiB, 67109376, 66 * MiB),
    (1048544, 1048576, 2 * MiB),
    (10 * MiB - 1024, 10485248, 20 * MiB),
]


def test_a_sequence_reserves_and_accounts_as_the_real_allocator_did():
    allocator = CachingAllocator()
    reserved = 0
    for handle, (request, block, segment) in enumerate(MEASURED_SEQUENCE):
        before = allocator.stats.allocated
        allocator.malloc(handle, request)
        reserved += segment
        assert allocator.stats.allocated - before == block, request
        assert allocator.stats.reserved == reserved, request
    assert allocator.stats.reserved == 130023424  # 2 + 20 + 102 MiB, as measured
    for handle in range(len(MEASURED_SEQUENCE)):
        allocator.free(handle)
    assert allocator.stats.allocated == 0 and allocator.stats.reserved == 130023424
    allocator.empty_cache()
    assert allocator.stats.reserved == 0


@pytest.mark.parametrize("request_bytes, block, reserved", MEASURED_SINGLE)
def test_single_requests(request_bytes, block, reserved):
    allocator = CachingAllocator()
    allocator.malloc("t", request_bytes)
    assert (allocator.stats.allocated, allocator.stats.reserved) == (block, reserved)


def test_a_remainder_of_at_most_1_MiB_is_handed_out_whole():
    # Measured: after a 1048544-byte request took its 2 MiB small segment's first MiB and was freed, a
    # 1048545-byte request (rounded into the large pool) got a new 20 MiB segment; a 2 MiB - 512 large
    # block serving a 1048545-byte request is handed out whole (2096640 allocated).
    allocator = CachingAllocator()
    allocator.malloc("a", 20 * MiB - 2096640 - 32)  # a block leaving a 2096640-byte free tail in 20 MiB
    before = allocator.stats.allocated
    allocator.malloc("b", 1048545)
    assert allocator.stats.allocated - before == 2096640
    assert allocator.stats.reserved == 20 * MiB


def test_streams_do_not_share_cached_blocks():
    allocator = CachingAllocator()
    allocator.malloc("a", 4096, stream="compute")
    allocator.free("a")
    allocator.malloc("b", 4096, stream="all_gather")
    assert allocator.stats.reserved == 4 * MiB  # one small segment per stream


def test_freed_neighbours_merge_so_a_larger_request_reuses_them():
    allocator = CachingAllocator()
    for name in "abc":
        allocator.malloc(name, 3 * MiB)  # three blocks of one 20 MiB segment
    allocator.free("a")
    allocator.free("b")
    allocator.malloc("d", 6 * MiB)  # fits the merged a+b block
    assert allocator.stats.reserved == 20 * MiB
    assert allocator.stats.segments == 1


def test_expandable_segments_map_pages_and_reuse_the_tail():
    allocator = CachingAllocator(expandable=True)
    allocator.malloc("a", 30 * MiB)
    assert allocator.stats.reserved == 40 * MiB  # two 20 MiB pages
    allocator.malloc("b", 5 * MiB)  # the rest of the second page
    assert allocator.stats.reserved == 40 * MiB
    allocator.malloc("c", 6 * MiB)  # 41 MiB in all: a third page
    assert allocator.stats.reserved == 60 * MiB
    small = CachingAllocator(expandable=True)
    small.malloc("s", 1000)
    assert small.stats.reserved == 2 * MiB


@pytest.mark.parametrize("request_bytes, pad, block", [(0, 32, 512), (480, 32, 512), (481, 32, 1024),
                                                       (512, 32, 1024), (512, 0, 512)])
def test_rounding_pads_32_bytes_on_atlas_a2_a3_and_none_on_950(request_bytes, pad, block):
    assert rounded_size(request_bytes, pad) == block

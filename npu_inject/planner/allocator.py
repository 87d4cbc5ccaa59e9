"""torch_npu 2.14's caching allocator, replayed: what a sequence of allocations reserves on the device.

The planner records every storage a training step allocates and frees (with the stream it was
allocated on) and replays that sequence here, so the predicted ``max_memory_reserved`` carries
what the allocator adds on top of the tensors themselves: the 32 bytes torch_npu pads every
request with on Atlas A2/A3 (none on Ascend 950 with CANN >= 9.1.0), rounding to 512-byte
blocks, 2 MiB segments for small requests and 20 MiB ones for medium requests, blocks kept
whole when the remainder is 1 MiB or less, one pool per stream, and free blocks that cannot
serve a larger request (fragmentation). With ``expandable_segments`` one virtual segment per
(stream, pool) is mapped page by page instead (2 MiB pages for small requests, 20 MiB for
large ones) and the tail is reused.

The rules and constants are torch_npu's NPUCachingAllocator (Ascend/pytorch, the source that
builds 2.14.0), which the CANN emulation's measurements confirm (docs/planner.md, "Checked
against the real allocator"): the same as CUDA's caching allocator except the padding.
Pure Python; what it cannot know: memory outside the allocator (HCCL's buffers, the CANN
runtime: the caller gives the ``limit`` they leave). Release-and-retry when the device is full is
modelled as torch_npu's last resort (every cached segment released), not its first (the cached
blocks at least as large as the request).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KiB, MiB = 1024, 1024 * 1024
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB  # rounded sizes up to this come from the small pool
SMALL_BUFFER = 2 * MiB  # a small pool segment (and an expandable small-pool page)
LARGE_BUFFER = 20 * MiB  # a segment for a rounded size in (1 MiB, 10 MiB); an expandable large-pool page
MIN_LARGE_ALLOC = 10 * MiB  # from this size a segment is the request rounded up to 2 MiB
ROUND_LARGE = 2 * MiB
NPU_PAD = 32  # bytes torch_npu adds to every request on Atlas A2/A3 (AddPadSize)
BASE_ADDR_ALIGN = 16 * KiB  # expandable segments: a block of 2 MiB or more starts at a multiple of this


def rounded_size(nbytes: int, pad: int = NPU_PAD) -> int:
    """The block size torch_npu gives a request of ``nbytes``."""
    size = nbytes + pad
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(block: int) -> int:
    """The segment torch_npu asks the device for when no cached block fits ``block`` bytes."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment: int, offset: int, size: int) -> None:
        self.segment, self.offset, self.size, self.free = segment, offset, size, True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class _Pool:
    """Free blocks of one (stream, small/large) pool, ordered by (size, segment, offset): best fit."""

    free: list[tuple[int, int, int]] = field(default_factory=list)

    def add(self, block: _Block) -> None:
        bisect.insort(self.free, block.key())

    def remove(self, block: _Block) -> None:
        self.free.pop(bisect.bisect_left(self.free, block.key()))

    def best_fit(self, size: int) -> int | None:
        """Index of the smallest free block of at least ``size`` bytes (lowest address on ties)."""
        index = bisect.bisect_left(self.free, (size, -1, -1))
        return index if index < len(self.free) else None


@dataclass
class Stats:
    allocated: int = 0  # bytes in handed-out blocks (rounded, padded, unsplit slack included)
    reserved: int = 0  # bytes of segments (or mapped pages)
    requested: int = 0  # bytes callers asked for
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_requested: int = 0
    segments: int = 0
    retries: int = 0  # times the device was full and the cache was released to retry
    failed: int = 0  # requests that did not fit even then: the run stops with "out of memory"


class CachingAllocator:
    """Replays allocations and frees; reports what torch.npu's memory statistics would.

    ``pad`` is 32 on Atlas A2/A3; ``expandable`` follows ``PYTORCH_NPU_ALLOC_CONF=expandable_segments:True``.
    ``limit``: the bytes the allocator can reserve (the device's memory less what lives outside it);
    a segment that would pass it makes the allocator release its cached segments and retry, as
    torch_npu does, and counts as failed when it still does not fit.
    """

    def __init__(self, *, pad: int = NPU_PAD, expandable: bool = False, large_page: int = LARGE_BUFFER,
                 device_memory: int = 64 << 30, limit: int | None = None) -> None:
        self.limit = limit
        self.pad = pad
        self.expandable = expandable
        self.large_page = large_page
        self.device_memory = device_memory  # an expandable segment reserves 1.125x this in address space
        self.stats = Stats()
        self._pools: dict[tuple[object, bool], _Pool] = {}
        self._blocks: dict[tuple[int, int], _Block] = {}  # (segment, offset) -> block
        self._segments: list[tuple[tuple[object, bool], _Block | None, int]] = []  # (pool key, first block, bytes)
        self._live: dict[object, tuple[_Block, int]] = {}  # handle -> (block, requested bytes)
        self._tail: dict[tuple[object, bool], _Block] = {}  # expandable: the last block of each pool's segment

    # -- public ---------------------------------------------------------------------------
    def malloc(self, handle: object, nbytes: int, stream: object = 0) -> None:
        size = rounded_size(nbytes, self.pad)
        key = (stream, size <= SMALL_SIZE)
        pool = self._pools.setdefault(key, _Pool())
        index = pool.best_fit(size)
        if index is not None and self.expandable:
            # torch_npu ranks a block before unmapped address space by the size it can grow to, so the
            # segment's tail is chosen last: it walks on while the next candidate can grow less.
            while index + 1 < len(pool.free) and self._growable(pool.free[index + 1]) < self._growable(pool.free[index]):
                index += 1
        block = self._blocks[pool.free[index][1:]] if index is not None else self._grow(key, pool, size)
        pool.remove(block)
        if self.expandable and size >= ROUND_LARGE and block.offset % BASE_ADDR_ALIGN:
            block = self._align(key, pool, block, size)
        self._split(key, pool, block, size)
        block.free = False
        self._live[handle] = (block, nbytes)
        self._count(block.size, nbytes)

    def free(self, handle: object) -> None:
        block, nbytes = self._live.pop(handle)
        self._count(-block.size, -nbytes)
        pool = self._pools[self._segments[block.segment][0]]
        block.free = True
        # Merge with free neighbours in the same segment, as the allocator does on free.
        for neighbour in (block.next, block.prev):
            if neighbour is not None and neighbour.free:
                pool.remove(neighbour)
                first, second = (block, neighbour) if neighbour is block.next else (neighbour, block)
                del self._blocks[(second.segment, second.offset)]
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                if self._tail.get(self._segments[block.segment][0]) is second:
                    self._tail[self._segments[block.segment][0]] = first
                block = first
        pool.add(block)

    def empty_cache(self) -> None:
        """Release every segment holding no allocated block (torch.npu.empty_cache)."""
        for segment, (key, first, nbytes) in enumerate(self._segments):
            if nbytes and first is not None and first.free and first.next is None:
                self._pools[key].remove(first)
                del self._blocks[(segment, first.offset)]
                self.stats.reserved -= nbytes
                self._segments[segment] = (key, None, 0)
                if self._tail.get(key) is first:
                    del self._tail[key]

    def reset_peaks(self) -> None:
        """torch.npu.reset_peak_memory_stats: the peaks restart from the current values."""
        self.stats.peak_allocated = self.stats.allocated
        self.stats.peak_reserved = self.stats.reserved
        self.stats.peak_requested = self.stats.requested

    # -- internals ------------------------------------------------------------------------
    def _count(self, allocated: int, requested: int) -> None:
        stats = self.stats
        stats.allocated += allocated
        stats.requested += requested
        stats.peak_allocated = max(stats.peak_allocated, stats.allocated)
        stats.peak_requested = max(stats.peak_requested, stats.requested)

    def _growable(self, entry: tuple[int, int, int]) -> int:
        block = self._blocks[entry[1:]]
        if block.next is not None:
            return block.size
        key = self._segments[block.segment][0]
        page = SMALL_BUFFER if key[1] else self.large_page
        reservation = -(-(self.device_memory + self.device_memory // 8) // page) * page
        return reservation - block.offset

    def _make_room(self, nbytes: int) -> None:
        if self.limit is None or self.stats.reserved + nbytes <= self.limit:
            return
        if not self.expandable:  # expandable segments hold little cache to release: not modelled
            self.stats.retries += 1
            self.empty_cache()
        if self.stats.reserved + nbytes > self.limit:
            self.stats.failed += 1

    def _reserve(self, nbytes: int) -> None:
        self.stats.reserved += nbytes
        self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)

    def _grow(self, key: tuple[object, bool], pool: _Pool, size: int) -> _Block:
        if self.expandable:
            return self._map_pages(key, pool, size)
        nbytes = segment_size(size)
        self._make_room(nbytes)
        segment = len(self._segments)
        block = _Block(segment, 0, nbytes)
        self._segments.append((key, block, nbytes))
        self._blocks[(segment, 0)] = block
        self.stats.segments += 1
        self._reserve(nbytes)
        pool.add(block)
        return block

    def _map_pages(self, key: tuple[object, bool], pool: _Pool, size: int) -> _Block:
        """Expandable segments: one virtual segment per pool, mapped page by page at its end."""
        page = SMALL_BUFFER if key[1] else self.large_page
        tail = self._tail.get(key)
        if tail is None:
            segment = len(self._segments)
            self._segments.append((key, None, 0))
            self.stats.segments += 1
            end = 0
        else:
            segment, end = tail.segment, tail.offset + tail.size
        have = tail.size if tail is not None and tail.free else 0
        mapped = -(-(size - have) // page) * page
        self._make_room(mapped)
        _, first, nbytes = self._segments[segment]
        self._reserve(mapped)
        if have:
            pool.remove(tail)
            tail.size += mapped
            block = tail
        else:
            block = _Block(segment, end, mapped)
            self._blocks[(segment, end)] = block
            block.prev = tail
            if tail is not None:
                tail.next = block
            self._tail[key] = block
        self._segments[segment] = (key, first or block, nbytes + mapped)
        pool.add(block)
        return block

    def _align(self, key: tuple[object, bool], pool: _Pool, block: _Block, size: int) -> _Block:
        """torch_npu's base_addr_aligned_kb (16 KiB): the block's leading bytes up to the next aligned
        address stay free, when the request still fits after them."""
        shift = BASE_ADDR_ALIGN - block.offset % BASE_ADDR_ALIGN
        if shift + size > block.size:
            return block
        aligned = _Block(block.segment, block.offset + shift, block.size - shift)
        self._blocks[(aligned.segment, aligned.offset)] = aligned
        aligned.prev, aligned.next = block, block.next
        if block.next is not None:
            block.next.prev = aligned
        block.next = aligned
        block.size = shift
        if self._tail.get(key) is block:
            self._tail[key] = aligned
        pool.add(block)
        return aligned

    def _split(self, key: tuple[object, bool], pool: _Pool, block: _Block, size: int) -> None:
        remaining = block.size - size
        small = key[1]
        # Small pool (and expandable segments): split from 512 bytes on; large pool: only above 1 MiB.
        if remaining >= MIN_BLOCK if (small or self.expandable) else remaining > SMALL_SIZE:
            rest = _Block(block.segment, block.offset + size, remaining)
            self._blocks[(rest.segment, rest.offset)] = rest
            block.size = size
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            if self._tail.get(key) is block:
                self._tail[key] = rest
            pool.add(rest)

"""A pure-Python model of PyTorch's CUDA caching allocator, for estimating reserved memory without a GPU.

Why: batchfit can trace a training step on fake tensors on a CPU-only machine, which yields a stream
of tensor allocations and frees but no memory numbers. What decides whether a batch fits on a GPU is
``torch.cuda.memory_reserved()``: the bytes the caching allocator has taken from the device, which is
larger than the bytes live tensors use because of rounding, segment granularity and fragmentation.
Replaying the trace through this model gives that number.

The model follows ``c10/cuda/CUDACachingAllocator.cpp`` (native allocator, default settings):

* Requests are rounded up to a multiple of 512 bytes (``MIN_BLOCK``); a 0-byte request allocates nothing.
* Rounded sizes up to 1 MiB (``SMALL_SIZE``) use the small pool, larger ones the large pool; the pools
  never share segments.
* A request takes the smallest cached free block of its pool that is big enough (ties: lowest address).
  A block with room to spare is split when the remainder is >= 512 bytes (small pool) or > 1 MiB (large
  pool); otherwise the whole block is handed out and the excess stays inside the allocated block.
* With no fitting block a new segment is reserved: 2 MiB for small requests, 20 MiB for large requests
  under 10 MiB, else the size rounded up to 2 MiB.
* Freed blocks coalesce with free neighbours of the same segment and stay cached; only ``empty_cache()``
  gives back segments, and only those that are entirely free.
* ``allocated_bytes`` counts allocated *block* sizes, like PyTorch's ``allocated_bytes`` stat behind
  ``torch.cuda.memory_allocated()``: an unsplit excess counts (a 13 MiB tensor alone reports 14 MiB).
  ``requested_bytes`` is the sum of the rounded request sizes.

Simplifications: one device and one stream (no cross-stream events or ``record_stream``); no device
capacity, so no out-of-memory path (no freeing of cached blocks and retry, no garbage collection
threshold); ``PYTORCH_CUDA_ALLOC_CONF`` options are at their defaults (``max_split_size`` unlimited, no
``roundup_power2_divisions``, no expandable segments); no CUDA graph private pools; segment addresses
are assigned in reservation order, so "lowest address" ties follow that order rather than whatever the
driver returns; the CUDA context and cuBLAS/cuDNN workspaces, which are not part of the allocator's
reserved bytes anyway, are not modelled.

Pure Python: no torch import.
"""

from __future__ import annotations

import bisect
import operator

__all__ = [
    "LARGE_BUFFER",
    "MIN_BLOCK",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "CachingAllocatorModel",
    "round_size",
    "segment_size",
]

MIB = 1024 * 1024

MIN_BLOCK = 512
"""kMinBlockSize: every request is rounded up to a multiple of this."""
SMALL_SIZE = 1 * MIB
"""kSmallSize: the largest rounded request served by the small pool."""
SMALL_BUFFER = 2 * MIB
"""kSmallBuffer: the segment size reserved for small requests."""
LARGE_BUFFER = 20 * MIB
"""kLargeBuffer: the segment size reserved for large requests under ``MIN_LARGE_ALLOC``."""
MIN_LARGE_ALLOC = 10 * MIB
"""kMinLargeAlloc: large requests from this size on get a segment of their own size (rounded)."""
ROUND_LARGE = 2 * MIB
"""kRoundLarge: the rounding of segments for requests of at least ``MIN_LARGE_ALLOC``."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def round_size(nbytes: int) -> int:
    """The size the allocator actually serves for a request of ``nbytes`` (a multiple of 512; 0 stays 0).

    Rounding is why many tiny tensors cost more than their bytes: each takes at least 512.
    """
    if nbytes < 0:
        raise ValueError(f"cannot round a negative size: {nbytes}")
    return _round_up(nbytes, MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """The segment a fresh device reservation gets when no cached block fits a ``rounded``-byte request.

    Small requests share 2 MiB segments and mid-sized ones 20 MiB segments, so that later requests can
    be carved out of them; big requests get a segment of (about) their own size.
    """
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _round_up(rounded, ROUND_LARGE)


def _is_small(rounded: int) -> bool:
    return rounded <= SMALL_SIZE


def _should_split(block_size: int, rounded: int, small: bool) -> bool:
    """Whether serving ``rounded`` from a ``block_size`` block leaves a remainder worth a block of its own.

    The large pool keeps remainders of 1 MiB or less attached to the allocated block, because such a
    remainder could only ever serve a small request, and those never come to the large pool.
    """
    remaining = block_size - rounded
    return remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE


class _Segment:
    """One device reservation; its blocks tile it exactly, in address order."""

    __slots__ = ("base", "size", "small")

    def __init__(self, base: int, size: int, small: bool) -> None:
        self.base = base
        self.size = size
        self.small = small


class _Block:
    """A contiguous piece of a segment, free or allocated, linked to its neighbours for coalescing."""

    __slots__ = ("addr", "size", "segment", "prev", "next", "allocated", "requested")

    def __init__(self, addr: int, size: int, segment: _Segment) -> None:
        self.addr = addr
        self.size = size
        self.segment = segment
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.requested = 0

    def key(self) -> tuple[int, int]:
        """Order in a free list: by size, then address, which makes the first fit the best fit."""
        return (self.size, self.addr)


class _FreeList:
    """A pool's cached free blocks, sorted so a bisect finds the smallest block that fits."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[int, _Block] = {}

    def add(self, block: _Block) -> None:
        bisect.insort(self._keys, block.key())
        self._blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        i = bisect.bisect_left(self._keys, block.key())
        del self._keys[i]
        del self._blocks[block.addr]

    def best_fit(self, rounded: int) -> _Block | None:
        """The smallest free block of at least ``rounded`` bytes, lowest address first among equals."""
        i = bisect.bisect_left(self._keys, (rounded, -1))
        if i == len(self._keys):
            return None
        return self._blocks[self._keys[i][1]]

    def whole_segments(self) -> list[_Block]:
        """Free blocks that span their entire segment: the only ones ``empty_cache`` can give back."""
        return [b for b in self._blocks.values() if b.prev is None and b.next is None]


class CachingAllocatorModel:
    """Replays ``malloc``/``free`` calls and tracks the bytes PyTorch's caching allocator would hold.

    ``malloc`` returns an opaque integer handle for the later ``free``. ``would_reserve`` asks what a
    request would add to the reservation without making it, which lets a caller find the step that
    sets the peak.
    """

    def __init__(self) -> None:
        self._small = _FreeList()
        self._large = _FreeList()
        self._live: dict[int, _Block | None] = {}
        self._next_handle = 1
        self._next_addr = 0
        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0

    # -- requests ---------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Serve a request of ``nbytes`` and return its handle; reserves a segment when nothing cached fits."""
        rounded = self._checked_round(nbytes)
        handle = self._next_handle
        self._next_handle += 1
        if rounded == 0:
            self._live[handle] = None
            return handle
        small = _is_small(rounded)
        block = self._pool(small).best_fit(rounded)
        if block is None:
            block = self._reserve(segment_size(rounded), small)
        else:
            self._pool(small).remove(block)
        if _should_split(block.size, rounded, small):
            self._split(block, rounded)
        block.allocated = True
        block.requested = rounded
        self._live[handle] = block
        self._allocated += block.size
        self._requested += rounded
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        return handle

    def free(self, handle: int) -> None:
        """Return a request's block to its pool's cache, merged with free neighbours; reserved is unchanged."""
        try:
            block = self._live.pop(handle)
        except KeyError:
            raise KeyError(f"unknown or already freed handle: {handle!r}") from None
        if block is None:
            return
        self._allocated -= block.size
        self._requested -= block.requested
        block.allocated = False
        block.requested = 0
        self._pool(block.segment.small).add(self._coalesce(block))

    def empty_cache(self) -> None:
        """Give back every segment that is entirely free, like ``torch.cuda.empty_cache()``."""
        for pool in (self._small, self._large):
            for block in pool.whole_segments():
                pool.remove(block)
                self._reserved -= block.segment.size

    def block_bytes(self, handle: int) -> int:
        """The bytes a live request's block counts in ``allocated_bytes`` (0 for a 0-byte request)."""
        block = self._live[handle]
        return 0 if block is None else block.size

    def would_reserve(self, nbytes: int) -> int:
        """Bytes ``malloc(nbytes)`` would add to the reservation now (0 when a cached block fits); no state changes."""
        rounded = self._checked_round(nbytes)
        if rounded == 0 or self._pool(_is_small(rounded)).best_fit(rounded) is not None:
            return 0
        return segment_size(rounded)

    # -- statistics -------------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Bytes in allocated blocks, unsplit excess included: what ``torch.cuda.memory_allocated()`` says."""
        return self._allocated

    @property
    def requested_bytes(self) -> int:
        """Sum of the rounded sizes of live requests: ``allocated_bytes`` less the unsplit excess."""
        return self._requested

    @property
    def reserved_bytes(self) -> int:
        """Bytes in segments taken from the device: what ``torch.cuda.memory_reserved()`` says."""
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        """The highest ``allocated_bytes`` since construction or the last ``reset_peaks()``."""
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """The highest ``reserved_bytes`` since construction or the last ``reset_peaks()``."""
        return self._peak_reserved

    def reset_peaks(self) -> None:
        """Start peak tracking afresh from the current values, like ``torch.cuda.reset_peak_memory_stats()``."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    # -- internals --------------------------------------------------------------------------------

    @staticmethod
    def _checked_round(nbytes: int) -> int:
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes: {nbytes}")
        return round_size(nbytes)

    def _pool(self, small: bool) -> _FreeList:
        return self._small if small else self._large

    def _reserve(self, size: int, small: bool) -> _Block:
        """Take a new segment from the "device" and return it as one free block not in any free list."""
        segment = _Segment(self._next_addr, size, small)
        self._next_addr += size
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return _Block(segment.base, size, segment)

    def _split(self, block: _Block, rounded: int) -> None:
        """Cut ``block`` down to ``rounded`` bytes; the tail becomes a cached free block (as in PyTorch)."""
        tail = _Block(block.addr + rounded, block.size - rounded, block.segment)
        tail.prev, tail.next = block, block.next
        if block.next is not None:
            block.next.prev = tail
        block.next = tail
        block.size = rounded
        self._pool(block.segment.small).add(tail)

    def _coalesce(self, block: _Block) -> _Block:
        """Merge a just-freed block with its free neighbours (taking them out of the free list)."""
        pool = self._pool(block.segment.small)
        prev = block.prev
        if prev is not None and not prev.allocated:
            pool.remove(prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            pool.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        return block

"""A pure-Python model of PyTorch's CUDA caching allocator, for estimating reserved memory without a GPU.

Why: batchfit can trace a training step on fake tensors on a CPU-only machine, which yields a stream
of tensor allocations and frees but no memory numbers. What decides whether a batch fits on a GPU is
``torch.cuda.memory_reserved()``: the bytes the caching allocator has taken from the device, which is
larger than the bytes live tensors use because of rounding, segment granularity and fragmentation.
Replaying the trace through this model gives that number.

The model follows ``c10/cuda/CUDACachingAllocator.cpp`` (the native allocator):

* Requests are rounded up to a multiple of 512 bytes (``MIN_BLOCK``); a 0-byte request allocates
  nothing. With ``roundup_power2_divisions``, a request over 512 x n bytes is rounded up to the next
  of n steps between two powers of two instead (``round_size``).
* Rounded sizes up to 1 MiB (``SMALL_SIZE``) use the small pool, larger ones the large pool; the pools
  never share segments.
* A request takes the smallest cached free block of its pool that is big enough (ties: lowest address);
  with ``max_split_size_mb``, a block of that size or more serves only a request of at least that size
  that it exceeds by less than ``max_non_split_rounding_mb`` (``get_free_block``). A block with room to
  spare is split when the remainder is >= 512 bytes (small pool, and every block under expandable
  segments) or > 1 MiB (large pool, requests under ``max_split_size``); otherwise the whole block is
  handed out and the excess stays inside the allocated block (``should_split``).
* With no fitting block a new segment is reserved: 2 MiB for small requests, 20 MiB
  (``large_segment_size_mb``) for large requests under 10 MiB, else the size rounded up to 2 MiB.
* Expandable segments (``expandable_segments:True``): each pool has one segment whose address space
  is mapped on demand in pages of 2 MiB (small pool) or 20 MiB (large pool); a miss maps just the
  pages the request needs beyond the free block at the mapped end (``find_expandable_block``,
  ``map_block``), so the reservation grows by the pages a request lacks, not by a segment per request
  size: where a step's blocks tile the segment, reserved stays within a page per pool of allocated
  (a freed hole stays mapped until ``empty_cache()``, which unmaps every whole free page); best fit
  prefers blocks that cannot grow into unmapped space.
* Under a limit (``limit_bytes``: the maximum a memory fraction allows, ``allowed_memory_maximum``), a
  miss first runs the garbage collector when ``garbage_collection_threshold`` is set (past that share
  of the limit it gives back the cached whole large segments that have gone unsearched longest,
  ``garbage_collect_cached_blocks``); a new reservation whose size (the segment size, also under
  expandable segments, where the pages actually mapped may overshoot the limit by less than a page)
  would take reserved bytes past the limit is refused; the allocator then gives back cached oversize
  blocks (``release_available_cached_blocks``, only with ``max_split_size_mb``), then every cached
  whole segment or unmapped page (``release_cached_blocks``), and tries again. A request still refused
  is an out-of-memory error in PyTorch; the model serves it anyway, so that a trace can go on, and
  keeps it for `CachingAllocatorModel.pop_failure`.
* Freed blocks coalesce with free neighbours of the same segment and stay cached; only ``empty_cache()``
  (or the limit) gives memory back.
* ``allocated_bytes`` counts allocated *block* sizes, like PyTorch's ``allocated_bytes`` stat behind
  ``torch.cuda.memory_allocated()``: an unsplit excess counts (a 13 MiB tensor alone reports 14 MiB).
  ``requested_bytes`` is the sum of the rounded request sizes.

Simplifications: one device and one stream (no cross-stream events or ``record_stream``); no device
capacity (a reservation fails only against ``limit_bytes``); no CUDA graph private pools; segment
addresses are assigned in reservation order, so "lowest address" ties follow that order rather than
whatever the driver returns; an expandable segment's address space never runs out (torch reserves
1.125 x the device's memory), so each pool has at most one; the settings are fixed for the model's
life (torch lets a program switch expandable segments on and off); the garbage collector and the
release of oversize blocks give back only whole segments (in torch an oversize cached block is one
anyway); ``per_process_memory_fraction`` is left to the caller's ``limit_bytes`` (it needs the device's
total); ``backend:cudaMallocAsync`` is refused (the driver's pool is not this allocator); the CUDA
context and cuBLAS/cuDNN workspaces, which are not part of the allocator's reserved bytes anyway, are
not modelled.

Pure Python: no torch import.
"""

from __future__ import annotations

import operator

from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.backends.allocator_blocks import (
    Block,
    Pool,
    Segment,
    allocate_expandable,
    collectable,
    merge,
    oversize_to_release,
    pages_to_map,
    split,
    unmap_pages,
)
from batchfit.backends.allocator_snapshot import SnapshotSegment, snapshot_of

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
"""kSmallBuffer: the segment size reserved for small requests (and an expandable small page)."""
LARGE_BUFFER = 20 * MIB
"""kLargeBuffer: the default segment for large requests under ``MIN_LARGE_ALLOC`` (and large page)."""
MIN_LARGE_ALLOC = 10 * MIB
"""kMinLargeAlloc: large requests from this size on get a segment of their own size (rounded)."""
ROUND_LARGE = 2 * MIB
"""kRoundLarge: the rounding of segments for requests of at least ``MIN_LARGE_ALLOC``."""

_DEFAULT = AllocatorConfig()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def round_size(nbytes: int, config: AllocatorConfig = _DEFAULT) -> int:
    """The size the allocator actually serves for a request of ``nbytes`` (0 stays 0).

    Rounding is why many tiny tensors cost more than their bytes: each takes at least 512. With
    ``roundup_power2_divisions`` n for the request's size, a request over 512 x n bytes is rounded up
    to the next of n equal steps between the powers of two around it (``roundup_power2_next_division``).
    """
    if nbytes < 0:
        raise ValueError(f"cannot round a negative size: {nbytes}")
    if nbytes == 0:
        return 0
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    divisions = config.divisions(nbytes)
    if divisions > 1 and nbytes > MIN_BLOCK * divisions:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        down = nbytes & ~(step - 1)
        return nbytes if down == nbytes else down + step
    return _round_up(nbytes, MIN_BLOCK)


def segment_size(rounded: int, config: AllocatorConfig = _DEFAULT) -> int:
    """The segment a fresh device reservation gets when no cached block fits a ``rounded``-byte request.

    Small requests share 2 MiB segments and mid-sized ones 20 MiB (``large_segment_size_mb``) segments,
    so that later requests can be carved out of them; big requests get a segment of (about) their own
    size. Under a limit this is also the size checked against it, expandable segments or not: torch's
    ``alloc_block`` checks this whole size before ``try_allocate_expandable_block`` maps only the pages
    missing beyond the free block at the segment's end, so under expandable segments a limit refuses
    some requests that a device of the limit's size would serve (stricter, on the safe side).
    """
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return config.large_segment_bytes
    return _round_up(rounded, ROUND_LARGE)


class CachingAllocatorModel:
    """Replays ``malloc``/``free`` calls and tracks the bytes PyTorch's caching allocator would hold.

    ``malloc`` returns an opaque integer handle for the later ``free``. ``would_reserve`` asks what a
    request would add to the reservation without making it, which lets a caller find the step that
    sets the peak. ``config``: the allocator's settings (module docs; default: torch's defaults);
    ``limit_bytes``: the memory fraction's maximum, which a caller may change between requests.
    """

    def __init__(self, config: AllocatorConfig | None = None, *, limit_bytes: int | None = None) -> None:
        self.config = config if config is not None else _DEFAULT
        if self.config.backend != "native":
            raise ValueError(
                f"the caching allocator model is of the native allocator, not backend:{self.config.backend} "
                "(whose memory pool the CUDA driver manages)"
            )
        self.limit_bytes = limit_bytes
        self._small = Pool(small=True)
        self._large = Pool(small=False)
        self._live: dict[int, Block | None] = {}
        self._next_handle = 1
        self._next_addr = 0
        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._failure: tuple[int, int] | None = None

    # -- requests ---------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Serve a request of ``nbytes`` and return its handle; reserves memory when nothing cached fits."""
        nbytes = self._checked(nbytes)
        rounded = round_size(nbytes, self.config)
        handle = self._next_handle
        self._next_handle += 1
        if rounded == 0:
            self._live[handle] = None
            return handle
        pool = self._pool(rounded <= SMALL_SIZE)
        if self._collecting:
            pool.searches += 1
        block = self._free_block(pool, rounded)
        refused = False
        if block is not None:
            pool.remove(block)
        else:
            block, refused = self._new_block(pool, rounded)
        if self._should_split(block, rounded):
            split(block, rounded, pool)
        block.allocated = True
        block.requested, block.nbytes = rounded, nbytes
        self._live[handle] = block
        self._allocated += block.size
        self._requested += rounded
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        if refused:
            self._failure = (self._allocated, self._reserved)
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
        block.requested = block.nbytes = 0
        pool = self._pool(block.segment.small)
        merge(block, block.prev, pool)
        merge(block, block.next, pool)
        pool.add(block)

    def empty_cache(self) -> None:
        """Give back every cached segment that is entirely free, and every whole free page of an
        expandable segment, like ``torch.cuda.empty_cache()`` (``release_cached_blocks``)."""
        for pool in (self._large, self._small):
            for block in pool.blocks():
                if block.segment.expandable:
                    self._reserved -= unmap_pages(block, pool)
                elif block.whole:
                    self._release(block, pool)

    def block_bytes(self, handle: int) -> int:
        """The bytes a live request's block counts in ``allocated_bytes`` (0 for a 0-byte request)."""
        block = self._live[handle]
        return 0 if block is None else block.size

    def address(self, handle: int) -> int | None:
        """Where a live request's block starts (a tensor's ``data_ptr()``); ``None`` for a 0-byte request."""
        block = self._live[handle]
        return None if block is None else block.addr

    def would_reserve(self, nbytes: int) -> int:
        """Bytes ``malloc(nbytes)`` would add to the reservation now (0 when a cached block fits), leaving
        the limit aside; no state changes."""
        rounded = round_size(self._checked(nbytes), self.config)
        if rounded == 0:
            return 0
        pool = self._pool(rounded <= SMALL_SIZE)
        if self._free_block(pool, rounded) is not None:
            return 0
        if self.config.expandable_segments:
            return pages_to_map(pool, rounded, self._page(pool.small))
        return segment_size(rounded, self.config)

    def pop_failure(self) -> tuple[int, int] | None:
        """``(allocated, reserved)`` bytes right after the last request PyTorch would have refused under
        ``limit_bytes`` (an out-of-memory error; the model served it anyway), or ``None``; forgets it."""
        failure, self._failure = self._failure, None
        return failure

    def snapshot(self) -> list[SnapshotSegment]:
        """The segments and their blocks in ``torch.cuda.memory_snapshot()``'s format, by address
        (`snapshot_of`)."""
        cached = [b for pool in (self._small, self._large) for b in pool.blocks()]
        return snapshot_of(cached + [b for b in self._live.values() if b is not None])

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
        """Bytes in segments (mapped pages) taken from the device: what ``torch.cuda.memory_reserved()`` says."""
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

    # -- finding a block --------------------------------------------------------------------------

    @staticmethod
    def _checked(nbytes: int) -> int:
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes: {nbytes}")
        return nbytes

    def _pool(self, small: bool) -> Pool:
        return self._small if small else self._large

    def _page(self, small: bool) -> int:
        return SMALL_BUFFER if small else self.config.large_segment_bytes

    @property
    def _collecting(self) -> bool:
        """Whether the garbage collector runs: it needs a threshold and a memory fraction (a limit)."""
        return self.limit_bytes is not None and self.config.garbage_collection_threshold is not None

    def _free_block(self, pool: Pool, rounded: int) -> Block | None:
        """The cached block ``get_free_block`` hands out for ``rounded`` bytes, or ``None``; no state changes."""
        i = pool.first_fit(rounded)
        if i is None:
            return None
        block = pool.at(i)
        if block.segment.expandable:
            # A block that can grow into unmapped space counts as that big: best fit prefers others.
            def reach(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while i + 1 < len(pool) and reach(pool.at(i + 1)) < reach(block):
                i += 1
                block = pool.at(i)
        most = self.config.max_split_size_bytes
        if most is not None:
            if rounded < most <= block.size:  # no oversize block for a smaller request
                return None
            if rounded >= most and block.size >= rounded + self.config.max_non_split_rounding:
                return None
        return block

    def _should_split(self, block: Block, rounded: int) -> bool:
        """Whether serving ``rounded`` from ``block`` leaves a remainder worth a block of its own.

        The large pool keeps remainders of 1 MiB or less attached to the allocated block, because such a
        remainder could only ever serve a small request, and those never come to the large pool; nor
        does it split a block for a request of ``max_split_size`` or more. Expandable segments split all.
        """
        remaining = block.size - rounded
        if block.segment.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        most = self.config.max_split_size_bytes
        return (most is None or rounded < most) and remaining > SMALL_SIZE

    # -- taking memory from the device ------------------------------------------------------------

    def _new_block(self, pool: Pool, rounded: int) -> tuple[Block, bool]:
        """A block from new device memory, after what the allocator gives back to make room under the
        limit; ``True`` with it when PyTorch would have refused the request (out of memory)."""
        if self._collecting:
            self._garbage_collect()
        block = self._alloc(pool, rounded)
        if block is None and self._release_oversize(pool, rounded):
            block = self._alloc(pool, rounded)
        if block is None:
            self.empty_cache()
            block = self._alloc(pool, rounded)
        if block is not None:
            return block, False
        block = self._alloc(pool, rounded, force=True)
        assert block is not None
        return block, True

    def _alloc(self, pool: Pool, rounded: int, force: bool = False) -> Block | None:
        """``alloc_block``: a new segment, or pages mapped into the expandable one; ``None`` when the
        segment size would take reserved bytes past ``limit_bytes`` (unless ``force``)."""
        size = segment_size(rounded, self.config)
        limit = self.limit_bytes
        if not force and limit is not None and self._reserved + size > limit:
            return None
        if self.config.expandable_segments:
            block, mapped, self._next_addr = allocate_expandable(pool, rounded, self._page(pool.small), self._next_addr)
            self._gain(mapped)
            return block
        segment = Segment(self._next_addr, size, pool.small)
        self._next_addr += size
        self._gain(size)
        return Block(segment.base, size, segment)

    def _gain(self, size: int) -> None:
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    # -- giving memory back -----------------------------------------------------------------------

    def _release(self, block: Block, pool: Pool) -> None:
        """Give a cached whole segment back to the device (``release_block``)."""
        pool.remove(block)
        self._reserved -= block.size

    def _release_oversize(self, pool: Pool, rounded: int) -> bool:
        """With ``max_split_size_mb``, give back cached oversize segments to make room for the request."""
        most = self.config.max_split_size_bytes
        if most is None or self.config.expandable_segments:
            return False
        blocks, enough = oversize_to_release(pool, rounded, most)
        for block in blocks:
            self._release(block, pool)
        return enough

    def _garbage_collect(self) -> None:
        """Past ``garbage_collection_threshold x limit_bytes`` reserved, give back the cached whole large
        segments unused longest, until reserved is back under it (or none is old enough)."""
        assert self.limit_bytes is not None and self.config.garbage_collection_threshold is not None
        threshold = int(self.config.garbage_collection_threshold * self.limit_bytes)
        if self._reserved > threshold:
            for block in collectable(self._large, self._reserved - threshold):
                self._release(block, self._large)

"""The caching allocator model's memory: segments, their blocks, each pool's free blocks, and what cuts and joins them.

Why a room of its own: `batchfit.backends.allocator_model` decides *when* the allocator takes
or gives back memory and keeps the statistics; this module is the memory it decides on, kept as
``c10/cuda/CUDACachingAllocator.cpp`` keeps it: a ``Block`` linked to its neighbours in its segment;
per pool the free blocks ordered by ``(size, address)`` (``BlockComparatorSize``, so the first fit
is the best fit) and, for expandable segments, the address space not backed by memory
(``BlockPool::unmapped``, by address); and the operations that change the tiling without a policy
of their own: split, merge, map and unmap pages, find room in an expandable segment, and the
cached segments the garbage collector and the oversize release give back. Each function that takes
or gives back device memory returns how many bytes, for the caller's statistics.

Pure Python: no torch import.
"""

from __future__ import annotations

import bisect

__all__ = [
    "Block",
    "Pool",
    "Segment",
    "EXPANDABLE_ADDRESS_SPACE",
    "allocate_expandable",
    "collectable",
    "expandable_candidate",
    "map_pages",
    "merge",
    "oversize_to_release",
    "pages_to_map",
    "split",
    "unmap_pages",
]

#: The address space of a model's expandable segment: more than any device's memory, so it never
#: runs out and a pool has at most one (torch reserves 1.125 x the device's memory per segment).
EXPANDABLE_ADDRESS_SPACE = 1 << 40


class Segment:
    """One device reservation (a ``cudaMalloc``), or one expandable segment's address range.

    ``page``: an expandable segment maps memory in pages of this size (0 for a plain segment).
    """

    __slots__ = ("base", "size", "small", "page")

    def __init__(self, base: int, size: int, small: bool, page: int = 0) -> None:
        self.base = base
        self.size = size
        self.small = small
        self.page = page

    @property
    def expandable(self) -> bool:
        return self.page > 0


class Block:
    """A contiguous piece of a segment: allocated, cached free, or (expandable) not mapped.

    ``requested``: the rounded request it serves; ``nbytes``: the request as made (torch's
    ``requested_size``); ``gc_base``: the pool's count of free-block searches when the block was
    cached (its age for the garbage collector is the count now less this).
    """

    __slots__ = ("addr", "size", "segment", "prev", "next", "allocated", "mapped", "requested", "nbytes", "gc_base")

    def __init__(self, addr: int, size: int, segment: Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.segment = segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = mapped
        self.requested = 0
        self.nbytes = 0
        self.gc_base = 0

    def key(self) -> tuple[int, int]:
        """Order in a free list: by size, then address, which makes the first fit the best fit."""
        return (self.size, self.addr)

    @property
    def whole(self) -> bool:
        """Whether the block is its entire segment: only such a block's segment can be given back."""
        return self.prev is None and self.next is None

    @property
    def reusable(self) -> bool:
        """Whether the block can become part of a new allocation (torch's ``allocatable``)."""
        return not self.allocated

    def insert_before(self, block: Block) -> None:
        """Link this new block into ``block``'s segment right before it."""
        self.prev, self.next = block.prev, block
        if block.prev is not None:
            block.prev.next = self
        block.prev = self

    def insert_after(self, block: Block) -> None:
        """Link this new block into ``block``'s segment right after it."""
        self.prev, self.next = block, block.next
        if block.next is not None:
            block.next.prev = self
        block.next = self


class Pool:
    """One pool's (small or large) cached free blocks, and its unmapped expandable address space.

    ``searches`` counts free-block searches while garbage collection is on (torch's
    ``get_free_blocks_call_count``); a block added to the free list notes it in ``gc_base``.
    """

    def __init__(self, small: bool) -> None:
        self.small = small
        self.searches = 0
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[int, Block] = {}
        self._unmapped: dict[int, Block] = {}

    # the free list, by (size, address) ---------------------------------------------------------------
    def add(self, block: Block) -> None:
        block.gc_base = self.searches
        bisect.insort(self._keys, block.key())
        self._blocks[block.addr] = block

    def remove(self, block: Block) -> None:
        i = bisect.bisect_left(self._keys, block.key())
        del self._keys[i]
        del self._blocks[block.addr]

    def __len__(self) -> int:
        return len(self._keys)

    def at(self, index: int) -> Block:
        """The free block at ``index`` in ``(size, address)`` order."""
        return self._blocks[self._keys[index][1]]

    def first_fit(self, size: int) -> int | None:
        """The index of the smallest free block of at least ``size`` bytes (lowest address among equals)."""
        i = bisect.bisect_left(self._keys, (size, -1))
        return None if i == len(self._keys) else i

    def blocks(self) -> list[Block]:
        """The free blocks in ``(size, address)`` order (a copy: the caller may change the pool)."""
        return [self._blocks[addr] for _, addr in self._keys]

    # unmapped address space (expandable segments), by address ----------------------------------------
    def add_unmapped(self, block: Block) -> None:
        self._unmapped[block.addr] = block

    def remove_unmapped(self, block: Block) -> None:
        del self._unmapped[block.addr]

    def unmapped(self) -> list[Block]:
        """The unmapped blocks, lowest address first."""
        return [self._unmapped[addr] for addr in sorted(self._unmapped)]


# changing the tiling --------------------------------------------------------------------------------
def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def split(block: Block, size: int, pool: Pool) -> None:
    """Cut ``block`` down to ``size`` bytes; the tail becomes a cached free block (as in PyTorch)."""
    tail = Block(block.addr + size, block.size - size, block.segment)
    tail.insert_after(block)
    block.size = size
    pool.add(tail)


def merge(block: Block, other: Block | None, pool: Pool) -> None:
    """Fold a free neighbour in the same mapping state into ``block`` (``try_merge_blocks``);
    ``block`` itself is in no free list or unmapped set while this runs."""
    if other is None or other.allocated or other.mapped != block.mapped:
        return
    if other.mapped:
        pool.remove(other)
    else:
        pool.remove_unmapped(other)
    if other is block.prev:
        block.addr, block.prev = other.addr, other.prev
        if other.prev is not None:
            other.prev.next = block
    else:
        block.next = other.next
        if other.next is not None:
            other.next.prev = block
    block.size += other.size


def expandable_candidate(pool: Pool, size: int) -> Block | None:
    """``find_expandable_block``: the lowest block (free, or unmapped) from which ``size`` bytes of free
    and unmapped space run on; ``None`` when the pool has no expandable segment yet."""
    for block in pool.unmapped():
        start = block.prev if block.prev is not None and block.prev.reusable else block
        room, current = 0, start
        while room < size and current is not None and current.reusable:
            room += current.size
            current = current.next
        if room >= size:
            return start
    return None


def map_pages(block: Block, size: int, pool: Pool) -> tuple[Block, int]:
    """``map_block``: back the first ``size`` bytes of unmapped ``block`` with whole pages, merged with its
    free neighbours into one cached block; that block and the bytes mapped."""
    mapped = _round_up(size, block.segment.page)
    pool.remove_unmapped(block)
    block.mapped = True
    if mapped < block.size:
        rest = Block(block.addr + mapped, block.size - mapped, block.segment, mapped=False)
        rest.insert_after(block)
        pool.add_unmapped(rest)
        block.size = mapped
    merge(block, block.prev, pool)
    merge(block, block.next, pool)
    pool.add(block)
    return block, mapped


def unmap_pages(block: Block, pool: Pool) -> int:
    """``unmap_block``: give back the whole pages inside cached ``block`` of an expandable segment, and
    the segment itself when nothing of it stays mapped; the bytes unmapped."""
    segment = block.segment
    offset, end = block.addr - segment.base, block.addr - segment.base + block.size
    first, last = _round_up(offset, segment.page), end // segment.page * segment.page
    if first >= last:
        return 0
    pool.remove(block)
    if first > offset:
        before = Block(block.addr, first - offset, segment)
        before.insert_before(block)
        pool.add(before)
    if end > last:
        after = Block(segment.base + last, end - last, segment)
        after.insert_after(block)
        pool.add(after)
    block.addr, block.size, block.mapped = segment.base + first, last - first, False
    merge(block, block.prev, pool)
    merge(block, block.next, pool)
    if not block.whole:  # else the segment is all unmapped: it goes (release_expandable_segment)
        pool.add_unmapped(block)
    return last - first


def allocate_expandable(pool: Pool, size: int, page: int, next_address: int) -> tuple[Block, int, int]:
    """``try_allocate_expandable_block``: a block of at least ``size`` bytes from the pool's expandable
    segment (made at ``next_address`` when the pool has none), its free block at the mapped end grown
    by as many pages as it lacks; the block (out of the free list), the bytes mapped, and the next
    free address."""
    candidate = expandable_candidate(pool, size)
    if candidate is None:
        base = _round_up(next_address, page)
        segment = Segment(base, EXPANDABLE_ADDRESS_SPACE, pool.small, page)
        next_address = base + segment.size
        candidate = Block(base, segment.size, segment, mapped=False)
        pool.add_unmapped(candidate)
    mapped = 0
    if not candidate.mapped:
        candidate, mapped = map_pages(candidate, min(candidate.size, size), pool)
    while candidate.size < size:  # a free block followed by unmapped space: map what it lacks
        following = candidate.next
        assert following is not None
        candidate, more = map_pages(following, min(size - candidate.size, following.size), pool)
        mapped += more
    pool.remove(candidate)
    return candidate, mapped, next_address


def pages_to_map(pool: Pool, size: int, page: int) -> int:
    """The bytes `allocate_expandable` would map for ``size`` bytes now; no state changes."""
    block = expandable_candidate(pool, size)
    if block is None:
        return _round_up(size, page)
    have = mapped = 0
    while have < size:  # along the candidate's chain of free and unmapped blocks
        assert block is not None
        if block.mapped:
            have += block.size
        else:
            pages = _round_up(min(block.size, size - have), page)
            have, mapped = have + pages, mapped + pages
        block = block.next
    return mapped


# what a policy gives back ----------------------------------------------------------------------------
def oversize_to_release(pool: Pool, size: int, max_split: int) -> tuple[list[Block], bool]:
    """``release_available_cached_blocks``: the cached oversize segments to give back for a request of
    ``size`` under ``max_split_size``: one big enough, else the biggest until as much; and whether
    that is enough (only whole segments: in torch an oversize cached block is one anyway)."""
    wanted = max(size, max_split)
    i = pool.first_fit(wanted)
    if i is not None:
        block = pool.at(i)
        return ([block], True) if block.whole else ([], False)
    chosen: list[Block] = []
    released = 0
    for block in reversed(pool.blocks()):
        if released >= wanted or block.size < max_split:
            break
        if block.whole:
            chosen.append(block)
            released += block.size
    return chosen, released >= wanted


def collectable(pool: Pool, target: int) -> list[Block]:
    """``garbage_collect_cached_blocks``: the cached whole (plain) segments of ``pool`` to give back to
    reclaim ``target`` bytes, oldest first in passes: each pass takes every one at least as old (in
    searches of the pool) as the average age of those left, until enough or none is taken."""
    freeable = [b for b in pool.blocks() if b.whole and not b.segment.expandable]
    ages = {id(b): pool.searches - b.gc_base for b in freeable}
    total_age, count = sum(ages.values()), len(freeable)
    chosen: list[Block] = []
    reclaimed, took = 0, True
    while reclaimed < target and took and count > 0:
        average, took = total_age / count, False
        for block in freeable:
            age = ages.pop(id(block), None)
            if age is None:
                continue  # taken in an earlier pass
            if age < average:
                ages[id(block)] = age
                continue
            took = True
            chosen.append(block)
            reclaimed += block.size
            total_age, count = total_age - age, count - 1
    return chosen

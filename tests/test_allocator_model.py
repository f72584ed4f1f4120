from __future__ import annotations

import random

import pytest

from batchfit.backends import CachingAllocatorModel
from batchfit.backends.allocator_model import (
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    round_size,
    segment_size,
)

MIB = 1024 * 1024


def test_constants_match_pytorch() -> None:
    assert (MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER) == (512, MIB, 2 * MIB)
    assert (LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE) == (20 * MIB, 10 * MIB, 2 * MIB)


@pytest.mark.parametrize(
    ("nbytes", "rounded"),
    [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (MIB, MIB), (MIB + 1, MIB + 512)],
)
def test_round_size(nbytes: int, rounded: int) -> None:
    assert round_size(nbytes) == rounded


def test_round_size_rejects_negative() -> None:
    with pytest.raises(ValueError):
        round_size(-1)


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [
        (512, 2 * MIB),
        (MIB, 2 * MIB),
        (MIB + 512, 20 * MIB),
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),
        (12 * MIB, 12 * MIB),
        (13 * MIB, 14 * MIB),
        (14 * MIB + 512, 16 * MIB),
    ],
)
def test_segment_size(rounded: int, segment: int) -> None:
    assert segment_size(rounded) == segment


def test_small_requests_share_one_2mib_segment() -> None:
    model = CachingAllocatorModel()
    model.malloc(100)
    assert model.reserved_bytes == 2 * MIB
    for _ in range(4):
        assert model.would_reserve(100) == 0
        model.malloc(100)
    assert model.reserved_bytes == 2 * MIB
    assert model.allocated_bytes == 5 * 512


def test_mid_sized_requests_split_a_20mib_segment() -> None:
    model = CachingAllocatorModel()
    model.malloc(3 * MIB)
    assert model.reserved_bytes == 20 * MIB
    model.malloc(3 * MIB)
    assert model.reserved_bytes == 20 * MIB
    assert model.allocated_bytes == 6 * MIB


def test_big_requests_get_their_own_segment_rounded_to_2mib() -> None:
    model = CachingAllocatorModel()
    model.malloc(12 * MIB)
    assert model.reserved_bytes == 12 * MIB
    model.malloc(13 * MIB)
    assert model.reserved_bytes == 26 * MIB


def test_unsplit_large_remainder_counts_as_allocated() -> None:
    # 13 MiB in a 14 MiB segment leaves 1 MiB, too little to split off in the large pool,
    # so PyTorch hands out (and counts as allocated) the whole 14 MiB block.
    model = CachingAllocatorModel()
    handle = model.malloc(13 * MIB)
    assert model.allocated_bytes == 14 * MIB
    assert model.requested_bytes == 13 * MIB
    model.free(handle)
    assert (model.allocated_bytes, model.requested_bytes) == (0, 0)


def test_large_remainder_over_1mib_is_split() -> None:
    model = CachingAllocatorModel()
    model.malloc(3 * MIB)
    model.malloc(16 * MIB - 512)  # leaves 1 MiB + 512 of the 20 MiB segment: split off
    assert model.allocated_bytes == 19 * MIB - 512
    assert model.would_reserve(MIB + 512) == 0
    model.malloc(MIB + 512)
    assert model.reserved_bytes == 20 * MIB


def test_freed_block_is_reused_for_the_same_size() -> None:
    model = CachingAllocatorModel()
    for size in (100, 3 * MIB, 12 * MIB, 13 * MIB):
        model.free(model.malloc(size))
        reserved = model.reserved_bytes
        assert model.would_reserve(size) == 0
        model.malloc(size)
        assert model.reserved_bytes == reserved


def test_adjacent_free_blocks_coalesce() -> None:
    model = CachingAllocatorModel()
    a = model.malloc(3 * MIB)
    b = model.malloc(3 * MIB)
    model.malloc(14 * MIB)  # takes exactly the rest of the 20 MiB segment
    assert model.reserved_bytes == 20 * MIB
    assert model.would_reserve(6 * MIB) == LARGE_BUFFER
    model.free(a)
    model.free(b)
    assert model.would_reserve(6 * MIB) == 0
    model.malloc(6 * MIB)
    assert model.reserved_bytes == 20 * MIB


def test_freeing_the_middle_block_merges_both_neighbours() -> None:
    model = CachingAllocatorModel()
    a, b, c = model.malloc(3 * MIB), model.malloc(3 * MIB), model.malloc(14 * MIB)
    model.free(a)
    model.free(c)
    model.empty_cache()
    assert model.reserved_bytes == 20 * MIB
    model.free(b)
    model.empty_cache()
    assert model.reserved_bytes == 0


def test_best_fit_takes_the_smallest_hole() -> None:
    model = CachingAllocatorModel()
    big_hole = model.malloc(2048)
    model.malloc(512)
    small_hole = model.malloc(1024)
    model.malloc(512)
    model.malloc(SMALL_SIZE)  # with the next one, fills the 2 MiB segment
    model.malloc(SMALL_BUFFER - SMALL_SIZE - 4096)
    assert model.would_reserve(512) == SMALL_BUFFER
    model.free(big_hole)
    model.free(small_hole)
    model.malloc(1024)  # best fit: the 1024 hole, keeping the 2048 hole whole
    assert model.would_reserve(2048) == 0
    model.malloc(2048)
    assert model.reserved_bytes == SMALL_BUFFER


def test_small_and_large_pools_do_not_share_segments() -> None:
    model = CachingAllocatorModel()
    model.free(model.malloc(3 * MIB))  # a free 20 MiB large segment
    assert model.would_reserve(100) == 2 * MIB
    model.malloc(100)
    assert model.reserved_bytes == 22 * MIB
    model.free(model.malloc(MIB))  # a free 1 MiB hole left in the small segment
    assert model.would_reserve(MIB + 512) == 0  # served by the large segment
    model.malloc(MIB + 512)
    model.malloc(MIB)  # fits the small segment's remainder
    assert model.would_reserve(MIB) == 2 * MIB  # small segment full; the large one's space does not count
    assert model.reserved_bytes == 22 * MIB


def test_empty_cache_releases_only_entirely_free_segments() -> None:
    model = CachingAllocatorModel()
    first = [model.malloc(MIB) for _ in range(2)]  # fills a 2 MiB segment
    second = [model.malloc(MIB) for _ in range(2)]  # a second one
    big = model.malloc(12 * MIB)
    assert model.reserved_bytes == 16 * MIB
    for handle in first:
        model.free(handle)
    model.free(second[0])
    model.free(big)
    model.empty_cache()
    assert model.reserved_bytes == 2 * MIB
    assert model.allocated_bytes == MIB
    model.free(second[1])
    model.empty_cache()
    assert model.reserved_bytes == 0


def test_peaks_and_reset_peaks() -> None:
    model = CachingAllocatorModel()
    model.malloc(3 * MIB)
    big = model.malloc(30 * MIB)
    model.free(big)
    model.empty_cache()
    assert (model.allocated_bytes, model.reserved_bytes) == (3 * MIB, 20 * MIB)
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (33 * MIB, 50 * MIB)
    model.reset_peaks()
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (3 * MIB, 20 * MIB)
    model.malloc(3 * MIB)
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (6 * MIB, 20 * MIB)


def test_zero_bytes_allocates_nothing() -> None:
    model = CachingAllocatorModel()
    assert model.would_reserve(0) == 0
    handle = model.malloc(0)
    assert (model.allocated_bytes, model.reserved_bytes) == (0, 0)
    model.free(handle)
    with pytest.raises(KeyError):
        model.free(handle)


def test_bad_requests_and_handles() -> None:
    model = CachingAllocatorModel()
    with pytest.raises(ValueError):
        model.malloc(-1)
    with pytest.raises(ValueError):
        model.would_reserve(-1)
    with pytest.raises(KeyError):
        model.free(12345)
    handle = model.malloc(100)
    model.free(handle)
    with pytest.raises(KeyError):
        model.free(handle)


def _random_size(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.05:
        return 0
    if kind < 0.55:
        return rng.randint(1, SMALL_SIZE)
    if kind < 0.85:
        return rng.randint(SMALL_SIZE + 1, MIN_LARGE_ALLOC + MIB)
    return rng.randint(MIN_LARGE_ALLOC, 64 * MIB)


@pytest.mark.parametrize("seed", range(5))
def test_random_trace_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    model = CachingAllocatorModel()
    live: dict[int, int] = {}  # handle -> rounded size
    peak_allocated = peak_reserved = 0
    for _ in range(600):
        before = (model.allocated_bytes, model.reserved_bytes)
        action = rng.random()
        if action < 0.55 or not live:
            size = _random_size(rng)
            expected = model.would_reserve(size)
            assert (model.allocated_bytes, model.reserved_bytes) == before  # would_reserve changes nothing
            live[model.malloc(size)] = round_size(size)
            assert model.reserved_bytes - before[1] == expected
            assert expected in (0, segment_size(round_size(size)))
        elif action < 0.97:
            handle = rng.choice(list(live))
            del live[handle]
            model.free(handle)
            assert model.reserved_bytes == before[1]
            assert model.allocated_bytes <= before[0]
        else:
            model.empty_cache()
            assert model.reserved_bytes <= before[1]
            assert model.allocated_bytes == before[0]
        peak_allocated = max(peak_allocated, model.allocated_bytes)
        peak_reserved = max(peak_reserved, model.reserved_bytes)
        assert model.requested_bytes == sum(live.values())
        large_live = sum(1 for r in live.values() if r > SMALL_SIZE)
        assert model.requested_bytes <= model.allocated_bytes <= model.requested_bytes + large_live * SMALL_SIZE
        assert model.allocated_bytes <= model.reserved_bytes
        assert model.reserved_bytes % SMALL_BUFFER == 0
        assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (peak_allocated, peak_reserved)
    for handle in list(live):
        model.free(handle)
    assert (model.allocated_bytes, model.requested_bytes) == (0, 0)
    model.empty_cache()  # everything free and coalesced: every segment goes back
    assert model.reserved_bytes == 0

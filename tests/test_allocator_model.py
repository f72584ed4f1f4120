from __future__ import annotations

import random

import pytest

from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.backends.allocator_model import (
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    CachingAllocatorModel,
    round_size,
    segment_size,
)
from batchfit.backends.allocator_snapshot import block_bytes_by_address

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


# PYTORCH_CUDA_ALLOC_CONF settings ---------------------------------------------------------------------
EXPANDABLE = AllocatorConfig(expandable_segments=True)


@pytest.mark.parametrize(
    ("nbytes", "divisions", "rounded"),
    [
        (1200, 4, 1536),  # not over 512 x 4: plain 512-byte rounding
        (1_258_291, 4, 1_310_720),  # 1.2 MiB -> 1.25 MiB (a quarter step between 1 and 2 MiB)
        (1_258_291, 2, 1_572_864),  # -> 1.5 MiB
        (3 * MIB + 1, 4, 3 * MIB + MIB // 2),
        (4 * MIB, 4, 4 * MIB),  # a power of two stays
        (1_258_291, 1, 1_258_496),  # 1 division: no rounding beyond 512
    ],
)
def test_roundup_power2_divisions(nbytes: int, divisions: int, rounded: int) -> None:
    config = AllocatorConfig(roundup_power2_divisions=divisions)
    assert round_size(nbytes, config) == rounded
    model = CachingAllocatorModel(config)
    model.malloc(nbytes)
    assert model.requested_bytes == rounded


def test_the_async_backend_is_not_modelled() -> None:
    with pytest.raises(ValueError, match="native allocator"):
        CachingAllocatorModel(AllocatorConfig(backend="cudaMallocAsync"))


def test_growing_requests_fragment_the_default_but_not_expandable_segments() -> None:
    # Each step a tensor a little bigger than the last, the last one freed first (the batch grows):
    # the default never fits the new size into the cached smaller segments and reserves one per
    # size; an expandable segment maps only the pages the free end lacks.
    native, expandable = CachingAllocatorModel(), CachingAllocatorModel(EXPANDABLE)
    for model in (native, expandable):
        for n in range(11, 31):
            model.free(model.malloc(n * MIB + 4096))
        model.malloc(30 * MIB + 4096)
    assert native.reserved_bytes - native.allocated_bytes > 200 * MIB  # a segment per two sizes
    assert expandable.allocated_bytes == expandable.requested_bytes == 30 * MIB + 4096
    assert expandable.reserved_bytes == 40 * MIB  # two 20 MiB pages: within one page of allocated
    assert expandable.peak_reserved_bytes == 40 * MIB


def test_expandable_segments_split_every_block_and_map_pages_per_pool() -> None:
    model = CachingAllocatorModel(EXPANDABLE)
    big = model.malloc(13 * MIB)  # the default would hand out a 14 MiB block
    assert model.block_bytes(big) == 13 * MIB
    assert model.reserved_bytes == LARGE_BUFFER  # one 20 MiB page
    model.malloc(100)
    assert model.reserved_bytes == LARGE_BUFFER + SMALL_BUFFER  # the small pool's own 2 MiB page
    assert model.would_reserve(7 * MIB) == 0  # the 7 MiB left of the large page
    assert model.would_reserve(8 * MIB) == LARGE_BUFFER  # one more page: the free 7 MiB plus 13 of it
    model.malloc(8 * MIB)
    assert model.reserved_bytes == 2 * LARGE_BUFFER + SMALL_BUFFER
    assert model.allocated_bytes == model.requested_bytes == 21 * MIB + 512


def test_expandable_empty_cache_unmaps_whole_free_pages_only() -> None:
    model = CachingAllocatorModel(EXPANDABLE)
    a, b, c = (model.malloc(15 * MIB) for _ in range(3))  # 45 MiB in three 20 MiB pages
    assert model.reserved_bytes == 60 * MIB
    model.free(b)  # [15, 30) MiB free: no whole page inside
    model.empty_cache()
    assert model.reserved_bytes == 60 * MIB
    model.free(c)  # [15, 60) MiB free: the pages [20, 40) and [40, 60) go
    model.empty_cache()
    assert model.reserved_bytes == 20 * MIB
    (segment,) = model.snapshot()
    assert (segment["is_expandable"], segment["total_size"], len(segment["blocks"])) == (True, 20 * MIB, 2)
    model.free(a)
    model.empty_cache()
    assert (model.reserved_bytes, model.snapshot()) == (0, [])


def test_best_fit_prefers_a_hole_to_the_block_that_can_grow() -> None:
    # Best fit counts a free block before unmapped space as big as it could grow (get_free_block).
    model = CachingAllocatorModel(EXPANDABLE)
    first = model.malloc(8 * MIB)
    hole = model.address(first)
    model.malloc(8 * MIB)
    model.free(first)  # an 8 MiB hole, and 4 MiB free at the mapped end, before unmapped space
    assert model.address(model.malloc(3 * MIB)) == hole
    default = CachingAllocatorModel()
    first = default.malloc(8 * MIB)
    end = default.address(default.malloc(8 * MIB))
    default.free(first)  # the same layout in a 20 MiB segment: the 4 MiB end is the best fit
    assert end is not None and default.address(default.malloc(3 * MIB)) == end + 8 * MIB


def test_expandable_segments_may_overshoot_the_limit_by_less_than_a_page() -> None:
    # alloc_block checks the segment size a request would get (12 MiB), not the pages mapped.
    model = CachingAllocatorModel(EXPANDABLE, limit_bytes=35 * MIB)
    model.malloc(12 * MIB)
    model.malloc(12 * MIB)  # 20 + 12 <= 35: allowed, and it maps a second 20 MiB page
    assert model.reserved_bytes == 40 * MIB
    assert model.pop_failure() is None
    model.malloc(12 * MIB)  # 16 MiB free at the end: no new page
    model.malloc(12 * MIB)  # 40 + 12 > 35 even after empty_cache: PyTorch would refuse it
    assert model.pop_failure() == (48 * MIB, 60 * MIB)
    assert model.pop_failure() is None


def test_a_refused_request_is_kept_and_served() -> None:
    model = CachingAllocatorModel(limit_bytes=50 * MIB)
    cached = model.malloc(12 * MIB)
    model.free(cached)
    model.malloc(30 * MIB)  # 12 + 30 <= 50
    assert model.pop_failure() is None
    model.malloc(14 * MIB)  # 42 + 14 > 50: the cached 12 MiB segment goes first, then 30 + 14 fits
    assert (model.reserved_bytes, model.pop_failure()) == (44 * MIB, None)
    model.malloc(30 * MIB)  # 44 + 30 > 50 with nothing cached: out of memory, served anyway
    assert model.pop_failure() == (74 * MIB, 74 * MIB)


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    config = AllocatorConfig(max_split_size_bytes=40 * MIB)
    model, default = CachingAllocatorModel(config), CachingAllocatorModel()
    for m in (model, default):
        m.free(m.malloc(60 * MIB))
        m.malloc(30 * MIB)
    assert default.reserved_bytes == 60 * MIB  # split out of the cached 60 MiB
    assert model.reserved_bytes == 90 * MIB  # an oversize block serves no smaller request
    model.malloc(50 * MIB)  # >= max_split_size and within 20 MiB of the cached 60: served whole
    assert (model.reserved_bytes, model.allocated_bytes) == (90 * MIB, 90 * MIB)
    model.free(model.malloc(90 * MIB))
    assert model.would_reserve(45 * MIB) == 46 * MIB  # 90 >= 45 + 20: not a fit


def test_max_split_size_gives_back_oversize_blocks_under_a_limit() -> None:
    model = CachingAllocatorModel(AllocatorConfig(max_split_size_bytes=40 * MIB), limit_bytes=100 * MIB)
    model.free(model.malloc(60 * MIB))
    model.malloc(30 * MIB)
    model.malloc(38 * MIB)  # 90 + 38 > 100: the cached 60 MiB oversize segment goes
    assert (model.reserved_bytes, model.pop_failure()) == (68 * MIB, None)


def test_garbage_collection_frees_the_oldest_cached_segments_under_a_fraction() -> None:
    config = AllocatorConfig(garbage_collection_threshold=0.3)
    for limit in (None, 100 * MIB):
        model = CachingAllocatorModel(config, limit_bytes=limit)
        model.free(model.malloc(24 * MIB))  # cached after the first search
        model.free(model.malloc(26 * MIB))  # cached after the second: younger
        model.malloc(28 * MIB)  # reserved 50 > 30% of 100: collect the older until 20 MiB are back
        if limit is None:  # no memory fraction, no garbage collection
            assert model.reserved_bytes == 78 * MIB
        else:
            assert model.reserved_bytes == 54 * MIB
            assert sorted(s["total_size"] for s in model.snapshot()) == [26 * MIB, 28 * MIB]


def test_large_segment_size() -> None:
    config = AllocatorConfig(large_segment_bytes=64 * MIB)
    assert segment_size(3 * MIB, config) == 64 * MIB
    assert segment_size(12 * MIB, config) == 12 * MIB
    model = CachingAllocatorModel(AllocatorConfig(large_segment_bytes=64 * MIB, expandable_segments=True))
    model.malloc(12 * MIB)
    assert model.reserved_bytes == 64 * MIB  # the large pool's page


# The snapshot, and the block a tensor really occupies -----------------------------------------------
def test_a_13mib_tensor_occupies_a_14mib_block() -> None:
    # The false leak: a meter that rounds storages to 512 bytes counts 13 MiB where the allocator
    # (and torch.cuda.memory_allocated()) counts the 14 MiB block; the snapshot says which.
    model = CachingAllocatorModel()
    handle = model.malloc(13 * MIB)
    address = model.address(handle)
    assert address is not None
    by_address = block_bytes_by_address(model.snapshot())
    assert by_address == {address: 14 * MIB} and sum(by_address.values()) == model.allocated_bytes
    assert round_size(13 * MIB) == 13 * MIB  # what 512-byte rounding says
    (segment,) = model.snapshot()
    assert segment["blocks"] == [
        {"address": address, "size": 14 * MIB, "requested_size": 13 * MIB, "state": "active_allocated", "frames": []}
    ]
    assert (segment["segment_type"], segment["total_size"], segment["allocated_size"]) == ("large", 14 * MIB, 14 * MIB)


def test_block_bytes_by_address_reads_snapshots_without_block_addresses() -> None:
    snapshot = [
        {"address": 4096, "blocks": [{"size": 512, "state": "inactive"}, {"size": 1024, "state": "active_allocated"}]},
        {"address": 0, "blocks": [{"size": 2048, "state": "active_pending_free"}]},
    ]
    assert block_bytes_by_address(snapshot) == {4608: 1024}


CONFIGS = {
    "default": AllocatorConfig(),
    "expandable": EXPANDABLE,
    "max_split": AllocatorConfig(max_split_size_bytes=32 * MIB),
    "roundup": AllocatorConfig(roundup_power2_divisions=4),
    "all": AllocatorConfig(expandable_segments=True, roundup_power2_divisions=8, max_split_size_bytes=24 * MIB),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("limit", [None, 160 * MIB])
def test_random_trace_keeps_invariants_under_settings(name: str, seed: int, limit: int | None) -> None:
    config = CONFIGS[name]
    gc = AllocatorConfig(**{**vars(config), "garbage_collection_threshold": 0.5}) if limit else config
    rng = random.Random(seed)
    model = CachingAllocatorModel(gc, limit_bytes=limit)
    page = LARGE_BUFFER if config.expandable_segments else 0
    live: dict[int, int] = {}  # handle -> rounded size
    over = False  # reserved may stay over the limit after a refused request, until it comes down
    for _ in range(500):
        before = model.reserved_bytes
        action = rng.random()
        if action < 0.55 or not live:
            size = _random_size(rng)
            expected = model.would_reserve(size)
            handle = model.malloc(size)
            live[handle] = round_size(size, config)
            failure = model.pop_failure()
            if limit is None:
                assert model.reserved_bytes - before == expected
            over = failure is not None or (over and model.reserved_bytes > limit)
            if limit is not None and not over:
                assert model.reserved_bytes <= limit + page
        elif action < 0.97:
            handle = rng.choice(list(live))
            del live[handle]
            model.free(handle)
            assert model.reserved_bytes == before
        else:
            model.empty_cache()
            assert model.reserved_bytes <= before
        assert model.requested_bytes == sum(live.values())
        if config.expandable_segments:
            assert model.allocated_bytes == model.requested_bytes  # every block split to its request
        assert model.requested_bytes <= model.allocated_bytes <= model.reserved_bytes
        snapshot = model.snapshot()
        assert sum(block_bytes_by_address(snapshot).values()) == model.allocated_bytes
        assert sum(s["total_size"] for s in snapshot) == model.reserved_bytes
        assert sum(s["allocated_size"] for s in snapshot) == model.allocated_bytes
        addresses = {model.address(h) for h in live if live[h]}
        assert addresses == set(block_bytes_by_address(snapshot))
    for handle in list(live):
        model.free(handle)
    model.empty_cache()
    assert (model.allocated_bytes, model.reserved_bytes, model.snapshot()) == (0, 0, [])

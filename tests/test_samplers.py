"""The batch samplers (batchfit/samplers.py): every index once, the budget held, DDP-even, resumable.

Pure index logic: no model runs here, except a real `DataLoader` over a variable-length dataset.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from batchfit.samplers import BucketBatchSampler, TokenBudgetBatchSampler

FAST = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(1, 64), min_size=1, max_size=120)


def bucket_sampler(lengths: object, batch_sizes: list[int] | None = None, **kwargs: object) -> BucketBatchSampler:
    """Three buckets that cover lengths up to 64, with batch sizes 5, 3 and 1 unless given."""
    return BucketBatchSampler(lengths, [8, 32, 64], batch_sizes or [5, 3, 1], **kwargs)  # type: ignore[arg-type]


def long_tail(n: int, seed: int) -> list[int]:
    """Lognormal lengths with a long tail, as real text has."""
    rng = random.Random(seed)
    return [max(1, min(512, int(rng.lognormvariate(3.5, 0.8)))) for _ in range(n)]


def bucket(length: int, boundaries: tuple[int, ...]) -> int:
    return next(i for i, bound in enumerate(boundaries) if length <= bound)


# Every index once, the budget held -----------------------------------------------------------------
@FAST
@given(lengths=lengths_st, seed=st.integers(0, 2**31), shuffle=st.booleans())
def test_bucket_sampler_yields_every_index_once(lengths: list[int], seed: int, shuffle: bool) -> None:
    sampler = bucket_sampler(lengths, seed=seed, shuffle=shuffle)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert len(batches) == len(sampler)
    for b in batches:
        buckets = {bucket(lengths[i], sampler.boundaries) for i in b}
        assert len(buckets) == 1 and 1 <= len(b) <= sampler.batch_sizes[buckets.pop()]


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 2**31), padded=st.booleans(), budget=st.integers(64, 400))
def test_token_budget_holds_and_every_index_once(lengths: list[int], seed: int, padded: bool, budget: int) -> None:
    sampler = TokenBudgetBatchSampler(lengths, budget, padded=padded, seed=seed)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b, (rows, padded_length) in zip(batches, sampler.steps()):
        row_lengths = [lengths[i] for i in b]
        assert rows == (len(b) if padded else 1) and len(b) >= 1  # packed: one row of the summed tokens
        assert padded_length == (max(row_lengths) if padded else sum(row_lengths))
        assert (rows * padded_length if padded else padded_length) <= budget


def test_token_budget_fills_batches_with_many_short_rows() -> None:
    """Short rows share a batch: the sampler is not one row per batch."""
    sampler = TokenBudgetBatchSampler([4] * 100, 64, padded=True, shuffle=False)
    assert sampler.steps() == [(16, 4)] * 6 + [(4, 4)]
    packed = TokenBudgetBatchSampler([3, 5] * 10, 16, padded=False, shuffle=False, sort_window=1000)
    assert all(tokens <= 16 for _, tokens in packed.steps())


def test_sort_window_keeps_batches_inside_a_window() -> None:
    lengths = long_tail(300, 1)
    sampler = TokenBudgetBatchSampler(lengths, 2048, sort_window=50, seed=3)
    assert sampler.sort_window == 50
    assert sorted(i for b in sampler for i in b) == list(range(300))
    default = TokenBudgetBatchSampler(lengths, 2048)
    assert default.sort_window == 300  # 100 x the mean rows per batch is more than the whole set


def test_shuffle_false_is_in_bucket_order() -> None:
    lengths = [40, 3, 10, 5, 60, 7, 20]
    sampler = BucketBatchSampler(lengths, [8, 32, 64], [2, 2, 2], shuffle=False)
    assert list(sampler) == [[1, 3], [5], [2, 6], [0, 4]]


# Deterministic, epochs differ, the global RNG untouched ---------------------------------------------
@pytest.mark.parametrize("make", [bucket_sampler, lambda lengths, **kw: TokenBudgetBatchSampler(lengths, 256, **kw)])
def test_deterministic_and_epochs_differ(make) -> None:
    lengths = [length % 64 + 1 for length in long_tail(200, 2)]
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first, second = make(lengths, seed=7), make(lengths, seed=7)
    assert list(first) == list(second)
    assert torch.equal(torch.random.get_rng_state(), before)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0
    assert list(make(lengths, seed=8)) != epoch0


def test_lengths_as_tensor_or_array_plan_the_same() -> None:
    lengths = [length % 64 + 1 for length in long_tail(100, 3)]
    expected = list(bucket_sampler(lengths, seed=1))
    assert list(bucket_sampler(torch.tensor(lengths), seed=1)) == expected
    assert list(bucket_sampler(np.array(lengths, dtype=np.int32), seed=1)) == expected
    assert list(bucket_sampler(tuple(lengths), seed=1)) == expected


# Resume ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bucket", "budget-padded", "budget-packed"])
@pytest.mark.parametrize("replicas", [1, 3])
def test_resume_mid_epoch_equals_uninterrupted(kind: str, replicas: int) -> None:
    lengths = [length % 64 + 1 for length in long_tail(300, 4)]

    def make(rank: int):
        if kind == "bucket":
            return bucket_sampler(lengths, seed=11, num_replicas=replicas, rank=rank)
        return TokenBudgetBatchSampler(
            lengths, 200, padded=kind == "budget-padded", seed=11, num_replicas=replicas, rank=rank
        )

    for rank in range(replicas):
        whole = make(rank)
        whole.set_epoch(2)
        expected = list(whole)
        interrupted = make(rank)
        interrupted.set_epoch(2)
        stop = len(expected) // 3
        it = iter(interrupted)
        done = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(interrupted.state_dict()))
        assert state["steps"] == stop and state["epoch"] == 2
        resumed = make(rank)
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # the usual loop sets the epoch again: the resume point stays
        assert done + list(resumed) == expected
        assert resumed.state_dict()["steps"] == len(expected)
        resumed.set_epoch(3)  # the next epoch starts from its beginning
        assert resumed.state_dict()["steps"] == 0 and len(list(resumed)) == len(resumed)


def test_state_dict_takes_the_loops_own_step_count() -> None:
    sampler = bucket_sampler([5, 20, 40] * 10)
    it = iter(sampler)
    for _ in range(4):
        next(it)  # a prefetching loader ran ahead of the 2 steps the loop consumed
    state = sampler.state_dict(steps=2)
    resumed = bucket_sampler([5, 20, 40] * 10)
    resumed.load_state_dict(state)
    assert list(resumed) == list(sampler)[2:]
    with pytest.raises(ValueError, match="steps must be <="):
        sampler.state_dict(steps=len(sampler) + 1)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"seed": 1}, "saved with seed=0, this sampler has 1"),
        ({"num_replicas": 2, "rank": 0}, "saved with num_replicas=4, this sampler has 2"),
        ({"lengths": list(range(1, 41))}, "saved with 30 lengths, this sampler has 40"),
        ({"lengths": [7] * 30}, "the lengths differ"),
        ({"batch_sizes": [5, 3, 2]}, r"saved with batch_sizes=\[5, 3, 1\], this sampler has \[5, 3, 2\]"),
        ({"drop_last": True}, "saved with drop_last=False, this sampler has True"),
    ],
)
def test_resume_under_other_settings_is_refused_by_name(other: dict, message: str) -> None:
    lengths = [5, 20, 40] * 10
    saved = bucket_sampler(lengths, num_replicas=4, rank=1)
    saved.set_epoch(3)
    state = saved.state_dict(steps=1)
    kwargs: dict = {"num_replicas": 4, "rank": 1, **other}
    here = bucket_sampler(kwargs.pop("lengths", lengths), **kwargs)
    plan = list(here)
    with pytest.raises(ValueError, match=message):
        here.load_state_dict(state)
    assert here.epoch == 0 and list(here) == plan  # nothing changed


def test_resume_refuses_another_kind_and_a_foreign_dict() -> None:
    lengths = [5, 20, 40] * 10
    state = bucket_sampler(lengths).state_dict()
    budget = TokenBudgetBatchSampler(lengths, 100)
    with pytest.raises(ValueError, match="saved with kind='BucketBatchSampler'"):
        budget.load_state_dict(state)
    other_budget = TokenBudgetBatchSampler(lengths, 120).state_dict()
    with pytest.raises(ValueError, match="saved with max_tokens=120, this sampler has 100"):
        budget.load_state_dict(other_budget)
    with pytest.raises(ValueError, match="state lacks"):
        budget.load_state_dict({"epoch": 1})
    with pytest.raises(TypeError, match="state must be a mapping"):
        budget.load_state_dict([1, 2])  # type: ignore[arg-type]
    too_far = {**budget.state_dict(), "steps": 10_000}
    with pytest.raises(ValueError, match="saved at step 10000"):
        budget.load_state_dict(too_far)
    assert budget.state_dict()["steps"] == 0


# DDP -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_bucket_ranks_step_together_from_one_bucket(replicas: int, drop_last: bool) -> None:
    for seed in range(5):
        lengths = [length % 64 + 1 for length in long_tail(97, seed)]
        ranks = [
            bucket_sampler(lengths, seed=seed, num_replicas=replicas, rank=r, drop_last=drop_last)
            for r in range(replicas)
        ]
        plans = [list(s) for s in ranks]
        assert len({len(p) for p in plans}) == 1 and all(len(p) == len(s) for p, s in zip(plans, ranks))
        for step in zip(*plans):
            assert len({len(b) for b in step}) == 1  # every rank the same rows
            assert len({bucket(lengths[i], ranks[0].boundaries) for b in step for i in b}) == 1
        seen = Counter(i for p in plans for b in p for i in b)
        if not drop_last:
            assert set(seen) == set(range(len(lengths)))
        assert max(seen.values()) <= replicas  # a filled batch repeats its bucket's rows, at most once per rank


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("padded", [True, False])
def test_token_budget_ranks_have_equal_steps(replicas: int, padded: bool) -> None:
    for seed in range(5):
        lengths = long_tail(101, seed)
        for drop_last in (False, True):
            ranks = [
                TokenBudgetBatchSampler(
                    lengths, 1024, padded=padded, seed=seed, drop_last=drop_last, num_replicas=replicas, rank=r
                )
                for r in range(replicas)
            ]
            plans = [list(s) for s in ranks]
            assert len({len(p) for p in plans} | {len(s) for s in ranks}) == 1
            union = {i for p in plans for b in p for i in b}
            if not drop_last:
                assert union == set(range(len(lengths)))
            solo = TokenBudgetBatchSampler(lengths, 1024, padded=padded, seed=seed)
            assert len(plans[0]) == (len(solo) // replicas if drop_last else -(-len(solo) // replicas))


def test_world_defaults_to_one_rank_without_a_process_group() -> None:
    sampler = bucket_sampler([3, 4])
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


@pytest.mark.distributed
def test_world_comes_from_the_process_group(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sampler = TokenBudgetBatchSampler([3, 4], 8)
        assert (sampler.num_replicas, sampler.rank) == (1, 0)
        with pytest.raises(ValueError, match=r"rank must be < num_replicas \(1\), got 1"):
            TokenBudgetBatchSampler([3, 4], 8, rank=1)
    finally:
        dist.destroy_process_group()


# Bad input -------------------------------------------------------------------------------------------
def test_budget_below_the_longest_row_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_tokens=50 is smaller than the longest row: lengths\[2\] = 80"):
        TokenBudgetBatchSampler([10, 20, 80, 30], 50)


def test_boundaries_that_miss_the_longest_are_refused() -> None:
    with pytest.raises(ValueError, match=r"lengths\[1\] = 90 is above the last bound 64"):
        BucketBatchSampler([10, 90, 30], [32, 64], [4, 2])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: bucket_sampler([3, 4.0]), TypeError, r"lengths\[1\] must be an int, got float"),
        (lambda: bucket_sampler([3, 0]), ValueError, r"lengths\[1\] must be >= 1, got 0"),
        (lambda: bucket_sampler("3456"), TypeError, "lengths must be a sequence of ints, got str"),
        (lambda: bucket_sampler([]), ValueError, "lengths is empty"),
        (lambda: bucket_sampler(torch.tensor([1.0, 2.0])), TypeError, "lengths must hold integers"),
        (lambda: bucket_sampler(torch.ones(2, 2, dtype=torch.long)), ValueError, "lengths must be 1-d"),
        (lambda: BucketBatchSampler([3], [8, 16], [2, -1]), ValueError, r"batch_sizes\[1\] must be >= 1, got -1"),
        (lambda: BucketBatchSampler([3], [8, 16], [2]), ValueError, "one size per bucket"),
        (lambda: BucketBatchSampler([3], [16, 8], [2, 2]), ValueError, "strictly ascending"),
        (lambda: TokenBudgetBatchSampler([3], 10.0), TypeError, "max_tokens must be an int"),
        (lambda: TokenBudgetBatchSampler([3], 10, sort_window=0), ValueError, "sort_window must be >= 1"),
        (lambda: TokenBudgetBatchSampler([3], 10, padded="yes"), TypeError, "padded must be a bool"),
        (lambda: bucket_sampler([3], num_replicas=2, rank=2), ValueError, r"rank must be < num_replicas \(2\)"),
        (lambda: bucket_sampler([3], num_replicas=0, rank=0), ValueError, "num_replicas must be >= 1"),
        (lambda: bucket_sampler([3], seed=1.5), TypeError, "seed must be an int"),
        (lambda: bucket_sampler([3]).set_epoch(-1), ValueError, "epoch must be >= 0"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


# A real DataLoader --------------------------------------------------------------------------------------
class Ragged(Dataset):
    """Token rows of the given lengths."""

    def __init__(self, lengths: list[int]) -> None:
        self.rows = [torch.arange(1, n + 1) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def test_dataloader_runs_the_planned_shapes() -> None:
    """A padding collate sees exactly the shapes ``steps()`` lists; a packing one the token totals."""
    lengths = [length % 64 + 1 for length in long_tail(120, 5)]
    dataset = Ragged(lengths)
    for sampler in (bucket_sampler(lengths, seed=2), TokenBudgetBatchSampler(lengths, 256, seed=2)):
        shapes = [tuple(batch.shape) for batch in DataLoader(dataset, batch_sampler=sampler, collate_fn=pad)]
        assert shapes == sampler.steps()
        assert sum(rows for rows, _ in shapes) == len(lengths)
    packed = TokenBudgetBatchSampler(lengths, 256, padded=False, seed=2)
    flat = [batch for batch in DataLoader(dataset, batch_sampler=packed, collate_fn=torch.cat)]
    assert [t.numel() for t in flat] == [tokens for _, tokens in packed.steps()]

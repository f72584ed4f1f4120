"""The pure arithmetic of a length plan (`batchfit.report.bucketing`), checked exhaustively.

No model: the frontier's measurements are stood in for by a monotone "true" batch per length
(what an exact search would find), so each choice can be compared with brute force: the buckets'
dynamic programme with every subset of ends, the token budget with every budget, the epoch's
steps with the sampler that forms them.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from batchfit.report.bucketing import (
    QUANTILES,
    Measured,
    candidate_lengths,
    choose_buckets,
    compositions,
    greedy_steps,
    histogram_of,
    pack_fill,
    propose_budget,
)
from batchfit.report.knobs import knobs_for
from batchfit.samplers import TokenBudgetBatchSampler


def lognormal_lengths(seed: int, rows: int = 400, longest: int = 512) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(rows, generator=generator) * 0.7 + 3.5)
    return drawn.clamp(1, longest).long().tolist()


def true_batch(seq_len: int, budget: float = 2e6, fixed: float = 2e5, a: float = 300.0, q: float = 2.0) -> int:
    """The largest batch at ``seq_len`` of a model whose memory is ``fixed + b (a s + q s^2)``."""
    return max(1, math.floor((budget - fixed) / (a * seq_len + q * seq_len**2)))


@pytest.mark.parametrize(
    ("given", "histogram"),
    [
        ([3, 1, 3, 2], {1: 1, 2: 1, 3: 2}),
        (torch.tensor([5, 5, 7]), {5: 2, 7: 1}),
        ({9: 2, 4: 0, 3: 1}, {3: 1, 9: 2}),
        (range(1, 4), {1: 1, 2: 1, 3: 1}),
    ],
)
def test_the_lengths_become_a_sorted_histogram(given, histogram):
    assert histogram_of(given) == histogram
    assert list(histogram_of(given)) == sorted(histogram)


@pytest.mark.parametrize(
    ("given", "error", "named"),
    [
        ("128", TypeError, "got str"),
        (5, TypeError, "got int"),
        ([1, 2.5], TypeError, "lengths[1]"),
        ([1, True], TypeError, "lengths[1]"),
        ([4, 0], ValueError, "lengths[1] must be a length of at least 1"),
        ({8: -1}, ValueError, "the rows of lengths[8]"),
        ([], ValueError, "holds no rows"),
        ({8: 0}, ValueError, "holds no rows"),
    ],
)
def test_bad_lengths_are_named(given, error, named):
    with pytest.raises(error, match=named.replace("[", r"\[").replace("]", r"\]")):
        histogram_of(given)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("multiple_of", [1, 8, 64])
def test_candidates_end_at_the_longest_and_round_up_within_it(seed, multiple_of):
    histogram = histogram_of(lognormal_lengths(seed))
    ends = candidate_lengths(histogram, multiple_of)
    assert ends[-1] == max(histogram)
    assert list(ends) == sorted(set(ends)) and len(ends) <= len(QUANTILES) + 1
    assert all(end % multiple_of == 0 or end == max(histogram) for end in ends)


def measured_at(ends, timed: bool = True) -> list[Measured]:
    # a rate that favours neither short nor long rows by much: a real curve, not a constant
    return [Measured(s, true_batch(s), true_batch(s) + 1, (1e5 / (s + 40)) if timed else None) for s in ends]


def epoch_cost(buckets) -> float:
    return sum(b.rows / b.samples_per_s for b in buckets)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_buckets", [1, 2, 3, 5])
def test_the_buckets_are_the_fastest_subset_of_the_ends(seed, max_buckets):
    histogram = histogram_of(lognormal_lengths(seed, rows=300, longest=256))
    ends = candidate_lengths(histogram, 8)
    measured = measured_at(ends)
    chosen = choose_buckets(histogram, measured, max_buckets)
    assert len(chosen) <= max_buckets
    assert sum(b.rows for b in chosen) == sum(histogram.values())
    assert sum(b.tokens for b in chosen) == sum(s * r for s, r in histogram.items())
    assert chosen[-1].longest == max(histogram)
    for bucket in chosen:  # each bucket's batch is the one measured at its longest length
        assert bucket.batch_size == true_batch(bucket.longest)
        assert bucket.shortest <= bucket.longest
    best = math.inf
    for k in range(1, max_buckets + 1):
        for inner in itertools.combinations(ends[:-1], k - 1):
            subset = set(inner) | {ends[-1]}
            trial = choose_buckets(histogram, [m for m in measured if m.seq_len in subset], len(subset))
            best = min(best, epoch_cost(trial))
    assert epoch_cost(chosen) == pytest.approx(best)


def test_untimed_ends_choose_by_padded_tokens_per_batch_slot():
    histogram = {10: 50, 100: 50}
    chosen = choose_buckets(histogram, measured_at([10, 55, 100], timed=False), 2)
    assert [b.longest for b in chosen] == [10, 100]  # no padding at all
    assert chosen[0].padding == 0 and chosen[1].padding == 0


def test_the_longest_row_must_be_measured():
    with pytest.raises(ValueError, match="longest length measured must be the data's longest"):
        choose_buckets({10: 1, 20: 1}, measured_at([10]), 2)


def brute_force_budget(histogram, batch_at) -> int:
    """The largest B with ``B // s <= batch_at(s)`` for every length ``s`` of the data."""
    return min((batch_at(s) + 1) * s - 1 for s in histogram)


@pytest.mark.parametrize("seed", range(25))
def test_the_budget_is_exact_where_every_length_is_known(seed):
    histogram = histogram_of(lognormal_lengths(seed, rows=200, longest=300))
    safe = {s: true_batch(s) for s in histogram}
    budget, binding = propose_budget(histogram, safe)
    assert budget == brute_force_budget(histogram, true_batch)
    assert budget // binding + 1 > true_batch(binding)  # one token more forms a batch too many
    assert (budget + 1) // binding > true_batch(binding)


@pytest.mark.parametrize("seed", range(25))
def test_between_measured_lengths_the_budget_is_sound_and_the_surface_makes_it_exact(seed):
    histogram = histogram_of(lognormal_lengths(seed, rows=200, longest=300))
    ends = candidate_lengths(histogram, 8)
    safe = {s: true_batch(s) for s in ends}
    exact = brute_force_budget(histogram, true_batch)
    without, _ = propose_budget(histogram, safe)  # the neighbours alone: never above the truth
    assert without <= exact
    assert all(without // s <= true_batch(s) for s in histogram)
    with_surface, _ = propose_budget(histogram, safe, lambda s: float(true_batch(s)))
    assert with_surface == exact
    # a surface that overshoots is held to the shorter measured neighbour's batch
    wild, _ = propose_budget(histogram, safe, lambda s: 1e9)
    shortest = min(ends)
    assert wild <= (true_batch(shortest) + 1) * max(histogram) + max(histogram)


@pytest.mark.parametrize("seed", range(10))
def test_the_compositions_are_batches_the_budget_admits(seed):
    histogram = histogram_of(lognormal_lengths(seed))
    budget, binding = propose_budget(histogram, {s: true_batch(s) for s in histogram})
    found = compositions(histogram, budget, binding, lambda rows, s: rows * (300 * s + 2 * s * s))
    kinds = [kind for _, _, kind in found]
    assert kinds[0] == "binding" and found[0][1] == binding
    assert ("longest" in kinds) == (max(histogram) != binding)
    assert any(s == max(histogram) for _, s, _ in found) and any(s == min(histogram) for _, s, _ in found)
    assert len({(r, s) for r, s, _ in found}) == len(found)
    for rows, seq_len, _ in found:
        assert rows == budget // seq_len and rows * seq_len <= budget


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("world_size", [1, 3])
def test_greedy_steps_are_the_steps_the_sampler_takes_over_sorted_rows(seed, world_size):
    lengths = lognormal_lengths(seed, rows=300, longest=200)
    budget = random.Random(seed).randint(200, 2000)
    sampler = TokenBudgetBatchSampler(
        lengths, budget, shuffle=False, sort_window=len(lengths), num_replicas=world_size, rank=0
    )
    assert greedy_steps(histogram_of(lengths), budget, world_size) == len(sampler)


@pytest.mark.parametrize("seed", range(10))
def test_packed_rows_are_filled_as_best_fit_allows(seed):
    lengths = lognormal_lengths(seed, rows=300, longest=256)
    histogram = histogram_of(lengths)
    fill = pack_fill(histogram, 256)
    assert sum(lengths) / (len(lengths) * 256) < fill <= 1
    rows = sum(lengths) / (fill * 256)
    assert rows == pytest.approx(round(rows)) and round(rows) >= math.ceil(sum(lengths) / 256)
    assert pack_fill({64: 8}, 128) == 1.0
    with pytest.raises(ValueError, match="shorter than the longest row"):
        pack_fill(histogram, max(histogram) - 1)


class _Plan:
    def __init__(self, buckets, budget, packing, longest):
        self.buckets, self.token_budget, self.packing, self.longest = buckets, budget, packing, longest


def test_packed_budgets_come_only_from_a_measured_packed_row():
    histogram = {32: 10, 256: 2}
    buckets = choose_buckets(histogram, measured_at([32, 256]), 2)

    class Budget:
        max_tokens = 2000

    class Packed:
        pack_length, batch_size, longest_packed_row = 256, 4, 1500

    unpacked = knobs_for(_Plan(buckets, Budget(), None, 256))
    assert "ppo_max_token_len_per_gpu" not in str(unpacked["verl"]) and "pack_length=" in unpacked["verl"]["note"]
    assert unpacked["batchfit"]["TokenBudgetBatchSampler.max_tokens"] == 2000
    assert unpacked["transformers"]["per_device_train_batch_size"] == buckets[-1].batch_size
    packed = knobs_for(_Plan(buckets, Budget(), Packed(), 256))
    assert packed["verl"]["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == 1500
    assert packed["slime"]["--max-tokens-per-gpu"] == 1500
    assert packed["transformers"]["per_device_train_batch_size"] == 1500 // 256
    assert packed["torchtune"]["tokenizer.max_seq_len"] == 256

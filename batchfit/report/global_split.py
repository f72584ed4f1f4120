"""The one splitter of a global batch: ``target`` samples as micro-batch x accumulation steps x ranks.

[`batchfit.plan`][batchfit.plan], [`recommend`][batchfit.recommend] with a target, the
integrations and the checkpointing fit all split a global batch here (`choose_split`), so they
agree on every target. The micro-batch comes from what the probe measured: only sizes within the
safe batch, and among the divisors of each rank's share the fastest measured one, because the
memory boundary says what *can* run, not what runs best. The split is exact wherever the ranks
share the target; a poor exact split names the non-exact alternative, never applies it.

Pure Python, no torch.
"""

from __future__ import annotations

import math

from batchfit.report.throughput import KNEE_FRACTION
from batchfit.units import check_positive_int

__all__ = ["ALTERNATIVE_FACTOR", "choose_split", "split_global", "whole_sequences"]

#: A non-exact split is worth mentioning when its micro-batch is at least this many times the exact
#: one's: below that, the exact split costs little, above it the user may prefer to drop a few samples.
ALTERNATIVE_FACTOR = 4


def split_global(
    target: int, safe_batch: int, world_size: int = 1, multiple_of: int = 1, rates: dict[int, float] | None = None
) -> tuple[int, int]:
    """``(micro_batch, accumulation)`` for a global batch of ``target`` samples over ``world_size``
    ranks: the one splitter (`choose_split`, which also says why)."""
    micro, steps, _ = choose_split(target, safe_batch, world_size, multiple_of, rates)
    return micro, steps


def choose_split(
    target: int, safe_batch: int, world_size: int = 1, multiple_of: int = 1, rates: dict[int, float] | None = None
) -> tuple[int, int, list[str]]:
    """``(micro_batch, accumulation, why)`` for a global batch of ``target`` samples over ``world_size`` ranks.

    Where ``world_size`` divides ``target`` the split is exact: the micro-batch is a divisor of each
    rank's share, at most ``safe_batch``, and a multiple of ``multiple_of`` where one divides (else
    the multiple is ignored, and ``why`` says so). Among those divisors (`_choose`): the fastest
    measured one (``rates``: samples/s per size, each size's best-timed trial) when it is on the
    measured plateau or no larger divisor is untimed; below the plateau the largest divisor not
    measured slower; with nothing timed, the largest divisor (fewest accumulation steps). A poor
    exact split (its micro-batch `ALTERNATIVE_FACTOR` times below the best non-exact one) names that
    alternative in ``why``; it is never applied silently. ``why`` is the reason, then notes.

    Otherwise (a share per rank is not whole) the fewest accumulation steps that reach the target
    with micro-batches on the grid of ``multiple_of`` (ignored only when ``safe_batch`` is below
    it), and among those the one whose global batch is nearest the target (more samples on a tie,
    as tokens round up to whole sequences); ``why`` is empty: the caller says how near.
    """
    for name, value in (("target", target), ("safe_batch", safe_batch), ("world_size", world_size)):
        check_positive_int(name, value)
    check_positive_int("multiple_of", multiple_of)
    if target % world_size:
        return (*_nearest(target, safe_batch, world_size, multiple_of), [])
    per_rank = target // world_size
    notes: list[str] = []
    divisors = _divisors_within(per_rank, safe_batch)  # never empty: 1 <= safe
    candidates = [d for d in divisors if d % multiple_of == 0]
    if not candidates:
        candidates = divisors
        notes.append(f"no divisor of {per_rank} within the safe batch is a multiple of {multiple_of}, so it is ignored")
    micro, why = _choose(per_rank, safe_batch, candidates, rates or {})
    alternative = min(safe_batch, per_rank)  # the best non-exact split's micro-batch, on the grid where one fits
    alternative = alternative // multiple_of * multiple_of or alternative
    if alternative >= ALTERNATIVE_FACTOR * micro and per_rank % alternative:
        alt_steps = per_rank // alternative
        alt_global = alternative * alt_steps * world_size
        notes.append(
            f"no exact split has a larger micro-batch: micro-batch {alternative} x {alt_steps} accumulation "
            f"step{'s' * (alt_steps != 1)} would give a global batch of {alt_global}, remainder "
            f"{target - alt_global} (samples left out, so not chosen)"
        )
    return micro, per_rank // micro, [why, *notes]


def _nearest(target: int, safe_batch: int, world_size: int, multiple_of: int) -> tuple[int, int]:
    """The non-exact split of `choose_split`: the fewest steps, then the nearest global batch."""
    step = multiple_of if multiple_of <= safe_batch else 1
    top = safe_batch // step * step
    steps = max(1, -(-target // (top * world_size)))
    ideal = target / (steps * world_size)
    low = min(top, max(step, math.floor(ideal / step) * step))
    high = min(top, max(step, math.ceil(ideal / step) * step))
    micro = high if abs(high * steps * world_size - target) <= abs(low * steps * world_size - target) else low
    return micro, steps


def _divisors_within(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` that are at most ``limit``, increasing. The work is
    ``min(limit, sqrt(n))`` steps: only micro-batches within the safe batch are candidates, so a
    huge target (``2**61 - 1``) costs no more than the safe batch, not the square root of it."""
    root = math.isqrt(n)
    if limit <= root:
        return [d for d in range(1, limit + 1) if n % d == 0]
    small = [d for d in range(1, root + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if n // d != d and n // d <= limit]


def _choose(per_rank: int, safe: int, candidates: list[int], rates: dict[int, float]) -> tuple[int, str]:
    """The micro-batch among ``candidates`` (increasing divisors of ``per_rank``), and why."""
    largest = candidates[-1]
    share = f"the per-rank share {per_rank}"
    biggest = (
        f"micro-batch {largest} is the largest divisor of {share} within the safe batch {safe} "
        "(fewest accumulation steps)"
    )
    timed = [d for d in candidates if d in rates]
    if not timed:
        return largest, biggest + "; none of its divisors was timed"
    fastest = max(timed, key=lambda d: (rates[d], d))
    rate = rates[fastest]
    best_size = max(rates, key=lambda size: (rates[size], size))
    on_plateau = rate >= KNEE_FRACTION * rates[best_size]
    untimed_larger = [d for d in candidates if d > fastest and d not in rates]
    if untimed_larger and not on_plateau:
        pick = untimed_larger[-1]  # a timed divisor above it ran slower than ``fastest``: not it
        head = (
            biggest
            if pick == largest
            else (
                f"micro-batch {pick} is the largest divisor of {share} within the safe batch {safe} "
                f"not measured slower (the larger {largest} ran at {rates[largest]:,.0f} samples/s)"
            )
        )
        return pick, (
            f"{head}; it was not timed, but the fastest timed divisor ({fastest}, {rate:,.0f} samples/s) is below "
            f"the measured plateau ({KNEE_FRACTION:.0%} of {rates[best_size]:,.0f} samples/s at batch {best_size}), "
            "where bigger batches still paid"
        )
    why = f"micro-batch {fastest} is the fastest measured divisor of {share} ({rate:,.0f} samples/s)"
    slower = [d for d in timed if d > fastest]
    if slower:
        why += f"; the larger {slower[-1]} measured slower ({rates[slower[-1]]:,.0f} samples/s)"
    if untimed_larger:
        why += (
            f"; larger divisors up to {untimed_larger[-1]} were not timed, and {fastest} is already on the measured "
            f"plateau (within {1 - KNEE_FRACTION:.0%} of the best rate, {rates[best_size]:,.0f} samples/s "
            f"at batch {best_size})"
        )
    return fastest, why


def whole_sequences(target_tokens: int, seq_len: int, world_size: int = 1) -> tuple[int, str | None]:
    """The global batch, in sequences, for ``target_tokens`` per optimizer step: the fewest whole
    sequences of ``seq_len`` tokens, the same number on each of ``world_size`` ranks, that hold at
    least ``target_tokens``; and, where that is more tokens than asked, a note saying so."""
    batch = -(-target_tokens // (seq_len * world_size)) * world_size
    if batch * seq_len == target_tokens:
        return batch, None
    per_rank = f" for each of {world_size} ranks" if world_size > 1 else ""
    below = batch - world_size
    nearest = f"; the nearest below is {below} sequences, {below * seq_len:,} tokens" if below else ""
    return batch, (
        f"target_tokens {target_tokens:,} is not a whole number of {seq_len:,}-token sequences{per_rank}: rounded "
        f"up to {batch} sequences, {batch * seq_len:,} tokens per step ({batch * seq_len - target_tokens:,} more"
        f"{nearest})"
    )

"""Buckets and a token budget from a length distribution and measured points: pure arithmetic.

Why pure: every choice here is exact given what was measured (each candidate length's exact and
safe batch, its rate), so it is tested exhaustively without a model (`tests/test_bucketing.py`),
and `batchfit.probe.length_plan` runs the trials it asks for.

* `histogram_of`: the lengths, checked, as ``{length: rows}``;
* `candidate_lengths`: where a bucket may end: row quantiles, heavier in the tail;
* `choose_buckets`: the bucket ends, among the candidates, that make the epoch fastest (a
  dynamic programme over the candidates: each bucket costs its rows over its measured rate);
* `propose_budget`, `compositions`: the largest ``max_tokens`` every padded batch fits under,
  and the batches that bind it;
* `greedy_steps`, `pack_fill`: an epoch's steps at a budget; the share of packed rows filled.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from batchfit.report.varlen import Bucket, CompositionKind

__all__ = [
    "DEFAULT_MAX_BUCKETS",
    "Measured",
    "candidate_lengths",
    "choose_buckets",
    "compositions",
    "greedy_steps",
    "histogram_of",
    "is_paired",
    "median_of",
    "pack_fill",
    "pairs_of",
    "prompt_ends",
    "propose_budget",
]

#: The most buckets a plan uses by default: every candidate end (the quantiles and the longest).
DEFAULT_MAX_BUCKETS = 12
#: Row quantiles a bucket may end at (the longest always): the tail is where padding and the
#: ``s^2`` term cost most, so it gets the most candidates.
QUANTILES = (0.1, 0.25, 0.4, 0.55, 0.7, 0.82, 0.9, 0.95, 0.98, 0.995)


class Measured(NamedTuple):
    """One candidate length as the frontier measured it."""

    seq_len: int
    safe_batch: int
    max_batch: int
    samples_per_s: float | None


def histogram_of(lengths: Any, name: str = "lengths") -> dict[int, int]:
    """``{length: rows}``, ascending, from one length per row (a sequence, a 1-d tensor or array)
    or a histogram ``{length: rows}``; a ``TypeError``/``ValueError`` naming the entry otherwise."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (Mapping, Iterable)):
        raise TypeError(
            f"{name} must be one length per row (a sequence of ints) or a histogram {{length: rows}}, "
            f"got {type(lengths).__name__}"
        )
    pairs = lengths.items() if isinstance(lengths, Mapping) else ((value, 1) for value in lengths)
    histogram: dict[int, int] = {}
    for index, (length, rows) in enumerate(pairs):
        where = f"{name}[{length!r}]" if isinstance(lengths, Mapping) else f"{name}[{index}]"
        length = _integer(length, where)
        rows = _integer(rows, f"the rows of {where}")
        if length < 1:
            raise ValueError(f"{where} must be a length of at least 1 token, got {length}")
        if rows < 0:
            raise ValueError(f"the rows of {where} must be >= 0, got {rows}")
        if rows:
            histogram[length] = histogram.get(length, 0) + rows
    if not histogram:
        raise ValueError(f"{name} holds no rows")
    return dict(sorted(histogram.items()))


def pairs_of(lengths: Any, name: str = "lengths") -> dict[tuple[int, int], int]:
    """``{(prompt, response): rows}`` from one ``(prompt, response)`` pair per row or such a
    histogram: generation-shaped data, each row a prompt and the tokens generated after it."""
    pairs = lengths.items() if isinstance(lengths, Mapping) else ((value, 1) for value in lengths)
    histogram: dict[tuple[int, int], int] = {}
    for index, (pair, rows) in enumerate(pairs):
        where = f"{name}[{index}]"
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{where} must be a (prompt, response) pair of lengths, like the first, got {pair!r}")
        prompt, response = (_integer(value, where) for value in pair)
        rows = _integer(rows, f"the rows of {where}")
        if prompt < 1 or response < 1 or rows < 0:
            raise ValueError(f"{where} must hold a prompt and a response of at least 1 token, got {pair!r}")
        if rows:
            histogram[(prompt, response)] = histogram.get((prompt, response), 0) + rows
    if not histogram:
        raise ValueError(f"{name} holds no rows")
    return dict(sorted(histogram.items()))


def is_paired(lengths: Any) -> bool:
    """Whether ``lengths`` are ``(prompt, response)`` pairs (or a histogram keyed by them)."""
    if isinstance(lengths, Mapping):
        first = next(iter(lengths), None)
    elif isinstance(lengths, (list, tuple)):
        first = lengths[0] if lengths else None
    else:
        return False
    return isinstance(first, (tuple, list))


def prompt_ends(pairs: Mapping[tuple[int, int], int], multiple_of: int = 1) -> tuple[tuple[int, int], ...]:
    """Where a generation bucket may end: the prompts' candidate lengths, each with the longest
    response of any row whose prompt is at most that long (so the point measured there bounds every
    bucket that ends there, whichever rows it starts at)."""
    prompts: dict[int, int] = {}
    for (prompt, _), rows in pairs.items():
        prompts[prompt] = prompts.get(prompt, 0) + rows
    return tuple(
        (end, max(response for (prompt, response) in pairs if prompt <= end))
        for end in candidate_lengths(prompts, multiple_of)
    )


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError(f"{where} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where} must be an integer, got {type(value).__name__}") from None


def candidate_lengths(histogram: Mapping[int, int], multiple_of: int = 1) -> tuple[int, ...]:
    """Where a bucket may end: the lengths at `QUANTILES` of the rows and the longest, each
    rounded up to ``multiple_of`` (a kernel's favourite length) but never past the longest."""
    lengths = sorted(histogram)
    cumulative = list(_cumulative(histogram.values()))
    total = cumulative[-1]
    found = {lengths[-1]}
    for quantile in QUANTILES:
        at = lengths[bisect.bisect_left(cumulative, math.ceil(quantile * total))]
        found.add(min(lengths[-1], multiple_of * math.ceil(at / multiple_of)))
    return tuple(sorted(found))


def median_of(histogram: Mapping[int, int]) -> int:
    """The median row's length (the lower one of an even count's two)."""
    half, running = (sum(histogram.values()) + 1) // 2, 0
    for length, rows in sorted(histogram.items()):
        running += rows
        if running >= half:
            return length
    return max(histogram)


def _cumulative(values: Iterable[int]) -> Iterable[int]:
    running = 0
    for value in values:
        running += value
        yield running


def choose_buckets(
    histogram: Mapping[int, int],
    measured: Sequence[Measured],
    max_buckets: int,
    world_size: int = 1,
    generated: Mapping[int, tuple[int, int]] | None = None,
) -> tuple[Bucket, ...]:
    """At most ``max_buckets`` buckets ending at measured lengths (the longest always) that make
    the epoch fastest: each bucket costs its rows over its measured rate (over its padded tokens
    per batch slot where a rate is missing). Empty buckets are dropped. ``generated``: per prompt
    length, ``(its rows' new tokens, the response each measured end generated)``: generation-shaped
    data, whose tokens are the new ones."""
    points = sorted(measured)
    ends = [point.seq_len for point in points]
    if not ends or ends[-1] < max(histogram):
        raise ValueError(f"the longest length measured must be the data's longest ({max(histogram)}), got {ends}")
    timed = all(point.samples_per_s for point in points)
    rows = [sum(r for length, r in histogram.items() if lo < length <= hi) for lo, hi in zip([0, *ends], ends)]

    def cost(start: int, end: int) -> float:  # the bucket (ends[start - 1], ends[end]]
        point, held = points[end], sum(rows[start : end + 1])
        return held / point.samples_per_s if timed and point.samples_per_s else held * point.seq_len / point.safe_batch

    n, most = len(ends), max(1, min(max_buckets, len(ends)))
    best: list[list[float]] = [[math.inf] * n for _ in range(most + 1)]
    came: list[list[int]] = [[-1] * n for _ in range(most + 1)]
    for end in range(n):
        best[1][end] = cost(0, end)
    for k in range(2, most + 1):
        for end in range(n):
            for previous in range(end):
                total = best[k - 1][previous] + cost(previous + 1, end)
                if total < best[k][end]:
                    best[k][end], came[k][end] = total, previous
    k = min(range(1, most + 1), key=lambda used: (best[used][n - 1], used))
    chosen, end = [], n - 1
    while k >= 1 and end >= 0:
        chosen.append(end)
        end, k = came[k][end], k - 1
    buckets, lower = [], 0
    for end in sorted(chosen):
        point = points[end]
        held = {length: r for length, r in histogram.items() if lower < length <= point.seq_len}
        if held:
            new = 0 if generated is None else generated[point.seq_len][1]
            buckets.append(
                Bucket(
                    shortest=min(held),
                    longest=point.seq_len,
                    rows=sum(held.values()),
                    tokens=sum(length * r if generated is None else generated[length][0] for length, r in held.items()),
                    new_tokens=new,
                    batch_size=point.safe_batch,
                    max_batch=point.max_batch,
                    samples_per_s=point.samples_per_s,
                    world_size=world_size,
                )
            )
        lower = point.seq_len
    return tuple(buckets)


def propose_budget(
    histogram: Mapping[int, int], safe: Mapping[int, int], predicted: Callable[[int], float] | None = None
) -> tuple[int, int]:
    """``(max_tokens, binding length)``: the largest padded budget whose every batch
    (``max_tokens // s`` rows of length ``s``, for each length ``s`` of the data) holds at most
    the batch length ``s`` takes: ``safe`` where measured; elsewhere the surface's ``predicted``
    batch, kept between the measured neighbours' (a longer length holds no more rows, a shorter
    no fewer). Every budget below it admits the same batches or smaller ones."""
    measured = sorted(safe)
    if not measured or measured[-1] < max(histogram):
        raise ValueError(f"the data's longest length ({max(histogram)}) was not measured")
    best: tuple[int, int] | None = None
    for length in histogram:
        above = measured[bisect.bisect_left(measured, length)]
        below = bisect.bisect_left(measured, length) - 1
        floor_rows = safe[above]
        ceiling_rows = math.inf if below < 0 or length in safe else safe[measured[below]]
        rows = floor_rows if length in safe or predicted is None else math.floor(predicted(length))
        rows = int(max(floor_rows, min(rows, ceiling_rows)))
        bound = (rows + 1) * length - 1  # one token more forms rows + 1 rows of this length
        if best is None or bound < best[0]:
            best = (bound, length)
    assert best is not None
    return best


def compositions(
    histogram: Mapping[int, int],
    max_tokens: int,
    binding: int,
    predicted_bytes: Callable[[int, int], float] | None = None,
) -> list[tuple[int, int, CompositionKind]]:
    """The batches a budget of ``max_tokens`` binds at, each ``(rows, seq_len, kind)``: the binding
    length's; rows at the longest length; as many shortest rows as it admits; and the mix
    ``predicted_bytes(rows, seq_len)`` calls fullest. A batch two of these name is listed once,
    by the first."""
    lengths = sorted(histogram)
    wanted: list[tuple[int, CompositionKind]] = [
        (binding, "binding"),
        (lengths[-1], "longest"),
        (lengths[0], "shortest"),
    ]
    if predicted_bytes is not None:
        wanted.append((max(lengths, key=lambda s: predicted_bytes(max_tokens // s, s)), "surface"))
    found: list[tuple[int, int, CompositionKind]] = []
    for length, kind in wanted:
        rows = max_tokens // length
        if rows >= 1 and all((rows, length) != (r, s) for r, s, _ in found):
            found.append((rows, length, kind))
    return found


def greedy_steps(histogram: Mapping[int, int], max_tokens: int, world_size: int = 1) -> int:
    """Steps an epoch takes when rows sorted by length are batched greedily under a padded budget
    (``rows x longest <= max_tokens``), the batches dealt to ``world_size`` ranks."""
    batches, rows_in, longest = 0, 0, 0
    for length, rows in sorted(histogram.items()):
        for _ in range(rows):
            if rows_in and (rows_in + 1) * max(longest, length) > max_tokens:
                batches, rows_in = batches + 1, 0
            rows_in, longest = rows_in + 1, length if rows_in == 0 else max(longest, length)
    batches += 1 if rows_in else 0
    return math.ceil(batches / world_size)


def pack_fill(histogram: Mapping[int, int], pack_length: int) -> float:
    """The share of packed rows of ``pack_length`` tokens the data fills, packed best fit,
    longest first (a row longer than ``pack_length`` is an error: packing does not cut rows)."""
    if max(histogram) > pack_length:
        raise ValueError(f"pack_length={pack_length} is shorter than the longest row ({max(histogram)})")
    rooms: list[int] = []  # the room left in each packed row, ascending
    for length, rows in sorted(histogram.items(), reverse=True):
        for _ in range(rows):
            at = bisect.bisect_left(rooms, length)
            if at < len(rooms):
                room = rooms.pop(at) - length
            else:
                room = pack_length - length
            bisect.insort(rooms, room)
    tokens = sum(length * rows for length, rows in histogram.items())
    return tokens / (len(rooms) * pack_length)

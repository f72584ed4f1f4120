"""The types that check each command-line value: sizes, counts, fractions, seconds, lengths.

Each is an ``argparse`` ``type``: it returns the value parsed (or, for sizes, the text once it
parses, since fractions resolve on the device later) and raises ``ArgumentTypeError`` with a
message that names what is wrong, which argparse prints beside the option's name.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from batchfit.probe.options import check_rank_limits
from batchfit.units import check_memory_limit, parse_reserve

__all__ = [
    "block_names",
    "count",
    "finite_seconds",
    "fraction",
    "int_at_least",
    "memory_limit",
    "positive_int",
    "rank_limits",
    "reserve",
    "seconds",
    "seq_lens",
    "size",
]


def memory_limit(value: str) -> str:
    try:
        check_memory_limit(value)  # syntax only: fractions resolve on the device later
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def rank_limits(value: str) -> tuple[tuple[int, str], ...]:
    """``--memory-limit-per-rank 0=24GiB,1=16GiB``: each rank's own limit, a size or a fraction as
    ``--memory-limit`` takes it, as ``(rank, limit)`` pairs. Checked by
    `batchfit.probe.options.check_rank_limits` (a rank listed twice is refused), and again over
    every use of the flag, against the job's ranks, once they are known."""
    pairs: list[tuple[int, str]] = []
    for part in value.split(","):
        rank, equals, limit = part.partition("=")
        if not equals or not rank.strip() or not limit.strip():
            raise argparse.ArgumentTypeError(f"{value!r}: give RANK=SIZE pairs, such as 0=24GiB,1=16GiB ({part!r})")
        try:
            pairs.append((int(rank.strip()), limit.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: the rank {rank.strip()!r} is not a whole number") from None
    try:
        check_rank_limits(pairs, name=repr(value))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return tuple(pairs)


def reserve(value: str) -> str:
    try:
        parse_reserve(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def size(value: str) -> str:
    try:
        parse_reserve(value)  # a size or bytes, no fraction
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value.strip().lower() == "auto":
        raise argparse.ArgumentTypeError("a size is needed here, such as 80GiB")
    return value


def block_names(value: str) -> str | tuple[str, ...]:
    """``batchfit fit --checkpointing``: ``auto``, or module names, comma-separated, as ``fit(checkpointing=)``
    takes them (each checked against the model by `batchfit.fit`)."""
    if value.strip() == "auto":
        return "auto"
    names = tuple(name.strip() for name in value.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{value!r}: name each block, comma-separated, such as h.0,h.1 (or auto)")
    return names


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``minimum`` (1 for sizes, 0 for step counts)."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{value!r} must be at least {minimum}")
        return number

    return parse


positive_int = int_at_least(1)
count = int_at_least(0)


#: ``all`` for a count of a loader's batches: every batch of it (the Python API's ``None``).
EVERY_BATCH = "all"


def batch_count(value: str) -> int | str:
    """A count of a loader's batches (``--scan-batches``): a positive count, or ``all`` (`EVERY_BATCH`)."""
    return EVERY_BATCH if value.strip().lower() == EVERY_BATCH else positive_int(value)


def as_keyword(value: Any) -> Any:
    """A parsed option as the Python API takes it: ``all`` (`EVERY_BATCH`) is ``None``."""
    return None if value == EVERY_BATCH else value


def fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be a fraction in [0, 1)")
    return number


def seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be more than 0 seconds")
    return number


def finite_seconds(value: str) -> float:
    number = seconds(value)
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number of seconds")
    return number


def seq_lens(value: str) -> tuple[int, ...]:
    """``--seq-lens 128,256,512``: whole positive lengths, each once."""
    lengths: list[int] = []
    for part in value.split(","):
        try:
            length = int(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a comma-separated list of lengths, such as 128,256,512 ({part.strip()!r} is not "
                "an integer)"
            ) from None
        if length < 1:
            raise argparse.ArgumentTypeError(f"{value!r}: every length must be at least 1, got {length}")
        if length in lengths:
            raise argparse.ArgumentTypeError(f"{value!r} lists {length} twice")
        lengths.append(length)
    return tuple(lengths)

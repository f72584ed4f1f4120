from __future__ import annotations

import pytest

from batchfit.units import format_bytes, parse_memory_limit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        ("24GiB", 24 * 2**30),
        ("24 GB", 24 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        ("3.9MB", 3_900_000),
        ("100", 100),
        ("0.5", 500),
        (0.25, 250),
        (1.0, 1000),
    ],
)
def test_parse(text: int | float | str, expected: int) -> None:
    assert parse_memory_limit(text, total_bytes=1000) == expected


def test_fraction_needs_a_total() -> None:
    with pytest.raises(ValueError, match="needs a device whose total memory is known"):
        parse_memory_limit(0.5, total_bytes=None)


@pytest.mark.parametrize("bad", [0, -1, "0GiB", "0.0", "-3GiB", "GiB", "", "1e9", True])
def test_rejects(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        parse_memory_limit(bad, total_bytes=1000)  # type: ignore[arg-type]


def test_format() -> None:
    assert format_bytes(None) == "-"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"

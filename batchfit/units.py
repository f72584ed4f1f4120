"""Byte quantities: parsing user limits ("24GiB", 0.8, 10**9) and formatting sizes (and durations);
the check of a positive count (a batch, a target, ranks) that the pure layers share.

Pure Python, no torch import.
"""

from __future__ import annotations

import operator
import re
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory_limit(limit: int | float | str, total_bytes: int | None, name: str = "memory_limit") -> int:
    """Turn a user's memory limit into bytes.

    Accepts an ``int`` number of bytes, a ``float`` fraction in (0, 1] of ``total_bytes``,
    or a string: ``"24GiB"``, ``"512 MB"``, ``"0.8"`` (a fraction), ``"1e9"`` is not accepted
    (say ``"1GB"``). Decimal units (GB) are powers of 1000, binary units (GiB) of 1024.
    Raises ``ValueError`` naming the bad value (a fraction of less than one byte too),
    ``TypeError`` for other types; messages call the value ``name`` (the argument the user wrote).
    """
    kind, value, shown = _read_limit(limit, name)
    if kind == "bytes":
        return int(value)
    if total_bytes is None:
        raise ValueError(f"{name} fraction {shown} needs a device whose total memory is known")
    nbytes = int(value * total_bytes)
    if nbytes < 1:
        raise ValueError(f"{name} fraction {shown} of {format_bytes(total_bytes)} is less than one byte")
    return nbytes


def check_memory_limit(limit: int | float | str, name: str = "memory_limit") -> None:
    """`parse_memory_limit`'s checks that need no device: the syntax, the sign, the range of a
    fraction. What a fraction comes to is only known on the device."""
    _read_limit(limit, name)


def _read_limit(limit: int | float | str, name: str) -> tuple[str, float, str]:
    """``("bytes", n, shown)`` or ``("fraction", f, shown)``, checked; see `parse_memory_limit`."""
    if isinstance(limit, bool):
        raise TypeError(f"{name} must be bytes, a size string or a fraction, not {limit!r}")
    if isinstance(limit, int):
        if limit <= 0:
            raise ValueError(f"{name} must be a positive number of bytes, got {limit}")
        return "bytes", limit, str(limit)
    if isinstance(limit, float):
        return "fraction", _fraction(limit, repr(limit), name), repr(limit)
    if isinstance(limit, str):
        match = _PATTERN.match(limit)
        if not match:
            raise ValueError(
                f"{name} {limit!r} is not a size: use bytes (e.g. 8000000000), "
                "a size with a unit ('24GiB', '512MB') or a fraction ('0.8')"
            )
        number, unit = match.group(1), match.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(
                f"{name} {limit!r} has an unknown unit {match.group(2)!r}: "
                f"use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        value = float(number)
        if unit == "" and number.endswith("."):
            raise ValueError(
                f"{name} {limit!r} is ambiguous: write a fraction with its digits ('0.8', '1.0' for all of "
                "the device) or a size with a unit ('1GB')"
            )
        if unit == "" and "." in number:
            return "fraction", _fraction(value, repr(limit), name), repr(limit)
        nbytes = int(value * _UNITS[unit])
        if nbytes <= 0:
            raise ValueError(f"{name} {limit!r} must be more than zero bytes")
        return "bytes", nbytes, repr(limit)
    raise TypeError(
        f"{name} must be bytes (int), a size string ('24GiB') or a fraction (float), not {type(limit).__name__}"
    )


def _fraction(value: float, shown: str, name: str) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} fraction {shown} must be in (0, 1]")
    return value


def parse_reserve(reserve: int | str) -> int | str:
    """``reserve=``: bytes or a size (no fraction: there is no total it could be of), or
    ``"auto"`` (measured on the device later). ``ValueError`` naming ``reserve`` otherwise."""
    if reserve == "auto":
        return reserve
    try:
        return parse_memory_limit(reserve, None, name="reserve")
    except ValueError as exc:
        raise ValueError(f"{exc}; or 'auto' to measure it on the device") from None


def as_int(name: str, value: Any) -> int:
    """``value`` as the Python int it holds: an int, or any other integral number (numpy's
    ``int64`` from ``np.arange``, any ``numbers.Integral``, a 0-d integer tensor: what
    ``__index__`` takes), never a bool (``True`` as a batch size is a mistake, not 1).
    ``TypeError`` naming ``name`` otherwise. Every count a probe takes is read here."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    boolean = isinstance(value, bool) or "bool" in str(getattr(value, "dtype", ""))
    if not boolean and getattr(value, "ndim", 0) == 0:
        try:
            return operator.index(value)
        except Exception:  # a float, a meta tensor (no value to read): not an int, said below
            pass
    raise TypeError(
        f"{name} must be an int, got {type(value).__name__} {value!r} (any integral number is one: a numpy "
        "integer, a 0-d integer tensor; a bool is not)"
    )


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int (`as_int`) if it is >= ``minimum``; else an error that names ``name``."""
    value = as_int(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_positive_int(name: str, value: Any) -> None:
    """``TypeError`` unless ``value`` is a Python int (not a bool), ``ValueError`` unless it is >= 1; each
    names ``name``. For values stored as given (a plan, a recommendation): `positive_int` converts."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")


def format_bytes(nbytes: float | int | None) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``; ``-`` for ``None``."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"


def format_duration(seconds: float) -> str:
    """A step time as people read it: ``12.3 ms`` below a second, ``1.25 s`` above."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"

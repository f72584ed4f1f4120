"""Reading a JSON document back into frozen records, every field checked against its type hint.

Generic over the dataclasses: it knows nothing of trials or results, so every record module can
use it (``Trial.from_dict``, ``Result.from_dict``) without importing the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from functools import cache
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

_Record = TypeVar("_Record")

# Reading documents back --------------------------------------------------------------------------


class _Corrupt(Exception):
    """What is wrong with a document, and where (raised inside, turned into one ValueError)."""


def read_document(cls: type[_Record], data: Any, noun: str) -> _Record:
    try:
        return _read_record(cls, data, "")
    except _Corrupt as corrupt:
        raise ValueError(f"not a batchfit {noun}: {corrupt}") from None


def _read_record(cls: type[_Record], data: Any, path: str) -> _Record:
    """``cls`` from the mapping ``data``, every field checked against its type hint."""
    if not isinstance(data, dict):
        if not path:
            raise _Corrupt(f"the document is {_kind(data)}, not an object")
        raise _Corrupt(f"field {path!r} must be an object, got {_shown(data)}")
    declared = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    for name in data:
        if name not in declared:
            raise _Corrupt(f"unknown field {_joined(path, str(name))!r}")
    for name, declaration in declared.items():
        if name not in data and declaration.default is MISSING and declaration.default_factory is MISSING:
            raise _Corrupt(f"missing field {_joined(path, name)!r}")
    hints = _hints(cls)
    return cls(**{name: _read_value(hints[name], value, _joined(path, name)) for name, value in data.items()})


def _read_value(hint: Any, value: Any, path: str, nullable: bool = False) -> Any:
    """``value`` as the type ``hint`` describes (JSON lists become tuples), or ``_Corrupt``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (arg for arg in args if arg is not type(None))
        return _read_value(inner, value, path, nullable=type(None) in args)
    if is_dataclass(hint):
        if nullable and not isinstance(value, dict):
            raise _Corrupt(f"field {path!r} must be an object or null, got {_shown(value)}")
        return _read_record(hint, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Corrupt(f"field {path!r} must be a list{' or null' if nullable else ''}, got {_shown(value)}")
        items = args[:1] * len(value) if args[1:] == (Ellipsis,) else args
        if len(items) != len(value):
            raise _Corrupt(f"field {path!r} must be a list of {len(items)} items, got {_shown(value)}")
        return tuple(_read_value(item, v, f"{path}[{i}]") for i, (item, v) in enumerate(zip(items, value)))
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        allowed = ", ".join(repr(arg) for arg in args) + (" or null" if nullable else "")
        raise _Corrupt(f"field {path!r} must be one of {allowed}, got {_shown(value)}")
    wanted, accepted = _SCALARS[hint]
    if not accepted(value):
        raise _Corrupt(f"field {path!r} must be {wanted}{' or null' if nullable else ''}, got {_shown(value)}")
    return float(value) if hint is float else value


#: What each scalar type hint accepts: a description for the message, and the test. Bools are
#: ints in Python, but never in a document; ints are accepted where a float is expected.
_SCALARS: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int beyond any float
        return False


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    """A JSON-ish name of ``value``'s type, with its article."""
    if value is None:
        return "null"
    names = {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), f"a {type(value).__name__}")


def _shown(value: Any) -> str:
    """``str '17'``, ``float nan``, ``null``: the type and (the start of) the value."""
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"

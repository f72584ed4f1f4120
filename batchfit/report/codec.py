"""Reading a JSON document back into frozen records, every field checked against its type hint.

Generic over the dataclasses: it knows nothing of trials or results, so every record module can
use it (``Trial.from_dict``, ``Result.from_dict``, the gate's report) without importing the others.

A value is checked twice: against its type (an int is an int, not a bool, a float or a string;
numbers are finite; a ``Literal`` is one of its words), then against what its field declares it
can be: batch sizes at least 1, byte counts and times not negative, a headroom below 1, a phase
or a device type one batchfit knows. Those constraints are ``typing.Annotated`` metadata on the
type hints (``Annotated[int, Range(1)]``, ``Annotated[str, OneOf(PHASES)]``), read with
``get_type_hints(include_extras=True)``, rather than ``dataclasses.field(metadata=...)``:

* a constraint has to reach inside containers: each pair of ``Trial.phase_peaks`` is a phase
  name and a byte count, each of ``step_times_s`` a time; a field's metadata can only govern the
  field's whole value, a hint governs every position it describes;
* a constrained type is declared once, as an alias (`Batch`, `Bytes`,
  `Seconds`, ...), and says what a value is wherever it appears, in any record of any
  module (the CI gate's report uses them too), with no ``field()`` call beside each default;
* to a type checker ``Annotated[int, ...]`` is a plain ``int``: writing records is unchanged.

Every int has a magnitude bound, declared or not (`INT_LIMIT`, 2**63): a value no memory
or batch can have (``budget_bytes`` of 10**400) is refused here, not when ``str(result)`` turns
it into a float. A field may also declare that it never exceeds another (`NotAbove`, e.g.
``safe_batch`` never above ``max_batch``), where the code that writes the records guarantees it.
A record may declare the schema its document carries (a ``SCHEMA`` class variable): the
document's ``"schema"`` must name it, at any depth (the gate's report holds a result). It may
also name fields its document carries for readers but that are derived from the others (a
``DERIVED`` class variable, e.g. the result's recommendation): they are skipped on reading.

Whatever is wrong, a document is refused with one ``ValueError`` saying what and where, e.g.
``not a batchfit result: field 'trials[2].peak_bytes' must be an int or null, got str '17'``;
a document nested too deeply to read (``"[" * 100000``) is one too, never a ``RecursionError``.

`JsonRecord` gives a record its JSON both ways (``to_dict``/``to_json``/``from_dict``/``from_json``)
from these declarations alone: a record subclasses it and names itself in refusals (``NOUN``); any
answer type may use it (the fit, the evaluation, the noise scale, an uneven split).
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import cache
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

_Record = TypeVar("_Record")
_Json = TypeVar("_Json", bound="JsonRecord")

#: Every int in a document lies in ``[-INT_LIMIT, INT_LIMIT)`` (a signed 64-bit int): no batch,
#: byte count or step count comes near it, and every such int becomes a float (as ``str(result)``
#: turns bytes into text) and a product of two of them stays far from any float's limit.
INT_LIMIT = 2**63


# Constraints, declared on the type hints --------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """A number in ``[low, high)``; ``high=None``: no bound above (an int still has `INT_LIMIT`)."""

    low: float
    high: float | None = None

    def bounded(self, hint: Any) -> Range:
        """The range an int of this hint really has: within `INT_LIMIT` too."""
        if hint is not int:
            return self
        high = INT_LIMIT if self.high is None else min(self.high, INT_LIMIT)
        return Range(max(self.low, -INT_LIMIT), high)

    def admits(self, number: float) -> bool:
        return self.low <= number and (self.high is None or number < self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f">= {_bound(self.low)}"
        return f"in [{_bound(self.low)}, {_bound(self.high)})"


@dataclass(frozen=True)
class OneOf:
    """A string that is one of ``words`` (a vocabulary a ``Literal`` would make too narrow a type)."""

    words: tuple[str, ...]

    def admits(self, word: str) -> bool:
        return word in self.words

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(word) for word in self.words)


@dataclass(frozen=True)
class NotAbove:
    """A field never greater than the record's field ``other`` (checked when both are set)."""

    other: str


#: The int the default constraint allows, where a hint declares none.
_ANY_INT = Range(-INT_LIMIT, INT_LIMIT)

#: A batch size, or another count that is at least one (ranks, a multiple, steps per trial).
Batch = Annotated[int, Range(1)]
#: A count that may be 0: steps, skipped steps, a device index.
Count = Annotated[int, Range(0)]
#: A number of bytes: a peak, a budget, a limit, a total.
Bytes = Annotated[int, Range(0)]
#: A duration in seconds.
Seconds = Annotated[float, Range(0)]
#: Samples per second, or another measured quantity that is never negative.
Rate = Annotated[float, Range(0)]


# Reading documents back --------------------------------------------------------------------------
class _Corrupt(Exception):
    """What is wrong with a document, and where (raised inside, turned into one ValueError)."""


def read_json(cls: type[_Record], text: str | bytes, noun: str) -> _Record:
    """``cls`` from the JSON ``text``; one ``ValueError`` naming the field for anything else."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"not a batchfit {noun}: the document is nested too deeply to read") from None
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"not a batchfit {noun}: invalid JSON ({error})") from None
    return read_document(cls, data, noun)


def read_document(cls: type[_Record], data: Any, noun: str) -> _Record:
    """``cls`` from the parsed document ``data``; one ``ValueError`` naming the field for anything else."""
    try:
        return _read_record(cls, data, "")
    except _Corrupt as corrupt:
        raise ValueError(f"not a batchfit {noun}: {corrupt}") from None
    except RecursionError:  # the reading follows the hints, so only a value shown can go this deep
        raise ValueError(f"not a batchfit {noun}: the document is nested too deeply to read") from None


# Writing and reading, for any record ------------------------------------------------------------
class JsonRecord:
    """JSON both ways for a frozen dataclass record: ``X.from_json(x.to_json()) == x``.

    The document is the fields (nested records as objects, tuples as lists), with the ``"schema"``
    of every record that declares one (``SCHEMA``, at any depth, as reading requires) and the
    values of its ``DERIVED`` names, for readers (skipped on reading). Reading checks every field
    as `read_document` does; a check of the record's own (``__post_init__``) is refused the same
    way, ``not a batchfit <NOUN>: ...``.
    """

    #: What a refused document is called: ``not a batchfit <NOUN>: ...``.
    NOUN: ClassVar[str] = "record"

    def to_dict(self) -> dict[str, Any]:
        """The fields, the schema and the derived values, as JSON values."""
        return document_of(self)  # type: ignore[no-any-return]

    def to_json(self, indent: int | None = 2) -> str:
        """A stable JSON document (keys sorted) of `to_dict`."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls: type[_Json], data: dict[str, Any]) -> _Json:
        """The inverse of `to_dict`; one ``ValueError`` naming the field for anything else."""
        return _constructed(read_document, cls, data)

    @classmethod
    def from_json(cls: type[_Json], text: str | bytes) -> _Json:
        """The inverse of `to_json`; one ``ValueError`` for anything else, invalid JSON included."""
        return _constructed(read_json, cls, text)


def document_of(value: Any) -> Any:
    """``value`` as JSON values: ``dataclasses.asdict``, with each record's ``SCHEMA`` and ``DERIVED``."""
    if is_dataclass(value) and not isinstance(value, type):
        data = {f.name: document_of(getattr(value, f.name)) for f in fields(value)}
        schema = getattr(value, "SCHEMA", None)
        if isinstance(schema, str):
            data["schema"] = schema
        for name in getattr(value, "DERIVED", ()):
            data[name] = document_of(getattr(value, name))
        return data
    if isinstance(value, (list, tuple)):
        return [document_of(item) for item in value]
    if isinstance(value, dict):
        return {key: document_of(item) for key, item in value.items()}
    return value


def _constructed(read: Callable[[type[_Json], Any, str], _Json], cls: type[_Json], document: Any) -> _Json:
    """``read(cls, document, cls.NOUN)``, a record's own refusal (``__post_init__``) said as the codec's."""
    try:
        return read(cls, document, cls.NOUN)
    except ValueError as error:
        if str(error).startswith("not a batchfit"):
            raise
        raise ValueError(f"not a batchfit {cls.NOUN}: {error}") from None


def _read_record(cls: type[_Record], data: Any, path: str) -> _Record:
    """``cls`` from the mapping ``data``, every field checked against its type hint."""
    if not isinstance(data, dict):
        if not path:
            raise _Corrupt(f"the document is {_kind(data)}, not an object")
        raise _Corrupt(f"field {path!r} must be an object, got {_shown(data)}")
    schema = getattr(cls, "SCHEMA", None)
    if isinstance(schema, str):
        if data.get("schema") != schema:
            where = f"field {_joined(path, 'schema')!r}" if path else "schema"
            raise _Corrupt(f"{where} is {_shown_plain(data.get('schema'))}, expected {schema!r}")
        data = {name: value for name, value in data.items() if name != "schema"}
    derived = getattr(cls, "DERIVED", ())
    if derived:  # what the document carries for its readers, computed again from the fields
        data = {name: value for name, value in data.items() if name not in derived}
    declared = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    for name in data:
        if name not in declared:
            raise _Corrupt(f"unknown field {_joined(path, str(name))!r}")
    for name, declaration in declared.items():
        if name not in data and declaration.default is MISSING and declaration.default_factory is MISSING:
            raise _Corrupt(f"missing field {_joined(path, name)!r}")
    hints = _hints(cls)
    record = cls(**{name: _read_value(hints[name], value, _joined(path, name)) for name, value in data.items()})
    for name, other in _ceilings(cls):
        mine, theirs = getattr(record, name), getattr(record, other)
        if mine is not None and theirs is not None and mine > theirs:
            raise _Corrupt(
                f"field {_joined(path, name)!r} must not exceed {_joined(path, other)!r} ({theirs}), got {mine}"
            )
    return record


def _read_value(hint: Any, value: Any, path: str, nullable: bool = False, rules: tuple[Any, ...] = ()) -> Any:
    """``value`` as the type ``hint`` describes (JSON lists become tuples), or ``_Corrupt``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        return _read_value(args[0], value, path, nullable, rules + tuple(hint.__metadata__))
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (arg for arg in args if arg is not type(None))
        return _read_value(inner, value, path, type(None) in args, rules)
    if is_dataclass(hint):
        if nullable and not isinstance(value, dict):
            raise _Corrupt(f"field {path!r} must be an object or null, got {_shown(value)}")
        return _read_record(hint, value, path)
    null = " or null" if nullable else ""
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Corrupt(f"field {path!r} must be a list{null}, got {_shown(value)}")
        items = args[:1] * len(value) if args[1:] == (Ellipsis,) else args
        if len(items) != len(value):
            raise _Corrupt(f"field {path!r} must be a list of {len(items)} items, got {_shown(value)}")
        return tuple(_read_value(item, v, f"{path}[{i}]") for i, (item, v) in enumerate(zip(items, value)))
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        allowed = ", ".join(repr(arg) for arg in args)
        raise _Corrupt(f"field {path!r} must be one of {allowed}{null}, got {_shown(value)}")
    wanted, accepted = _SCALARS[hint]
    if not accepted(value):
        raise _Corrupt(f"field {path!r} must be {wanted}{null}, got {_shown(value)}")
    read = float(value) if hint is float else value  # an int where a number is expected: as the float it becomes
    if hint is int and not any(isinstance(rule, Range) for rule in rules):
        rules = (*rules, _ANY_INT)
    for rule in rules:
        if isinstance(rule, Range) and not rule.bounded(hint).admits(read):
            noun = "an int" if hint is int else "a number"
            raise _Corrupt(f"field {path!r} must be {noun} {rule.bounded(hint)}{null}, got {_shown(value)}")
        if isinstance(rule, OneOf) and not rule.admits(read):
            raise _Corrupt(f"field {path!r} must be {rule}{null}, got {_shown(value)}")
    return read


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
    return get_type_hints(cls, include_extras=True)


@cache
def _ceilings(cls: type) -> tuple[tuple[str, str], ...]:
    """The ``(field, other)`` pairs of ``cls`` whose field never exceeds the other (`NotAbove`)."""
    hints = _hints(cls)
    return tuple(
        (f.name, rule.other) for f in fields(cls) for rule in _metadata(hints[f.name]) if isinstance(rule, NotAbove)
    )


def _metadata(hint: Any) -> tuple[Any, ...]:
    """The ``Annotated`` metadata of ``hint``, through an optional (``X | None``)."""
    if get_origin(hint) in (Union, UnionType):
        return tuple(rule for arg in get_args(hint) for rule in _metadata(arg))
    return tuple(hint.__metadata__) if get_origin(hint) is Annotated else ()


def _bound(number: float) -> str:
    """``2**63`` for the int limit (its digits say less), else the number as written."""
    if abs(number) == INT_LIMIT:
        return f"{'-' if number < 0 else ''}2**63"
    return f"{number:g}" if isinstance(number, float) else str(number)


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    """A JSON-ish name of ``value``'s type, with its article."""
    if value is None:
        return "null"
    names = {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), f"a {type(value).__name__}")


#: Containers shown a few levels and items deep: a list nested 100,000 deep is shown as ``[[[...]]]``.
_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxlist, _PREVIEW.maxtuple, _PREVIEW.maxdict = 3, 4, 4, 4


def _shown(value: Any) -> str:
    """``str '17'``, ``float nan``, ``null``: the type and (the start of) the value."""
    if value is None:
        return "null"
    return f"{type(value).__name__} {_shown_plain(value)}"


def _shown_plain(value: Any) -> str:
    """(The start of) ``repr(value)``, whatever the value: never deeper or longer than a message needs."""
    try:
        text = _PREVIEW.repr(value) if isinstance(value, (list, tuple, dict)) else repr(value)
    except ValueError:  # an int with more digits than int-to-str allows, perhaps inside a list
        return f"of {value.bit_length()} bits" if isinstance(value, int) else "(too large to show)"
    return text if len(text) <= 40 else text[:37] + "..."

"""The CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``), read as torch reads them and said in words.

Why: the same training step reserves a different amount of CUDA memory under different allocator
settings. ``expandable_segments:True`` keeps reserved memory within a page of allocated memory
per pool, where the default can reserve gigabytes more on an LLM step; ``roundup_power2_divisions``
rounds requests up; ``max_split_size_mb`` stops big cached blocks from being split. A probe on a
GPU meets the settings of its process; an estimate must model the same ones, and a result must say
which were in force. `AllocatorConfig` is that one reading, for both.

What torch reads (torch 2.13: ``c10/core/AllocatorConfig.cpp`` and ``c10/cuda/CUDAAllocatorConfig.h``):

* the first of `ENV_VARIABLES` that is *set* (an empty value counts, and then means the
  defaults), and only that one: ``PYTORCH_CUDA_ALLOC_CONF`` wins over ``PYTORCH_ALLOC_CONF``
  (an earlier layout of that file read ``PYTORCH_ALLOC_CONF`` first);
* comma-separated ``key:value`` entries, a list value in brackets (``[256:1,>:4]``); whitespace is
  dropped anywhere; a later entry for the same key wins;
* ``True``/``False`` spelled exactly so (``true`` is an error in torch 2.13's ``ConfigTokenizer``).

Malformed values raise ``ValueError`` naming the variable and the entry, where torch raises at
CUDA initialisation. One difference, on purpose: a key torch 2.13 does not know is kept in
`AllocatorConfig.unrecognized` instead of refused (torch's CUDA build refuses it, "Unrecognized
key ... in CUDA allocator config"), because a newer torch may know keys this list does not, and a
probe must not fail on a setting its own torch accepted.

Pure Python: no torch import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from batchfit.units import format_bytes

__all__ = ["ENV_VARIABLES", "ROUNDUP_INTERVALS", "AllocatorConfig", "Backend"]

MIB = 2**20
#: Where torch looks for the settings, in its order; the first that is set is read, alone.
ENV_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
#: kRoundUpPowerOfTwoIntervals: ``roundup_power2_divisions`` has one value per power-of-two size
#: interval, [1, 2) MiB, [2, 4) MiB, ... up to [32, 64) GiB and beyond (sizes under 1 MiB use the first).
ROUNDUP_INTERVALS = 16
#: The default ``large_segment_size_mb``: the segment for requests of 1 to 10 MiB, and the page of
#: an expandable segment's large pool (kLargeBuffer).
DEFAULT_LARGE_SEGMENT = 20 * MIB
_MIN_LARGE_ALLOC_MB = 10  # kMinLargeAlloc in MiB: large_segment_size_mb must be more than this
_SMALL_PAGE = 2 * MIB  # kSmallBuffer: the small pool's segment and expandable page

#: ``"pluggable"``: an allocator swapped in with ``torch.cuda.memory.change_current_allocator``, which no
#: environment variable names (torch reports it; the settings here do not apply to it).
Backend = Literal["native", "cudaMallocAsync", "pluggable"]

#: Keys torch knows whose settings do not change what the device allocator reserves: host
#: (pinned) memory, the lock around cudaMalloc, CUDA graph capture, an early OOM check.
_INERT_KEYS = frozenset(
    {
        "pinned_use_background_threads",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
        "pinned_free_catch_all",
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "graph_capture_record_stream_reuse",
        "throw_on_cudamalloc_oom",
    }
)
_SEPARATORS = frozenset(",:[]")
_UINT = re.compile(r"[0-9]+")
_FLOAT = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|[0-9]+\.")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of PyTorch's CUDA caching allocator that change what it reserves.

    Every field defaults to torch's default, so ``AllocatorConfig()`` is an unset
    ``PYTORCH_CUDA_ALLOC_CONF``. Sizes are in bytes (torch's keys are in MiB).

    Attributes:
        backend: ``"native"`` (the caching allocator) or ``"cudaMallocAsync"`` (the CUDA driver's
            stream-ordered pool, which ignores every other setting here; ``hipMallocAsync`` reads as it), or
            ``"pluggable"`` (one swapped in by the program, as torch reports it; never read from the text).
        expandable_segments: one segment per pool that grows by mapping pages (2 MiB in the small
            pool, `large_segment_bytes` in the large one) instead of a new segment per miss.
        roundup_power2_divisions: per size interval (`ROUNDUP_INTERVALS` of them, from 1 MiB),
            how many steps to round a request to between two powers of two (0 or 1: plain 512-byte
            rounding). An ``int`` is that number for every interval (torch's old form).
        max_split_size_bytes: cached blocks of this size or more are never split (``None``: no limit).
        max_non_split_rounding_bytes: how much bigger than a request of at least
            ``max_split_size_bytes`` a cached block may be and still serve it (``None``: the
            default, `large_segment_bytes`).
        large_segment_bytes: ``large_segment_size_mb``: the segment for requests of 1 to 10 MiB.
        garbage_collection_threshold: under a memory fraction, the share of it past which cached
            whole large segments that went unused longest are given back before a new one is taken.
        per_process_memory_fraction: a memory fraction set from the start (``None``: none).
        other: known settings that do not change what the allocator reserves, as ``(key, value)``.
        unrecognized: keys torch 2.13 does not know (kept, not refused: see the module docs).
        variable: the environment variable the settings came from, ``None`` when not from one.
        text: the settings as written.
    """

    backend: Backend = "native"
    expandable_segments: bool = False
    roundup_power2_divisions: int | tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    max_split_size_bytes: int | None = None
    max_non_split_rounding_bytes: int | None = None
    large_segment_bytes: int = DEFAULT_LARGE_SEGMENT
    garbage_collection_threshold: float | None = None
    per_process_memory_fraction: float | None = None
    other: tuple[tuple[str, str], ...] = ()
    unrecognized: tuple[str, ...] = ()
    variable: str | None = None
    text: str = ""

    def __post_init__(self) -> None:
        divisions = self.roundup_power2_divisions
        if isinstance(divisions, int):
            divisions = (divisions,) * ROUNDUP_INTERVALS
        divisions = tuple(divisions)
        if len(divisions) != ROUNDUP_INTERVALS or not all(d == 0 or _is_power_of_two(d) for d in divisions):
            raise ValueError(
                f"roundup_power2_divisions must be {ROUNDUP_INTERVALS} values (or one), each 0 or a power of 2: "
                f"{self.roundup_power2_divisions!r}"
            )
        object.__setattr__(self, "roundup_power2_divisions", divisions)
        if self.backend not in ("native", "cudaMallocAsync", "pluggable"):
            raise ValueError(f"backend must be 'native', 'cudaMallocAsync' or 'pluggable', got {self.backend!r}")
        if self.large_segment_bytes <= _MIN_LARGE_ALLOC_MB * MIB:
            raise ValueError(f"large_segment_bytes must be over {_MIN_LARGE_ALLOC_MB} MiB: {self.large_segment_bytes}")
        for name in ("max_split_size_bytes", "max_non_split_rounding_bytes"):
            value = getattr(self, name)
            if value is not None and value < self.large_segment_bytes:
                raise ValueError(f"{name} must be at least large_segment_bytes ({self.large_segment_bytes}): {value}")
        threshold = self.garbage_collection_threshold
        if threshold is not None and not 0.0 < threshold < 1.0:
            raise ValueError(f"garbage_collection_threshold must be in (0, 1): {threshold}")
        fraction = self.per_process_memory_fraction
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise ValueError(f"per_process_memory_fraction must be in [0, 1]: {fraction}")

    # reading ----------------------------------------------------------------------------------------
    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> AllocatorConfig:
        """The settings a torch process started with ``environ`` uses (the first of `ENV_VARIABLES` set)."""
        for variable in ENV_VARIABLES:
            if variable in environ:
                return cls.parse(environ[variable], variable)
        return cls()

    @classmethod
    def parse(cls, text: str, variable: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorConfig:
        """The settings ``text`` states, parsed as torch parses them (module docs); ``variable`` names the
        source in errors. ``ValueError`` naming the variable and the entry when torch would refuse it."""
        entries = _entries(text, variable)
        fields: dict[str, object] = {"variable": variable, "text": text}
        other: dict[str, str] = {}
        unrecognized: list[str] = []
        # torch reads large_segment_size_mb first: the limits of the other sizes depend on it.
        large_mb = DEFAULT_LARGE_SEGMENT // MIB
        for key, value, entry in entries:
            if key == "large_segment_size_mb":
                large_mb = _uint(value, entry, variable)
                if large_mb <= _MIN_LARGE_ALLOC_MB:
                    raise _bad(variable, entry, f"large_segment_size_mb must be more than {_MIN_LARGE_ALLOC_MB}")
        fields["large_segment_bytes"] = large_mb * MIB
        for key, value, entry in entries:
            if key == "large_segment_size_mb":
                continue
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                size_mb = _uint(value, entry, variable)
                if size_mb < large_mb:
                    raise _bad(variable, entry, f"{key} must be at least the large segment size, {large_mb}")
                name = "max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"
                fields[name] = size_mb * MIB
            elif key == "garbage_collection_threshold":
                threshold = _float(value, entry, variable)
                if not 0.0 < threshold < 1.0:
                    raise _bad(variable, entry, "garbage_collection_threshold must be in (0.0, 1.0)")
                fields["garbage_collection_threshold"] = threshold
            elif key == "per_process_memory_fraction":
                fraction = _float(value, entry, variable)
                if not 0.0 <= fraction <= 1.0:
                    raise _bad(variable, entry, "per_process_memory_fraction must be in [0.0, 1.0]")
                fields["per_process_memory_fraction"] = fraction
            elif key == "roundup_power2_divisions":
                fields["roundup_power2_divisions"] = _divisions(value, entry, variable)
            elif key == "expandable_segments":
                fields["expandable_segments"] = _bool(value, entry, variable)
            elif key == "backend":
                if value not in ("native", "cudaMallocAsync", "hipMallocAsync"):
                    raise _bad(variable, entry, "the backend must be native or cudaMallocAsync")
                fields["backend"] = "native" if value == "native" else "cudaMallocAsync"
            elif key in _INERT_KEYS:
                other[key] = value if isinstance(value, str) else "[" + ",".join(value) + "]"
            elif key not in unrecognized:
                unrecognized.append(key)
        fields["other"] = tuple(other.items())
        fields["unrecognized"] = tuple(unrecognized)
        return cls(**fields)  # type: ignore[arg-type]

    # using --------------------------------------------------------------------------------------------
    @property
    def divisions_by_interval(self) -> tuple[int, ...]:
        """``roundup_power2_divisions`` as its `ROUNDUP_INTERVALS` values."""
        divisions = self.roundup_power2_divisions
        assert isinstance(divisions, tuple)  # __post_init__ made it one
        return divisions

    def divisions(self, nbytes: int) -> int:
        """The ``roundup_power2_divisions`` value for a request of ``nbytes`` (torch's
        ``roundup_power2_divisions(size)``: the interval of its highest power of two, from 1 MiB)."""
        index = max(0, nbytes.bit_length() - 1 - 20)
        return self.divisions_by_interval[min(index, ROUNDUP_INTERVALS - 1)]

    @property
    def max_non_split_rounding(self) -> int:
        """How much bigger than an oversize request a cached block may be and still serve it."""
        if self.max_non_split_rounding_bytes is not None:
            return self.max_non_split_rounding_bytes
        return self.large_segment_bytes

    def changes(self) -> tuple[str, ...]:
        """Each setting that differs from torch's default, in words: what it changes in what is reserved."""
        said: list[str] = []
        if self.backend == "cudaMallocAsync":
            said.append(
                "backend cudaMallocAsync: the CUDA driver's stream-ordered pool serves every request, and the "
                "caching allocator's settings do not apply"
            )
        large = format_bytes(self.large_segment_bytes)
        if self.expandable_segments:
            said.append(
                f"expandable segments: each pool grows one segment by mapping pages ({format_bytes(_SMALL_PAGE)} "
                f"small, {large} large): reserved memory grows by the pages a request lacks, not by a segment per "
                "request size, and every block is split to its request"
            )
        if any(self.divisions_by_interval):
            said.append(f"roundup_power2_divisions: requests are rounded up ({self._divisions_in_words()})")
        if self.max_split_size_bytes is not None:
            said.append(
                f"max_split_size {format_bytes(self.max_split_size_bytes)}: cached blocks of that size or more are "
                f"never split, and serve only requests of at least that size that they exceed by less than "
                f"{format_bytes(self.max_non_split_rounding)}"
            )
        elif self.max_non_split_rounding_bytes is not None:
            said.append("max_non_split_rounding_mb: no effect without max_split_size_mb")
        if self.large_segment_bytes != DEFAULT_LARGE_SEGMENT:
            said.append(f"large segments of {large} (not 20 MiB) for requests between 1 and 10 MiB")
        if self.garbage_collection_threshold is not None:
            said.append(
                f"garbage_collection_threshold {self.garbage_collection_threshold:g}: under a memory fraction, past "
                f"{self.garbage_collection_threshold:.0%} of the allowed memory reserved, the cached whole large "
                "segments unused longest are given back before a new one is reserved"
            )
        if self.per_process_memory_fraction is not None:
            said.append(
                f"per_process_memory_fraction {self.per_process_memory_fraction:g}: the allocator caps its reserved "
                "memory at that share of the device from the start"
            )
        if self.other:
            listed = ", ".join(f"{key}:{value}" for key, value in self.other)
            said.append(f"settings that do not change what is reserved: {listed}")
        if self.unrecognized:
            said.append(
                "keys torch 2.13 does not know, ignored here (its CUDA build refuses them): "
                + ", ".join(self.unrecognized)
            )
        return tuple(said)

    def describe(self) -> str:
        """One line: where the settings came from and what they change (or that they are the defaults)."""
        said = "; ".join(self.changes()) or "the caching allocator's defaults"
        return said if self.variable is None else f"{self.variable}={self.text!r}: {said}"

    def _divisions_in_words(self) -> str:
        """``roundup_power2_divisions`` as runs of equal values over size ranges, in words."""
        runs: list[tuple[int, int]] = []  # (first interval, value)
        for index, value in enumerate(self.divisions_by_interval):
            if not runs or runs[-1][1] != value:
                runs.append((index, value))
        words = []
        for n, (start, value) in enumerate(runs):
            end = runs[n + 1][0] if n + 1 < len(runs) else None
            span = " ".join(
                part
                for part in (
                    "" if start == 0 else f"from {format_bytes(MIB << start)}",
                    "" if end is None else f"below {format_bytes(MIB << end)}",
                )
                if part
            )
            rounding = f"to the next of {value} steps between powers of two" if value > 1 else "to 512 bytes"
            words.append(f"{span}: {rounding}" if span else rounding)
        return "; ".join(words)


# parsing ---------------------------------------------------------------------------------------------
def _tokens(text: str) -> list[str]:
    """torch's ``ConfigTokenizer``: separators ``, : [ ]`` are tokens of their own; whitespace is dropped."""
    tokens: list[str] = []
    buffer = ""
    for char in text:
        if char in _SEPARATORS:
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(char)
        elif not char.isspace():
            buffer += char
    if buffer:
        tokens.append(buffer)
    return tokens


def _entries(text: str, variable: str) -> list[tuple[str, str | tuple[str, ...], str]]:
    """``(key, value, entry as written)`` per entry; a list value as its tokens inside the brackets."""
    tokens = _tokens(text)
    entries: list[tuple[str, str | tuple[str, ...], str]] = []
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in _SEPARATORS or i + 1 >= len(tokens) or tokens[i + 1] != ":":
            raise _bad(variable, "".join(tokens[i : i + 3]), "expected key:value")
        if i + 2 >= len(tokens):
            raise _bad(variable, key + ":", "a value is missing")
        value: str | tuple[str, ...]
        if tokens[i + 2] == "[":
            try:
                end = tokens.index("]", i + 3)
            except ValueError:
                raise _bad(variable, "".join(tokens[i:]), "the list has no closing ']'") from None
            value = tuple(tokens[i + 3 : end])
        elif tokens[i + 2] in _SEPARATORS:
            raise _bad(variable, "".join(tokens[i : i + 3]), "a value is missing")
        else:
            end = i + 2
            value = tokens[end]
        entries.append((key, value, "".join(tokens[i : end + 1])))
        i = end + 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise _bad(variable, "".join(tokens[i - 1 : i + 1]), "entries are separated by ','")
            i += 1
    return entries


def _bad(variable: str, entry: str, problem: str) -> ValueError:
    return ValueError(f"{variable}: {problem} (in the entry {entry!r})")


def _scalar(value: str | tuple[str, ...], entry: str, variable: str) -> str:
    if not isinstance(value, str):
        raise _bad(variable, entry, "expected a single value, not a list")
    return value


def _uint(value: str | tuple[str, ...], entry: str, variable: str) -> int:
    text = _scalar(value, entry, variable)
    if not _UINT.fullmatch(text):
        raise _bad(variable, entry, f"{text!r} is not a whole number")
    return int(text)


def _float(value: str | tuple[str, ...], entry: str, variable: str) -> float:
    text = _scalar(value, entry, variable)
    if not _FLOAT.fullmatch(text):
        raise _bad(variable, entry, f"{text!r} is not a number")
    return float(text)


def _bool(value: str | tuple[str, ...], entry: str, variable: str) -> bool:
    text = _scalar(value, entry, variable)
    if text not in ("True", "False"):
        raise _bad(variable, entry, f"expected True or False (torch reads no other spelling), got {text!r}")
    return text == "True"


def _divisions(value: str | tuple[str, ...], entry: str, variable: str) -> tuple[int, ...]:
    """``roundup_power2_divisions`` as torch fills its 16 intervals (``parseRoundUpPower2Divisions``):
    an int is every interval; in a list ``MiB:n`` sets the interval of that power of two (the first
    entry also every interval below it) and ``>:n`` every interval after the last one set."""
    if isinstance(value, str):
        divisions = _uint(value, entry, variable)
        if not _is_power_of_two(divisions):
            raise _bad(variable, entry, "the divisions must be a power of 2")
        return (divisions,) * ROUNDUP_INTERVALS
    filled = [0] * ROUNDUP_INTERVALS
    tokens = list(value)
    first, last = True, 0
    i = 0
    while i < len(tokens):
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise _bad(variable, entry, "expected [MiB:divisions,...,>:divisions]")
        bound, count = tokens[i], _uint(tokens[i + 2], entry, variable)
        if count != 0 and not _is_power_of_two(count):
            raise _bad(variable, entry, f"the divisions must be 0 or a power of 2, got {count}")
        if bound == ">":
            filled[last + 1 :] = [count] * (ROUNDUP_INTERVALS - last - 1)
        else:
            size_mb = _uint(bound, entry, variable)
            if not _is_power_of_two(size_mb):
                raise _bad(variable, entry, f"the interval bounds must be powers of 2, got {size_mb}")
            index = min(size_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                filled[:index] = [count] * index
                first = False
            filled[index] = count
            last = index
        i += 3
        if i < len(tokens):
            if tokens[i] != ",":
                raise _bad(variable, entry, "list entries are separated by ','")
            i += 1
    return tuple(filled)

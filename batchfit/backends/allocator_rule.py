"""What a caching allocator did during one trial, and whether its steps fit by that allocator's rule.

Why (docs/concepts/measuring.md#what-fits-on-cuda): three proof runs on an H200 showed that near the
cap "no out-of-memory error" is not an answer a fresh training process reproduces. When the native
allocator is refused a new segment under the memory fraction it synchronises, gives back every
wholly free cached segment and tries again (``num_alloc_retries``). Whether the retry succeeds
depends on which segments happen to be whole at that moment, which a different history (a fresh
process) changes; a step that flushes is also slow (a device sync, ``cudaFree`` and ``cudaMalloc``).
So each allocator gets the rule its behaviour allows:

* **native**: a step that needed a retry does not fit;
* **expandable segments**: out-of-memory alone decides; retries are reported, not failed on (part of
  them are the cap's emulation: torch charges the whole request against the fraction before mapping
  only the missing pages);
* **``backend:cudaMallocAsync``**: the fraction caps requested bytes, which are the same between
  processes to within 32 KiB, so out-of-memory alone decides; the driver's pool reserves more, by an
  amount that differs between processes (~0.6 GiB seen), reported as the pool's overhead and taken
  off the safe batch's cap, not off the max.

The same facts size the safe batch's headroom: it must hold one more of the step's largest single
allocation (a GPT-2 fp32 log-softmax buffer was 17.5% of a 24 GiB cap, more than a 10% headroom).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.report.records import RETRY_REFUSAL, AllocatorFacts
from batchfit.units import format_bytes

#: Which rule judges a trial: the allocator the process runs (`rule_of`).
Rule = Literal["native", "expandable", "async", "pluggable"]

#: ``torch.cuda.memory_stats`` keys read here (an allocator backend without one reads as absent).
RETRIES = "num_alloc_retries"
INACTIVE_PEAK = "inactive_split_bytes.all.peak"
SEGMENTS = "segment.all.current"


def rule_of(backend: str, expandable_segments: bool) -> Rule:
    """The rule of an allocator: its backend and whether segments are expandable."""
    if backend == "cudaMallocAsync":
        return "async"
    if backend == "pluggable":
        return "pluggable"
    return "expandable" if expandable_segments else "native"


def unmodelled(settings: AllocatorConfig) -> list[str]:
    """What the allocator's settings put beyond what the rule reads, in words (nothing for the defaults)."""
    notes: list[str] = []
    if settings.backend not in ("native", "cudaMallocAsync"):
        notes.append(
            f"the allocator is {settings.backend!r} (a pluggable allocator): batchfit reads no retries or split-free "
            "bytes from it, so a step fits when it raised no out-of-memory error, and how it fragments is not modelled "
            "(see docs/concepts/measuring.md#what-fits-on-cuda)"
        )
    if settings.max_split_size_bytes is not None and settings.backend == "native":
        notes.append(
            f"{settings.variable or 'the allocator configuration'} sets max_split_size_mb: before a retry the "
            "allocator frees cached blocks of that size or more without counting one, so a step that survived "
            "that way is judged as fitting (see docs/concepts/measuring.md#what-fits-on-cuda)"
        )
    if settings.unrecognized:
        notes.append(
            f"{settings.variable or 'the allocator configuration'} sets keys batchfit does not know ("
            + ", ".join(settings.unrecognized)
            + "): what they change is not modelled; the answer is what this process ran under them"
        )
    return notes


class AllocatorWatch:
    """One trial's allocator facts, gathered at the end of each phase from the allocator's statistics.

    ``begin`` at the start of a trial, ``phase_ended`` after each phase with the statistics read then and
    the phase's peaks, ``failed`` with the request an out-of-memory message stated; then `facts` and
    `refusal` say what happened and whether it fits.
    """

    def __init__(self, rule: Rule) -> None:
        self.rule: Rule = rule
        self._retries_before = 0
        self._retries = 0
        self._retry_phase: str | None = None
        self._inactive_peak: int | None = None
        self._pool_overhead: int | None = None
        self._failed_request: int | None = None

    def begin(self, stats: Mapping[str, Any]) -> None:
        self._retries_before = int(stats.get(RETRIES, 0) or 0)
        self._retries = 0
        self._retry_phase = None
        self._inactive_peak = None
        self._pool_overhead = None
        self._failed_request = None

    def phase_ended(self, name: str, stats: Mapping[str, Any], allocated_peak: int, reserved_peak: int) -> None:
        retries = max(0, int(stats.get(RETRIES, 0) or 0) - self._retries_before)
        if retries > self._retries and self._retry_phase is None:
            self._retry_phase = name
        self._retries = retries
        inactive = stats.get(INACTIVE_PEAK)
        if inactive is not None:
            self._inactive_peak = max(self._inactive_peak or 0, int(inactive))
        if self.rule == "async":
            self._pool_overhead = max(self._pool_overhead or 0, reserved_peak - allocated_peak)

    def failed(self, requested: int | None) -> None:
        """The request an out-of-memory message stated: at least the largest single allocation."""
        self._failed_request = requested

    def facts(self, largest_request: int | None, segments: list[Any] | None) -> AllocatorFacts:
        """The trial's facts; ``largest_request`` as recorded (``None``: not recorded), ``segments`` the
        allocator's snapshot while the trial's segments are still held (``None``: no snapshot)."""
        requests = [n for n in (largest_request, self._failed_request) if n is not None]
        sizes = [int(segment.get("total_size", 0)) for segment in segments or ()]
        return AllocatorFacts(
            retries=self._retries,
            inactive_split_peak_bytes=self._inactive_peak,
            largest_request_bytes=max(requests, default=None),
            largest_segment_bytes=max(sizes, default=None),
            pool_overhead_bytes=self._pool_overhead,
            rule=self.rule,
        )

    def refusal(self) -> tuple[str, str] | None:
        """``(phase, reason)`` when the steps ran but do not fit by the rule (native: a retry)."""
        if self.rule != "native" or not self._retries or self._retry_phase is None:
            return None
        return self._retry_phase, (
            f"{RETRY_REFUSAL}: the step ran only after the allocator flushed its cache at the cap "
            f"{self._retries} time(s) (num_alloc_retries); on the native allocator that does not fit, since a fresh "
            "process's history decides whether the retry succeeds (see docs/concepts/measuring.md#what-fits-on-cuda)"
        )


def facts_notes(facts: AllocatorFacts | None, headroom_bytes: int | None) -> list[str]:
    """What the boundary's allocator facts say a reader should know: retries that were only reported,
    split-free bytes beyond the headroom (fragmentation: ``expandable_segments:True`` is the cure)."""
    if facts is None:
        return []
    rule = facts.rule
    notes: list[str] = []
    if facts.retries and rule == "expandable":
        notes.append(
            f"at the largest batch the allocator flushed its cache {facts.retries} time(s) at the cap (expandable "
            "segments: reported, not failed on; part of them are the cap's emulation)"
        )
    inactive = facts.inactive_split_peak_bytes
    if rule == "native" and inactive and headroom_bytes is not None and inactive > headroom_bytes:
        notes.append(
            f"at the largest batch {format_bytes(inactive)} sat free but split inside segments still in use, more "
            f"than the headroom of {format_bytes(headroom_bytes)}: the native allocator fragments here; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually fits more "
            "(see docs/concepts/measuring.md#what-fits-on-cuda)"
        )
    return notes

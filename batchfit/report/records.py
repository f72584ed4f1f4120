"""The records of a probe: one trial, the device, the settings. Frozen, JSON-ready, torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from batchfit.report.codec import Batch, Bytes, Count, NotAbove, OneOf, Range, Rate, Seconds, read_document

PHASES = ("batch", "forward", "backward", "step")
#: How the message of a trial begins whose steps ran but needed an allocator retry, which on CUDA's native
#: allocator does not fit (``batchfit.backends.allocator_rule``).
RETRY_REFUSAL = "CUDA allocator retry"

#: Where a step was when it ran out of memory, and the phases peaks are recorded for.
Phase = Literal["batch", "forward", "backward", "step"]
#: A phase as the meters name it (a plain ``str`` to a type checker, one of `PHASES` in a
#: document): the keys of ``phase_peaks`` and the phase of a memory line.
PhaseName = Annotated[str, OneOf(PHASES)]
#: The device kinds a result can come from: those batchfit probes (``batchfit.backends``), which
#: include those ``batchfit.estimate`` estimates for, and ``"unknown"``, what a probe of
#: ``torchrun`` jobs says until its first job has told it.
DEVICE_TYPES = ("cpu", "cuda", "xpu", "unknown")
#: A step that trains, or only runs forward.
#: What a probe runs: a training step, a forward, the evaluation step beside the training state, generation.
Mode = Literal["train", "inference", "eval", "generate"]
#: Mixed precision's dtype (``None`` in a record: none).
Amp = Literal["bf16", "fp16"]
#: Why a trial ran: the search, the safe batch's verification, the CI gate's one trial, or a
#: size timed warm after the search for the throughput answer (``batchfit.probe.timing``).
TrialKind = Literal["search", "verify", "gate", "time"]
#: Which memory a budget, a peak or a memory equation counts: what live tensors hold
#: (``"allocated"``), or what the allocator holds from the device (``"reserved"``, the unit of
#: a CUDA limit).
Unit = Literal["allocated", "reserved"]


@dataclass(frozen=True)
class AllocatorFacts:
    """What the allocator did during one trial: the facts that decide "fits" near a caching
    allocator's cap, and the safe batch's headroom (see docs/concepts/measuring.md#what-fits-on-cuda).

    Attributes:
        retries: times the allocator, refused a new segment at the cap, synchronised, gave back every
            wholly free cached segment and tried again (CUDA's ``num_alloc_retries``). On the native
            allocator a step that needed one does not fit: whether it survives depends on which
            segments happen to be whole at that moment, which a fresh process's history changes.
        inactive_split_peak_bytes: the peak of free bytes split off inside segments that still hold a
            live block (``inactive_split_bytes``): reserved, but not usable for a larger request.
        largest_request_bytes: the largest single allocation the trial made (the block a headroom must
            hold to absorb one more of it), ``None`` where it could not be read.
        largest_segment_bytes: the largest segment the allocator held during the trial.
        pool_overhead_bytes: under ``backend:cudaMallocAsync``, what the driver's pool reserved beyond the
            bytes in use at the peak (the fraction caps requested bytes; the pool varies between processes).
        rule: which allocator's rule judged the trial: ``"native"`` (a retry does not fit),
            ``"expandable"`` (expandable segments: out-of-memory alone), ``"async"``
            (``backend:cudaMallocAsync``: out-of-memory alone), ``"pluggable"`` (one swapped in by the
            program, whose counters are not read: out-of-memory alone); ``None`` off a caching allocator.
    """

    retries: Count = 0
    inactive_split_peak_bytes: Bytes | None = None
    largest_request_bytes: Bytes | None = None
    largest_segment_bytes: Bytes | None = None
    pool_overhead_bytes: Bytes | None = None
    rule: Literal["native", "expandable", "async", "pluggable"] | None = None


@dataclass(frozen=True)
class Trial:
    """One batch size, run for real.

    Attributes:
        batch_size: the size tried.
        fits: every step completed without running out of memory.
        kind: ``"search"`` for the search's trials, ``"verify"`` for the extra steps that
            check the safe batch, ``"time"`` for a size timed warm after the search (one untimed
            step, then the timed ones: ``batchfit.probe.timing``), ``"gate"`` for the CI gate's.
        phase: where it ran out of memory (``"batch"``, ``"forward"``, ``"backward"``,
            ``"step"``), ``None`` when it fitted.
        peak_bytes: peak allocated memory (live tensors) of the trial. For a failed trial: a
            lower bound of what the size needs (on the CPU the live bytes plus the failing
            request; on CUDA the live bytes when it failed), else ``None``.
        phase_peaks: peak allocated memory per phase, as ``(phase, bytes)`` pairs.
        reserved_peak_bytes: the same in reserved bytes (what the allocator held from the
            device; on CUDA a memory limit counts these). Equal to ``peak_bytes`` on the CPU. For
            a failed CUDA trial: reserved bytes plus the segment the allocator was refused.
        phase_reserved_peaks: peak reserved memory per phase.
        step_time_s: median wall time of the timed steps (steps 2..N; a one-step trial times its
            only step), ``None`` if none ran.
        step_times_s: the wall time of every timed step, in order (their spread is the noise).
        samples_per_s: ``batch_size / step_time_s``; across ranks the whole group's,
            ``world_size * batch_size / step_time_s`` with the slowest rank's step time.
        steps: steps that completed.
        leaked_bytes: memory still allocated after the trial was released (0 is healthy).
        message: first line of the out-of-memory error, for failed trials.
        skipped_steps: steps whose optimizer update a ``GradScaler`` skipped (fp16 gradients
            overflowed). They ran on top of ``steps``: a trial only counts real optimizer steps,
            because the optimizer state is allocated in the first one.
        cap_bytes: the lower limit the trial ran under, ``None`` for the budget itself: the safe
            batch is verified under the budget less its headroom (what the headroom means).
        kv_bytes_per_token: with ``mode="generate"``, the KV cache the generation returned, in bytes
            per token of one row (``None`` when it returned no cache).
        allocator: what the allocator did during the trial (`AllocatorFacts`), ``None`` where the
            meter cannot say (a fake trial, a job per trial).
        replay: the trial replayed a fresh process on a caching allocator (``Prober.trial(...,
            from_scratch=True)``: nothing cached, no workspace, steps until the layout settled); its verdict
            overrules a warm trial's at the same size and below (docs/concepts/search.md).
    """

    batch_size: Batch
    fits: bool
    kind: TrialKind = "search"
    phase: Phase | None = None
    peak_bytes: Bytes | None = None
    phase_peaks: tuple[tuple[PhaseName, Bytes], ...] = ()
    step_time_s: Seconds | None = None
    samples_per_s: Rate | None = None
    steps: Count = 0
    leaked_bytes: Bytes = 0
    message: str | None = None
    reserved_peak_bytes: Bytes | None = None
    phase_reserved_peaks: tuple[tuple[PhaseName, Bytes], ...] = ()
    skipped_steps: Count = 0
    step_times_s: tuple[Seconds, ...] = ()
    cap_bytes: Bytes | None = None
    kv_bytes_per_token: Bytes | None = None
    allocator: AllocatorFacts | None = None
    replay: bool = False

    @property
    def refused_for_retry(self) -> bool:
        """Whether the trial failed without running out of memory: its steps needed an allocator retry,
        which on CUDA's native allocator does not fit (docs/concepts/measuring.md#what-fits-on-cuda)."""
        return not self.fits and (self.message or "").startswith(RETRY_REFUSAL)

    @property
    def peaks_by_phase(self) -> dict[str, int]:
        return dict(self.phase_peaks)

    @property
    def capped_peak_bytes(self) -> int | None:
        """The peak a memory limit is compared with: reserved bytes where they were recorded (a
        CUDA limit caps them; on the CPU they equal the live-tensor bytes), else allocated."""
        return self.reserved_peak_bytes if self.reserved_peak_bytes is not None else self.peak_bytes

    def peak_in(self, unit: Unit) -> int | None:
        """The peak counted in ``unit``."""
        return self.reserved_peak_bytes if unit == "reserved" else self.peak_bytes

    def phase_peaks_in(self, unit: Unit) -> tuple[tuple[str, int], ...]:
        """The per-phase peaks counted in ``unit``."""
        return self.phase_reserved_peaks if unit == "reserved" else self.phase_peaks

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trial:
        """The inverse of ``dataclasses.asdict(trial)`` (JSON turns the pairs into lists).

        Raises ``ValueError`` naming the field when ``data`` is not a trial (see
        [`Result.from_dict`][batchfit.report.result.Result.from_dict]).
        """
        return read_document(cls, data, "trial")


@dataclass(frozen=True)
class DeviceInfo:
    """The device the probe ran on.

    ``total_bytes`` is the total that memory fractions and budgets refer to: on CUDA the
    runtime's ``totalGlobalMem`` (what ``set_per_process_memory_fraction`` multiplies).
    ``nvml_total_bytes`` is NVML's (``nvidia-smi``'s) total, which also counts memory the driver
    reserves (about 0.5 GiB more); shown beside it, never used for arithmetic. ``config``: the
    settings that change what a step allocates or how fast it runs (allocator backend,
    ``PYTORCH_CUDA_ALLOC_CONF``, TF32, ``cudnn.benchmark``; torch threads on the CPU).
    """

    type: Annotated[str, OneOf(DEVICE_TYPES)]
    index: Count | None = None
    name: str = ""
    total_bytes: Bytes | None = None
    nvml_total_bytes: Bytes | None = None
    config: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceInfo:
        """The inverse of ``dataclasses.asdict(info)``; ``ValueError`` naming the field when
        ``data`` is not a device description."""
        return read_document(cls, data, "device")


@dataclass(frozen=True)
class Settings:
    """The options the probe ran with, as resolved (limits in bytes).

    ``strategy`` is any name: ``"binary"`` and ``"interpolate"`` are batchfit's, and a strategy
    object of the user's records its own ``name``. ``init_batch`` never exceeds ``max_batch``
    (the search's grid refuses it).
    """

    mode: Mode = "train"
    amp: Amp | None = None
    #: The tokens each row generated (``mode="generate"``).
    max_new_tokens: Batch | None = None
    init_batch: Annotated[Batch, NotAbove("max_batch")] = 2
    max_batch: Batch = 32768
    multiple_of: Batch = 1
    steps_per_trial: Batch | None = None
    verify_steps: Count = 2
    headroom: Annotated[float, Range(0, 1)] = 0.10
    strategy: str = "interpolate"
    memory_limit_bytes: Bytes | None = None
    limit_source: str = "device"
    time_budget_s: Seconds | None = None
    reserve_bytes: Bytes = 0


@dataclass(frozen=True)
class CacheHit:
    """Where a result read from the cache came from (``find(cache=DIR)``, ``batchfit.probe.cache``).

    A hit runs no trial: everything measured in the result is the stored probe's, so a reader
    must be able to tell which probe that was, when it ran and on how many ranks.

    Attributes:
        path: the cache entry the result was read from.
        key: the entry's key, the SHA-256 (hex) of the canonical fields it was keyed on (the entry
            stores them too, under ``"key_fields"``).
        written_at: when the entry was written, UTC, ISO 8601 (``2026-11-25T10:00:00Z``).
        world_size: the ranks that measured it (batch sizes are per rank; samples/s that group's).
        elapsed_s: how long the stored probe took (the result's own ``elapsed_s`` is the hit's).
    """

    path: str
    key: str
    written_at: str
    world_size: Batch = 1
    elapsed_s: Seconds = 0.0


#: Where the batch a probe sized on came from (``batchfit.probe.real_data``): the worst batch of a
#: loader's scan, the longest item by the dataset's own lengths, or the ``seq_len`` the user gave.
SizedOnSource = Literal["loader scan", "dataset lengths", "seq_len"]


@dataclass(frozen=True)
class SizedOn:
    """Which batch of real data the answer holds for, and how much data was looked at to pick it.

    Variable-length data runs out of memory at its longest batch, not at its first, so a probe
    given a loader sizes on the worst batch it finds (``batchfit.probe.real_data``); a reader of
    the result needs to know which one that was, and how much of the data the choice rests on.

    Attributes:
        source: ``"loader scan"`` (the worst of the batches scanned), ``"dataset lengths"`` (the
            longest item by the dataset's ``lengths``, collated alone) or ``"seq_len"`` (the
            length the user gave; the rows come from the scan's worst batch or the sample).
        batches_scanned: batches drawn from the loader (0 when none was).
        total_batches: the loader's ``len()``, ``None`` where it has none.
        leaf: the tensor whose length varies (``"sample['input_ids']"``), ``None`` when no
            dimension varied.
        dim: the dimension of ``leaf`` that varies (the sequence).
        length: its size in the batch sized on (after the collate function's padding).
        first_length: its size in the loader's first batch.
        batch_number: the worst batch's place in the loader's order (1: the first).
        dataset_size: with the dataset's lengths: how many items they cover.
        dataset_length: with the dataset's lengths: the longest item's own length (before padding).
    """

    source: SizedOnSource
    batches_scanned: Count = 0
    total_batches: Count | None = None
    leaf: str | None = None
    dim: Count | None = None
    length: Count | None = None
    first_length: Count | None = None
    batch_number: Batch | None = None
    dataset_size: Count | None = None
    dataset_length: Count | None = None

    def __str__(self) -> str:
        """``print(result.sized_on)`` reads as the summary; ``repr`` keeps the fields."""
        return self.summary()

    def summary(self) -> str:
        """One line: the length sized on, where it was measured, and how much data was seen."""
        where = f" (dim {self.dim} of {self.leaf})" if self.leaf is not None and self.dim is not None else ""
        length = f"length {self.length:,}{where}" if self.length is not None else "the shapes of the batch"
        of_total = f" (of {self.total_batches:,})" if self.total_batches is not None else ""
        scanned = f"{self.batches_scanned:,} batch{'es' if self.batches_scanned != 1 else ''} scanned{of_total}"
        first = f"; the first batch had length {self.first_length:,}" if self.first_length is not None else ""
        if self.source == "dataset lengths":
            declared = f" ({self.dataset_length:,})" if self.dataset_length is not None else ""
            items = f" of {self.dataset_size:,} samples" if self.dataset_size is not None else ""
            return f"{length}: the longest sample{items}{declared} by the dataset's lengths, collated alone"
        if self.source == "seq_len":
            asked = f"seq_len={self.length:,}{where}" if self.length is not None else "seq_len="
            if self.dataset_size is not None:
                rows = f"the longest of {self.dataset_size:,} samples (by the dataset's lengths)"
            elif self.batches_scanned:
                rows = f"the rows of the worst of {scanned}"
            elif self.leaf is not None:
                had = f" (length {self.first_length:,})" if self.first_length is not None else ""
                return f"{asked}, built from the sample's rows{had}"
            else:
                return f"{asked}, passed to make_batch(batch_size, seq_len)"
            return f"{asked}, built from {rows}{first}"
        if self.leaf is None:
            if self.batches_scanned <= 1:
                return f"the first batch ({scanned})"
            return f"the first batch: the {scanned} all have the same shapes"
        number = f" of batch {self.batch_number:,}" if self.batch_number is not None else ""
        return f"{length}{number}, the worst of {scanned}{first}"

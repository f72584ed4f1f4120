"""The records of a probe: one trial, the device, the settings. Frozen, JSON-ready, torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from batchfit.report.codec import read_document

PHASES = ("batch", "forward", "backward", "step")

#: Where a step was when it ran out of memory, and the phases peaks are recorded for.
Phase = Literal["batch", "forward", "backward", "step"]
#: Why a trial ran: the search, the safe batch's verification, or the CI gate's one trial.
TrialKind = Literal["search", "verify", "gate"]
#: Which memory a budget, a peak or a memory equation counts: what live tensors hold
#: (``"allocated"``), or what the allocator holds from the device (``"reserved"``, the unit of
#: a CUDA limit).
Unit = Literal["allocated", "reserved"]


@dataclass(frozen=True)
class Trial:
    """One batch size, run for real.

    Attributes:
        batch_size: the size tried.
        fits: every step completed without running out of memory.
        kind: ``"search"`` for the search's trials, ``"verify"`` for the extra steps that
            check the safe batch.
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
    """

    batch_size: int
    fits: bool
    kind: TrialKind = "search"
    phase: Phase | None = None
    peak_bytes: int | None = None
    phase_peaks: tuple[tuple[str, int], ...] = ()
    step_time_s: float | None = None
    samples_per_s: float | None = None
    steps: int = 0
    leaked_bytes: int = 0
    message: str | None = None
    reserved_peak_bytes: int | None = None
    phase_reserved_peaks: tuple[tuple[str, int], ...] = ()
    skipped_steps: int = 0
    step_times_s: tuple[float, ...] = ()

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
        :meth:`Result.from_dict`).
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

    type: str
    index: int | None = None
    name: str = ""
    total_bytes: int | None = None
    nvml_total_bytes: int | None = None
    config: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceInfo:
        """The inverse of ``dataclasses.asdict(info)``; ``ValueError`` naming the field when
        ``data`` is not a device description."""
        return read_document(cls, data, "device")


@dataclass(frozen=True)
class Settings:
    """The options the probe ran with, as resolved (limits in bytes)."""

    mode: str = "train"
    amp: str | None = None
    init_batch: int = 2
    max_batch: int = 32768
    multiple_of: int = 1
    steps_per_trial: int | None = None
    verify_steps: int = 3
    headroom: float = 0.10
    strategy: str = "interpolate"
    memory_limit_bytes: int | None = None
    limit_source: str = "device"
    time_budget_s: float | None = None
    reserve_bytes: int = 0

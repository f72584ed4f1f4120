"""What :func:`batchfit.find` returns: the :class:`Result`, and its versioned JSON document."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from batchfit.report.codec import read_document
from batchfit.report.memory import MemoryModel
from batchfit.report.records import DeviceInfo, Settings, Trial, Unit
from batchfit.report.throughput import Throughput
from batchfit.search import StopReason

SCHEMA = "batchfit.result/1"


@dataclass(frozen=True)
class Result:
    """The answer of :func:`batchfit.find`.

    Attributes:
        max_batch: the largest batch size that trained (the exact boundary when
            ``boundary_reached``).
        safe_batch: a size whose predicted peak leaves ``settings.headroom`` of the budget free,
            checked with ``settings.verify_steps`` extra steps (``safe_verified``).
        best_throughput_batch: the fitting size with the most samples/s (see ``throughput``
            for the knee and how much of the difference is noise).
        budget_bytes: the memory the probe was allowed to use.
        boundary_reached: a size failed right above ``max_batch``; ``False`` means the search
            hit ``max_batch`` or the time budget first.
        stop_reason: ``"boundary"``, ``"max_batch"`` or ``"stopped"``.
        non_monotone: some size failed although a larger one fitted.
        trials: every trial, in order.
        memory: the fitted memory equation, ``None`` with fewer than two fitting sizes.
        notes: warnings worth reading (leaked memory, non-monotone memory, ...).
        budget_counts: the memory the budget counts, ``"allocated"`` (live tensors; the CPU) or
            ``"reserved"`` (the allocator's segments; CUDA). The search aims, and the safe batch
            keeps its headroom, in this unit.
        world_size: the ranks that probed together (``torchrun``, DDP); batch sizes are per
            rank, peaks the largest rank's, throughput the whole group's. 1 for one process.
        estimated: the answer of :func:`batchfit.estimate` (fake tensors, no device), not of
            real steps; ``assumptions`` says what it rests on.
    """

    max_batch: int
    safe_batch: int
    best_throughput_batch: int
    budget_bytes: int | None
    boundary_reached: bool
    stop_reason: StopReason
    non_monotone: bool
    safe_verified: bool
    trials: tuple[Trial, ...]
    memory: MemoryModel | None
    device: DeviceInfo
    settings: Settings
    elapsed_s: float
    torch_version: str
    batchfit_version: str
    notes: tuple[str, ...] = field(default=())
    budget_counts: Unit = "allocated"
    throughput: Throughput | None = None
    world_size: int = 1
    estimated: bool = False
    assumptions: tuple[str, ...] = field(default=())

    @property
    def global_max_batch(self) -> int:
        """``max_batch`` over every rank: ``world_size * max_batch``."""
        return self.world_size * self.max_batch

    @property
    def global_safe_batch(self) -> int:
        """``safe_batch`` over every rank: ``world_size * safe_batch``."""
        return self.world_size * self.safe_batch

    @property
    def search_trials(self) -> tuple[Trial, ...]:
        return tuple(t for t in self.trials if t.kind == "search")

    def trial(self, batch_size: int) -> Trial | None:
        """The last search trial at ``batch_size``, if any."""
        found = [t for t in self.search_trials if t.batch_size == batch_size]
        return found[-1] if found else None

    # JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = SCHEMA
        return data

    def to_json(self, indent: int | None = 2) -> str:
        """A stable JSON document (schema ``batchfit.result/1``)."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        """The inverse of :meth:`to_dict`.

        Every field is checked against its type: ints are ints (not bools, floats or strings),
        numbers finite, names within their allowed values, nested records likewise; fields
        with a default may be absent (documents written before they existed), others may not,
        and unknown fields are refused. Anything else raises one ``ValueError`` that says what
        is wrong and where, e.g. ``not a batchfit result: field 'trials[2].peak_bytes' must be
        an int or null, got str '17'``.
        """
        if isinstance(data, dict) and data.get("schema") != SCHEMA:
            raise ValueError(f"not a batchfit result: schema is {data.get('schema')!r}, expected {SCHEMA!r}")
        if isinstance(data, dict):
            data = {name: value for name, value in data.items() if name != "schema"}
        return read_document(cls, data, "result")

    @classmethod
    def from_json(cls, text: str | bytes) -> Result:
        """The inverse of :meth:`to_json`; ``ValueError`` for anything else (see :meth:`from_dict`)."""
        try:
            data = json.loads(text)
        except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
            raise ValueError(f"not a batchfit result: invalid JSON ({error})") from None
        return cls.from_dict(data)

    # Text -----------------------------------------------------------------------------------
    def __str__(self) -> str:
        from batchfit.report.text import render_text  # text reads results; results do not need text

        return render_text(self)

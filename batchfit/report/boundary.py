"""The boundary a search found: the largest batch that trained, the one to run with, and how sure.

Declared once and shared by every answer that has one: the result ([`Result`][batchfit.Result]), the
evaluation step's ([`Evaluation`][batchfit.Evaluation]), a rank's own
([`RankBatch`][batchfit.report.uneven.RankBatch]) and a checkpointing policy's
([`PolicyRow`][batchfit.report.checkpointing.PolicyRow]) inherit it; a frontier point reads it from its
result. Its fields are keyword-only, so each record keeps its own positional fields, and they read,
compare and write to JSON as the record's own (a flat document, no ``"boundary"`` object). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Protocol

from batchfit.report.codec import Batch, NotAbove

__all__ = ["Boundary", "Bounded"]


class Bounded(Protocol):
    """Anything that answers with a boundary: a `Boundary` of any kind, or a frontier point (through its result)."""

    @property
    def max_batch(self) -> int: ...
    @property
    def safe_batch(self) -> int: ...
    @property
    def safe_verified(self) -> bool: ...
    @property
    def boundary_reached(self) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """Where memory ends for one answer, and the batch to run with inside it.

    Attributes:
        max_batch: the largest batch that ran (the exact boundary when ``boundary_reached``).
        safe_batch: the batch that leaves the headroom free; never above ``max_batch``.
        safe_verified: ``safe_batch`` ran with the verification's extra steps, and fitted.
        boundary_reached: a size failed right above ``max_batch``; ``False``: the search stopped
            first (its ``max_batch``, its time budget).
    """

    max_batch: Batch
    safe_batch: Annotated[Batch, NotAbove("max_batch")]
    safe_verified: bool
    boundary_reached: bool

    @classmethod
    def of(cls, answer: Bounded) -> Boundary:
        """The boundary alone of any answer that has one (``dataclasses.asdict`` of it: its keywords)."""
        return Boundary(
            max_batch=answer.max_batch,
            safe_batch=answer.safe_batch,
            safe_verified=answer.safe_verified,
            boundary_reached=answer.boundary_reached,
        )

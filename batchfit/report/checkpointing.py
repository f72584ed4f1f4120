"""What [`batchfit.fit`][batchfit.fit] returns: the checkpointing policies it measured, and the one to train with.

A policy is which of a model's repeated blocks recompute their activations in backward instead of
keeping them (`Policy`); a row is what real steps measured under one (`PolicyRow`); the [`Fit`][batchfit.Fit]
holds the rows, the boundary each other policy's memory line predicts, and one
[`Recommendation`][batchfit.Recommendation] (in the form `Result.recommendation` has) with the policy it
rests on. Pure Python (no torch), like the rest of `batchfit.report`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from batchfit.report.recommendation import Recommendation
from batchfit.report.records import DeviceInfo, Unit

__all__ = ["Fit", "Placement", "Policy", "PolicyRow"]

#: Where k of N blocks are checkpointed: the first k (their activations live longest: made first,
#: freed last in backward, so recomputing them lowers the peak most), or spread evenly.
Placement = Literal["first", "evenly"]
#: The schema a fit's JSON document names.
SCHEMA = "batchfit.fit/1"


@dataclass(frozen=True)
class Policy:
    """Which of a model's repeated blocks run under activation checkpointing, or, for a
    ``torch.compile``'d model, the partitioner's activation memory budget.

    Attributes:
        checkpointed: the names of the blocks checkpointed (`model.named_modules()` names).
        blocks: how many repeated blocks the policy chooses from (N); for a budget, the steps
            between budget 1.0 and 0.0.
        placement: how ``checkpointed`` was chosen among them.
        budget: ``torch._functorch.config.activation_memory_budget`` the model is compiled under
            (1.0 keeps what the partitioner keeps by default, 0.0 recomputes all it can); ``None``:
            a policy of blocks.
    """

    checkpointed: tuple[str, ...]
    blocks: int
    placement: Placement = "first"
    budget: float | None = None

    @property
    def k(self) -> int:
        """How many blocks are checkpointed; for a budget, how many steps it lies below 1.0."""
        if self.budget is not None:
            return round((1 - self.budget) * self.blocks)
        return len(self.checkpointed)

    @property
    def label(self) -> str:
        """``none``, ``all 12 blocks``, ``3 of 12 blocks (the first)`` or ``compile budget 0.7``."""
        if self.budget is not None:
            return f"compile budget {self.budget:g}"
        if self.k == 0:
            return "none"
        if self.k == self.blocks:
            return f"all {self.blocks} blocks"
        return f"{self.k} of {self.blocks} blocks ({'the first' if self.placement == 'first' else 'evenly'})"


@dataclass(frozen=True)
class PolicyRow:
    """What real steps measured under one policy.

    Attributes:
        policy: the policy applied.
        max_batch: the largest batch that trained under it (exact where ``boundary_reached``).
        safe_batch: the largest batch within the headroom (``safe_verified``: checked by real steps).
        fixed_bytes, per_sample_bytes: its memory equation (``None``: one fitting size only).
        trials: the real trials its memory answer took.
        micro_batch, accumulation: how it reaches the target (``None``: not a candidate, not timed).
        samples_per_s: warm plain steps at ``micro_batch`` (``None``: not timed).
    """

    policy: Policy
    max_batch: int
    safe_batch: int
    safe_verified: bool
    boundary_reached: bool
    fixed_bytes: int | None
    per_sample_bytes: float | None
    trials: int
    micro_batch: int | None = None
    accumulation: int | None = None
    samples_per_s: float | None = None


@dataclass(frozen=True)
class Fit:
    """The answer of [`batchfit.fit`][batchfit.fit]: the policies measured, and the one to train with.

    Attributes:
        target_batch: the samples one optimizer step should see (per process).
        blocks: the repeated blocks the policies chose from, in order (empty for budgets).
        blocks_from: where they were found (``"transformer.h"``), ``"given"``, or
            ``"torch.compile's activation memory budget"`` for a compiled model's budgets.
        rows: the policies measured by real steps, fewest checkpointed first.
        chosen: the index in ``rows`` of the recommended policy.
        recommendation: the micro-batch and accumulation to train with under it, and why.
        predicted: ``(k, max batch)`` for every k from 0 to N blocks checkpointed (the first k, or
            evenly; for budgets, k steps below 1.0): the memory lines of the rows measured, interpolated
            (only k = 0 when the target fitted as the model is: nothing else was measured).
        budget_bytes, budget_counts, device: the memory every row was measured within, and where.
        trials: the real trials the whole fit ran; elapsed_s: how long it took.
        notes: what a reader should know (blocks you had checkpointed, a prediction that missed).
    """

    target_batch: int
    blocks: tuple[str, ...]
    blocks_from: str
    rows: tuple[PolicyRow, ...]
    chosen: int
    recommendation: Recommendation
    predicted: tuple[tuple[int, int], ...]
    budget_bytes: int | None
    budget_counts: Unit
    device: DeviceInfo
    trials: int
    elapsed_s: float
    notes: tuple[str, ...] = field(default=())

    @property
    def policy(self) -> Policy:
        """The recommended policy."""
        return self.rows[self.chosen].policy

    def row(self, k: int) -> PolicyRow | None:
        """The row of the policy with ``k`` blocks checkpointed, if one was measured."""
        return next((row for row in self.rows if row.policy.k == k), None)

    def __str__(self) -> str:
        from batchfit.report.checkpointing_text import fit_text

        return fit_text(self)

    def plot(self, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
        """Draw max batch and samples/s against blocks checkpointed to ``path`` (``.png``, ``.svg``, ``.pdf``);
        needs matplotlib (``pip install 'batchfit[plot]'``). Returns the path written."""
        from batchfit.report.checkpointing_text import save_fit_plot

        return save_fit_plot(self, path, dpi=dpi)

    def to_dict(self) -> dict[str, Any]:
        """The fields and the schema (``policy`` derived, for readers)."""
        data = asdict(self)
        data["schema"] = SCHEMA
        data["policy"] = asdict(self.policy)
        return data

    def to_json(self, indent: int | None = 2) -> str:
        """The fit as a JSON document (`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent)

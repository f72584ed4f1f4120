"""What [`batchfit.fit`][batchfit.fit] returns: the checkpointing policies it measured, and the one to train with.

A policy is which of a model's repeated blocks recompute their activations in backward instead of
keeping them (`Policy`); a row is what real steps measured under one (`PolicyRow`); the [`Fit`][batchfit.Fit]
holds the rows, the boundary each other policy's memory line predicts, and one
[`Recommendation`][batchfit.Recommendation] (in the form `Result.recommendation` has) with the policy it
rests on. Pure Python (no torch), like the rest of `batchfit.report`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from batchfit.report.boundary import Boundary
from batchfit.report.codec import Batch, Bytes, Count, JsonRecord, Rate, Seconds
from batchfit.report.recommendation import Recommendation
from batchfit.report.records import DeviceInfo, Unit

__all__ = ["Fit", "Placement", "Policy", "PolicyRow", "fit_recommendation"]

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
class PolicyRow(Boundary):
    """What real steps measured under one policy (its boundary, by keyword, is a
    [`Boundary`][batchfit.report.boundary.Boundary]'s).

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
    fixed_bytes: int | None
    per_sample_bytes: float | None
    trials: Count
    micro_batch: Batch | None = None
    accumulation: Batch | None = None
    samples_per_s: Rate | None = None


@dataclass(frozen=True)
class Fit(JsonRecord):
    """The answer of [`batchfit.fit`][batchfit.fit]: the policies measured, and the one to train with.

    Attributes:
        target_batch: the samples one optimizer step should see (per process).
        blocks: the repeated blocks the policies chose from, in order (empty for budgets).
        blocks_from: where they were found (``"transformer.h"``; several groups comma-separated,
            those that save most first: ``"layer1, layer2, layer3, layer4"``), ``"given"``, or
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

    #: The schema its JSON document names.
    SCHEMA: ClassVar[str] = SCHEMA
    #: What the document carries for its readers, derived from the fields (skipped on reading).
    DERIVED: ClassVar[tuple[str, ...]] = ("policy",)
    NOUN: ClassVar[str] = "fit"

    target_batch: Batch
    blocks: tuple[str, ...]
    blocks_from: str
    rows: tuple[PolicyRow, ...]
    chosen: Count
    recommendation: Recommendation
    predicted: tuple[tuple[int, int], ...]
    budget_bytes: Bytes | None
    budget_counts: Unit
    device: DeviceInfo
    trials: Count
    elapsed_s: Seconds
    notes: tuple[str, ...] = field(default=())

    @property
    def policy(self) -> Policy:
        """The recommended policy."""
        return self.rows[self.chosen].policy

    def row(self, k: int) -> PolicyRow | None:
        """The row of the policy with ``k`` blocks checkpointed, if one was measured."""
        return next((row for row in self.rows if row.policy.k == k), None)

    def __str__(self) -> str:
        from batchfit.report.checkpointing_text import fit_text  # lazy: it annotates with Fit, the one way back

        return fit_text(self)

    def plot(self, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
        """Draw max batch and samples/s against blocks checkpointed to ``path`` (``.png``, ``.svg``, ``.pdf``);
        needs matplotlib (``pip install 'batchfit[plot]'``). Returns the path written."""
        from batchfit.report.checkpointing_text import save_fit_plot  # lazy: as __str__'s

        return save_fit_plot(self, path, dpi=dpi)


def fit_recommendation(
    best: PolicyRow, timed: Sequence[PolicyRow], rows: Sequence[PolicyRow], target: int, free: int, already: int = 0
) -> Recommendation:
    """``best`` (the fastest of the ``timed`` rows) in `Result.recommendation`'s form, its reason
    saying what was measured: whether the target fits in one step as the model is, why no policy
    was timed beside it (``free``: the blocks a policy could choose; ``already``: yours, checkpointed
    before the fit), and each other candidate's rate against the chosen one."""
    micro, steps, rate = best.micro_batch or 1, best.accumulation or 1, best.samples_per_s or 0.0
    split = f"{micro}" + (f" x {steps} accumulation steps" if steps > 1 else "")
    others = "; ".join(
        f"{row.policy.label} at {row.micro_batch}"
        + (f" x {row.accumulation}" if (row.accumulation or 1) > 1 else "")
        + f": {row.samples_per_s:.1f} samples/s, the chosen {rate / (row.samples_per_s or rate) - 1:.0%} faster"
        for row in timed
        if row is not best
    )
    as_is = "as the model is" + (f", with the {already} blocks you checkpointed" if already else "")
    if best.policy.k == 0 and len(timed) == 1 and micro * steps == target and steps == 1:
        reason = (
            f"target {target} fits in one step {as_is} (safe batch {best.safe_batch}): nothing to recompute, "
            f"{rate:.1f} samples/s"
        )
    elif best.policy.k == 0 and len(timed) == 1:
        tried = [row for row in rows if row.policy.k]
        if not free:
            why = "no block is left to checkpoint"
        elif tried:
            most = max(tried, key=lambda row: row.policy.k)
            why = f"no policy measured holds it in one step ({most.policy.label}: safe batch {most.safe_batch})"
        else:
            why = "no policy was measured to hold it in one step"
        reason = (
            f"target {target} does not fit in one step {as_is} (max {best.max_batch}, safe batch "
            f"{best.safe_batch}), and {why}: trains it as {split} at {rate:.1f} samples/s"
        )
    else:
        reason = f"{best.policy.label} trains target {target} as {split} at {rate:.1f} samples/s" + (
            f", the fastest measured ({others})" if others else ""
        )
    return Recommendation(
        batch_size=micro,
        accumulation=steps,
        world_size=1,
        global_batch=micro * steps,
        decided_by="target",
        reason=reason,
        max_batch=best.max_batch,
        safe_batch=best.safe_batch,
        best_batch=micro,
        samples_per_s=rate,
        target=target,
        target_changed_by=micro * steps - target,
    )

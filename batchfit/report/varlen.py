"""What [`batchfit.buckets`][batchfit.buckets] returns: batch sizes for variable-length data.

Pure Python (no torch import), like every record of `batchfit.report`:

* [`Bucket`][batchfit.report.varlen.Bucket]: one length bucket, its batch (exact and verified at its
  longest length, as a frontier point is), its padding and its share of the epoch;
* [`Composition`][batchfit.report.varlen.Composition]: one batch a token-budget sampler can form,
  run for real;
* [`TokenBudget`][batchfit.report.varlen.TokenBudget]: the largest ``max_tokens_per_batch`` every
  such batch fits under, and the compositions that proved it;
* [`Packing`][batchfit.report.varlen.Packing]: rows packed to one length with restarting positions;
* [`Soak`][batchfit.report.varlen.Soak]: the epoch replayed at the chosen sizes;
* [`LengthPlan`][batchfit.LengthPlan]: all of it, with the knobs each framework takes
  (`batchfit.report.knobs`), and its JSON document (schema ``batchfit.lengths/1``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar, Literal

from batchfit.report.codec import Batch, Bytes, Count, JsonRecord, Range, Rate, Seconds
from batchfit.report.frontier import Frontier, LongestLimit
from batchfit.report.knobs import knobs_for

LENGTHS_SCHEMA = "batchfit.lengths/1"

#: Which way of batching a plan's tokens/s compares: buckets of padded rows, or packed rows.
Layout = Literal["buckets", "packing"]


@dataclass(frozen=True)
class Bucket:
    """Rows of length ``shortest..longest``, padded to ``longest``, in batches of ``batch_size``.

    Attributes:
        shortest, longest: the lengths the bucket takes (both included); ``longest`` is the length
            its rows are padded to, and where its batch was searched.
        rows, tokens: the data's rows in the bucket and their real (unpadded) tokens.
        batch_size: the batch per rank: the verified safe batch at ``longest``.
        max_batch: the exact largest batch at ``longest`` (``max_batch + 1`` ran out of memory).
        samples_per_s: measured at ``batch_size`` and ``longest`` (``None`` when not timed).
        world_size: the ranks a step spans (each takes ``batch_size`` rows).
        new_tokens: generation-shaped data: the tokens every row generates after its prompt (the
            bucket's longest response; ``tokens`` then counts the rows' real new tokens); 0 in training.
    """

    shortest: Batch
    longest: Batch
    rows: Count
    tokens: Count
    batch_size: Batch
    max_batch: Batch
    samples_per_s: Rate | None
    world_size: Batch = 1
    new_tokens: Count = 0

    @property
    def padded_tokens(self) -> int:
        """Tokens the bucket's batches hold once padded: ``rows x longest`` (generating: ``rows x new_tokens``)."""
        return self.rows * (self.new_tokens or self.longest)

    @property
    def padding(self) -> float:
        """The share of the padded tokens that is padding."""
        return 0.0 if self.padded_tokens == 0 else 1 - self.tokens / self.padded_tokens

    @property
    def steps(self) -> int:
        """Optimizer steps the bucket takes an epoch (its last batch may be short)."""
        return math.ceil(self.rows / (self.batch_size * self.world_size))

    @property
    def tokens_per_s(self) -> float | None:
        """Real (unpadded) tokens a second on one rank at the bucket's measured rate (``None``: not timed)."""
        return None if not self.samples_per_s or not self.rows else self.samples_per_s * self.tokens / self.rows

    @property
    def seconds(self) -> float | None:
        """The bucket's share of an epoch in seconds, at its measured rate (``None``: not timed)."""
        if not self.samples_per_s:
            return None
        return self.rows / (self.samples_per_s * self.world_size)


CompositionKind = Literal["longest", "shortest", "binding", "surface"]


@dataclass(frozen=True)
class Composition:
    """One batch a token-budget sampler can form: ``rows`` rows of ``seq_len`` tokens (padded).

    Attributes:
        rows, seq_len: the batch's shape.
        kind: why it was run: ``"longest"`` (rows at the longest length), ``"shortest"`` (as many
            of the shortest rows as the budget admits), ``"binding"`` (the length where the budget
            is tightest), ``"surface"`` (the mix the fitted surface predicts fullest).
        fits: it ran under the safe cap (the budget less its headroom).
        peak_bytes: its peak (a lower bound when it did not fit).
        predicted_bytes: what the surface predicted (``None`` without a surface).
    """

    rows: Batch
    seq_len: Batch
    kind: CompositionKind
    fits: bool
    peak_bytes: Bytes | None
    predicted_bytes: Bytes | None = None


@dataclass(frozen=True)
class TokenBudget:
    """The largest ``max_tokens`` such that every batch of ``rows x longest_row <= max_tokens``
    formed from the data's lengths fits (the rows padded to the batch's longest).

    Attributes:
        max_tokens: the budget, per rank.
        binding_length: the data length where it binds (one more token there makes a batch
            of ``max_tokens // binding_length + 1`` rows, one more than that length holds).
        compositions: the worst batches the budget admits, run for real under the safe cap.
        steps: the steps a greedy sampler over length-sorted rows takes an epoch at this budget.
        rejected: compositions of a higher budget proposed first that did not fit (each a
            measurement: the budget was proposed again below it).
    """

    max_tokens: Batch
    binding_length: Batch
    compositions: tuple[Composition, ...]
    steps: Count
    rejected: tuple[Composition, ...] = ()


@dataclass(frozen=True)
class Packing:
    """Rows packed to ``pack_length`` tokens (documents end to end, positions restarting at each),
    as transformers' ``DataCollatorWithFlattening`` or torchtune's packing builds them.

    Attributes:
        pack_length: tokens per packed row.
        batch_size, max_batch: the verified safe batch of packed rows, and the exact largest.
        longest_packed_row: the longest single packed row that trains (batch 1): the token budget
            of a collator that flattens the whole batch into one row.
        longest_limited_by: what ended that search: ``"memory"`` (one token more did not fit),
            ``"positions"`` (the model takes no longer row) or ``"max_seq_len"``.
        fill: the share of a packed row the data's documents fill (first fit, longest first).
        tokens_per_s: real tokens/s on one rank at ``batch_size`` (measured rate x ``fill``; ``None``: not timed).
    """

    pack_length: Batch
    batch_size: Batch
    max_batch: Batch
    longest_packed_row: Batch | None
    fill: Annotated[float, Range(0, 1)]
    tokens_per_s: Rate | None
    longest_limited_by: LongestLimit | None = None


@dataclass(frozen=True)
class Soak(JsonRecord):
    """An epoch's batches, as a sampler formed them, replayed as real training steps.

    Attributes:
        sampler: what formed the batches (``"buckets"``, ``"token budget"``...).
        steps: steps replayed; ``oom``: those that did not fit (ran out of memory; on the native
            CUDA allocator also a step that needed an allocator retry, batchfit's rule there); the
            run continued after each.
        peak_bytes, peak_step, peak_shape: the highest peak, the step (1-based) where it was,
            and that step's ``(rows, seq_len)``.
        budget_bytes: the budget the steps ran under.
        retries_per_100, reserved_drift_per_100: on a caching allocator, its retries (a flush of
            the cache to satisfy an allocation) and the growth of reserved memory in bytes, each per
            100 steps after the first 100 (after the first half of a shorter soak); ``None`` where
            the device keeps no cache (the CPU).
        seconds: the replay's wall time.
        fresh: its first step started as in a fresh process (nothing cached, a fresh optimizer),
            whichever process ran it: always ``True``.
        process: where it ran: ``"this"`` process (a model given), or a ``"fresh"`` one started
            for it (a target ``"module:factory"`` given: nothing of the caller's process in it).
    """

    NOUN: ClassVar[str] = "soak"

    sampler: str
    steps: Count
    oom: Count
    peak_bytes: Bytes
    peak_step: Count
    peak_shape: tuple[int, int]
    budget_bytes: Bytes | None
    retries_per_100: float | None
    reserved_drift_per_100: float | None
    seconds: Seconds
    fresh: bool = True
    process: Literal["this", "fresh"] = "this"


@dataclass(frozen=True)
class LengthPlan(JsonRecord):
    """Batch sizes for variable-length data: buckets, a token budget, packing, and the proof.

    Attributes:
        buckets: the chosen buckets, shortest first.
        token_budget: the verified ``max_tokens`` per batch (``None`` when not asked for).
        packing: packed rows (``None`` when not asked for).
        soaks: the epochs replayed (``verify="epoch"``).
        frontier: the frontier the buckets were read from (every candidate length).
        rows, shortest, median, longest: the data's length distribution.
        world_size: the ranks every step spans.
        notes: what a reader should know.
    """

    SCHEMA: ClassVar[str] = LENGTHS_SCHEMA
    NOUN: ClassVar[str] = "length plan"
    DERIVED: ClassVar[tuple[str, ...]] = ("best_layout", "tokens_per_s", "padding", "epoch_steps", "knobs")

    buckets: tuple[Bucket, ...]
    token_budget: TokenBudget | None
    packing: Packing | None
    frontier: Frontier
    rows: Count
    shortest: Batch
    median: Batch
    longest: Batch
    world_size: Batch = 1
    soaks: tuple[Soak, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The buckets' upper lengths, as a bucket sampler takes them."""
        return tuple(bucket.longest for bucket in self.buckets)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The buckets' batch sizes per rank, in the order of `boundaries`."""
        return tuple(bucket.batch_size for bucket in self.buckets)

    @property
    def epoch_steps(self) -> int:
        """Steps an epoch takes with the buckets."""
        return sum(bucket.steps for bucket in self.buckets)

    @property
    def padding(self) -> float:
        """The share of the buckets' padded tokens that is padding."""
        padded = sum(bucket.padded_tokens for bucket in self.buckets)
        return 0.0 if padded == 0 else 1 - sum(bucket.tokens for bucket in self.buckets) / padded

    @property
    def tokens_per_s(self) -> float | None:
        """Real tokens/s on one rank over an epoch of the buckets, from each bucket's measured rate."""
        seconds = [None if not b.samples_per_s else b.rows / b.samples_per_s for b in self.buckets]
        if not seconds or any(s is None for s in seconds):
            return None
        total = sum(s for s in seconds if s is not None)
        return None if total <= 0 else sum(bucket.tokens for bucket in self.buckets) / total

    @property
    def best_layout(self) -> Layout | None:
        """Whether buckets or packing trains more real tokens/s here (``None``: not both measured)."""
        mine = self.tokens_per_s
        packed = None if self.packing is None else self.packing.tokens_per_s
        if mine is None or packed is None:
            return None
        return "packing" if packed > mine else "buckets"

    @property
    def knobs(self) -> dict[str, dict[str, Any]]:
        """The settings each framework takes for this plan (`batchfit.report.knobs.knobs_for`)."""
        return knobs_for(self)

    def with_soak(self, soak: Soak) -> LengthPlan:
        """This plan with one more replayed epoch."""
        return replace(self, soaks=(*self.soaks, soak))

    def plot(self, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
        """Draw the plan to an image at ``path`` (``.png``, ``.svg``, ``.pdf``): tokens/s and padding
        per bucket, and the token budget's binding compositions; the path written. Needs matplotlib:
        ``pip install 'batchfit[plot]'`` (`PlotUnavailableError`, an ``ImportError``, otherwise)."""
        from batchfit.report.varlen_plot import save_length_plot  # lazy: the image reads this record (a cycle)

        return save_length_plot(self, path, dpi=dpi)

    def __str__(self) -> str:
        from batchfit.report.varlen_text import plan_text  # lazy: the text reads this record (a cycle)

        return plan_text(self)

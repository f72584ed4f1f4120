"""What [`batchfit.find`][batchfit.find] returns: the [`Result`][batchfit.Result], and its versioned JSON document."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from batchfit.report.boundary import Boundary
from batchfit.report.codec import Batch, Bytes, JsonRecord, Seconds
from batchfit.report.evaluation import Evaluation
from batchfit.report.generation import Generation
from batchfit.report.memory import MemoryModel
from batchfit.report.noise import NoiseScale
from batchfit.report.recommendation import Recommendation, recommend
from batchfit.report.records import CacheHit, DeviceInfo, Settings, SizedOn, Trial, Unit
from batchfit.report.throughput import Throughput
from batchfit.report.uneven import RankBatch
from batchfit.search.core import StopReason

SCHEMA = "batchfit.result/1"


@dataclass(frozen=True)
class Result(Boundary, JsonRecord):
    """The answer of [`batchfit.find`][batchfit.find].

    Its boundary (``max_batch``, ``safe_batch``, ``safe_verified``, ``boundary_reached``) is declared by
    [`Boundary`][batchfit.report.boundary.Boundary]: keyword-only fields, read and written as its own.

    Attributes:
        max_batch: the largest batch size that trained (the exact boundary when
            ``boundary_reached``).
        safe_batch: a size whose predicted peak leaves ``settings.headroom`` of the budget free,
            checked with ``settings.verify_steps`` extra steps (``safe_verified``); never above
            ``max_batch``.
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
        estimated: the answer of [`batchfit.estimate`][batchfit.estimate] (fake tensors, no device), not of
            real steps; ``assumptions`` says what it rests on.
        sized_on: which batch of real data the sizes were built from, when the sample was a
            ``DataLoader`` (the worst batch of a scan, or the longest item by the dataset's
            lengths) or ``seq_len`` was given; ``None`` for a plain sample or ``make_batch``.
        noise_scale: the gradient noise scale, when ``find(noise_scale=True)`` measured it.
        from_cache: where the result was read from when ``find(cache=DIR)`` found it there (no
            trial ran: every measurement is the stored probe's, ``elapsed_s`` is the hit's own);
            ``None`` for a result measured now.
        evaluation: the evaluation step's answer, when ``find(eval=True)`` sized it beside training's.
        generation: with ``mode="generate"``, the context sized on, the KV cache per token and the tokens/s.
        per_rank: each rank's own max and safe batch ([`RankBatch`][batchfit.report.uneven.RankBatch]), in
            rank order, when the ranks that probed together had different budgets (mixed cards, a
            shared device); ``()`` otherwise. ``max_batch`` and ``safe_batch`` stay the group's (what
            fits on every rank); ``recommend(uneven=True)`` splits a global batch by these.
    """

    #: The schema its JSON document names (see `to_json`).
    SCHEMA: ClassVar[str] = SCHEMA
    #: What the document carries for its readers, derived from the fields (skipped on reading).
    DERIVED: ClassVar[tuple[str, ...]] = ("recommendation",)
    NOUN: ClassVar[str] = "result"

    best_throughput_batch: Batch
    budget_bytes: Bytes | None
    stop_reason: StopReason
    non_monotone: bool
    trials: tuple[Trial, ...]
    memory: MemoryModel | None
    device: DeviceInfo
    settings: Settings
    elapsed_s: Seconds
    torch_version: str
    batchfit_version: str
    notes: tuple[str, ...] = field(default=())
    budget_counts: Unit = "allocated"
    throughput: Throughput | None = None
    world_size: Batch = 1
    estimated: bool = False
    assumptions: tuple[str, ...] = field(default=())
    sized_on: SizedOn | None = None
    noise_scale: NoiseScale | None = None
    from_cache: CacheHit | None = None
    evaluation: Evaluation | None = None
    generation: Generation | None = None
    per_rank: tuple[RankBatch, ...] = field(default=())

    def __post_init__(self) -> None:
        # One answer per rank: a rank listed twice would have a global batch split over ranks that do not exist.
        ranks = [answer.rank for answer in self.per_rank]
        twice = sorted({rank for rank in ranks if ranks.count(rank) > 1})
        if twice:
            raise ValueError(
                f"field 'per_rank' lists rank {twice[0]} more than once (ranks {ranks}): one answer per rank"
            )

    @property
    def eval_max_batch(self) -> int | None:
        """The largest evaluation batch (``find(eval=True)``), ``None`` when evaluation was not sized."""
        return None if self.evaluation is None else self.evaluation.max_batch

    @property
    def eval_safe_batch(self) -> int | None:
        """The evaluation batch to run with (``find(eval=True)``), ``None`` when evaluation was not sized."""
        return None if self.evaluation is None else self.evaluation.safe_batch

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

    # The batch to train with ------------------------------------------------------------------
    def recommend(
        self,
        *,
        target_batch: int | None = None,
        target_tokens: int | None = None,
        seq_len: int | None = None,
        world_size: int | None = None,
        uneven: bool = False,
    ) -> Recommendation:
        """The batch to train with, and the accumulation and ranks that reach it, with the bound
        that decided and why ([`batchfit.report.recommendation.recommend`][batchfit.recommend]): the memory bound,
        the throughput knee, the noise scale when measured, and a target global batch (or tokens
        per step at ``seq_len``) when given. ``world_size``: train on that many ranks instead of
        the ranks that probed (an elastic re-plan: the same global batch, no new probe). ``uneven``: also
        split that global batch over the ranks by what each fits (``per_rank``), with the loss weights
        that keep the gradient the mean (``Recommendation.uneven``)."""
        return recommend(
            self,
            target_batch=target_batch,
            target_tokens=target_tokens,
            seq_len=seq_len,
            world_size=world_size,
            uneven=uneven,
        )

    @property
    def recommendation(self) -> Recommendation:
        """[`recommend`][batchfit.report.result.Result.recommend] without a target: derived from the fields, never
        stored, so a result
        read back from JSON recommends the same (its JSON document carries it, for readers)."""
        return self.recommend()

    # JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields, the schema, and the recommendation (derived:
        [`from_dict`][batchfit.report.result.Result.from_dict] skips it)."""
        return super().to_dict()

    def to_json(self, indent: int | None = 2) -> str:
        """A stable JSON document (schema ``batchfit.result/1``)."""
        return super().to_json(indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        """The inverse of [`to_dict`][batchfit.report.result.Result.to_dict].

        Every field is checked against its type: ints are ints (not bools, floats or strings),
        numbers finite, names within their allowed values, nested records likewise; fields
        with a default may be absent (documents written before they existed), others may not,
        and unknown fields are refused. Every field is then checked against what it can be:
        batch sizes and ``world_size`` at least 1, byte counts, steps, times and rates not
        negative, every int below 2**63 in magnitude, ``settings.headroom`` in [0, 1), the mode,
        amp, phases and device type among those batchfit writes, ``safe_batch`` not above
        ``max_batch`` (see `batchfit.report.codec`), each rank once in ``per_rank``. Anything else raises one
        ``ValueError`` that says what is wrong and where, e.g. ``not a batchfit result: field
        'trials[2].peak_bytes' must be an int or null, got str '17'`` or ``... field
        'settings.headroom' must be a number in [0, 1), got float 1.5``. So a result that
        loads can be printed and compared.
        """
        return super().from_dict(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> Result:
        """The inverse of [`to_json`][batchfit.report.result.Result.to_json]; ``ValueError`` for anything else (see
        [`from_dict`][batchfit.report.result.Result.from_dict]),
        a document nested too deeply to parse included."""
        return super().from_json(text)

    # Text -----------------------------------------------------------------------------------
    def __str__(self) -> str:
        from batchfit.report.text import render_text  # lazy: text annotates with Result, the one way back

        return render_text(self)

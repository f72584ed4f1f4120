"""What [`batchfit.frontier`][batchfit.frontier] returns: the largest batch per sequence length, and the surface.

Pure Python (no torch import), like every record of `batchfit.report`:

* [`Surface`][batchfit.Surface]: the two-dimensional memory equation ``fixed + b * (a * s + q * s**2)``, with
  what its terms mean;
* [`FrontierPoint`][batchfit.FrontierPoint]: one length's answer (the exact largest batch, the verified safe batch,
  tokens/s), with the one-dimensional [`Result`][batchfit.Result] it came from;
* [`Frontier`][batchfit.Frontier]: the points, the longest length that trains at batch 1, the token budget, and
  its versioned JSON document (schema ``batchfit.frontier/1``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from batchfit.report.codec import Batch, Bytes, Range, Rate, Seconds, read_document, read_json
from batchfit.report.memory import FittedBytes
from batchfit.report.records import DeviceInfo, Unit
from batchfit.report.result import SCHEMA as RESULT_SCHEMA
from batchfit.report.result import Result
from batchfit.report.throughput import best_timed

FRONTIER_SCHEMA = "batchfit.frontier/1"

#: What ended the search for the longest length at batch 1: memory (the exact boundary), the
#: model's position embeddings (it cannot take a longer sequence), or the ``max_seq_len`` asked for.
LongestLimit = Literal["memory", "positions", "max_seq_len"]

#: A quadratic term holding less than this share of the per-sample bytes at the longest length
#: measured is read as "no s^2 term" (noise, or an allocator's rounding).
QUADRATIC_SHARE = 0.02


@dataclass(frozen=True)
class Surface:
    """``peak(b, s) = fixed_bytes + b * (per_token_bytes * s + per_token_squared_bytes * s**2)``.

    The batch's activations grow with the tokens it holds (``a``: bytes per token: hidden
    states, MLP activations, logits) and, where attention keeps its score matrix, with the square
    of the length (``q``: bytes per sample per squared token: eager attention saves the
    ``heads x s x s`` scores and probabilities for backward; SDPA's flash and memory-efficient
    kernels recompute them and save only ``O(s)`` statistics, so ``q`` is about 0). ``fixed``:
    weights, gradients, optimizer state and whatever does not grow with the batch.

    Of a generation frontier, ``s`` is the context (the prompt's ``seq_len`` plus ``Frontier.new_tokens``).

    Fitted on the per-length memory lines of the frontier's points (each length's exact search
    measures ``fixed + slope(s) * b``; ``slope(s) = a * s + q * s**2`` is fitted through them by
    least squares); with one length, ``q`` is 0 and ``a = slope / s``.
    """

    fixed_bytes: FittedBytes
    per_token_bytes: FittedBytes
    per_token_squared_bytes: FittedBytes
    lengths: tuple[int, ...] = ()
    unit: Unit = "allocated"

    def per_sample_bytes(self, seq_len: float) -> float:
        """Bytes one more sample of length ``seq_len`` costs."""
        return self.per_token_bytes * seq_len + self.per_token_squared_bytes * seq_len**2

    def predict(self, batch_size: float, seq_len: float) -> float:
        """Predicted peak bytes of a batch of ``batch_size`` sequences of ``seq_len`` tokens."""
        return self.fixed_bytes + batch_size * self.per_sample_bytes(seq_len)

    def largest_batch(self, seq_len: float, budget_bytes: float) -> float:
        """The batch (a real number) where the surface meets ``budget_bytes`` at ``seq_len``."""
        slope = self.per_sample_bytes(seq_len)
        return math.inf if slope <= 0 else (budget_bytes - self.fixed_bytes) / slope

    def longest_length(self, batch_size: float, budget_bytes: float) -> float:
        """The length (a real number) where the surface meets ``budget_bytes`` at ``batch_size``."""
        room = (budget_bytes - self.fixed_bytes) / batch_size
        a, q = self.per_token_bytes, self.per_token_squared_bytes
        if room <= 0:
            return 0.0
        if q <= 0:
            return math.inf if a <= 0 else room / a
        return (-a + math.sqrt(a * a + 4 * q * room)) / (2 * q)

    @property
    def quadratic_share(self) -> float:
        """The share of a sample's bytes the ``s**2`` term holds at the longest length fitted."""
        longest = max(self.lengths, default=0)
        total = self.per_sample_bytes(longest)
        return 0.0 if total <= 0 else max(0.0, self.per_token_squared_bytes * longest**2 / total)

    @property
    def quadratic(self) -> bool:
        """Whether the ``s**2`` term is real: it holds at least `QUADRATIC_SHARE` of a
        sample's bytes at the longest length fitted."""
        return len(self.lengths) >= 2 and self.quadratic_share >= QUADRATIC_SHARE

    def meaning(self) -> str:
        """What the fitted terms say, in a sentence."""
        if len(self.lengths) < 2:
            return "one length measured: the s^2 term cannot be told from the linear one"
        if self.quadratic:
            return (
                f"the s^2 term holds {self.quadratic_share:.0%} of a sample's memory at length "
                f"{max(self.lengths):,}: attention holds its s x s scores (for backward, or in a generation's "
                "prefill; eager attention, or SDPA's math kernel, which it falls back to for attention dropout on the "
                "CPU or a mask the fused kernels do not take); SDPA's flash or memory-efficient kernels do not"
            )
        return (
            "memory grows linearly in the length (no s^2 term): attention does not keep its s x s scores "
            "(SDPA's flash or memory-efficient kernels, or no attention)"
        )

    @classmethod
    def fit(cls, lines: Sequence[tuple[int, float, float]], unit: Unit = "allocated") -> Surface | None:
        """The surface through per-length lines ``(seq_len, fixed_bytes, per_sample_bytes)``.

        ``fixed`` is their mean; ``slope(s) = a s + q s^2`` by least squares, each length weighted
        by ``1 / s^2`` so that short and long lengths count alike (relative error). One length:
        ``q = 0``. A negative ``q`` (noise on a linear model) is refitted with ``q = 0``."""
        usable = [(s, f, p) for s, f, p in lines if s > 0 and math.isfinite(p) and p > 0]
        if not usable:
            return None
        lengths = tuple(sorted({s for s, _, _ in usable}))
        fixed = sum(f for _, f, _ in usable) / len(usable)
        # In relative terms: slope / s = a + q s, a straight line in s through the points (s, slope / s).
        xs = [float(s) for s, _, _ in usable]
        ys = [p / s for s, _, p in usable]
        a, q = sum(ys) / len(ys), 0.0
        if len(lengths) >= 2:
            mean_x = sum(xs) / len(xs)
            spread = sum((x - mean_x) ** 2 for x in xs)
            q = sum((x - mean_x) * (y - a) for x, y in zip(xs, ys)) / spread
            a = a - q * mean_x
            if q < 0:
                a, q = sum(p for _, _, p in usable) / sum(xs), 0.0
        return cls(fixed_bytes=fixed, per_token_bytes=a, per_token_squared_bytes=q, lengths=lengths, unit=unit)


@dataclass(frozen=True)
class FrontierPoint:
    """One sequence length of the frontier.

    Of a generation frontier (``frontier(mode="generate")``) the length is the prompt's: each row
    then generates all its new tokens (``result.generation.new_tokens``), so the batch holds
    ``context_tokens = seq_len + new_tokens`` tokens a row in its KV cache, and its tokens/s are new tokens.

    Its boundary (``max_batch``, ``safe_batch``, ``safe_verified``, ``boundary_reached``) is its
    result's, read through it: ``max_batch`` is the exact largest batch at that length (fits,
    ``max_batch + 1`` did not) when ``boundary_reached``; ``safe_batch`` leaves the headroom free,
    verified by real steps (``safe_verified``). At lengths after the first, the verification runs
    first, at the safe batch the surface predicts, and is kept when the memory line's candidate is
    at most 3% above it (one trial less; ``find()`` would verify the candidate itself). Its JSON
    carries ``max_batch`` and ``safe_batch`` for readers.

    Attributes:
        seq_len: the length every sequence of the batch had (the prompt's, generating).
        tokens_per_s: tokens/s of the safe batch's timed steps (``None`` when they were not timed:
            an estimate, ``verify_steps=0``).
        best_batch, best_tokens_per_s: the measured batch with the most tokens/s at this length.
        result: the one-dimensional answer at this length, every trial included.
    """

    #: What the document carries for its readers, read from ``result`` (skipped on reading).
    DERIVED: ClassVar[tuple[str, ...]] = ("max_batch", "safe_batch")

    seq_len: Batch
    tokens_per_s: Rate | None
    best_batch: Batch
    best_tokens_per_s: Rate | None
    result: Result

    @classmethod
    def of(cls, seq_len: int, result: Result) -> FrontierPoint:
        timed = best_timed(result.trials)
        safe = timed.get(result.safe_batch)
        best = result.throughput
        per_row = result.generation.new_tokens if result.generation is not None else seq_len  # tokens a row makes
        return cls(
            seq_len=seq_len,
            tokens_per_s=None if safe is None or not safe.samples_per_s else safe.samples_per_s * per_row,
            best_batch=result.best_throughput_batch,
            best_tokens_per_s=None if best is None else best.best_samples_per_s * per_row,
            result=result,
        )

    @property
    def max_batch(self) -> int:
        """The largest batch that trained at this length (``result.max_batch``)."""
        return self.result.max_batch

    @property
    def safe_batch(self) -> int:
        """The batch to run with at this length (``result.safe_batch``)."""
        return self.result.safe_batch

    @property
    def safe_verified(self) -> bool:
        return self.result.safe_verified

    @property
    def boundary_reached(self) -> bool:
        return self.result.boundary_reached

    @property
    def new_tokens(self) -> int:
        """The tokens each row generated (a generation frontier's), 0 for training and inference."""
        return 0 if self.result.generation is None else self.result.generation.new_tokens

    @property
    def context_tokens(self) -> int:
        """The tokens a row holds at its longest: ``seq_len``, plus ``new_tokens`` when generating."""
        return self.seq_len + self.new_tokens

    @property
    def tokens(self) -> int:
        """Tokens in the largest batch: ``max_batch * context_tokens`` (``max_batch * seq_len`` in training)."""
        return self.max_batch * self.context_tokens

    @property
    def safe_tokens(self) -> int:
        return self.safe_batch * self.context_tokens

    @property
    def trials(self) -> int:
        """Trials this point ran (search, confirmation and verification)."""
        return len(self.result.trials)


@dataclass(frozen=True)
class Frontier:
    """The answer of [`batchfit.frontier`][batchfit.frontier]: per length, the largest and safe batch and tokens/s.

    Attributes:
        points: one [`FrontierPoint`][batchfit.FrontierPoint] per length asked for, shortest first.
        longest_at_batch_1: the longest length that trains at batch 1, found by the same exact
            search on the length axis (``None`` when not asked for); ``longest_limited_by`` says
            what stopped it (``"memory"``: ``longest + 1`` ran out of memory; ``"positions"``:
            the model takes no longer sequence; ``"max_seq_len"``: the ceiling asked for).
        longest_trials: trials the length-axis search ran.
        surface: the fitted memory surface ``fixed + b (a s + q s^2)``.
        budget_bytes, budget_counts: the budget every point was searched under and what it counts.
        device: where the trials ran (or what was estimated for).
        elapsed_s: seconds from the call to the answer.
        estimated: from fake tensors ([`batchfit.estimate`][batchfit.estimate] with ``seq_lens=``), not real steps.
        notes, assumptions: what a reader should know; what an estimate rests on.
    """

    SCHEMA: ClassVar[str] = FRONTIER_SCHEMA

    points: tuple[FrontierPoint, ...]
    surface: Surface | None
    budget_bytes: Bytes | None
    budget_counts: Unit
    device: DeviceInfo
    elapsed_s: Seconds
    longest_at_batch_1: Batch | None = None
    longest_limited_by: LongestLimit | None = None
    longest_trials: Annotated[int, Range(0)] = 0
    estimated: bool = False
    notes: tuple[str, ...] = field(default=())
    assumptions: tuple[str, ...] = field(default=())

    def point(self, seq_len: int) -> FrontierPoint:
        """The point at ``seq_len``; ``KeyError`` naming the lengths there are."""
        for point in self.points:
            if point.seq_len == seq_len:
                return point
        raise KeyError(f"no point at seq_len={seq_len}; the frontier has {[p.seq_len for p in self.points]}")

    @property
    def new_tokens(self) -> int:
        """The tokens each row generated, for a generation frontier (0 otherwise)."""
        return max((point.new_tokens for point in self.points), default=0)

    @property
    def token_budget(self) -> int:
        """Tokens per batch that fit at every length measured: the smallest ``max_batch * seq_len``
        (generating, the context's tokens, the KV budget a serving engine is given).

        A token-budget sampler (batches of up to N tokens, any length) is safe with this N over
        the lengths measured: the fixed memory and any ``s^2`` term make long sequences the binding
        ones, which is why it is the minimum and not the longest length's."""
        return min(point.tokens for point in self.points)

    @property
    def safe_token_budget(self) -> int:
        """[`token_budget`][batchfit.report.frontier.Frontier.token_budget] at the safe batches (the headroom kept)."""
        return min(point.safe_tokens for point in self.points)

    @property
    def trials(self) -> int:
        """Trials in all: every point's, and the length-axis search's."""
        return sum(point.trials for point in self.points) + self.longest_trials

    @property
    def fastest(self) -> FrontierPoint | None:
        """The point whose safe batch trains the most tokens/s (``None`` when nothing was timed)."""
        timed = [point for point in self.points if point.tokens_per_s]
        return max(timed, key=lambda point: point.tokens_per_s or 0.0) if timed else None

    # JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = FRONTIER_SCHEMA
        for point, written in zip(self.points, data["points"]):
            written.update(max_batch=point.max_batch, safe_batch=point.safe_batch)
            written["result"]["schema"] = RESULT_SCHEMA
        return data

    def to_json(self, indent: int | None = 2) -> str:
        """A stable JSON document (schema ``batchfit.frontier/1``), every point's result in full."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Frontier:
        """The inverse of [`to_dict`][batchfit.report.result.Result.to_dict], every field checked as
        [`Result.from_dict`][batchfit.report.result.Result.from_dict] checks."""
        return read_document(cls, data, "frontier")

    @classmethod
    def from_json(cls, text: str | bytes) -> Frontier:
        return read_json(cls, text, "frontier")

    def __str__(self) -> str:
        from batchfit.report.frontier_text import render_frontier  # lazy: it annotates with Frontier, the one way back

        return render_frontier(self)

    def plot(self, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
        """Draw the frontier to an image at ``path`` (``.png``, ``.svg``, ``.pdf``); the path written.
        Needs matplotlib: ``pip install 'batchfit[plot]'`` (an ``ImportError`` saying so otherwise)."""
        from batchfit.report.frontier_plot import save_frontier_plot  # lazy: matplotlib only when drawing

        return save_frontier_plot(self, path, dpi=dpi)

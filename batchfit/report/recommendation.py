"""The batch to train with: one [`Recommendation`][batchfit.Recommendation], the bound that decided it, and why.

A probe measures several answers to "which batch?": the largest that fits, the safe batch (with
headroom, verified), the throughput knee (past it, bigger batches stop paying in samples/s) and,
when asked, the gradient noise scale ``B_simple`` (McCandlish et al. 2018: roughly the critical
batch, past which a larger batch buys almost no fewer optimizer steps for the same loss).
[`recommend`][batchfit.recommend] turns them into one choice, per rank ``batch_size`` x ``accumulation`` x
``world_size``, by these rules, first match wins:

1. **A target** (``target_batch``, or ``target_tokens`` in whole sequences of ``seq_len``) is the
   user's: the learning rate and schedule were tuned for it. It is reached exactly where any
   micro-batch within the safe batch (a multiple of ``settings.multiple_of``) divides each rank's
   share: the fastest measured such micro-batch on the measured plateau, else the largest
   (fewest passes; a global batch costs the same samples however it is split). Otherwise (the
   ranks cannot share the target) with the fewest accumulation steps and the micro-batch that
   brings the global batch nearest the target, and ``target_changed_by`` (and the reason) say by
   how much: never silently. `batchfit.report.global_split` is that arithmetic, the one splitter
   ([`batchfit.plan`][batchfit.plan] and the integrations use it too). Tokens are whole
   sequences, the same number on every rank, rounded up.
2. **The noise scale**, ``B`` (global): above what fits (``safe x world_size``), train at the safe
   batch and accumulate to about ``B``: up to ``B`` more samples per step still cut the steps
   nearly in proportion, and accumulation is the only way there. Below the throughput knee, train
   at the knee: below it the device idles (every sample costs more time), above it samples past
   the noise scale buy few steps. Between the knee and the safe batch, train at ``B`` rounded to
   the grid (the multiples of ``multiple_of``): the most samples a step can use well, at full
   speed. When the signal drowned in the noise (``b_simple`` is ``None``) the noise scale is large,
   at least ``low``: larger batches still pay, so the safe batch, accumulated to ``low`` when that
   is above what fits.
3. **The throughput knee**, without a noise scale: the smallest batch within 5% of the best
   samples/s. Bigger batches are hardly faster per sample, and without a noise scale nothing says
   they still buy fewer steps (past the critical batch they do not), so the knee is the cheapest
   bet; the reason says how much faster per sample the safe batch measured.
4. **Memory**: the safe batch, when nothing was timed (an estimate), or when the knee (or the
   noise scale's choice) is above it.

Never above ``safe_batch`` per rank: the largest batch that fits leaves no headroom for a
fragmenting allocator or a longer batch. Caveats say what the numbers cannot: the noise scale is
derived for SGD (a guide for Adam), near zero at initialisation and growing while training (so
measure it again later), and a wide interval asks for more passes.

Pure Python (no torch, no estimation layer): a result read back from JSON on a machine without
torch recommends the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from batchfit.report.codec import Batch, Count, JsonRecord, NotAbove, Range, Rate
from batchfit.report.global_split import whole_sequences
from batchfit.report.recommendation_rules import (
    Decider,
    Facts,
    Measured,
    by_noise,
    by_speed,
    by_target,
    caveats_for,
    off_text,
    split_text,
)
from batchfit.report.uneven import TARGET_TOLERANCE, UnevenSplit, split_uneven, weights_of
from batchfit.units import check_positive_int

__all__ = ["Recommendation", "recommend"]

#: What `recommend` reads of a result.
_READS = ("max_batch", "safe_batch", "safe_verified", "settings", "throughput", "world_size", "noise_scale", "sized_on")
#: The width of the label column of `Recommendation.lines`, as the probe's summary has it.
LABEL = 17


@dataclass(frozen=True)
class Recommendation(JsonRecord):
    """The batch to train with, how to reach it, the bound that decided it, and the numbers behind it.

    A plan ([`batchfit.plan`][batchfit.plan]) is a recommendation decided by the target; it reads
    under the names a training loop uses too (`micro_batch`, `accumulation_steps`, `target_batch`,
    `remainder`, `exact`). JSON both ways: ``Recommendation.from_json(rec.to_json()) == rec``.

    Attributes:
        batch_size: the micro-batch each rank runs per forward/backward (never above ``safe_batch``).
        accumulation: forward/backward passes whose gradients are summed before one optimizer step.
        world_size: the ranks to train on: the ranks that probed, or those a re-plan was asked for.
        global_batch: ``batch_size * accumulation * world_size``: the samples one optimizer step sees.
        decided_by: ``"target"``, ``"noise scale"``, ``"throughput knee"`` or ``"memory"``.
        reason: why, with the numbers that decided it (the decision itself is
            [`decision`][batchfit.report.recommendation.Recommendation.decision]).
        caveats: what a reader should know before trusting it.
        max_batch, safe_batch: the probe's largest fitting and safe batch, per rank.
        knee_batch: the throughput knee (``None``: nothing was timed).
        best_batch: the size with the most samples/s measured.
        samples_per_s: the rate measured at ``batch_size`` (``None``: not timed).
        noise_scale, noise_low, noise_high: ``B_simple`` and its interval, in samples (``None``:
            not measured; ``noise_scale`` ``None`` with a ``noise_low``: the signal drowned in
            noise, the scale is large; ``noise_high`` ``None``: no upper bound measured).
        target: the global batch asked for, in samples (``None``: none).
        target_tokens, seq_len, tokens_per_step: the token view, where a length is known.
        target_changed_by: ``global_batch - target`` (0: reached exactly; ``None``: no target).
        uneven: with ``recommend(uneven=True)``, the same global batch (within `TARGET_TOLERANCE`,
            1%, for fewer passes: a caveat says where it moved) split over the ranks in
            proportion to what each fits, with the loss weights that keep the gradient the mean
            (``None``: not asked). The fields above stay the even split, for comparison;
            [`uneven_split`][batchfit.distributed.uneven_split] applies this one in a training loop.
    """

    batch_size: Annotated[Batch, NotAbove("safe_batch")]
    accumulation: Batch
    world_size: Batch
    global_batch: Batch
    decided_by: Decider
    reason: str
    max_batch: Batch
    safe_batch: Annotated[Batch, NotAbove("max_batch")]
    best_batch: Batch
    caveats: tuple[str, ...] = ()
    knee_batch: Batch | None = None
    samples_per_s: Rate | None = None
    noise_scale: Annotated[float, Range(0)] | None = None
    noise_low: Annotated[float, Range(0)] | None = None
    noise_high: Annotated[float, Range(0)] | None = None
    target: Batch | None = None
    target_tokens: Batch | None = None
    seq_len: Batch | None = None
    tokens_per_step: Count | None = None
    target_changed_by: int | None = None
    uneven: UnevenSplit | None = None

    NOUN: ClassVar[str] = "recommendation"

    def __post_init__(self) -> None:
        # The numbers a step is set up from must agree: a record that says otherwise would mislead
        # exactly where it matters (how many samples an optimizer step sees).
        if self.global_batch != self.batch_size * self.accumulation * self.world_size:
            raise ValueError(
                f"global_batch {self.global_batch} is not batch_size {self.batch_size} x accumulation "
                f"{self.accumulation} x world_size {self.world_size}"
            )
        changed = None if self.target is None else self.global_batch - self.target
        if self.target_changed_by != changed:
            raise ValueError(f"target_changed_by {self.target_changed_by} is not global_batch - target ({changed})")
        tokens = None if self.seq_len is None else self.global_batch * self.seq_len
        if self.tokens_per_step != tokens:
            raise ValueError(f"tokens_per_step {self.tokens_per_step} is not global_batch x seq_len ({tokens})")
        if self.uneven is not None and self.uneven.world_size != self.world_size:
            raise ValueError(f"the uneven split has {self.uneven.world_size} ranks, world_size is {self.world_size}")

    @property
    def exact(self) -> bool:
        """The target was reached exactly (``True`` without a target)."""
        return not self.target_changed_by

    @property
    def micro_batch(self) -> int:
        """``batch_size``: what each rank runs per forward/backward."""
        return self.batch_size

    @property
    def accumulation_steps(self) -> int:
        """``accumulation``: forward/backward passes per optimizer step."""
        return self.accumulation

    @property
    def target_batch(self) -> int | None:
        """``target``: the global batch asked for (``None``: none was)."""
        return self.target

    @property
    def remainder(self) -> int:
        """``target - global_batch`` (0 when exact or without a target): stated, never dropped silently."""
        return -(self.target_changed_by or 0)

    def summary(self) -> str:
        """One line: the split, how near the target, the rate at the micro-batch, the bounds, why
        (``global batch 1024 = 4 ranks x micro-batch 64 x 4 accumulation steps (exact); ...``)."""
        ranks = f"{self.world_size} ranks x " if self.world_size > 1 else ""
        steps = "step" if self.accumulation == 1 else "steps"
        exactness = "exact" if self.exact else f"{self.remainder} short of the target {self.target}"
        if self.remainder < 0:
            exactness = f"{-self.remainder} over the target {self.target}"
        if self.target_tokens is not None and self.tokens_per_step is not None and self.exact:
            over = self.tokens_per_step - self.target_tokens
            if over:
                exactness = f"{over:,} tokens over the target {self.target_tokens:,}: whole sequences"
        if self.target is None:
            exactness = f"decided by {self.decided_by}"
        split = f"{ranks}micro-batch {self.batch_size} x {self.accumulation} accumulation {steps} ({exactness})"
        text = f"global batch {self.global_batch} = {split}"
        if self.seq_len is not None and self.tokens_per_step is not None:
            per_step = f"{self.tokens_per_step:,} tokens/step"
            text = f"{per_step} = global batch {self.global_batch} x {self.seq_len:,} tokens = {split}"
        if self.samples_per_s is not None:
            text += f"; {self.samples_per_s:,.0f} samples/s"
            if self.seq_len is not None:
                text += f" ({self.samples_per_s * self.seq_len:,.0f} tokens/s)"
            text += f" measured at micro-batch {self.batch_size}"
        text += f"; safe batch {self.safe_batch}"
        if self.knee_batch is not None:
            text += f", throughput knee {self.knee_batch}"
        return f"{text}. {self.reason}" + ("" if self.reason.endswith(".") else ".")

    def split(self) -> str:
        """``global batch 384 = micro-batch 48 x 4 accumulation steps x 2 ranks``: the set-up in words."""
        text = f"global batch {self.global_batch} = micro-batch {self.batch_size}"
        if self.accumulation > 1:
            text += f" x {self.accumulation} accumulation steps"
        if self.world_size > 1:
            text += f" x {self.world_size} ranks"
        return text + (", no accumulation" if self.accumulation == 1 else "")

    def decision(self) -> str:
        """``train at 48 x 4 accumulation (global batch 192), decided by the noise scale``: what to
        do, in one clause; [`reason`][batchfit.ray.WorkerBatch.reason] says why."""
        totals = [f"global batch {self.global_batch}"] if self.global_batch != self.batch_size else []
        if self.tokens_per_step is not None:
            totals.append(f"{self.tokens_per_step:,} tokens")
        said = f" ({', '.join(totals)})" if totals else ""
        decider = self.decided_by if self.decided_by == "memory" else f"the {self.decided_by}"
        return f"train at {split_text(self.batch_size, self.accumulation, self.world_size)}{said}, decided by {decider}"

    def metrics(self) -> dict[str, float]:
        """What the integrations log beside the batch they set (``batchfit/noise_scale``, ``_low``,
        ``_high``, ``batchfit/recommended_batch``, ``batchfit/recommended_global_batch``): the
        numbers measured, none that was not."""
        named = {
            "noise_scale": self.noise_scale,
            "noise_scale_low": self.noise_low,
            "noise_scale_high": self.noise_high,
            "recommended_batch": self.batch_size,
            "recommended_global_batch": self.global_batch,
        }
        return {f"batchfit/{name}": float(value) for name, value in named.items() if value is not None}

    def lines(self) -> list[str]:
        """The lines the CLI prints last: the decision
        ([`decision`][batchfit.report.recommendation.Recommendation.decision]), why
        ([`reason`][batchfit.ray.WorkerBatch.reason]), then
        one line per caveat (unwrapped; the caller fits them to its width)."""
        lines = [f"{'recommended':<{LABEL}}{self.decision()}", f"{'why':<{LABEL}}{self.reason}"]
        if self.uneven is not None:
            uneven = self.uneven
            lines += [
                f"{'uneven':<{LABEL}}{uneven.text()} (global batch {uneven.global_batch}): {uneven.reason}",
                f"{'loss weights':<{LABEL}}{uneven.weights_text()}",
            ]
        return lines + [f"{'caveat':<{LABEL}}{caveat}" for caveat in self.caveats]

    def __str__(self) -> str:
        return "\n".join(self.lines())


# The recommendation --------------------------------------------------------------------------------
def recommend(
    result: Measured,
    *,
    target_batch: int | None = None,
    target_tokens: int | None = None,
    seq_len: int | None = None,
    world_size: int | None = None,
    uneven: bool = False,
) -> Recommendation:
    """The batch to train with for ``result``, by the rules of this module's docstring.

    Args:
        result: a probe's answer ([`batchfit.find`][batchfit.find],
            [`batchfit.estimate`][batchfit.estimate]), batch sizes per rank; its ``noise_scale`` is
            used when measured.
        target_batch: a global batch to reach, in samples (over every rank and accumulation step).
        target_tokens: instead, tokens per optimizer step: the fewest whole sequences, the same
            number on every rank, that hold them (rounded up; the reason says by how much).
        seq_len: the tokens in each sequence; default the length the probe sized on
            (``result.sized_on``). It adds the token view (``tokens_per_step``).
        world_size: the ranks to train on; default the ranks that probed (``result.world_size``).
            Another number re-plans without a new probe (an elastic job that restarted with more
            or fewer ranks): a rank's batch sizes hold on the same device kind, so with a target
            the global batch is kept, split over the new ranks, exactly where a split allows and
            otherwise as near as one does, ``target_changed_by`` saying by how much. A caveat says
            it was re-planned, and that the samples/s are those of the probe's ranks.
        uneven: also split the global batch (the target, else the one the rules chose) over the
            ranks in proportion to each rank's own safe batch (``result.per_rank``; ranks that
            probed alike split evenly), with the loss weights that keep the gradient the mean
            over every sample (`batchfit.report.uneven`): ``Recommendation.uneven``. The fewest
            passes whose global batch is within `TARGET_TOLERANCE` (1%) of it (`split_uneven`):
            a caveat names the target and what it became where they differ, and the split's
            reason says when it gains nothing over the even split.

    Raises:
        TypeError: ``result`` is not a result; a target, ``seq_len`` or ``world_size`` is not an
            int; both targets given.
        ValueError: a target, ``seq_len`` or ``world_size`` is not positive; ``target_tokens``
            without a known length; with ``uneven``: a target below the number of ranks, a rank
            that fits nothing, or a ``world_size`` other than the ranks that probed apart.
    """
    # Duck-typed (`Measured`): the result module calls this one (Result.recommend), so it is not imported here.
    if not all(hasattr(result, name) for name in _READS):
        raise TypeError(f"result must be a batchfit Result, got {type(result).__name__}")
    if target_batch is not None and target_tokens is not None:
        raise TypeError("give target_batch (samples per step) or target_tokens (tokens per step), not both")
    named = (("target_batch", target_batch), ("target_tokens", target_tokens), ("seq_len", seq_len))
    for name, value in (*named, ("world_size", world_size)):
        if value is not None:
            check_positive_int(name, value)
    if not isinstance(uneven, bool):
        raise TypeError(f"uneven must be True or False, got {type(uneven).__name__} {uneven!r}")
    safe_batches = _rank_safe_batches(result, world_size) if uneven else ()
    sized = getattr(result.sized_on, "length", None)
    length = seq_len if seq_len is not None else sized
    if target_tokens is not None and length is None:
        raise ValueError(
            f"target_tokens {target_tokens:,} needs seq_len=, the tokens in each sequence: the result does not "
            "record the length it was sized on"
        )
    facts = Facts.of(result, world_size)
    about = _about_length(seq_len, sized, target_tokens) if target_batch is not None or target_tokens else []
    if target_tokens is not None:
        assert length is not None
        target_batch, rounded = whole_sequences(target_tokens, length, facts.ranks)
        about += [rounded] if rounded else []
    if target_batch is not None:
        micro, steps, decided, reason, caveats = by_target(facts, target_batch, tuple(about))
    elif facts.noise is not None:
        micro, steps, decided, reason, caveats = by_noise(facts, facts.noise)
    else:
        micro, steps, decided, reason, caveats = by_speed(facts)
    caveats += caveats_for(result, facts, micro)
    noise = facts.noise
    global_batch = micro * steps * facts.ranks
    split = None
    if uneven:
        asked = target_batch is not None
        split, said = _uneven(target_batch or global_batch, safe_batches, micro, steps, facts.ranks, asked)
        caveats += said
    return Recommendation(
        batch_size=micro,
        accumulation=steps,
        world_size=facts.ranks,
        global_batch=global_batch,
        decided_by=decided,
        reason=reason,
        caveats=tuple(caveats),
        max_batch=result.max_batch,
        safe_batch=result.safe_batch,
        best_batch=facts.best,
        knee_batch=facts.knee,
        # A target's split is chosen on each size's best-timed trial, and states the rate it chose on.
        samples_per_s=facts.measured.get(micro) if target_batch is not None else facts.rate(micro),
        noise_scale=None if noise is None else noise.b_simple,
        noise_low=None if noise is None else noise.low,
        noise_high=None if noise is None else noise.high,
        target=target_batch,
        target_tokens=target_tokens,
        seq_len=length,
        tokens_per_step=None if length is None else global_batch * length,
        target_changed_by=None if target_batch is None else global_batch - target_batch,
        uneven=split,
    )


def _about_length(seq_len: int | None, sized: int | None, target_tokens: int | None) -> list[str]:
    """What a target's reason says first of the length: the probe's, where the tokens are counted in
    it, or that the probe sized on another length (its batch sizes hold at that one)."""
    if seq_len is None and target_tokens is not None and sized is not None:
        return [f"seq_len {sized:,} is the length the probe sized on"]
    if seq_len is not None and sized is not None and sized != seq_len:
        return [f"the probe sized on sequences of {sized:,} tokens, not {seq_len:,}: its batch sizes hold at {sized:,}"]
    return []


def _rank_safe_batches(result: Measured, world_size: int | None) -> tuple[int, ...]:
    """Each rank's safe batch for an uneven split: its own (``result.per_rank``), or the group's
    on every rank where the ranks probed alike (or one alone). Checked before any split."""
    per_rank = tuple(getattr(result, "per_rank", ()) or ())
    probed = len(per_rank) if per_rank else result.world_size
    if world_size is not None and world_size != probed and per_rank:
        raise ValueError(
            f"uneven=True splits over the {probed} ranks that probed, each by its own safe batch; world_size="
            f"{world_size} asks for other ranks, whose memory the probe did not see: probe on those ranks"
        )
    if not per_rank:
        return (result.safe_batch,) * (world_size or probed)
    for answer in per_rank:
        if answer.safe_batch < 1:
            raise ValueError(f"rank {answer.rank} fits no sample (safe batch {answer.safe_batch})")
    return tuple(answer.safe_batch for answer in sorted(per_rank, key=lambda a: a.rank))


def _uneven(
    target: int, safe_batches: tuple[int, ...], micro: int, steps: int, ranks: int, asked: bool
) -> tuple[UnevenSplit, list[str]]:
    """``target`` split unevenly (`split_uneven`), said against the even split ``micro x steps``, and
    a caveat when its global batch is not ``target`` (``asked``: the user's target, else the even
    split's global batch). Where it needs as many passes as the even split, and is no nearer the
    target, it gains nothing, and says so first."""
    micro_batches, passes = split_uneven(target, safe_batches)
    reached, even = sum(micro_batches) * passes, micro * steps * ranks
    nearer = abs(reached - target) < abs(even - target)
    said = f"in proportion to each rank's safe batch ({', '.join(map(str, safe_batches))})"
    more = "as many passes per step" if passes == steps else f"more passes per step ({passes} against {steps})"
    if passes < steps:
        said += f": {passes} pass{'es' * (passes != 1)} per step instead of {steps} at the even micro-batch {micro}"
    elif nearer:
        said += f": nearer the target than the even split's {even} (micro-batch {micro}), with {more}"
    else:
        farther = ", no nearer the target" if reached != target else ""
        said = (
            f"gains nothing over the even split {split_text(micro, steps, ranks)}: {more}{farther}; "
            "train with that, this one is for comparison"
        )
    if len(set(micro_batches)) == 1:
        said += "; every rank runs the same micro-batch: the split is even, every weight is 1"
    caveats = []
    if reached != target:
        whose = f"the target {target}" if asked else f"the even split's global batch {target}"
        within = abs(reached - target) <= TARGET_TOLERANCE * target
        why = (
            f"within {TARGET_TOLERANCE:.0%} of it in the fewest passes; an exact split, where there is one, needs more"
            if within
            else f"no split comes within {TARGET_TOLERANCE:.0%} of it: the fewest passes, nearest"
        )
        caveats.append(f"the uneven split's global batch is {reached}, {off_text(reached - target)} {whose} ({why})")
    split = UnevenSplit(
        micro_batches=micro_batches,
        accumulation=passes,
        global_batch=reached,
        loss_weights=weights_of(micro_batches),
        safe_batches=safe_batches,
        reason=said,
    )
    return split, caveats

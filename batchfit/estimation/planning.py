"""From a probe's answer to a training set-up: a target global batch as micro-batch x accumulation steps.

A user rarely wants "the largest batch that fits": they want a *global* batch (what the learning rate and
the schedule were tuned for) and need to know how to reach it on their devices.
[`plan_for`][batchfit.estimation.planning.plan_for] splits that target over the ranks and into
gradient-accumulation steps, choosing the per-rank micro-batch from what the probe measured: only sizes
within the verified safe batch, and among those the fastest measured one, because the memory boundary
says what *can* run, not what runs best.

The target is a number of samples (``target_batch``) or, as LLM recipes state it, of tokens per
optimizer step (``target_tokens`` with ``seq_len``): tokens are reached as whole sequences, rounded
up (`tokens_to_batch`), and the plan states the tokens each step really holds.
[`plan_for`][batchfit.estimation.planning.plan_for] also takes a [`Frontier`][batchfit.Frontier] (the largest batch per
length), and plans on its point at ``seq_len``.

Pure Python (no torch import): a plan can be made from a result loaded from JSON on a machine
without torch. [`batchfit.plan`][batchfit.plan] (``batchfit.api``) also takes a model, and probes it first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchfit.report import Frontier, Result, Trial
from batchfit.report.throughput import KNEE_FRACTION
from batchfit.units import check_positive_int

__all__ = ["ALTERNATIVE_FACTOR", "Plan", "check_target", "plan_for", "tokens_to_batch"]

#: A non-exact split is worth mentioning when its micro-batch is at least this many times the exact
#: one's: below that, the exact split costs little, above it the user may prefer to drop a few samples.
ALTERNATIVE_FACTOR = 4


@dataclass(frozen=True)
class Plan:
    """How to train with a target global batch: ``world_size`` ranks x ``micro_batch`` x ``accumulation_steps``.

    Attributes:
        target_batch: the global batch asked for.
        world_size: the ranks the global batch is spread over.
        micro_batch: the batch each rank runs per forward/backward (per rank, per step).
        accumulation_steps: forward/backward passes whose gradients are summed before one
            optimizer step.
        global_batch: ``micro_batch * accumulation_steps * world_size``, what the plan really trains
            with (``target_batch`` when ``exact``).
        exact: ``global_batch == target_batch``.
        remainder: ``target_batch - global_batch``, 0 when exact. Stated, never dropped silently: a
            plan that trains on fewer samples than asked says so.
        samples_per_s: the rate measured at ``micro_batch`` (the whole group's when the probe ran
            on several ranks), ``None`` when that size was not timed.
        knee_batch: the probe's throughput knee (past it, bigger batches hardly pay in speed),
            shown beside so that a reader sees how the micro-batch compares; ``None`` when the
            probe timed nothing.
        safe_batch: the probe's safe batch, the bound of ``micro_batch``.
        reason: why this micro-batch, in one sentence.
        seq_len: the tokens in each sequence (sample), when the plan has a token view (a
            ``target_tokens`` plan, a frontier's, or ``seq_len=`` given); ``None`` otherwise.
        tokens_per_step: ``global_batch * seq_len``, the tokens one optimizer step really holds;
            ``None`` without ``seq_len``.
        target_tokens: the tokens per step asked for (``None`` for a plan asked in samples). When
            it is not a whole number of sequences for every rank, ``tokens_per_step`` is the
            smallest that is (more than asked, never fewer), and ``reason`` says so.
    """

    target_batch: int
    world_size: int
    micro_batch: int
    accumulation_steps: int
    global_batch: int
    exact: bool
    remainder: int
    samples_per_s: float | None
    knee_batch: int | None
    safe_batch: int
    reason: str
    seq_len: int | None = None
    tokens_per_step: int | None = None
    target_tokens: int | None = None

    def __post_init__(self) -> None:
        # A plan whose numbers disagree would mislead exactly where it matters (how many samples an
        # optimizer step sees), so an inconsistent one cannot be built.
        if self.global_batch != self.micro_batch * self.accumulation_steps * self.world_size:
            raise ValueError(
                f"global_batch {self.global_batch} is not micro_batch {self.micro_batch} x accumulation_steps "
                f"{self.accumulation_steps} x world_size {self.world_size}"
            )
        if self.remainder != self.target_batch - self.global_batch or self.exact != (self.remainder == 0):
            raise ValueError(
                f"exact={self.exact} and remainder={self.remainder} do not match target_batch {self.target_batch} "
                f"and global_batch {self.global_batch}"
            )
        if self.seq_len is None:
            if self.tokens_per_step is not None or self.target_tokens is not None:
                raise ValueError("tokens_per_step and target_tokens need seq_len: a plan without it has no token view")
        elif self.tokens_per_step != self.global_batch * self.seq_len:
            raise ValueError(
                f"tokens_per_step {self.tokens_per_step} is not global_batch {self.global_batch} x seq_len "
                f"{self.seq_len}"
            )

    def __str__(self) -> str:
        ranks = f"{self.world_size} ranks x " if self.world_size > 1 else ""
        steps = "step" if self.accumulation_steps == 1 else "steps"
        exactness = "exact" if self.exact else f"{self.remainder} short of the target {self.target_batch}"
        if self.target_tokens is not None and self.tokens_per_step is not None and self.exact:
            over = self.tokens_per_step - self.target_tokens
            if over:
                exactness = f"{over:,} tokens over the target {self.target_tokens:,}: whole sequences"
        split = f"{ranks}micro-batch {self.micro_batch} x {self.accumulation_steps} accumulation {steps} ({exactness})"
        if self.seq_len is not None and self.tokens_per_step is not None:
            text = (
                f"{self.tokens_per_step:,} tokens/step = global batch {self.global_batch} x {self.seq_len:,} tokens "
                f"= {split}"
            )
        else:
            text = f"global batch {self.global_batch} = {split}"
        if self.samples_per_s is not None:
            text += f"; {self.samples_per_s:,.0f} samples/s"
            if self.seq_len is not None:
                text += f" ({self.samples_per_s * self.seq_len:,.0f} tokens/s)"
            text += f" measured at micro-batch {self.micro_batch}"
        text += f"; safe batch {self.safe_batch}"
        if self.knee_batch is not None:
            text += f", throughput knee {self.knee_batch}"
        return text + f". {self.reason}"


def plan_for(
    result: Result | Frontier,
    target_batch: int | None = None,
    world_size: int | None = None,
    *,
    target_tokens: int | None = None,
    seq_len: int | None = None,
) -> Plan:
    """Split ``target_batch`` (global) into ``world_size`` ranks x micro-batch x accumulation steps.

    The per-rank share ``target_batch // world_size`` is split exactly: the micro-batch is a divisor
    of it, at most ``result.safe_batch`` (the safe batch, not the max batch: it keeps the headroom
    and was verified with extra steps), and a multiple of ``settings.multiple_of`` where one
    divides (otherwise the multiple is ignored, and the reason says so). Among those divisors:

    * the fastest *measured* one (each size's best-timed fitting trial, as
      [`of`][batchfit.report.throughput.Throughput.of] counts it) wins over slower measured ones;
    * a larger divisor that was not timed wins over the fastest measured one, unless that one is
      already on the measured plateau (within `KNEE_FRACTION` of the best
      rate measured at any size): below the plateau, the measurements say bigger is faster, and the
      larger divisor also needs fewer accumulation steps;
    * with nothing timed, the largest divisor (fewest accumulation steps).

    An exact split always exists (1 divides everything), so the plan returned is always exact. When
    it is poor (e.g. a prime per-rank share larger than the safe batch leaves micro-batch 1), the
    reason also names the non-exact alternative and how many samples it would leave out, for the
    user to choose; it is never applied silently.

    In tokens (``target_tokens`` and ``seq_len``, for a global batch stated as tokens per optimizer
    step): the global batch is ``target_tokens / seq_len`` sequences, reached as whole sequences
    for every rank: `tokens_to_batch` rounds *up* to a multiple of ``seq_len * world_size``
    tokens (never fewer tokens than asked), and the plan's ``tokens_per_step`` and ``reason`` say
    how many more it holds and what the nearest split below would be.

    Args:
        result: a probe's answer ([`batchfit.find`][batchfit.find]); its batch sizes are per rank. Or a
            [`Frontier`][batchfit.Frontier]: the plan is made on its point at
            ``seq_len`` (required: a frontier has several lengths, and the choice of length is
            the user's).
        target_batch: the global batch to reach in samples (sequences), summed over every rank
            and accumulation step. Exactly one of ``target_batch`` and ``target_tokens``.
        world_size: the ranks to train on; default ``result.world_size``.
        target_tokens: the global batch to reach in tokens per optimizer step.
        seq_len: the tokens in each sequence. Needed with ``target_tokens`` unless the result
            records the length it was sized on (``result.sized_on``); with ``target_batch`` it is
            optional and adds the token view (``tokens_per_step``). The result's micro-batch is
            for the length it was probed at: plan at that length.

    Raises:
        TypeError: ``result`` is not a [`Result`][batchfit.Result] or a frontier; a target,
            ``seq_len`` or ``world_size`` is not an int; both or neither of ``target_batch`` and
            ``target_tokens`` are given.
        ValueError: a target, ``seq_len`` or ``world_size`` is not positive; ``target_batch`` is
            not divisible by ``world_size``; ``target_tokens`` is less than one sequence per rank
            (``seq_len * world_size``); ``target_tokens`` without a known ``seq_len``; a frontier
            without ``seq_len`` or with no point at it.
    """
    is_frontier = isinstance(result, Frontier)
    if not isinstance(result, Result) and not is_frontier:
        raise TypeError(f"result must be a batchfit Result or Frontier, got {type(result).__name__}")
    check_target(target_batch, world_size, target_tokens=target_tokens, seq_len=seq_len)
    about_target: list[str] = []  # how the target was read: before the reason, which is about the split
    if is_frontier:
        result = _point_result(result, seq_len, about_target)
    assert isinstance(result, Result)
    sized_at = _sized_on_length(result)
    if seq_len is None and target_tokens is not None:
        if sized_at is None:
            raise ValueError(
                f"target_tokens {target_tokens:,} needs seq_len=, the tokens in each sequence: the result does not "
                "record the length it was sized on"
            )
        seq_len = sized_at
        about_target.append(f"seq_len {seq_len:,} is the length the probe sized on")
    elif seq_len is not None and sized_at is not None and sized_at != seq_len:
        about_target.append(
            f"the probe sized on sequences of {sized_at:,} tokens, not {seq_len:,}: its batch sizes hold at "
            f"{sized_at:,}"
        )
    if world_size is None:
        world_size = result.world_size
    check_target(target_batch, world_size, target_tokens=target_tokens, seq_len=seq_len)
    if target_tokens is not None:
        assert seq_len is not None
        target_batch = tokens_to_batch(target_tokens, seq_len, world_size)
        if target_batch * seq_len != target_tokens:
            about_target.append(_rounding_note(target_tokens, seq_len, world_size, target_batch))
    assert target_batch is not None
    safe = result.safe_batch
    if safe < 1:
        raise ValueError(f"the result's safe_batch is {safe}: not even one sample fits, there is nothing to plan")
    per_rank = target_batch // world_size
    multiple_of = max(1, result.settings.multiple_of)

    notes: list[str] = []
    divisors = _divisors_within(per_rank, safe)  # never empty: 1 <= safe
    candidates = [d for d in divisors if d % multiple_of == 0]
    if not candidates:
        candidates = divisors
        notes.append(f"no divisor of {per_rank} within the safe batch is a multiple of {multiple_of}, so it is ignored")

    rates = _measured_rates(result.trials)
    micro, why = _choose(per_rank, safe, candidates, rates)

    alternative = _alternative(per_rank, safe, multiple_of)
    if alternative >= ALTERNATIVE_FACTOR * micro and per_rank % alternative:
        alt_steps = per_rank // alternative
        alt_global = alternative * alt_steps * world_size
        notes.append(
            f"no exact split has a larger micro-batch: micro-batch {alternative} x {alt_steps} accumulation "
            f"step{'s' * (alt_steps != 1)} would give a global batch of {alt_global}, remainder "
            f"{target_batch - alt_global} (samples left out, so not chosen)"
        )
    if world_size != result.world_size and micro in rates:
        notes.append(f"the rates were measured with {result.world_size} rank(s), not {world_size}")

    steps = per_rank // micro
    global_batch = micro * steps * world_size
    return Plan(
        target_batch=target_batch,
        world_size=world_size,
        micro_batch=micro,
        accumulation_steps=steps,
        global_batch=global_batch,
        exact=global_batch == target_batch,
        remainder=target_batch - global_batch,
        samples_per_s=rates.get(micro),
        knee_batch=result.throughput.knee_batch if result.throughput is not None else None,
        safe_batch=safe,
        reason="; ".join([*about_target, why, *notes]) + ".",
        seq_len=seq_len,
        tokens_per_step=None if seq_len is None else global_batch * seq_len,
        target_tokens=target_tokens,
    )


def tokens_to_batch(target_tokens: int, seq_len: int, world_size: int = 1) -> int:
    """The global batch, in sequences, for ``target_tokens`` per optimizer step: the fewest whole
    sequences of ``seq_len`` tokens, the same number on each of ``world_size`` ranks, that hold at
    least ``target_tokens`` (``ceil(target_tokens / (seq_len * world_size)) * world_size``)."""
    check_target(None, world_size, target_tokens=target_tokens, seq_len=seq_len)
    return -(-target_tokens // (seq_len * world_size)) * world_size


def check_target(
    target_batch: Any = None, world_size: Any = None, *, target_tokens: Any = None, seq_len: Any = None
) -> None:
    """The checks of [`plan_for`][batchfit.estimation.planning.plan_for] that need no result, so that
    ``batchfit.plan(model, ...)``
    refuses a bad target before it spends a probe on it. ``world_size`` and ``seq_len`` may be
    ``None`` (not known yet: the result's); what can be checked without them is."""
    if (target_batch is None) == (target_tokens is None):
        raise TypeError(
            "give exactly one of target_batch (samples per optimizer step) and target_tokens (tokens per step, "
            f"with seq_len): {'both were given' if target_batch is not None else 'neither was given'}"
        )
    if target_tokens is not None:
        check_positive_int("target_tokens", target_tokens)
    else:
        check_positive_int("target_batch", target_batch)
    if seq_len is not None:
        check_positive_int("seq_len", seq_len)
    if world_size is not None:
        check_positive_int("world_size", world_size)
    if target_tokens is not None:
        if seq_len is not None and target_tokens < seq_len * (world_size or 1):
            per = f" on each of {world_size} ranks ({seq_len * world_size:,} tokens)" if (world_size or 1) > 1 else ""
            raise ValueError(
                f"target_tokens {target_tokens:,} is less than one sequence of seq_len {seq_len:,}{per}: a step "
                "holds whole sequences"
            )
        return
    if world_size is None:
        return
    if target_batch % world_size:
        raise ValueError(
            f"target_batch {target_batch} is not divisible by world_size {world_size}: every rank must get a whole "
            f"share (the nearest are {target_batch // world_size * world_size} and "
            f"{(target_batch // world_size + 1) * world_size})"
        )


def _rounding_note(target_tokens: int, seq_len: int, world_size: int, batch: int) -> str:
    per_rank = f" for each of {world_size} ranks" if world_size > 1 else ""
    below = batch - world_size  # >= world_size: target_tokens >= seq_len * world_size
    return (
        f"target_tokens {target_tokens:,} is not a whole number of {seq_len:,}-token sequences{per_rank}: rounded "
        f"up to {batch} sequences, {batch * seq_len:,} tokens per step ({batch * seq_len - target_tokens:,} more; "
        f"the nearest below is {below} sequences, {below * seq_len:,} tokens)"
    )


def _point_result(frontier: Frontier, seq_len: int | None, notes: list[str]) -> Result:
    """The result of ``frontier``'s point at ``seq_len``; a ``ValueError`` listing its lengths."""
    lengths = ", ".join(f"{point.seq_len:,}" for point in frontier.points)
    if seq_len is None:
        raise ValueError(f"a frontier has a point per length ({lengths}): pass seq_len= to choose the one to plan on")
    try:
        point = frontier.point(seq_len)
    except KeyError:
        raise ValueError(f"the frontier has no point at seq_len={seq_len:,}; its lengths: {lengths}") from None
    notes.append(
        f"planned on the frontier's point at seq_len {seq_len:,} (max batch {point.max_batch}, safe batch "
        f"{point.safe_batch})"
    )
    return point.result


def _sized_on_length(result: Result) -> int | None:
    """The sequence length the probe sized on, where the result records one (``result.sized_on``)."""
    sized_on = getattr(result, "sized_on", None)
    for name in ("seq_len", "length"):
        value = getattr(sized_on, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _divisors_within(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` that are at most ``limit``, increasing. The work is
    ``min(limit, sqrt(n))`` steps: only micro-batches within the safe batch are candidates, so a
    huge target (``2**61 - 1``) costs no more than the safe batch, not the square root of it."""
    root = math.isqrt(n)
    if limit <= root:
        return [d for d in range(1, limit + 1) if n % d == 0]
    small = [d for d in range(1, root + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if n // d != d and n // d <= limit]


def _measured_rates(trials: tuple[Trial, ...]) -> dict[int, float]:
    """samples/s per size, from each size's best-timed fitting trial, as
    [`of`][batchfit.report.throughput.Throughput.of] counts them (`best_timed`)."""
    from batchfit.report.throughput import best_timed

    return {size: trial.samples_per_s or 0.0 for size, trial in best_timed(trials).items()}


def _choose(per_rank: int, safe: int, candidates: list[int], rates: dict[int, float]) -> tuple[int, str]:
    """The micro-batch among ``candidates`` (increasing divisors of ``per_rank``), and why."""
    largest = candidates[-1]
    share = f"the per-rank share {per_rank}"
    biggest = (
        f"micro-batch {largest} is the largest divisor of {share} within the safe batch {safe} "
        "(fewest accumulation steps)"
    )
    timed = [d for d in candidates if d in rates]
    if not timed:
        return largest, biggest + "; none of its divisors was timed"
    fastest = max(timed, key=lambda d: (rates[d], d))
    rate = rates[fastest]
    best_size = max(rates, key=lambda size: (rates[size], size))
    on_plateau = rate >= KNEE_FRACTION * rates[best_size]
    untimed_larger = [d for d in candidates if d > fastest and d not in rates]
    if untimed_larger and not on_plateau:
        pick = untimed_larger[-1]  # a timed divisor above it ran slower than ``fastest``: not it
        head = (
            biggest
            if pick == largest
            else (
                f"micro-batch {pick} is the largest divisor of {share} within the safe batch {safe} "
                f"not measured slower (the larger {largest} ran at {rates[largest]:,.0f} samples/s)"
            )
        )
        return pick, (
            f"{head}; it was not timed, but the fastest timed divisor ({fastest}, {rate:,.0f} samples/s) is below "
            f"the measured plateau ({KNEE_FRACTION:.0%} of {rates[best_size]:,.0f} samples/s at batch {best_size}), "
            "where bigger batches still paid"
        )
    why = f"micro-batch {fastest} is the fastest measured divisor of {share} ({rate:,.0f} samples/s)"
    slower = [d for d in timed if d > fastest]
    if slower:
        why += f"; the larger {slower[-1]} measured slower ({rates[slower[-1]]:,.0f} samples/s)"
    if untimed_larger:
        why += (
            f"; larger divisors up to {untimed_larger[-1]} were not timed, and {fastest} is already on the measured "
            f"plateau (within {1 - KNEE_FRACTION:.0%} of the best rate, {rates[best_size]:,.0f} samples/s "
            f"at batch {best_size})"
        )
    return fastest, why


def _alternative(per_rank: int, safe: int, multiple_of: int) -> int:
    """The micro-batch of the best non-exact split: as large as the safe batch and the share allow,
    rounded down to ``multiple_of`` where that leaves something."""
    micro = min(safe, per_rank)
    rounded = micro // multiple_of * multiple_of
    return rounded if rounded >= 1 else micro

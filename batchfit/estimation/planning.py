"""From a probe's answer to a training set-up: a target global batch as micro-batch x accumulation steps.

A user rarely wants "the largest batch that fits": they want a *global* batch (what the learning rate and
the schedule were tuned for) and need to know how to reach it on their devices.
[`plan_for`][batchfit.estimation.planning.plan_for] splits that target over the ranks and into
gradient-accumulation steps, choosing the per-rank micro-batch from what the probe measured: only sizes
within the verified safe batch, and among those the fastest measured one, because the memory boundary
says what *can* run, not what runs best.

A plan is a [`Recommendation`][batchfit.Recommendation] decided by the target: ``plan_for(result, t, n)``
is ``result.recommend(target_batch=t, world_size=n)`` (the one splitter,
`batchfit.report.global_split`), with the checks a plan adds: the ranks must share the target
exactly (``recommend`` instead goes as near as it can, and says by how much), and a target in
tokens must hold a whole sequence on every rank. ``Plan`` is the name it had: an alias of
``Recommendation``, kept so that old imports and ``isinstance`` checks work.

The target is a number of samples (``target_batch``) or, as LLM recipes state it, of tokens per
optimizer step (``target_tokens`` with ``seq_len``): tokens are reached as whole sequences, rounded
up (`tokens_to_batch`), and the plan states the tokens each step really holds.
[`plan_for`][batchfit.estimation.planning.plan_for] also takes a [`Frontier`][batchfit.Frontier] (the largest batch per
length), and plans on its point at ``seq_len``.

Pure Python (no torch import): a plan can be made from a result loaded from JSON on a machine
without torch. [`batchfit.plan`][batchfit.plan] (``batchfit.api``) also takes a model, and probes it first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchfit.report import Frontier, Recommendation, Result
from batchfit.report.global_split import ALTERNATIVE_FACTOR, whole_sequences
from batchfit.units import check_positive_int

__all__ = ["ALTERNATIVE_FACTOR", "Plan", "check_target", "plan_for", "tokens_to_batch"]

#: The name a plan had before it was a [`Recommendation`][batchfit.Recommendation] decided by the
#: target: the same class, so ``isinstance(plan, Plan)`` and its attributes keep working.
Plan = Recommendation


def plan_for(
    result: Result | Frontier,
    target_batch: int | None = None,
    world_size: int | None = None,
    *,
    target_tokens: int | None = None,
    seq_len: int | None = None,
) -> Recommendation:
    """Split ``target_batch`` (global) into ``world_size`` ranks x micro-batch x accumulation steps.

    The per-rank share ``target_batch // world_size`` is split exactly: the micro-batch is a divisor
    of it, at most ``result.safe_batch`` (the safe batch, not the max batch: it keeps the headroom
    and was verified with extra steps), and a multiple of ``settings.multiple_of`` where one
    divides (otherwise the multiple is ignored, and the reason says so). Among those divisors:

    * the fastest *measured* one (each size's best-timed fitting trial, as
      [`of`][batchfit.report.throughput.Throughput.of] counts it) wins over slower measured ones;
    * a larger divisor that was not timed wins over the fastest measured one, unless that one is
      already on the measured plateau (within ``KNEE_FRACTION`` of the best
      rate measured at any size): below the plateau, the measurements say bigger is faster, and the
      larger divisor also needs fewer accumulation steps;
    * with nothing timed, the largest divisor (fewest accumulation steps).

    An exact split always exists (1 divides everything), so the plan returned is always exact. When
    it is poor (e.g. a prime per-rank share larger than the safe batch leaves micro-batch 1), the
    reason also names the non-exact alternative and how many samples it would leave out, for the
    user to choose; it is never applied silently.

    It is ``result.recommend(target_batch=..., world_size=...)``
    ([`recommend`][batchfit.recommend]): the same split, reason and caveats, as a
    [`Recommendation`][batchfit.Recommendation] (``micro_batch``, ``accumulation_steps``,
    ``target_batch``, ``exact``, ``remainder`` read as a plan's did; `summary` is the one line
    ``str()`` of a plan used to be).

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
    point = None
    if is_frontier:
        result, point = _point_result(result, seq_len)
    assert isinstance(result, Result)
    sized_at = getattr(result.sized_on, "length", None)
    if seq_len is None and target_tokens is not None and sized_at is None:
        raise ValueError(
            f"target_tokens {target_tokens:,} needs seq_len=, the tokens in each sequence: the result does not "
            "record the length it was sized on"
        )
    ranks = result.world_size if world_size is None else world_size
    check_target(target_batch, ranks, target_tokens=target_tokens, seq_len=sized_at if seq_len is None else seq_len)
    if result.safe_batch < 1:
        raise ValueError(
            f"the result's safe_batch is {result.safe_batch}: not even one sample fits, there is nothing to plan"
        )
    plan = result.recommend(
        target_batch=target_batch, target_tokens=target_tokens, seq_len=seq_len, world_size=world_size
    )
    return plan if point is None else dataclasses.replace(plan, reason=f"{point}; {plan.reason}")


def tokens_to_batch(target_tokens: int, seq_len: int, world_size: int = 1) -> int:
    """The global batch, in sequences, for ``target_tokens`` per optimizer step: the fewest whole
    sequences of ``seq_len`` tokens, the same number on each of ``world_size`` ranks, that hold at
    least ``target_tokens`` (``ceil(target_tokens / (seq_len * world_size)) * world_size``)."""
    check_target(None, world_size, target_tokens=target_tokens, seq_len=seq_len)
    return whole_sequences(target_tokens, seq_len, world_size)[0]


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


def _point_result(frontier: Frontier, seq_len: int | None) -> tuple[Result, str]:
    """The result of ``frontier``'s point at ``seq_len``, and a note saying so; a ``ValueError``
    listing its lengths."""
    lengths = ", ".join(f"{point.seq_len:,}" for point in frontier.points)
    if seq_len is None:
        raise ValueError(f"a frontier has a point per length ({lengths}): pass seq_len= to choose the one to plan on")
    try:
        point = frontier.point(seq_len)
    except KeyError:
        raise ValueError(f"the frontier has no point at seq_len={seq_len:,}; its lengths: {lengths}") from None
    said = (
        f"planned on the frontier's point at seq_len {seq_len:,} (max batch {point.max_batch}, safe batch "
        f"{point.safe_batch})"
    )
    return point.result, said

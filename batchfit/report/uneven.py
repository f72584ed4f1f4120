"""Ranks that fit different batches: each rank's own answer (`RankBatch`) and one global batch split
unevenly over them (`UnevenSplit`, `split_uneven`).

With mixed cards, or a rank that shares its device, the ranks of one job fit different batches. An
even split runs every rank at the smallest rank's micro-batch; an uneven one gives each rank a
micro-batch in proportion to its own safe batch, so the same global batch needs fewer passes.

The gradient must stay the mean over all ``G`` samples of a step. DDP's all-reduce *averages* the
ranks' gradients, and each rank's loss is the mean over its own ``b_r`` samples, so with uneven
``b_r`` the plain average weighs a sample on a small rank more than one on a large rank. Scaling
rank ``r``'s loss by ``w_r = W x b_r / T`` (``W`` ranks, ``T = sum(b_r)`` samples per pass) gives
``(1/W) x sum_r w_r x mean_r = (1/T) x sum of every sample's gradient``: the mean over all of them.
With accumulation each pass's loss is divided by the passes as usual. Even splits get ``w_r = 1``.

Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from batchfit.report.boundary import Boundary
from batchfit.report.codec import Batch, Bytes, Count, JsonRecord, Range
from batchfit.units import check_positive_int

__all__ = ["TARGET_TOLERANCE", "RankBatch", "UnevenSplit", "split_uneven"]

#: How far an uneven split's global batch may be from the target to need fewer passes (a fraction
#: of the target): within 1%, a learning rate tuned for the target trains alike, where an exact
#: split may need many times the passes. The one place it is declared; the answer says the change.
TARGET_TOLERANCE = 0.01

#: How far a stored loss weight may be from ``W x b_r / T`` (a document's float rounding).
_WEIGHT_TOLERANCE = 1e-9


@dataclass(frozen=True)
class RankBatch(Boundary):
    """One rank's own answer, when the ranks of a probe had different budgets.

    Attributes:
        rank: the rank (``torch.distributed.get_rank()`` of the probe).
        max_batch: the largest batch this rank fitted on its own budget.
        safe_batch: the largest batch that ran under this rank's budget less the headroom.
        budget_bytes: this rank's budget (its limit, or what its device could reach).
        safe_verified: ``safe_batch`` ran with the verification's steps, every rank at its own safe
            batch at once (the uneven split itself); ``False``: the group's safe batch, the fallback.
        boundary_reached: a size failed on this rank right above ``max_batch``.
    """

    rank: Count
    budget_bytes: Bytes | None


@dataclass(frozen=True)
class UnevenSplit(JsonRecord):
    """One global batch split over ranks that fit different micro-batches.

    Attributes:
        micro_batches: each rank's micro-batch per pass, in rank order.
        accumulation: passes per optimizer step, the same on every rank (each pass is one
            all-reduce, so every rank must run as many).
        global_batch: ``sum(micro_batches) x accumulation``.
        loss_weights: what each rank multiplies its mean loss by, ``W x b_r / sum(b)`` (see the
            module docs): the all-reduced gradient is then the mean over every sample.
        safe_batches: the per-rank safe batches the split is proportional to.
        reason: how the split was chosen.
    """

    NOUN: ClassVar[str] = "uneven split"

    micro_batches: tuple[Batch, ...]
    accumulation: Batch
    global_batch: Batch
    loss_weights: tuple[Annotated[float, Range(0)], ...]
    safe_batches: tuple[Batch, ...]
    reason: str = ""

    def __post_init__(self) -> None:
        ranks = len(self.micro_batches)
        if not ranks or len(self.loss_weights) != ranks or len(self.safe_batches) != ranks:
            raise ValueError(
                f"micro_batches, loss_weights and safe_batches must have one entry per rank, got {ranks}, "
                f"{len(self.loss_weights)} and {len(self.safe_batches)}"
            )
        if self.global_batch != sum(self.micro_batches) * self.accumulation:
            raise ValueError(
                f"global_batch {self.global_batch} is not sum(micro_batches) {sum(self.micro_batches)} x "
                f"accumulation {self.accumulation}"
            )
        for rank, (weight, expected) in enumerate(zip(self.loss_weights, weights_of(self.micro_batches))):
            if not math.isclose(weight, expected, rel_tol=_WEIGHT_TOLERANCE):
                raise ValueError(f"loss_weights[{rank}] {weight} is not world_size x micro-batch / pass ({expected})")

    @property
    def world_size(self) -> int:
        return len(self.micro_batches)

    @property
    def pass_batch(self) -> int:
        """The samples of one pass over every rank, ``sum(micro_batches)``."""
        return sum(self.micro_batches)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each rank's slice of a pass's ``pass_batch`` samples starts."""
        starts = [0]
        for micro in self.micro_batches[:-1]:
            starts.append(starts[-1] + micro)
        return tuple(starts)

    def share(self, rank: int) -> tuple[slice, float, int, int, int]:
        """Rank ``rank``'s share: ``(part, weight, micro_batch, accumulation, pass_batch)``, its slice
        of each pass's ``pass_batch`` samples and the weight of its mean loss (see the module docs)."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
        if not 0 <= rank < self.world_size:
            last = self.world_size - 1
            raise ValueError(f"rank {rank} is not one of the split's {self.world_size} ranks (0 to {last})")
        start, micro = self.offsets[rank], self.micro_batches[rank]
        return slice(start, start + micro), self.loss_weights[rank], micro, self.accumulation, self.pass_batch

    def text(self) -> str:
        """``micro-batches 32 + 16 on ranks 0, 1 x 2 accumulation steps``."""
        ranks = ", ".join(str(r) for r in range(self.world_size))
        said = f"micro-batches {' + '.join(map(str, self.micro_batches))} on ranks {ranks}"
        return said + (f" x {self.accumulation} accumulation steps" if self.accumulation > 1 else "")

    def weights_text(self) -> str:
        """``rank 0 x1.333, rank 1 x0.667: each rank's mean loss x its weight ...``."""
        weights = ", ".join(f"rank {r} x{w:.4g}" for r, w in enumerate(self.loss_weights))
        per_pass = f" / {self.accumulation}" if self.accumulation > 1 else ""
        return (
            f"{weights}: loss = weight x the rank's mean loss{per_pass}, so the all-reduced gradient is the mean "
            f"over all {self.global_batch} samples (DDP averages the ranks' means)"
        )


def weights_of(micro_batches: Sequence[int]) -> tuple[float, ...]:
    """``W x b_r / sum(b)`` per rank: the loss weights of an uneven pass (see the module docs)."""
    total = sum(micro_batches)
    return tuple(len(micro_batches) * micro / total for micro in micro_batches)


def split_uneven(
    target: int, safe_batches: Sequence[int], *, tolerance: float = TARGET_TOLERANCE
) -> tuple[tuple[int, ...], int]:
    """``(micro_batches, accumulation)`` for a global batch of ``target`` samples over ranks whose
    safe batches are ``safe_batches``.

    The fewest passes (never fewer than hold ``target``, ``ceil(target / sum(safe_batches))``)
    whose global batch is within ``tolerance`` of ``target`` (default `TARGET_TOLERANCE`, 1%), and
    with them the global batch nearest ``target`` (exact where one is; more samples on a tie);
    each rank's micro-batch in proportion to its safe batch (never above it, at least 1; the
    remainders go to the ranks furthest below their share). A few samples more or fewer cost
    nothing a learning rate can tell, where an exact split may need far more passes: 3,000,009
    over safe batches (526, 263) is 3,000,567 in 3,803 passes, not (2, 1) x 1,000,003.
    ``tolerance=0`` asks for an exact split. Where no pass count comes within ``tolerance``, the
    fewest passes, nearest. Bounded time for any target, a prime one included: at most one try
    per samples-per-pass (``sum(safe_batches)``), and one in the usual case.

    Raises:
        TypeError: ``target`` or a safe batch is not an int.
        ValueError: ``target`` is not positive or is smaller than the number of ranks (every rank
            needs a sample per pass); a rank's safe batch is below 1 (it fits nothing); no ranks;
            ``tolerance`` not in ``[0, 1)``.
    """
    check_positive_int("target_batch", target)
    if not safe_batches:
        raise ValueError("an uneven split needs at least one rank's safe batch, got none")
    for rank, safe in enumerate(safe_batches):
        if isinstance(safe, bool) or not isinstance(safe, int):
            raise TypeError(f"the safe batch of rank {rank} must be an int, got {type(safe).__name__} {safe!r}")
        if safe < 1:
            raise ValueError(f"rank {rank} fits no sample (safe batch {safe}): an uneven split cannot use it")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction of the target in [0, 1), got {tolerance!r}")
    ranks, total = len(safe_batches), sum(safe_batches)
    if target < ranks:
        raise ValueError(
            f"target_batch {target} is smaller than the {ranks} ranks: every rank needs at least one sample per pass"
        )
    passes = _fewest_passes(target, ranks, total, math.floor(tolerance * target))
    return proportional(_nearest(target, passes, ranks, total), safe_batches), passes


def _fewest_passes(target: int, ranks: int, total: int, slack: int) -> int:
    """The fewest passes of ``ranks`` to ``total`` samples each whose product is within ``slack``
    of ``target``, never fewer than hold it; none: that fewest. Tried by samples per pass, each
    with its own fewest passes in closed form: those passes fall as the samples per pass grow, so
    the largest that comes within ``slack`` decides. The first try (``total``) decides unless a
    pass holds fewer than about ``1 / (2 x tolerance)`` samples (each pass rounds by at most half
    of the passes), so the loop is short exactly where it runs at all."""
    fewest = -(-target // total)
    if abs(_nearest(target, fewest, ranks, total) * fewest - target) <= slack:
        return fewest
    for per_pass in range(total, ranks - 1, -1):
        passes = max(fewest, -(-(target - slack) // per_pass))
        if per_pass * passes <= target + slack:
            return passes
    return fewest


def _nearest(target: int, passes: int, ranks: int, total: int) -> int:
    """The samples per pass, ``ranks`` to ``total``, whose ``passes`` come nearest ``target``
    (more samples on a tie). Integer arithmetic: exact for any target."""
    low, high = (min(total, max(ranks, bound)) for bound in (target // passes, -(-target // passes)))
    return high if abs(high * passes - target) <= abs(low * passes - target) else low


def proportional(per_pass: int, safe_batches: Sequence[int]) -> tuple[int, ...]:
    """``per_pass`` samples over the ranks in proportion to ``safe_batches``: each within
    ``[1, safe]``, the remainders to the ranks furthest below their share (the lower rank on a
    tie). Needs ``len(safe_batches) <= per_pass <= sum(safe_batches)``."""
    total = sum(safe_batches)
    shares = [per_pass * safe / total for safe in safe_batches]
    micro = [min(safe, max(1, math.floor(share))) for safe, share in zip(safe_batches, shares)]
    while sum(micro) < per_pass:
        room = [r for r in range(len(micro)) if micro[r] < safe_batches[r]]
        micro[max(room, key=lambda r: (shares[r] - micro[r], -r))] += 1
    while sum(micro) > per_pass:
        spare = [r for r in range(len(micro)) if micro[r] > 1]
        micro[min(spare, key=lambda r: (shares[r] - micro[r], r))] -= 1
    return tuple(micro)

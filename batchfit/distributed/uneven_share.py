"""An uneven split in the training loop: this rank's part of each pass, and its loss weight (`uneven_split`).

``Result.recommend(..., uneven=True)`` splits one global batch over ranks that fit different
micro-batches (`batchfit.report.uneven`, whose docs say why the weights keep the gradient the mean
over every sample). This is the two numbers a rank needs from it.
"""

from __future__ import annotations

from typing import NamedTuple

from batchfit.report import Recommendation, UnevenSplit

__all__ = ["UnevenShare", "uneven_split"]


class UnevenShare(NamedTuple):
    """One rank's share of an uneven split: five fields, the names of
    [`UnevenSplit.share`][batchfit.report.uneven.UnevenSplit.share]'s tuple (the split decides it;
    this only names its parts).

    Unpack all five, ``part, weight, micro_batch, steps, pass_batch = uneven_split(...)``, or read
    them by name (``uneven_split(...).weight``).

    Attributes:
        part: this rank's slice of one pass's ``pass_batch`` samples (the same samples, in the same
            order, on every rank: e.g. a loader of ``pass_batch`` seeded alike).
        weight: what this rank multiplies its mean loss by, ``world_size x micro-batch / pass_batch``.
        micro_batch: ``part``'s length.
        accumulation: passes per optimizer step (divide each pass's loss by it, as usual).
        pass_batch: the samples of one pass over every rank.
    """

    part: slice
    weight: float
    micro_batch: int
    accumulation: int
    pass_batch: int


def uneven_split(plan: Recommendation | UnevenSplit, rank: int | None = None) -> UnevenShare:
    """This rank's slice of each pass and its loss weight, from ``recommend(..., uneven=True)``.

    Example:
        ```python
        rec = result.recommend(target_batch=96, uneven=True)  # result: find(..., distributed=True)
        part, weight, _, steps, per_pass = batchfit.distributed.uneven_split(rec)
        for i, (x, y) in enumerate(loader):  # per_pass samples a batch, alike on every rank
            loss = weight * loss_fn(ddp(x[part]), y[part]) / steps
            loss.backward()  # DDP averages the ranks: the gradient is the mean over all of them
            if (i + 1) % steps == 0:
                optimizer.step()
                optimizer.zero_grad()
        ```

    Args:
        plan: a [`Recommendation`][batchfit.Recommendation] made with ``uneven=True``, or its
            ``uneven`` split.
        rank: the rank; default ``torch.distributed.get_rank()`` (0 without a process group).

    Raises:
        TypeError: ``plan`` is not one of those, or ``rank`` not an int.
        ValueError: a recommendation made without ``uneven=True``; ``rank`` outside the split's ranks.
    """
    split = plan.uneven if isinstance(plan, Recommendation) else plan
    if isinstance(plan, Recommendation) and split is None:
        raise ValueError("the recommendation has no uneven split: make it with result.recommend(..., uneven=True)")
    if not isinstance(split, UnevenSplit):
        raise TypeError(f"plan must be a Recommendation or an UnevenSplit, got {type(plan).__name__}")
    return UnevenShare(*split.share(_this_rank() if rank is None else rank))


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

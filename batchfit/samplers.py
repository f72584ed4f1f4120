"""Batch samplers for variable-length data: per-bucket batch sizes and a token budget, for `DataLoader`.

Both are ``torch.utils.data.Sampler[list[int]]``, passed as ``DataLoader(dataset,
batch_sampler=sampler)``, and share one contract:

* **Deterministic**: an epoch's batches are a function of the lengths, the settings, ``seed`` and
  the epoch (``set_epoch``), drawn from a ``torch.Generator`` seeded with ``seed + epoch``; the
  global RNG is neither read nor moved.
* **DDP-aware**: every rank computes the same global plan and takes its share, so every rank has
  exactly ``len(sampler)`` steps (a rank with one step more would hang the others' all-reduce).
  ``num_replicas``/``rank`` default to the process group's, else 1 and 0, as ``DistributedSampler``.
* **Resumable**: ``state_dict()`` is a plain JSON-able dict (the same on every rank);
  ``load_state_dict`` resumes mid-epoch where it stopped, the remaining batches identical to an
  uninterrupted run, and refuses by name a state saved under another seed, world size, kind,
  lengths or setting.
* ``steps()`` lists this rank's epoch as ``(rows, padded_length)`` per step: the shapes a soak
  replays.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from batchfit.sampler_state import (
    checked_bool,
    checked_ints,
    checked_state,
    longest,
    sampler_state,
    world,
)
from batchfit.units import as_int, positive_int


class _PlannedBatchSampler(Sampler[list[int]]):
    """What both samplers share: the epoch, this rank's plan, the resume point and the state."""

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        num_replicas: int | None,
        rank: int | None,
    ) -> None:
        self._lengths = checked_ints("lengths", lengths, 1)
        self._shuffle = checked_bool("shuffle", shuffle)
        self._seed = as_int("seed", seed)
        self._drop_last = checked_bool("drop_last", drop_last)
        self._num_replicas, self._rank = world(num_replicas, rank)
        self._epoch = 0
        self._steps = 0  # batches handed out this epoch (the resume point once loaded)
        self._resume_from = 0  # where the next __iter__ starts
        self._cached: tuple[int, list[list[int]]] | None = None

    # What each sampler says ------------------------------------------------------------------
    def _global_plan(self, generator: torch.Generator) -> list[list[list[int]]]:
        """The epoch's steps, each a list of ``num_replicas`` batches (rank ``r`` takes the r-th)."""
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        """The settings a resume must share (JSON values: lists, not tuples)."""
        raise NotImplementedError

    def _padded_length(self, batch: list[int]) -> int:
        """The length memory sees for ``batch``: its longest row when padded."""
        return max(self._lengths[i] for i in batch)

    # The shared contract ---------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch whose batches ``__iter__`` yields (``set_epoch``)."""
        return self._epoch

    @property
    def seed(self) -> int:
        """The seed each epoch's generator adds the epoch to."""
        return self._seed

    @property
    def num_replicas(self) -> int:
        """The world size the plan is split over."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """This rank: which share of each step ``__iter__`` yields."""
        return self._rank

    def set_epoch(self, epoch: int) -> None:
        """Draw the next ``__iter__`` from ``epoch`` (call it before each epoch, on every rank).

        The same epoch again keeps a resume point from ``load_state_dict``, so the usual loop
        (``for epoch in range(start, n): sampler.set_epoch(epoch); ...``) resumes mid-epoch.
        """
        epoch = positive_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._steps, self._resume_from = epoch, 0, 0

    def _plan(self) -> list[list[int]]:
        """This rank's batches for the current epoch (computed once per epoch)."""
        if self._cached is None or self._cached[0] != self._epoch:
            generator = torch.Generator().manual_seed(self._seed + self._epoch)
            mine = [step[self._rank] for step in self._global_plan(generator)]
            self._cached = (self._epoch, mine)
        return self._cached[1]

    def __len__(self) -> int:
        """This rank's steps in the whole current epoch (the same on every rank), a resumed one's included."""
        return len(self._plan())

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches, from the resume point when ``load_state_dict`` set one."""
        plan = self._plan()
        start, self._resume_from = self._resume_from, 0
        self._steps = start
        for batch in plan[start:]:
            self._steps += 1
            yield list(batch)

    def steps(self) -> list[tuple[int, int]]:
        """This rank's current epoch as the shape memory sees per step, in order: ``(rows,
        padded_length)``; a packed batch (``padded=False``) is one row of its summed tokens, as a
        flattening collator hands it to the model."""
        return [self._shape(batch) for batch in self._plan()]

    def _shape(self, batch: list[int]) -> tuple[int, int]:
        return len(batch), self._padded_length(batch)

    def state_dict(self, steps: int | None = None) -> dict[str, Any]:
        """The resumable state: a plain JSON-able dict, the same on every rank.

        ``steps``: the batches consumed this epoch, when not the sampler's count of batches handed
        out (a ``DataLoader`` with workers fetches ``prefetch_factor * num_workers`` ahead, so pass
        your loop's step count there).
        """
        count = self._steps if steps is None else positive_int("steps", steps, 0)
        if count > len(self):
            raise ValueError(f"steps must be <= this epoch's {len(self)} steps, got {count}")
        return sampler_state(
            type(self).__name__, self._seed, self._epoch, self._num_replicas, count, self._lengths, self._config()
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` stopped: its epoch, the next ``__iter__`` from its step.

        A state saved with another kind, seed, world size, lengths or setting is refused with a
        `ValueError` naming what differs, and nothing here changes.
        """
        here = sampler_state(
            type(self).__name__, self._seed, self._epoch, self._num_replicas, 0, self._lengths, self._config()
        )
        epoch, steps = checked_state(state, here)
        previous = self._epoch
        self._epoch = epoch
        total = len(self)
        if steps > total:
            self._epoch = previous
            raise ValueError(f"cannot resume: saved at step {steps} of epoch {epoch}, which has {total} steps here")
        self._steps = self._resume_from = steps


class BucketBatchSampler(_PlannedBatchSampler):
    """Batches drawn from length buckets, each bucket with its own batch size.

    Per epoch each bucket's indices are shuffled and chunked into global batches of
    ``batch_size * num_replicas``, each split into one batch per rank (rank ``r`` takes the r-th
    slice), and the global batches' order is shuffled: at every step all ranks draw from the same
    bucket, so they pad to the same bound. A bucket's last, incomplete global batch is dropped
    with ``drop_last`` (a bucket smaller than one global batch then yields nothing); otherwise it
    is filled, by repeating that bucket's own (shuffled) indices from its start as
    ``DistributedSampler`` pads, only up to the next multiple of ``num_replicas``: every rank gets
    the same number of rows, possibly fewer than the bucket's batch size but never none. Without
    DDP nothing is repeated and every index appears exactly once per epoch. ``shuffle=False``:
    buckets in ascending order, indices in order.

    Args:
        lengths: one int > 0 per item (a list, tuple, 1-d integer tensor or array).
        boundaries: ascending bucket upper bounds (inclusive); an item goes to the first bucket
            whose bound holds its length, and the last must hold the longest.
        batch_sizes: one batch size >= 1 per bucket, per rank.
        shuffle: shuffle within buckets and the order of the batches.
        seed: the seed every epoch's generator adds the epoch to (the same on every rank).
        drop_last: drop each bucket's incomplete last global batch instead of filling it.
        num_replicas: the world size (default: the process group's, else 1).
        rank: this rank (default: the process group's, else 0).
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        boundaries: Sequence[int],
        batch_sizes: Sequence[int],
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(lengths, shuffle=shuffle, seed=seed, drop_last=drop_last, num_replicas=num_replicas, rank=rank)
        bounds = checked_ints("boundaries", boundaries, 1)
        for i in range(1, len(bounds)):
            if bounds[i] <= bounds[i - 1]:
                raise ValueError(
                    f"boundaries must be strictly ascending, got {bounds[i - 1]} then {bounds[i]} at boundaries[{i}]"
                )
        sizes = checked_ints("batch_sizes", batch_sizes, 1)
        if len(sizes) != len(bounds):
            raise ValueError(f"batch_sizes must have one size per bucket ({len(bounds)}), got {len(sizes)}")
        index, length = longest(self._lengths)
        if length > bounds[-1]:
            raise ValueError(
                f"boundaries do not cover the longest item: lengths[{index}] = {length} is above "
                f"the last bound {bounds[-1]}"
            )
        self._boundaries, self._batch_sizes = bounds, sizes
        members: list[list[int]] = [[] for _ in bounds]
        bucket_of = torch.bucketize(torch.tensor(self._lengths), torch.tensor(bounds), right=False).tolist()
        for item, bucket in enumerate(bucket_of):
            members[bucket].append(item)
        self._members = tuple(tuple(m) for m in members)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The buckets' inclusive upper bounds, ascending."""
        return self._boundaries

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Each bucket's batch size per rank."""
        return self._batch_sizes

    def _config(self) -> dict[str, Any]:
        return {
            "boundaries": list(self._boundaries),
            "batch_sizes": list(self._batch_sizes),
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
        }

    def _global_plan(self, generator: torch.Generator) -> list[list[list[int]]]:
        replicas = self._num_replicas
        steps: list[list[list[int]]] = []
        for members, size in zip(self._members, self._batch_sizes):
            if not members:
                continue
            order = list(members)
            if self._shuffle:
                order = [members[i] for i in torch.randperm(len(members), generator=generator).tolist()]
            width = size * replicas
            for start in range(0, len(order), width):
                chunk = order[start : start + width]
                if len(chunk) < width:
                    if self._drop_last:
                        break
                    fill = -len(chunk) % replicas
                    chunk += (order * (fill // len(order) + 1))[:fill]
                rows = len(chunk) // replicas
                steps.append([chunk[r * rows : (r + 1) * rows] for r in range(replicas)])
        if self._shuffle:
            steps = [steps[i] for i in torch.randperm(len(steps), generator=generator).tolist()]
        return steps


class TokenBudgetBatchSampler(_PlannedBatchSampler):
    """Batches filled up to a token budget: as many rows as fit, whatever their lengths.

    With ``padded=True`` a batch holds ``rows * longest_row <= max_tokens`` (the collate pads to
    the batch's longest, so that is what memory sees); with ``padded=False`` it holds
    ``sum(lengths) <= max_tokens`` (rows packed end to end, as transformers'
    ``DataCollatorWithFlattening`` does). Per epoch the indices are shuffled, sorted by length
    within windows of ``sort_window`` items (so a batch holds similar lengths and pads little; a
    batch never spans two windows), filled greedily, and the batches' order shuffled. Under DDP the
    batches are dealt round-robin to the ranks; when their count does not divide by
    ``num_replicas``, batches from the start are repeated to fill the last step, or with
    ``drop_last`` the remainder is dropped, so every rank has exactly ``len(self)`` steps. Without
    DDP every index appears exactly once per epoch.

    Args:
        lengths: one int > 0 per item (a list, tuple, 1-d integer tensor or array).
        max_tokens: the budget per batch; the longest row alone must fit it.
        padded: budget rows times the longest row (True) or the sum of the rows (False, packed).
        shuffle: shuffle the rows before sorting within windows, and the batches' order.
        seed: the seed every epoch's generator adds the epoch to (the same on every rank).
        drop_last: drop the batches that would leave the ranks uneven instead of repeating some.
        num_replicas: the world size (default: the process group's, else 1).
        rank: this rank (default: the process group's, else 0).
        sort_window: rows sorted together (default: 100 x ``max_tokens // mean length``, at most all).
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        max_tokens: int,
        *,
        padded: bool = True,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        sort_window: int | None = None,
    ) -> None:
        super().__init__(lengths, shuffle=shuffle, seed=seed, drop_last=drop_last, num_replicas=num_replicas, rank=rank)
        self._max_tokens = positive_int("max_tokens", max_tokens, 1)
        self._padded = checked_bool("padded", padded)
        self._sort_window_arg = None if sort_window is None else positive_int("sort_window", sort_window, 1)
        index, length = longest(self._lengths)
        if length > self._max_tokens:
            raise ValueError(
                f"max_tokens={self._max_tokens} is smaller than the longest row: lengths[{index}] = {length}"
            )
        count = len(self._lengths)
        mean = -(-sum(self._lengths) // count)
        self._window = min(count, self._sort_window_arg or 100 * max(1, self._max_tokens // mean))
        self._by_length = torch.tensor(self._lengths, dtype=torch.int64)

    @property
    def max_tokens(self) -> int:
        """The token budget every batch holds."""
        return self._max_tokens

    @property
    def padded(self) -> bool:
        """Whether the budget counts padded rows (True) or packed tokens (False)."""
        return self._padded

    @property
    def sort_window(self) -> int:
        """The rows sorted by length together (the default resolved)."""
        return self._window

    def _config(self) -> dict[str, Any]:
        return {
            "max_tokens": self._max_tokens,
            "padded": self._padded,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "sort_window": self._sort_window_arg,
        }

    def _padded_length(self, batch: list[int]) -> int:
        if self._padded:
            return super()._padded_length(batch)
        return sum(self._lengths[i] for i in batch)

    def _shape(self, batch: list[int]) -> tuple[int, int]:
        return (len(batch), self._padded_length(batch)) if self._padded else (1, self._padded_length(batch))

    def _batches(self, generator: torch.Generator) -> list[list[int]]:
        """Every batch of the epoch, greedily filled in window-sorted order."""
        count = len(self._lengths)
        order = torch.randperm(count, generator=generator) if self._shuffle else torch.arange(count)
        window = torch.arange(count) // self._window
        key = window * (int(self._by_length.max()) + 1) + self._by_length[order]
        order = order[torch.sort(key, stable=True).indices]
        batches: list[list[int]] = []
        batch: list[int] = []
        longest_row = tokens = 0
        budget, padded = self._max_tokens, self._padded
        for position, (item, length) in enumerate(zip(order.tolist(), self._by_length[order].tolist())):
            new_window = position % self._window == 0
            fits = (len(batch) + 1) * max(longest_row, length) <= budget if padded else tokens + length <= budget
            if batch and (new_window or not fits):
                batches.append(batch)
                batch, longest_row, tokens = [], 0, 0
            batch.append(item)
            longest_row, tokens = max(longest_row, length), tokens + length
        batches.append(batch)
        return batches

    def _global_plan(self, generator: torch.Generator) -> list[list[list[int]]]:
        batches = self._batches(generator)
        if self._shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        replicas = self._num_replicas
        extra = -len(batches) % replicas
        if extra and self._drop_last:
            batches = batches[: len(batches) - len(batches) % replicas]
        elif extra:
            batches = batches + (batches * (extra // len(batches) + 1))[:extra]
        return [batches[start : start + replicas] for start in range(0, len(batches), replicas)]

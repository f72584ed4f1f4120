"""This process alone: `Solo`, the interface every set of ranks implements, and what a rank
can say at a meeting. `Group` implements it for every rank of a
``torch.distributed`` job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from batchfit.distributed.buckets import Buckets
from batchfit.report import Trial

#: The phases of a step as a message names them.
PHASES = {"batch": "building the batch", "step": "the optimizer step"}

#: What a rank says at a meeting, worst last: the maximum over ranks is what every rank does.
OK, OUT_OF_MEMORY, INTERRUPTED, FAILED = 0, 1, 2, 3


class PeerOutOfMemory(Exception):
    """Another rank ran out of memory in the phase that just ended: the trial failed everywhere."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        self.message = message
        super().__init__(f"rank {rank} ran out of memory: {message}")


class Solo:
    """This process alone: every meeting is a no-op. The interface `Group` implements.

    ``world_size``: the ranks this one process speaks for (a driver of a job per trial, an estimate
    of a sharded job's rank 0); alone, 1. `Group` sets its own."""

    rank = 0
    #: The stand-ins for a DDP model's gradient buckets (`held`), for the probe's lifetime.
    _buckets: Buckets | None = None

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size

    @property
    def is_leader(self) -> bool:
        """Whether this process speaks for the group (prints, writes files): rank 0."""
        return self.rank == 0

    def join(self, settings: dict[str, Any]) -> None:
        """Meet the other ranks before the probe starts, with the settings that must agree (once:
        a second call is a no-op, so the result cache can meet them before the probe does)."""

    @contextlib.contextmanager
    def meet(self, phase: str, batch_size: int | None = None) -> Iterator[None]:
        """Run the code inside, then meet: raise what another rank's failure asks of this one."""
        yield

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return flag

    def smallest(self, value: int | None) -> int | None:
        """The smallest ``value`` over the ranks that know one (``None``: none does)."""
        return value

    def gather(self, value: Any, where: str = "gathering every rank's value") -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order; ``where`` names the meeting in errors."""
        return [value]

    def combine(self, trial: Trial) -> Trial:
        """One trial as the whole group ran it."""
        return trial

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a picklable object), so that a decision one rank takes
        (the result cache's hit or miss: ``batchfit.probe.cache``) is every rank's. Alone: ``value``."""
        return value

    def held(self, model: nn.Module) -> list[torch.Tensor]:
        """Every tensor ``model`` holds before a step, for a meter that counts what it is told exists:
        its parameters and buffers, and for a DDP model on the CPU one stand-in per gradient bucket
        (``batchfit.distributed.buckets``: the buckets themselves are out of Python's reach)."""
        self._buckets = Buckets()
        return [*model.parameters(), *model.buffers(), *self._buckets.held(model)]

    @contextlib.contextmanager
    def deferred_sync(self, model: nn.Module) -> Iterator[None]:
        """Run the steps inside without the data group's collectives in backward (alone: as they are)."""
        try:
            yield
        finally:
            if self._buckets is not None:
                self._buckets.settle()

    def sync_gradients(self, model: nn.Module, phase: str = "step", batch_size: int | None = None) -> None:
        """The gradient all-reduce `deferred_sync` held back; ``phase`` and ``batch_size`` name
        the meeting it holds before it (see `Group.sync_gradients`)."""

    def notes(self, model: nn.Module) -> list[str]:
        """What a reader of the result should know about probing ``model`` on these ranks."""
        return []

    def close(self, settled: bool = False) -> None:
        """Leave the group (no meeting), and stop counting DDP's buckets. ``settled``: every rank ended
        the probe normally, so the ranks meet once more before the group goes (`Group.close`)."""
        if self._buckets is not None:
            self._buckets.drop()

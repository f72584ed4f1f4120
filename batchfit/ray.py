"""Ray Train: inside ``train_func``, the per-worker batch and accumulation for a global batch.

Under Ray Train's ``TorchTrainer`` every worker is a rank of a ``torch.distributed`` job that Ray
set up (gloo on the CPU, NCCL on GPUs) before ``train_func`` runs, and
``ray.train.torch.prepare_model`` wraps the model in ``DistributedDataParallel``. That is the job
[`batchfit.find`][batchfit.find] already probes as under ``torchrun``: every worker calls it, the workers meet
after every phase of every step over a side gloo group, one worker's out-of-memory fails the
trial on all of them, and every worker gets the same answer (``batchfit.distributed.ranks``).
Nothing of Ray is needed for that; [`find`][batchfit.find] works as is inside ``train_func``.

What Ray adds is the question a ``train_func`` really asks: the run's global batch comes from
``train_loop_config`` (the learning rate was tuned for it), the number of workers from the
``ScalingConfig``, and each worker needs its micro-batch and gradient-accumulation steps.
[`worker_batch`][batchfit.ray.worker_batch] probes, splits the global batch over
``ray.train.get_context()``'s world size
([`batchfit.Result.recommend`][batchfit.report.result.Result.recommend] with ``world_size``: exactly
where a split allows, otherwise as near as one does, saying by how much) and returns a
[`WorkerBatch`][batchfit.ray.WorkerBatch], whose [`metrics`][batchfit.ray.WorkerBatch.metrics] go to
``ray.train.report``. Without a global batch it is the batch to train with that
[`recommend`][batchfit.report.result.Result.recommend] names (the throughput knee, the noise scale
when measured, or the safe batch).

An elastic run (``ScalingConfig(num_workers=(min, max))``) restarts ``train_func`` with another
number of workers: with ``cache=`` on storage every worker reaches, the restart finds the answer
of the first probe (the cache's key leaves the world size out: a worker's sizes hold on the same
device kind), runs no trial, and the same ``global_batch`` is split over the new workers.

A non-OOM error in one worker's model fails every worker (the others raise
[`RankFailedError`][batchfit.errors.RankFailedError] naming it), so ``trainer.fit()`` fails with it rather
than hang; batchfit's errors survive the pickling Ray sends them through.

Import-safe: this module imports neither ray nor torch at import time; [`worker_batch`][batchfit.ray.worker_batch]
raises an ``ImportError`` naming ``pip install 'batchfit[ray]'`` when Ray Train is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchfit.api import find
from batchfit.probe.options import find_options
from batchfit.report import Recommendation, Result
from batchfit.units import check_positive_int

if TYPE_CHECKING:
    from torch import nn
    from typing_extensions import Unpack

    from batchfit.probe.keywords import FindKeywords

__all__ = ["INSTALL_HINT", "WorkerBatch", "worker_batch"]

INSTALL_HINT = "pip install 'batchfit[ray]'"


@dataclass(frozen=True)
class WorkerBatch:
    """What one Ray Train worker trains with: ``micro_batch`` x ``accumulation_steps`` on each of
    ``world_size`` workers, and the probe it comes from. Every worker holds the same record.

    A record of its own rather than a bare [`Recommendation`][batchfit.Recommendation]: the world
    size belongs to the Ray run (an elastic run restarts with another), not to the probe, and a
    log wants the split in one line and its numbers flat. Its numbers are the recommendation's,
    read through under the names a training loop uses.

    Attributes:
        result: the probe's answer ([`batchfit.find`][batchfit.find]); batch sizes per worker.
        recommendation: the batch to train with for these workers
            ([`batchfit.Result.recommend`][batchfit.report.result.Result.recommend] with
            ``world_size``), its caveats included.
    """

    result: Result
    recommendation: Recommendation

    @property
    def world_size(self) -> int:
        """The workers of the run (``ray.train.get_context().get_world_size()``)."""
        return self.recommendation.world_size

    @property
    def micro_batch(self) -> int:
        """The batch each worker runs per forward/backward."""
        return self.recommendation.batch_size

    @property
    def accumulation_steps(self) -> int:
        """Forward/backward passes per optimizer step."""
        return self.recommendation.accumulation

    @property
    def global_batch(self) -> int:
        """``micro_batch * accumulation_steps * world_size``: the samples per optimizer step the
        run really trains with."""
        return self.recommendation.global_batch

    @property
    def target_batch(self) -> int | None:
        """The global batch asked for; ``None`` when none was."""
        return self.recommendation.target

    @property
    def exact(self) -> bool:
        """``global_batch == target_batch`` (``True`` without a target: nothing was asked)."""
        return self.recommendation.exact

    @property
    def remainder(self) -> int:
        """``target_batch - global_batch`` (0 when exact): stated, never dropped silently."""
        return -(self.recommendation.target_changed_by or 0)

    @property
    def reason(self) -> str:
        """Why this split, in one sentence (the recommendation's reason)."""
        return self.recommendation.reason

    def summary(self) -> str:
        """One line for a log: the split, how it compares with what was asked, and the probe."""
        steps = f"{self.accumulation_steps} accumulation step{'s' * (self.accumulation_steps != 1)}"
        workers = f"{self.world_size} worker{'s' * (self.world_size != 1)}"
        line = f"micro-batch {self.micro_batch} x {steps} x {workers} = global batch {self.global_batch}"
        if self.target_batch is None:
            line += f" (no global batch asked: decided by {self.recommendation.decided_by})"
        elif self.exact:
            line += " (as asked)"
        else:
            fewer = "fewer" if self.remainder > 0 else "more"
            line += f" ({abs(self.remainder)} {fewer} than the {self.target_batch} asked)"
        verified = "" if self.result.safe_verified else ", not verified"
        return f"{line}; probe: max batch {self.result.max_batch}, safe batch {self.result.safe_batch}{verified}"

    def __str__(self) -> str:
        return self.summary()

    def metrics(self) -> dict[str, int]:
        """A flat dict of numbers for ``ray.train.report`` (and any metrics logger): the split,
        the target, and the probe's bounds, each under ``batchfit/``."""
        found = {
            "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps,
            "global_batch": self.global_batch,
            "world_size": self.world_size,
            "max_batch": self.result.max_batch,
            "safe_batch": self.result.safe_batch,
            "exact": int(self.exact),
            "remainder": self.remainder,
        }
        if self.target_batch is not None:
            found["target_batch"] = self.target_batch
        return {f"batchfit/{name}": value for name, value in found.items()}


def worker_batch(
    model: nn.Module,
    sample: Any = None,
    *,
    global_batch: int | None = None,
    **find_keywords: Unpack[FindKeywords],
) -> WorkerBatch:
    """Probe inside a Ray Train ``train_func`` and return this worker's batch for ``global_batch``.

    Call it on every worker, after ``ray.train.torch.prepare_model(model)`` and before the
    training loop, with the same arguments (the workers probe together, as under ``torchrun``):

    ```python
    fit = batchfit.ray.worker_batch(model, sample, global_batch=config["global_batch"])
    ray.train.report(fit.metrics())
    ```

    Args:
        model: the model as it trains (DDP-wrapped by ``prepare_model``: the probe defers DDP's
            gradient all-reduce until every worker's backward worked, so none waits in it).
        sample: one batch, as [`batchfit.find`][batchfit.find] takes it.
        global_batch: the samples per optimizer step over every worker and accumulation step (what
            the learning rate was tuned for). Split into micro-batch x accumulation steps within the
            safe batch ([`batchfit.Result.recommend`][batchfit.report.result.Result.recommend]):
            exactly where a split allows, else the nearest global batch, ``remainder`` and the
            reason saying by how much. ``None``: the batch to train with that the recommendation
            names (the knee, the noise scale when measured, or the safe batch), no target.
        **find_keywords: [`batchfit.find`][batchfit.find]'s keywords, with the same names and meanings
            ([`FindOptions`][batchfit.probe.keywords.FindOptions] and the hooks).

    Raises:
        ImportError: Ray Train is not installed.
        RuntimeError: not called inside a Ray Train training function (use
            [`batchfit.find`][batchfit.find] and
            [`batchfit.Result.recommend`][batchfit.report.result.Result.recommend] there), or
            several workers without the torch process group that ``TorchTrainer`` sets up (the
            workers could not agree).
        TypeError, ValueError: a bad argument, named (before any probe).
        Exception: whatever [`batchfit.find`][batchfit.find] raises (an error of any worker's model, on
            every worker).
    """
    if global_batch is not None:
        check_positive_int("global_batch", global_batch)
    find_options("worker_batch", find_keywords)  # a typo fails before Ray is asked
    world_size = _world_size()
    if world_size > 1 and find_keywords.get("distributed") is not False:
        _check_process_group(world_size)
    result = find(model, sample, **find_keywords)
    return WorkerBatch(result, result.recommend(target_batch=global_batch, world_size=world_size))


def _world_size() -> int:
    """The number of workers of the Ray Train run this function runs in."""
    try:
        import ray.train
    except ImportError as exc:
        raise ImportError(f"batchfit.ray needs Ray Train: {INSTALL_HINT}") from exc
    try:
        context = ray.train.get_context()
    except RuntimeError as exc:
        raise RuntimeError(
            "batchfit.ray.worker_batch runs inside a Ray Train training function; outside one, use "
            "batchfit.find() and result.recommend(target_batch=..., world_size=...) "
            "(see docs/how-to/many-nodes.md#ray-train)"
        ) from exc
    return int(context.get_world_size())


def _check_process_group(world_size: int) -> None:
    """Several workers agree on one answer only over the torch process group ``TorchTrainer`` sets
    up; without it each would probe alone and could train with a different batch."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"batchfit.ray.worker_batch on {world_size} workers needs the torch process group TorchTrainer sets "
            "up, and none is initialised: run it in TorchTrainer's train_func, or pass distributed=False "
            "(see docs/how-to/many-nodes.md#ray-train)"
        )

"""What `find(eval=True)` measured of the evaluation step, beside the training answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from batchfit.report.codec import Batch, NotAbove
from batchfit.report.memory import MemoryModel
from batchfit.report.records import Trial
from batchfit.report.throughput import Throughput


@dataclass(frozen=True)
class Evaluation:
    """The evaluation step's answer (`mode="eval"`): sized with the training state live (weights and
    optimizer state: evaluation runs mid-training, in what training leaves free), the model in
    ``eval()``, forward and loss (or ``eval_step``) under ``torch.no_grad``, the output kept for the metrics.

    Attributes:
        max_batch: the largest evaluation batch that ran.
        safe_batch: the evaluation batch with the headroom left free, verified like training's.
        best_throughput_batch: the fastest evaluation batch timed.
        safe_verified: the safe batch's verification ran and fitted.
        boundary_reached: a size failed right above ``max_batch``.
        throughput: the evaluation's speed (its knee: ``throughput.knee_batch``), ``None`` untimed.
        memory: the evaluation step's memory equation.
        trials: every evaluation trial, in order.
    """

    max_batch: Batch
    safe_batch: Annotated[Batch, NotAbove("max_batch")]
    best_throughput_batch: Batch
    safe_verified: bool
    boundary_reached: bool
    throughput: Throughput | None = None
    memory: MemoryModel | None = None
    trials: tuple[Trial, ...] = field(default=())

"""What `find(eval=True)` measured of the evaluation step, beside the training answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar, Protocol

from batchfit.report.boundary import Boundary, Bounded
from batchfit.report.codec import Batch, JsonRecord
from batchfit.report.memory import MemoryModel
from batchfit.report.records import Trial
from batchfit.report.throughput import Throughput


class Probed(Bounded, Protocol):
    """What `Evaluation.of` reads of a probe's answer (a `Result`, which imports this module)."""

    @property
    def best_throughput_batch(self) -> int: ...
    @property
    def throughput(self) -> Throughput | None: ...
    @property
    def memory(self) -> MemoryModel | None: ...
    @property
    def trials(self) -> tuple[Trial, ...]: ...


@dataclass(frozen=True)
class Evaluation(Boundary, JsonRecord):
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

    NOUN: ClassVar[str] = "evaluation"

    best_throughput_batch: Batch
    throughput: Throughput | None = None
    memory: MemoryModel | None = None
    trials: tuple[Trial, ...] = field(default=())

    @classmethod
    def of(cls, result: Probed) -> Evaluation:  # type: ignore[override]  # a probe's whole answer, not a boundary
        """The evaluation answer of a ``mode="eval"`` probe's ``result``."""
        return cls(
            **asdict(Boundary.of(result)),
            best_throughput_batch=result.best_throughput_batch,
            throughput=result.throughput,
            memory=result.memory,
            trials=result.trials,
        )

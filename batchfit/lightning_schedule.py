"""PyTorch Lightning: ``Trainer(callbacks=[BatchScheduler()])`` grows the batch as the noise scale does.

The callback runs a [`BatchSchedule`][batchfit.probe.batch_schedule.BatchSchedule] inside Lightning's
own gradient accumulation: the micro-batch stays the dataloader's, and ``trainer.accumulate_grad_batches``
follows the schedule. Where it hooks in (Lightning 2.6):

* ``setup``/``on_fit_start``: the settings are checked against the trainer (automatic optimization, an
  optimizer whose learning-rate rule is known, a second batch size to compare), before any step;
* ``on_train_start`` (after the strategy has wrapped the model in DDP, built the optimizer and
  scheduler, and restored a checkpoint, callbacks included): the schedule is built on
  ``trainer.strategy.model`` (DDP-wrapped where the run is, so the meter uses its communication hook),
  a saved state is loaded, and ``trainer.accumulate_grad_batches`` is set to its accumulation;
* ``on_train_batch_start`` of the first micro-batch of a step (Lightning zeroes the gradients inside
  that batch's closure, before its backward): ``begin_step``;
* ``on_train_batch_end`` of the batch whose optimizer step ran (``trainer.global_step`` moved; the LR
  scheduler has stepped too): ``end_step``, and a change is set on the trainer for the next batch.

Lightning steps when ``batch_progress.current.ready % accumulate_grad_batches == 0`` (the batches of
this epoch) and on an epoch's last batch, and divides each micro-batch's loss by the same attribute.
A new accumulation is therefore only decided at a step boundary the new value keeps (the next batch
of the epoch a multiple of it, or a new epoch); elsewhere the decision waits a step, so the trainer's
steps, the schedule's steps and the losses' divisor always agree. An epoch's short last step counts
the samples it trained, and its norms (in other units) are not a window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from batchfit.api_schedule import DEFAULT_GROWTH, schedule, schedule_rule
from batchfit.lightning_trainer import INSTALL_HINT
from batchfit.probe.batch_schedule import BatchSchedule
from batchfit.report.schedule import ScheduleChange, ScheduleState
from batchfit.report.schedule_rule import ScheduleRule
from batchfit.units import positive_int

try:
    from lightning.pytorch import Callback as _Callback

    _MISSING: ImportError | None = None
except ImportError as _error:  # the class below still exists; constructing it says what to install
    _Callback = object  # type: ignore[assignment,misc]
    _MISSING = _error

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BatchScheduler"]

#: The micro-batch the settings are checked with before the train loader's is read (any passes).
_UNREAD_MICRO_BATCH = 2


class BatchScheduler(_Callback):  # type: ignore[misc,valid-type]
    """Grow the global batch during ``fit`` by Lightning's gradient accumulation (see the module docs).

    The arguments are [`batchfit.schedule`][batchfit.schedule]'s:

    Args:
        micro_batch: rows per micro-batch on each rank (default: the train dataloader's ``batch_size``).
        accumulation: micro-batches per step at the start (default: ``trainer.accumulate_grad_batches``).
        max_accumulation: the most micro-batches per step (default ``16 x accumulation``).
        policy: ``"noise"`` (measured), or a baseline: ``"constant"``, ``"ramp"``, ``"seesaw"``.
        lr_rule: ``"sqrt"``, ``"linear"`` or ``"none"`` (default: by the optimizer's family).
        every: meter every this many optimizer steps.
        min_steps: at least this many steps between two changes.
        settle: metered steps at a batch before the noise scale may change it.
        decay: the noise scale's moving-average weight on the past, per metered step.
        fraction: the share of the measured noise scale the doubled batch may reach.
        meter: ``"micro-batches"`` or ``"layernorm"`` (each example's LayerNorm gradients).
        thresholds: samples at which ``"ramp"`` and ``"seesaw"`` double the batch.

    Raises:
        ImportError: Lightning is not installed.
        TypeError, ValueError: an argument is invalid (here), or does not fit the trainer (at fit start).
    """

    def __init__(
        self,
        micro_batch: int | None = None,
        accumulation: int | None = None,
        max_accumulation: int | None = None,
        policy: str = "noise",
        lr_rule: str | None = None,
        every: int = 10,
        min_steps: int = 50,
        settle: int = 3,
        decay: float = 0.9,
        fraction: float = 0.5,
        meter: str = "micro-batches",
        thresholds: Sequence[int] = (),
    ) -> None:
        if _MISSING is not None:
            raise ImportError(
                f"batchfit.lightning.BatchScheduler needs PyTorch Lightning (the 'lightning' package): {INSTALL_HINT}"
            ) from _MISSING
        super().__init__()
        if isinstance(thresholds, (str, bytes)) or not isinstance(thresholds, Sequence):
            raise TypeError(f"thresholds must be a sequence of sample counts, got {type(thresholds).__name__}")
        self.micro_batch = None if micro_batch is None else positive_int("micro_batch", micro_batch)
        self.accumulation = None if accumulation is None else positive_int("accumulation", accumulation)
        self.max_accumulation = None if max_accumulation is None else positive_int("max_accumulation", max_accumulation)
        self.settings: dict[str, Any] = {
            "policy": policy,
            "lr_rule": lr_rule,
            "every": every,
            "min_steps": min_steps,
            "settle": settle,
            "decay": decay,
            "fraction": fraction,
            "meter": meter,
            "thresholds": tuple(positive_int("thresholds", t) for t in thresholds),
        }
        # The rule's own checks, on what is known now (the ranks, the trainer's accumulation and the loader's
        # micro-batch are not: stand-ins that pass, checked for real when training starts).
        start = self.accumulation or 1
        most = self.max_accumulation or start * DEFAULT_GROWTH
        ScheduleRule(
            micro_batch=self.micro_batch or _UNREAD_MICRO_BATCH,
            accumulation=start,
            max_accumulation=most,
            world_size=2,
            **{**self.settings, "lr_rule": "none" if lr_rule is None else lr_rule},
        )
        self._schedule: BatchSchedule | None = None
        self._loaded: dict[str, Any] | None = None  # a checkpoint's schedule, until the schedule is built
        self._micro_batches = 0  # micro-batches of the step under way (0: none under way)
        self._steps_before = 0  # trainer.global_step when it began

    # what the run shows ------------------------------------------------------------------------
    @property
    def schedule(self) -> BatchSchedule | None:
        """The run's [`BatchSchedule`][batchfit.probe.batch_schedule.BatchSchedule], once training has started."""
        return self._schedule

    @property
    def changes(self) -> tuple[ScheduleChange, ...]:
        """Every change of the batch so far (empty before training)."""
        return () if self._schedule is None else self._schedule.changes

    def megatron(self, seq_length: int | None = None) -> str:
        """The realised schedule as Megatron-LM's ``--step-batch-size-schedule`` (tokens with ``seq_length``)."""
        return self._state().megatron(seq_length)

    def olmo_core(self, seq_length: int | None = None) -> dict[str, list[int]]:
        """The realised schedule as OLMo-core's ``BatchSizeSchedulerCallback`` takes it."""
        return self._state().olmo_core(seq_length)

    # checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The schedule's state (JSON values) for Lightning's checkpoint."""
        if self._schedule is not None:
            return {"schedule": self._schedule.state_dict()}
        return {} if self._loaded is None else {"schedule": self._loaded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's schedule; it is checked and loaded when training starts."""
        self._loaded = state_dict.get("schedule")

    # Lightning hooks ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        """Refuse, before any work, a run the schedule cannot steer."""
        if stage == "fit":
            _check_trainer(trainer, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the settings against the trainer's optimizer, accumulation and ranks (a checkpoint's
        ranks too, where the strategy has restored it already), before the sanity check or any step."""
        micro = self.micro_batch or _UNREAD_MICRO_BATCH  # the loader's is read when training starts
        schedule_rule(trainer.strategy.model, _optimizer(trainer), **self._arguments(trainer, micro))
        if self._loaded is not None:
            ScheduleState.from_dict(self._loaded).check_resumable(trainer.world_size)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the schedule on the strategy's model, load a saved state, set the trainer's accumulation."""
        self._close()
        built = schedule(
            trainer.strategy.model,
            _optimizer(trainer),
            **self._arguments(trainer, self._micro_batch(trainer)),
            scaler=getattr(trainer.precision_plugin, "scaler", None),
        )
        if self._loaded is not None:
            try:
                built.load_state_dict(self._loaded)
            except BaseException:
                built.close()
                raise
        self._schedule, self._loaded, self._micro_batches = built, None, 0
        trainer.accumulate_grad_batches = built.accumulation

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Begin a step at its first micro-batch."""
        schedule = self._running()
        if self._micro_batches == 0:
            if trainer.accumulate_grad_batches != schedule.accumulation:
                raise RuntimeError(
                    f"trainer.accumulate_grad_batches was set to {trainer.accumulate_grad_batches} during the run, and "
                    f"the batch schedule trains {schedule.accumulation}: let BatchScheduler alone set it"
                )
            self._steps_before = trainer.global_step
            schedule.begin_step()
        self._micro_batches += 1

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the batch whose optimizer step ran: count the step, apply a change, log."""
        if self._micro_batches == 0 or trainer.global_step == self._steps_before:
            return  # accumulating
        epoch_loop = trainer.fit_loop.epoch_loop
        last = batch_idx + 1 >= trainer.num_training_batches or epoch_loop.batch_progress.is_last_batch
        next_batch = 0 if last else batch_idx + 1  # Lightning counts the step boundaries per epoch
        micro_batches, self._micro_batches = self._micro_batches, 0
        change = _end_step(self._running(), micro_batches, next_batch)
        schedule = self._running()
        metrics = {
            "batchfit/global_batch": float(schedule.global_batch),
            "batchfit/accumulation": float(schedule.accumulation),
        }
        if schedule.state.b_simple is not None:
            metrics["batchfit/noise_scale"] = schedule.state.b_simple
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        if change is not None:
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            trainer.accumulate_grad_batches = change.accumulation
            rank_zero_info(
                f"BatchScheduler: step {change.step}: global batch {change.global_batch} (accumulation "
                f"{change.accumulation}), learning rate x{change.lr_factor:.3g} of the start: {change.reason}"
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stop metering (the schedule stays readable)."""
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Stop metering when the run fails."""
        self._close()

    # the work ----------------------------------------------------------------------------------
    def _arguments(self, trainer: pl.Trainer, micro_batch: int) -> dict[str, Any]:
        """`batchfit.schedule`'s keywords for this trainer, less the model, the optimizer and the scaler."""
        accumulation = self.accumulation if self.accumulation is not None else trainer.accumulate_grad_batches
        configs = trainer.lr_scheduler_configs
        return {
            "lr_scheduler": configs[0].scheduler if configs else None,
            "micro_batch": micro_batch,
            "accumulation": accumulation,
            "max_accumulation": self.max_accumulation,
            "world_size": trainer.world_size,
            **self.settings,
        }

    def _micro_batch(self, trainer: pl.Trainer) -> int:
        """``micro_batch``, or the train dataloader's batch size; ``ValueError`` when they differ or none is read."""
        loader = trainer.train_dataloader
        size = getattr(loader, "batch_size", None)
        if isinstance(size, bool) or not isinstance(size, int):
            size = None
        if self.micro_batch is None:
            if size is None:
                raise ValueError(
                    "BatchScheduler reads the micro-batch from the train dataloader's batch_size, and "
                    f"{type(loader).__name__} has none: pass micro_batch="
                )
            return size
        if size is not None and size != self.micro_batch:
            raise ValueError(
                f"BatchScheduler(micro_batch={self.micro_batch}) but the train dataloader's batch_size is {size}: "
                "every sample count of the schedule would be wrong; pass the loader's batch size"
            )
        return self.micro_batch

    def _running(self) -> BatchSchedule:
        if self._schedule is None:
            raise RuntimeError("BatchScheduler: no schedule: training has not started")
        return self._schedule

    def _state(self) -> ScheduleState:
        if self._schedule is None:
            raise RuntimeError("BatchScheduler: no schedule to export yet: call it after trainer.fit()")
        return self._schedule.state

    def _close(self) -> None:
        if self._schedule is not None:
            self._schedule.close()
        self._micro_batches = 0


def _end_step(schedule: BatchSchedule, micro_batches: int, next_batch: int) -> ScheduleChange | None:
    """``schedule.end_step()`` for a step of ``micro_batches`` (Lightning's short last step of an epoch
    has fewer: its samples are counted, its norms dropped), holding any change that would put the next
    step's boundary (``next_batch`` of the epoch) off Lightning's: the rule changes by doubling."""
    aligned = next_batch % (2 * schedule.accumulation) == 0
    return schedule.end_step(micro_batches, hold=not aligned)


def _optimizer(trainer: pl.Trainer) -> Any:
    """The optimizer whose learning rate follows the batch: the trainer's (automatic optimization has one)."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    optimizers = list(trainer.optimizers)
    if not optimizers or isinstance(optimizers[0], _MockOptimizer):
        raise ValueError("BatchScheduler needs the optimizer configure_optimizers() returns, and there is none")
    return optimizers[0]


def _check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """``ValueError`` for a run whose accumulation the callback cannot steer."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    if not pl_module.automatic_optimization:
        raise ValueError(
            "BatchScheduler steers Lightning's gradient accumulation, which manual optimization "
            "(automatic_optimization = False) does not use: use batchfit.schedule() in training_step"
        )
    if trainer.strategy.handles_gradient_accumulation:
        raise ValueError(
            f"the {type(trainer.strategy).__name__} accumulates gradients itself: BatchScheduler cannot change it"
        )
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise ValueError("BatchScheduler sets the accumulation: remove the GradientAccumulationScheduler callback")

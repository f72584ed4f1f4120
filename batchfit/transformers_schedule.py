"""A Hugging Face ``Trainer`` whose batch grows as training goes: `BatchSchedulerCallback`.

``Trainer(..., callbacks=[BatchSchedulerCallback()])`` trains under a
[`BatchSchedule`][batchfit.probe.batch_schedule.BatchSchedule] built by
[`batchfit.schedule`][batchfit.schedule] from the trainer's own model, optimizer, LR scheduler and
batch: the micro-batch stays ``per_device_train_batch_size``, the accumulation
(``gradient_accumulation_steps``) follows the schedule, the learning rate moves with it.

**How a change reaches the Trainer** (transformers 5.x, ``Trainer._run_epoch``). The loop reads
``args.gradient_accumulation_steps`` afresh for every optimizer step (the micro-batches it fetches)
and for every micro-batch (``(step + 1) % gradient_accumulation_steps == 0`` ends the step,
``step % gradient_accumulation_steps == 0`` fires ``on_step_begin``), with ``step`` counting
micro-batches from the start of the epoch; the loss is divided per step (by the step's
``num_items_in_batch``, or by ``len(batch_samples)``), and Accelerate's own accumulation stays 1. So
the callback sets ``args.gradient_accumulation_steps`` at the step boundary (``on_step_end``) and at
each epoch's start. A change made where the epoch's micro-batch count is not a multiple of the new
accumulation would misplace the next optimizer step under that modulus, so the value set there is an
``int`` whose ``%`` counts from where the accumulation took effect (`_Accumulation`; it pickles as a
plain ``int``). Every step's micro-batches are counted (``on_substep_end``, ``on_step_end``) and a
step that did not take what the schedule set is an error, never a silent drift; only an epoch's last
step may be shorter (the Trainer's own remainder): its norms are not metered.

**Resuming**: the schedule's state is saved in every checkpoint (``TrainerState.stateful_callbacks``,
as an ``ExportableState``) and restored by ``resume_from_checkpoint``, with or without
``restore_callback_states_from_checkpoint`` (with it, transformers replaces the callback by a new
instance: find it with `BatchSchedulerCallback.of`). A saved schedule from another world size or
micro-batch is a ``ValueError``. The Trainer counts the epochs and the data to skip on resuming as if
every step had taken the accumulation it started with; the schedule itself resumes exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from batchfit.api_schedule import DEFAULT_GROWTH, schedule
from batchfit.probe.batch_schedule import BatchSchedule
from batchfit.report.schedule import ScheduleChange, ScheduleState
from batchfit.report.schedule_rule import ScheduleRule
from batchfit.transformers_trainer import INSTALL_HINT
from batchfit.units import positive_int

try:
    from transformers import TrainerCallback as _Callback
    from transformers.trainer_callback import ExportableState as _Exportable

    _MISSING: ImportError | None = None
except ImportError as _error:  # the class below still exists; constructing it says what to install

    class _Callback:  # type: ignore[no-redef]
        """Stands in for transformers' ``TrainerCallback`` where transformers is not installed."""

    class _Exportable:  # type: ignore[no-redef]
        """Stands in for transformers' ``ExportableState`` where transformers is not installed."""

    _MISSING = _error

__all__ = ["BatchSchedulerCallback"]

LOGGER = logging.getLogger("batchfit.schedule")
#: The settings the callback hands to `batchfit.schedule` and its rule as they were given.
_RULE_SETTINGS = ("policy", "lr_rule", "every", "min_steps", "settle", "decay", "fraction", "meter", "thresholds")


class _Accumulation(int):
    """``gradient_accumulation_steps`` whose ``%`` counts micro-batches from ``offset``: the Trainer's
    ``(step + 1) % accumulation`` then ends each step after ``accumulation`` micro-batches counted
    from where this accumulation took effect, not from the epoch's start."""

    offset: int

    def __new__(cls, value: int, offset: int) -> _Accumulation:
        made = super().__new__(cls, value)
        made.offset = offset
        return made

    def __rmod__(self, other: Any) -> Any:
        if isinstance(other, int) and not isinstance(other, bool):
            return (other - self.offset) % int(self)
        return NotImplemented

    def __reduce__(self) -> tuple[Any, ...]:
        return (int, (int(self),))  # a checkpoint's training_args.bin holds a plain int


def _accumulation_at(accumulation: int, epoch_micro_batches: int) -> int:
    """The ``gradient_accumulation_steps`` that makes the Trainer take ``accumulation`` micro-batches per
    step from ``epoch_micro_batches`` on: a plain int where the count is a multiple of it."""
    offset = epoch_micro_batches % accumulation
    return accumulation if offset == 0 else _Accumulation(accumulation, offset)


class BatchSchedulerCallback(_Callback, _Exportable):  # type: ignore[misc]
    """A ``TrainerCallback`` that grows the Trainer's batch by a batch schedule (see the module docs).

    Args:
        micro_batch: rows per micro-batch (default and only accepted value: the Trainer's
            ``per_device_train_batch_size``; the schedule never changes it).
        accumulation: micro-batches per step at the start (default ``gradient_accumulation_steps``;
            not below it: the Trainer sized its epochs with it).
        max_accumulation: the most micro-batches per step (default 16 x ``accumulation``).
        policy: ``"noise"`` (the measured noise scale), or ``"constant"``, ``"ramp"``, ``"seesaw"``.
        lr_rule: ``"sqrt"``, ``"linear"`` or ``"none"`` (default: by the optimizer's family).
        every: meter every this many optimizer steps.
        min_steps: at least this many steps between two changes.
        settle: metered steps at a batch before the noise scale may change it.
        decay: the noise scale's moving-average weight on the past, per metered step.
        fraction: the share of the measured noise scale the doubled batch may reach.
        meter: ``"micro-batches"`` or ``"layernorm"`` (each example's LayerNorm gradients).
        thresholds: samples (all ranks) at which ``"ramp"`` and ``"seesaw"`` double the batch.
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
            raise ImportError(f"BatchSchedulerCallback needs Hugging Face transformers: {INSTALL_HINT}") from _MISSING
        if isinstance(thresholds, (str, bytes)) or not isinstance(thresholds, Sequence):
            raise TypeError(f"thresholds must be a sequence of sample counts, got {type(thresholds).__name__}")
        self.settings: dict[str, Any] = {
            "micro_batch": _optional("micro_batch", micro_batch),
            "accumulation": _optional("accumulation", accumulation),
            "max_accumulation": _optional("max_accumulation", max_accumulation),
            "policy": policy,
            "lr_rule": lr_rule,
            "every": every,
            "min_steps": min_steps,
            "settle": settle,
            "decay": decay,
            "fraction": fraction,
            "meter": meter,
            "thresholds": [positive_int("thresholds", t) for t in thresholds],
        }
        start = self.settings["accumulation"] or 2
        # Everything but what the Trainer's arguments decide is checked now, by the rule itself (stand-ins
        # that pass for the micro-batch and the ranks: the Trainer's are checked in on_init_end).
        self._rule(micro_batch=2, accumulation=start, world_size=2, lr_rule=lr_rule or "none")
        self.schedule: BatchSchedule | None = None
        #: A checkpoint's schedule, where transformers restores the callback's attributes itself.
        self.saved: dict[str, Any] | None = None
        self._started_with: int | None = None
        self._epoch_length: int | None = None
        self._resumed_at = 0
        self._epoch_micro = 0
        self._micro = 0

    # The results ---------------------------------------------------------------------------------
    @classmethod
    def of(cls, trainer: Any) -> BatchSchedulerCallback:
        """The trainer's live callback of this class (after a resume that restored callback states,
        transformers' new instance, not the one given to the ``Trainer``)."""
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, cls):
                return callback
        raise ValueError(f"the trainer has no {cls.__name__} among its callbacks")

    @property
    def schedule_state(self) -> ScheduleState:
        """Where the run's schedule stands: steps, samples, accumulation, every change and metered point."""
        if self.schedule is None:
            raise RuntimeError("the batch schedule starts with trainer.train(): there is no schedule yet")
        return self.schedule.state

    @property
    def changes(self) -> tuple[ScheduleChange, ...]:
        """Every change of the batch so far, in order."""
        return self.schedule_state.changes

    def megatron(self, seq_length: int | None = None) -> str:
        """The realised schedule as Megatron-LM's ``--step-batch-size-schedule`` (tokens with ``seq_length``)."""
        return self.schedule_state.megatron(seq_length)

    def olmo_core(self, seq_length: int | None = None) -> dict[str, list[int]]:
        """The realised schedule as OLMo-core's ``BatchSizeSchedulerCallback`` takes it (tokens with ``seq_length``)."""
        return self.schedule_state.olmo_core(seq_length)

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves (``ExportableState``): the settings and the schedule's state, JSON."""
        return {
            "args": dict(self.settings),
            "attributes": {"saved": None if self.schedule is None else self.schedule.state_dict()},
        }

    # The Trainer's events ------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The settings checked against the Trainer's arguments while it is built, before any training."""
        self._rule(**self._from_args(args), lr_rule=self.settings["lr_rule"] or "none")

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        """Build the schedule (the optimizer exists now), resume a checkpoint's, and set its accumulation."""
        found = self._from_args(args)
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
        built = schedule(
            model,
            inner,
            **found,
            max_accumulation=self.settings["max_accumulation"],
            **self._rule_settings(),
            lr_scheduler=lr_scheduler,
            scaler=getattr(optimizer, "scaler", None),
        )
        try:
            saved = self._resumed(built, state)
        except BaseException:
            built.close()
            raise
        if self.schedule is not None:
            self.schedule.close()
        self.schedule, self.saved = built, None
        self._epoch_length = len(train_dataloader) if hasattr(train_dataloader, "__len__") else None
        self._resumed_at = self._skipped(args, state) if state.global_step > 0 else 0
        self._started_with = int(args.gradient_accumulation_steps)
        args.gradient_accumulation_steps = built.accumulation
        if saved is not None:
            LOGGER.info(
                "resumed the batch schedule at step %d: global batch %d (accumulation %d)",
                built.state.step,
                built.global_batch,
                built.accumulation,
            )

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer counts an epoch's micro-batches from 0 (or from where a resumed epoch goes on)."""
        self._epoch_micro, self._resumed_at = self._resumed_at, 0
        args.gradient_accumulation_steps = _accumulation_at(self._live().accumulation, self._epoch_micro)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before the step's first micro-batch: metered when the rule asks."""
        self._live().begin_step()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After each micro-batch but the step's last."""
        self._micro += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the optimizer step: counted, and a change applies from the next step on (logged)."""
        live = self._live()
        done, self._micro = self._micro + 1, 0  # the step's last micro-batch has no on_substep_end
        self._epoch_micro += done
        expected = live.accumulation
        if done != expected and not (done < expected and self._epoch_ended()):
            if done > expected or self._epoch_length is not None:
                raise RuntimeError(
                    f"optimizer step {state.global_step} took {done} micro-batches where the batch schedule set "
                    f"gradient_accumulation_steps={expected}: this transformers version's training loop does not read "
                    "it as batchfit expects (transformers 5.x's Trainer._run_epoch); please report it"
                )
            LOGGER.warning(  # a dataset without a length may just have ended
                "optimizer step %d took %d micro-batches where the batch schedule set %d (the end of the dataset?)",
                state.global_step,
                done,
                expected,
            )
        change = live.end_step(min(done, expected))  # an epoch's short last step: its rows counted, no window
        if change is not None:
            args.gradient_accumulation_steps = _accumulation_at(change.accumulation, self._epoch_micro)
            state.log_history.append(_record(change, state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The meter's hooks removed, and ``gradient_accumulation_steps`` put back to the user's."""
        if self.schedule is not None:
            self.schedule.close()
        if self._started_with is not None:
            args.gradient_accumulation_steps = self._started_with

    # Helpers -------------------------------------------------------------------------------------
    def _live(self) -> BatchSchedule:
        if self.schedule is None:
            raise RuntimeError(f"{type(self).__name__} got a step before on_train_begin: add it before trainer.train()")
        return self.schedule

    def _epoch_ended(self) -> bool:
        """Whether the Trainer has run every micro-batch of the epoch (its last step may be short)."""
        return self._epoch_length is not None and self._epoch_micro >= self._epoch_length

    def _rule(self, *, micro_batch: int, accumulation: int, world_size: int, lr_rule: str) -> ScheduleRule:
        """The rule these settings give (``ValueError`` naming what is wrong); the optimizer's LR rule aside."""
        most = self.settings["max_accumulation"]
        return ScheduleRule(
            micro_batch=micro_batch,
            accumulation=accumulation,
            max_accumulation=accumulation * DEFAULT_GROWTH if most is None else most,
            world_size=world_size,
            **{**self._rule_settings(), "lr_rule": lr_rule, "thresholds": tuple(self.settings["thresholds"])},
        )

    def _rule_settings(self) -> dict[str, Any]:
        """The settings passed on unchanged to the rule (the sizes come from the Trainer's arguments)."""
        return {name: self.settings[name] for name in _RULE_SETTINGS}

    def _from_args(self, args: Any) -> dict[str, int]:
        """The micro-batch, starting accumulation and world size the Trainer's arguments give, checked."""
        if getattr(args, "deepspeed", None):
            raise ValueError(
                "BatchSchedulerCallback does not support DeepSpeed, whose config holds its own accumulation"
            )
        micro, steps = int(args.train_batch_size), int(args.gradient_accumulation_steps)
        asked_micro, asked_steps = self.settings["micro_batch"], self.settings["accumulation"]
        if asked_micro is not None and asked_micro != micro:
            raise ValueError(
                f"micro_batch={asked_micro}, but the Trainer trains micro-batches of {micro}: the schedule keeps the "
                "micro-batch, so set per_device_train_batch_size to it (or leave micro_batch out)"
            )
        if asked_steps is not None and asked_steps < steps:
            raise ValueError(
                f"accumulation={asked_steps} is below the Trainer's gradient_accumulation_steps={steps}, with which it "
                "counted its epochs: set gradient_accumulation_steps to it (or leave accumulation out)"
            )
        return {"micro_batch": micro, "accumulation": asked_steps or steps, "world_size": int(args.world_size)}

    def _resumed(self, built: BatchSchedule, state: Any) -> dict[str, Any] | None:
        """``built`` checked for this run and, when ``train()`` resumes a checkpoint, loaded with its
        schedule (returned): ``ValueError`` on another world size or micro-batch."""
        if built.meter is not None and built.rule.world_size > 1 and not built.meter.reduces and built.accumulation < 2:
            raise ValueError(
                "policy='noise' under data-parallel training with gradient_accumulation_steps=1: a TrainerCallback "
                "receives the model without its DDP wrapper, so the meter compares each rank's micro-batches (their "
                "windows averaged over the ranks), and one micro-batch per step gives no second batch size; set "
                "gradient_accumulation_steps >= 2, or use batchfit.schedule() with the DDP model"
            )
        saved = self._saved(state)
        if saved is not None:
            built.load_state_dict(saved)
            if built.state.step != state.global_step:
                LOGGER.warning(
                    "the saved batch schedule is at step %d, the checkpoint at %d: the schedule counts from its own",
                    built.state.step,
                    state.global_step,
                )
        return saved

    def _saved(self, state: Any) -> dict[str, Any] | None:
        """The checkpoint's schedule when ``train()`` resumes one (``None`` for a fresh run)."""
        if state.global_step == 0:
            return None
        if self.saved is not None:
            return self.saved
        entry = (state.stateful_callbacks or {}).get(type(self).__name__)
        entry = entry[0] if isinstance(entry, list) and entry else entry
        saved = entry.get("attributes", {}).get("saved") if isinstance(entry, dict) else None
        if saved is None:
            LOGGER.warning(
                "resuming at step %d from a checkpoint without a batch schedule: the schedule starts afresh here",
                state.global_step,
            )
        return saved

    def _skipped(self, args: Any, state: Any) -> int:
        """Micro-batches of the resumed epoch the Trainer skips, counted as it does (``_init_training_state``:
        with the ``gradient_accumulation_steps`` it starts with)."""
        if args.ignore_data_skip or self._epoch_length is None:
            return 0
        steps = int(args.gradient_accumulation_steps)
        per_epoch = max(self._epoch_length // steps + int(self._epoch_length % steps > 0), 1)
        return (state.global_step % per_epoch) * steps


def _optional(name: str, value: Any) -> int | None:
    """``None``, or ``value`` checked as a positive int (`positive_int`, naming ``name``)."""
    return None if value is None else positive_int(name, value)


def _record(change: ScheduleChange, step: int) -> dict[str, Any]:
    """A change as the Trainer's ``log_history`` keeps it."""
    record: dict[str, Any] = {
        "batchfit/accumulation": change.accumulation,
        "batchfit/global_batch": change.global_batch,
        "batchfit/lr_factor": change.lr_factor,
        "batchfit/reason": change.reason,
        "step": step,
    }
    if change.noise_scale is not None:
        record["batchfit/noise_scale"] = change.noise_scale
    return record

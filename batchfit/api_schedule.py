"""`schedule`: a batch that grows during training as the measured gradient noise scale does.

The entry point checks what it is given, in one place, before anything of the user's is touched,
and builds a [`BatchSchedule`][batchfit.probe.batch_schedule.BatchSchedule] under a
[`ScheduleRule`][batchfit.report.schedule.ScheduleRule]. The integrations (``batchfit.lightning``'s
``BatchSchedule`` callback, ``batchfit.transformers``' ``ScheduleCallback``) build theirs here too.

A plain loop::

    schedule = batchfit.schedule(model, optimizer, micro_batch=result, accumulation=2)
    batches = iter(loader)
    while schedule.state.samples < budget:
        with schedule.step():
            for batch in schedule.micro_batches(batches):
                (model(**batch)["loss"] / schedule.accumulation).backward()
            optimizer.step()
            optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchfit.probe.batch_schedule import BatchSchedule
from batchfit.report import Result
from batchfit.report.schedule_rule import LINEAR_OPTIMIZERS, SQRT_OPTIMIZERS, ScheduleRule, lr_rule_for
from batchfit.units import positive_int

__all__ = ["DEFAULT_GROWTH", "schedule", "schedule_rule"]

#: Without ``max_accumulation``, the batch may grow to this many times where it starts (4 doublings).
DEFAULT_GROWTH = 16


def schedule(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    micro_batch: int | Result,
    accumulation: int = 2,
    max_accumulation: int | None = None,
    world_size: int | None = None,
    policy: str = "noise",
    lr_rule: str | None = None,
    every: int = 10,
    min_steps: int = 50,
    settle: int = 3,
    decay: float = 0.9,
    fraction: float = 0.5,
    meter: str = "micro-batches",
    thresholds: Sequence[int] = (),
    lr_scheduler: Any = None,
    scaler: Any = None,
) -> BatchSchedule:
    """A batch schedule for a training run: the micro-batch stays, the accumulation grows.

    Args:
        model: the module trained (DDP-wrapped where the run is data-parallel).
        optimizer: whose learning rate follows the batch by ``lr_rule``.
        micro_batch: rows per micro-batch on each rank, or a ``find`` result (its safe batch).
        accumulation: micro-batches per optimizer step at the start.
        max_accumulation: the most micro-batches per step (default ``16 x accumulation``).
        world_size: data-parallel ranks (default: ``torch.distributed``'s, else 1).
        policy: ``"noise"`` (measured), or a baseline: ``"constant"``, ``"ramp"``, ``"seesaw"``.
        lr_rule: ``"sqrt"``, ``"linear"`` or ``"none"`` (default: by the optimizer's family).
        every: meter every this many optimizer steps.
        min_steps: at least this many steps between two changes.
        settle: metered steps at a batch before the noise scale may change it.
        decay: the noise scale's moving-average weight on the past, per metered step.
        fraction: the share of the measured noise scale the doubled batch may reach.
        meter: ``"micro-batches"`` (their norms and their sum's) or ``"layernorm"`` (each example's
            LayerNorm gradients: no accumulation or DDP needed).
        thresholds: samples at which ``"ramp"`` and ``"seesaw"`` double the batch.
        lr_scheduler: the LR scheduler stepping ``optimizer`` (its base rates are scaled too).
        scaler: an fp16 run's ``GradScaler``.
    """
    return BatchSchedule(
        model,
        optimizer,
        schedule_rule(
            model,
            optimizer,
            micro_batch=micro_batch,
            accumulation=accumulation,
            max_accumulation=max_accumulation,
            world_size=world_size,
            policy=policy,
            lr_rule=lr_rule,
            every=every,
            min_steps=min_steps,
            settle=settle,
            decay=decay,
            fraction=fraction,
            meter=meter,
            thresholds=thresholds,
            lr_scheduler=lr_scheduler,
        ),
        lr_scheduler=lr_scheduler,
        scaler=scaler,
    )


def schedule_rule(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    micro_batch: int | Result,
    accumulation: int = 2,
    max_accumulation: int | None = None,
    world_size: int | None = None,
    policy: str = "noise",
    lr_rule: str | None = None,
    every: int = 10,
    min_steps: int = 50,
    settle: int = 3,
    decay: float = 0.9,
    fraction: float = 0.5,
    meter: str = "micro-batches",
    thresholds: Sequence[int] = (),
    lr_scheduler: Any = None,
) -> ScheduleRule:
    """The rule `schedule` trains under, every argument checked (its arguments, less the scaler)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(micro_batch, Result):
        micro = micro_batch.safe_batch
    else:
        micro = positive_int("micro_batch", micro_batch)
    start = positive_int("accumulation", accumulation)
    most = start * DEFAULT_GROWTH if max_accumulation is None else positive_int("max_accumulation", max_accumulation)
    ranks = _world_size() if world_size is None else positive_int("world_size", world_size)
    rule_name = lr_rule_for(_family(optimizer), lr_rule)
    if lr_scheduler is None and rule_name != "none" and any("initial_lr" in g for g in optimizer.param_groups):
        raise ValueError(
            "the optimizer has an LR scheduler (its parameter groups carry 'initial_lr'), which would overwrite the "
            "learning rate the schedule scales: pass it as lr_scheduler=, or lr_rule='none'"
        )
    if isinstance(thresholds, (str, bytes)) or not isinstance(thresholds, Sequence):
        raise TypeError(f"thresholds must be a sequence of sample counts, got {type(thresholds).__name__}")
    return ScheduleRule(
        micro_batch=micro,
        accumulation=start,
        max_accumulation=most,
        world_size=ranks,
        policy=policy,  # type: ignore[arg-type]
        lr_rule=rule_name,
        every=positive_int("every", every),
        min_steps=positive_int("min_steps", min_steps),
        settle=positive_int("settle", settle),
        decay=_number(decay),
        fraction=_number(fraction),
        meter=meter,  # type: ignore[arg-type]
        thresholds=tuple(positive_int("thresholds", t) for t in thresholds),
    )


def _family(optimizer: torch.optim.Optimizer) -> str:
    """The name of the first class in the optimizer's lineage whose learning-rate rule is known (a subclass
    of ``AdamW`` is Adam-like), else its own class name."""
    known = SQRT_OPTIMIZERS | LINEAR_OPTIMIZERS
    return next((c.__name__ for c in type(optimizer).__mro__ if c.__name__ in known), type(optimizer).__name__)


def _number(value: Any) -> Any:
    """An int given for a float setting as a float (the rule refuses anything else by name)."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

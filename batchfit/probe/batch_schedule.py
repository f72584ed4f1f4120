"""The batch schedule applied to a training run: `BatchSchedule`.

The rule and its state are pure (``batchfit.report.schedule``); this is where they meet torch: it
meters the steps the rule asks for (``batchfit.probe.noise_meter``), tells the loop how many
micro-batches the next step takes, and on a change multiplies the learning rate of every parameter
group (and the base rates of the LR scheduler, which would otherwise overwrite it) by the rule's
factor. Every change is logged (logger ``batchfit.schedule``) with its reason. Under DDP every rank
decides from the same all-reduced window, and the ranks check after each metered step that they
hold the same accumulation (one all-reduce of two numbers), so a divergence is an error, never a
silent hang.

What it does not change: the micro-batch, the loss, the gradients, the optimizer's state. Resuming:
``state_dict()``/``load_state_dict()`` carry the state; the optimizer's and the scheduler's own state
dicts carry the rates already scaled, so nothing is applied again on load.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchfit.probe.layernorm_meter import LayerNormMeter
from batchfit.probe.noise_meter import NoiseMeter
from batchfit.report.schedule import ScheduleChange, ScheduleState
from batchfit.report.schedule_rule import ScheduleRule

__all__ = ["BatchSchedule"]

LOGGER = logging.getLogger("batchfit.schedule")


class BatchSchedule:
    """The batch a run trains with, step by step (see the module docs).

    Args:
        model: the module trained (DDP-wrapped where the run is data-parallel).
        optimizer: whose learning rate follows the batch.
        rule: how the batch may change.
        lr_scheduler: the LR scheduler stepping ``optimizer``, whose base rates are scaled too.
        scaler: the ``GradScaler`` of an fp16 run, whose scale is taken out of the norms.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rule: ScheduleRule,
        *,
        lr_scheduler: Any = None,
        scaler: Any = None,
    ) -> None:
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.state = ScheduleState.start(rule)
        self._drawn = 0  # micro-batches `micro_batches` handed out for the step under way
        self.meter: NoiseMeter | LayerNormMeter | None = None
        if rule.policy == "noise":
            meter = LayerNormMeter if rule.meter == "layernorm" else NoiseMeter
            self.meter = meter(model, rule.micro_batch)

    @property
    def rule(self) -> ScheduleRule:
        """The rule the run trains under."""
        return self.state.rule

    @property
    def accumulation(self) -> int:
        """Micro-batches the next optimizer step takes (divide each micro-batch's loss by it)."""
        return self.state.accumulation

    @property
    def global_batch(self) -> int:
        """Samples the next optimizer step takes, on all ranks."""
        return self.state.global_batch

    @property
    def changes(self) -> tuple[ScheduleChange, ...]:
        """Every change so far, in order."""
        return self.state.changes

    def begin_step(self) -> None:
        """Call before the first micro-batch of an optimizer step: meters it when the rule asks."""
        self._drawn = 0
        if self.meter is not None and self.state.meters():
            scale = float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else 1.0
            self.meter.start(scale)

    def end_step(self, micro_batches: int | None = None, *, hold: bool = False) -> ScheduleChange | None:
        """Call after the optimizer step: the step is counted, and a change (returned) applies from the
        next step on. ``micro_batches``: what the step took when fewer than `accumulation` (its
        norms are dropped); ``hold``: no change after this step (see `ScheduleState.after_step`)."""
        if micro_batches is None and 0 < self._drawn < self.accumulation:
            micro_batches = self._drawn  # `micro_batches` ran out of data: a short step
        self._drawn = 0
        metered = self.meter is not None and self.meter.active
        window = None
        if metered and self.meter is not None:
            taken = self.accumulation if micro_batches is None else micro_batches
            window = self.meter.stop(taken) if taken == self.accumulation else self.meter.stop_without_window()
        before = self.state
        self.state = before.after_step(window, micro_batches=micro_batches, hold=hold)
        if metered and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._check_ranks_agree()
        if len(self.state.changes) == len(before.changes):
            return None
        change = self.state.changes[-1]
        self._scale_learning_rate(change.lr_factor / before.lr_factor)
        LOGGER.info(
            "step %d: global batch %d -> %d (accumulation %d -> %d), learning rate x%.3g: %s",
            change.step,
            before.global_batch,
            change.global_batch,
            before.accumulation,
            change.accumulation,
            change.lr_factor / before.lr_factor,
            change.reason,
        )
        return change

    @contextlib.contextmanager
    def step(self) -> Iterator[BatchSchedule]:
        """``with schedule.step(): ...`` around one optimizer step's micro-batches and its optimizer step."""
        try:
            self.begin_step()  # inside: Ctrl-C right after the hooks are registered still removes them
            yield self
        except BaseException:
            if self.meter is not None:
                self.meter.stop_without_window()
            raise
        self.end_step()

    def micro_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The next step's micro-batches drawn from ``batches`` (fewer when it runs out: the step is counted
        short, its rows only)."""
        for _ in range(self.accumulation):
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._drawn += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state for a checkpoint (JSON values)."""
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict`. ``ValueError`` when it ran on another world size or micro-batch, or
        its accumulation is above this rule's most; other settings follow this run's rule (logged)."""
        saved = ScheduleState.from_dict(state)
        saved.check_resumable(self.rule.world_size, self.rule.micro_batch)
        if saved.accumulation > self.rule.max_accumulation:
            raise ValueError(
                f"the saved batch schedule reached accumulation {saved.accumulation}, above this run's "
                f"max_accumulation {self.rule.max_accumulation}: raise it to resume"
            )
        changed = [f.name for f in fields(ScheduleRule) if getattr(saved.rule, f.name) != getattr(self.rule, f.name)]
        if changed:
            LOGGER.info("resumed batch schedule: %s follow this run's settings", ", ".join(changed))
        self.state = replace(saved, rule=self.rule)

    def close(self) -> None:
        """Stop metering (a DDP model keeps the measuring all-reduce, which reduces as the default does)."""
        if self.meter is not None:
            self.meter.stop_without_window()

    def _scale_learning_rate(self, ratio: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = _scaled(group["lr"], ratio)
            if "initial_lr" in group:
                group["initial_lr"] = _scaled(group["initial_lr"], ratio)
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "base_lrs"):
            self.lr_scheduler.base_lrs = [_scaled(lr, ratio) for lr in self.lr_scheduler.base_lrs]

    def _check_ranks_agree(self) -> None:
        k = float(self.state.accumulation)
        mine = torch.tensor([k, -k], dtype=torch.float64, device=self.meter.device if self.meter else "cpu")
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if mine[0] != k or -mine[1] != k:
            raise RuntimeError(
                f"the ranks disagree on the batch schedule at step {self.state.step}: accumulation between "
                f"{-float(mine[1]):.0f} and {float(mine[0]):.0f} (this rank {k:.0f}); every rank must build the "
                "schedule with the same settings"
            )


def _scaled(value: Any, ratio: float) -> Any:
    """A learning rate times ``ratio``, a tensor one in place (a capturable optimizer's)."""
    if isinstance(value, torch.Tensor):
        return value.mul_(ratio)
    return value * ratio

"""A run's batch schedule as text (``str(state)``, ``state.summary()``): the rule, every change with
its reason, the latest noise scale, and the schedule as Megatron-LM replays it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchfit.report.schedule import ScheduleState
    from batchfit.report.schedule_rule import ScheduleRule

__all__ = ["rule_text", "schedule_text"]

#: How each learning-rate rule is said.
LR_TEXT = {"sqrt": "x sqrt(batch ratio)", "linear": "x batch ratio", "none": "left as it is"}


def rule_text(rule: ScheduleRule) -> str:
    """The rule in one line: the policy, how the batch is made, how the learning rate follows it."""
    ranks = f" x {rule.world_size} ranks" if rule.world_size > 1 else ""
    lr = LR_TEXT[rule.lr_rule]
    most = rule.global_batch(rule.max_accumulation)
    guards = (
        f", metered every {rule.every} steps, doubled when {rule.fraction:g} x B_simple reaches the doubled batch"
        if rule.policy == "noise"
        else ""
    )
    return (
        f"batch schedule ({rule.policy}): micro-batch {rule.micro_batch:,} x {rule.accumulation} accumulation{ranks} "
        f"= global batch {rule.global_batch(rule.accumulation):,} at the start, at most {most:,} "
        f"(accumulation {rule.max_accumulation}); learning rate {lr} ({rule.lr_rule}){guards}"
    )


def schedule_text(state: ScheduleState) -> str:
    """The schedule in a few lines: what a person reads to see how the batch grew and why."""
    lines = [
        rule_text(state.rule),
        f"now: step {state.step:,}, {state.samples:,} samples, global batch {state.global_batch:,} "
        f"(accumulation {state.accumulation}), learning rate x{state.lr_factor:.3g} of the start",
    ]
    batch, lr = state.rule.global_batch(state.rule.accumulation), 1.0
    for change in state.changes:
        lines.append(
            f"  step {change.step:,} ({change.samples:,} samples): batch {batch:,} -> {change.global_batch:,}, "
            f"lr x{change.lr_factor / lr:.3g}: {change.reason}"
        )
        batch, lr = change.global_batch, change.lr_factor
    if not state.changes:
        lines.append("  no change yet")
    if state.rule.policy == "noise":
        b_simple = state.b_simple
        measured = "not measured yet" if b_simple is None else f"~{b_simple:,.0f} samples"
        recent = state.noise_scale()
        alone = "" if recent is None else f"; the last {recent.windows} windows alone: {recent.interval_text()}"
        lines.append(f"B_simple (smoothed over {state.windows:,} metered steps): {measured}{alone}")
    lines.append(f'Megatron-LM: --step-batch-size-schedule "{state.megatron()}"')
    return "\n".join(lines)

"""A [`LengthPlan`][batchfit.LengthPlan] as text: the buckets' table with a bar per bucket, the
token budget's compositions, packing, the soaks and the knobs (``str(plan)``, the CLI's table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit.units import format_bytes

if TYPE_CHECKING:
    from batchfit.report.varlen import LengthPlan

__all__ = ["plan_text"]

#: The widest bar of the buckets' chart, in characters.
BAR = 24


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def plan_text(plan: LengthPlan) -> str:
    """The plan, in lines: what a person reads to pick how to batch."""
    lines = [
        f"lengths: {plan.rows:,} rows, shortest {plan.shortest:,}, median {plan.median:,}, longest {plan.longest:,}"
        + (f"; {plan.world_size} ranks a step" if plan.world_size > 1 else ""),
        "",
        f"{'bucket':>15} {'rows':>8} {'batch':>6} {'max':>6} {'padding':>8} {'steps':>6} {'tokens/s':>10}  "
        "tokens/s (#), padding (.)",
    ]
    rates = [bucket.tokens_per_s for bucket in plan.buckets]
    top = max((r for r in rates if r), default=0.0)
    for bucket, rate in zip(plan.buckets, rates):
        filled = 0 if not top or rate is None else round(BAR * rate / top)
        padded = round(BAR * bucket.padding)
        lines.append(
            f"{bucket.shortest:>7,}-{bucket.longest:<7,} {bucket.rows:>8,} {bucket.batch_size:>6,} "
            f"{bucket.max_batch:>6,} {bucket.padding:>8.1%} {bucket.steps:>6,} {_rate(rate):>10}  "
            f"{'#' * filled}{'.' * padded}"
        )
    lines.append(
        f"buckets: {plan.epoch_steps:,} steps an epoch, {plan.padding:.1%} padding, "
        f"{_rate(plan.tokens_per_s)} real tokens/s"
    )
    budget = plan.token_budget
    if budget is not None:
        lines += [
            "",
            f"token budget: max_tokens={budget.max_tokens:,} (rows x longest row), binds at length "
            f"{budget.binding_length:,}; {budget.steps:,} steps an epoch; verified at:",
        ]
        for c in budget.compositions:
            peak = "-" if c.peak_bytes is None else format_bytes(c.peak_bytes)
            lines.append(
                f"  {c.rows:>6,} x {c.seq_len:<7,} ({c.kind}): {'fits' if c.fits else 'OUT OF MEMORY'}, peak {peak}"
            )
        for c in budget.rejected:
            lines.append(f"  a higher budget first: {c.rows:,} x {c.seq_len:,} ({c.kind}) did not fit")
    packing = plan.packing
    if packing is not None:
        row = "-" if packing.longest_packed_row is None else f"{packing.longest_packed_row:,}"
        lines += [
            "",
            f"packing: rows of {packing.pack_length:,} tokens, batch {packing.batch_size:,} "
            f"(max {packing.max_batch:,}), {packing.fill:.1%} filled, {_rate(packing.tokens_per_s)} real tokens/s; "
            f"longest packed row at batch 1: {row}",
        ]
        if plan.best_layout is not None:
            lines.append(f"faster here, measured: {plan.best_layout}")
    for soak in plan.soaks:
        drift = (
            ""
            if soak.retries_per_100 is None or soak.reserved_drift_per_100 is None
            else f"; {soak.retries_per_100:.2f} allocator retries and "
            f"{format_bytes(soak.reserved_drift_per_100)} reserved drift per 100 steps"
        )
        where = ", in a fresh process" if soak.process == "fresh" else ""
        lines.append(
            f"soak ({soak.sampler}): {soak.steps:,} steps, {soak.oom} out of memory, peak "
            f"{format_bytes(soak.peak_bytes)} at step {soak.peak_step:,} "
            f"({soak.peak_shape[0]:,} x {soak.peak_shape[1]:,}){drift}{where}"
        )
    knobs = plan.knobs
    if knobs:
        lines += ["", "knobs:"]
        for framework, settings in knobs.items():
            shown = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "note")
            lines.append(f"  {framework}: {shown or settings.get('note', '')}")
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)

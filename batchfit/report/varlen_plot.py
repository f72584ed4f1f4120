"""An image of a [`LengthPlan`][batchfit.LengthPlan] (``LengthPlan.plot(path)``): what each bucket
trains, and where the token budget binds.

Two panels, side by side:

* **the buckets**: per bucket, its real tokens/s (a solid bar) with the padding it trains on top
  (hatched: the bar's whole height is the padded tokens/s), labelled with its batch and padding
  share; the buckets' epoch average and packing's tokens/s (when measured) as reference lines;
* **the token budget**: rows against length (both log2): the rows the budget admits at each
  length (``max_tokens // s``, a line, markers at the measured lengths) under the measured max and
  safe batch there; the compositions that were run, marked fits or out of memory; the binding
  length highlighted. The budget holds where its line stays on or under the safe batch.

matplotlib is optional and imported only when drawing (`require_matplotlib`), as for
`batchfit.report.frontier_plot`.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from batchfit.report.frontier_plot import require_matplotlib, save_figure
from batchfit.report.frontier_text import compact_rate
from batchfit.report.text import device_text
from batchfit.units import format_bytes

if TYPE_CHECKING:
    from batchfit.report.varlen import Bucket, LengthPlan, TokenBudget

__all__ = ["length_figure", "save_length_plot"]

#: Label text on a white ground over the bars and lines it meets.
LABEL_STYLE: dict[str, Any] = {
    "fontsize": 8,
    "zorder": 6,
    "bbox": {"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
}
#: Inches: the budget's panel, and what each bucket's bar and label take of the buckets' panel.
PANEL_WIDTH = 6.5
BAR_WIDTH = 1.0
#: Points between stacked labels of compositions at nearby lengths.
LINE = 12
#: How each composition kind is named in its label.
KIND_TEXT = {"longest": "longest", "shortest": "shortest", "binding": "binding", "surface": "surface's worst"}


def save_length_plot(plan: LengthPlan, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
    """Draw ``plan`` to ``path`` (the format from its suffix: ``.png``, ``.svg``, ``.pdf``); the path
    written. What is drawn: `length_figure`.

    Raises:
        PlotUnavailableError: matplotlib is not installed (an ``ImportError``: install the ``plot`` extra).
        OSError: the file cannot be written.
    """
    plt = require_matplotlib("a length plan")
    return save_figure(plt, length_figure(plan), path, dpi)


def length_figure(plan: LengthPlan) -> Any:
    """``plan`` drawn on a new matplotlib figure (see the module), which the caller saves and
    closes: the buckets' panel, and the token budget's beside it when the plan has one."""
    plt = require_matplotlib("a length plan")
    width = max(PANEL_WIDTH, BAR_WIDTH * len(plan.buckets) + 1.5)  # each bucket's label has its room
    ratios = [width, PANEL_WIDTH] if plan.token_budget is not None else [width]
    figure, axes = plt.subplots(
        1, len(ratios), figsize=(sum(ratios), 4.8), layout="constrained", squeeze=False, width_ratios=ratios
    )
    _buckets(axes[0][0], plan)
    if plan.token_budget is not None:
        _budget(axes[0][1], plan, plan.token_budget)
    figure.suptitle(_title(plan), fontsize=10)
    return figure


def bucket_label(bucket: Bucket) -> str:
    """The bucket's lengths (one where it holds one) and its rows, as its tick says them."""
    lengths = f"{bucket.longest:,}" if bucket.shortest == bucket.longest else f"{bucket.shortest:,}-{bucket.longest:,}"
    return f"{lengths}\n{bucket.rows:,} rows"


def _buckets(axes: Any, plan: LengthPlan) -> None:
    """Per bucket: real tokens/s (solid) and the padding trained with it (hatched on top)."""
    from matplotlib.patches import Patch

    buckets = plan.buckets
    places = list(range(len(buckets)))
    real = [bucket.tokens_per_s for bucket in buckets]
    padded = [None if bucket.samples_per_s is None else bucket.samples_per_s * bucket.longest for bucket in buckets]
    solid = [0.0 if rate is None else rate for rate in real]
    extra = [0.0 if (p is None or r is None) else p - r for p, r in zip(padded, real)]
    axes.bar(places, solid, color="tab:blue", edgecolor="black", linewidth=0.5, zorder=3)
    axes.bar(places, extra, bottom=solid, color="white", edgecolor="tab:blue", hatch="///", linewidth=0.5, zorder=3)
    top = max([s + e for s, e in zip(solid, extra)] + _references(plan) + [1.0])
    for place, bucket, rate, height in zip(places, buckets, real, [s + e for s, e in zip(solid, extra)]):
        rate_text = "not timed" if rate is None else f"{compact_rate(rate)} tok/s"
        axes.annotate(
            f"batch {bucket.batch_size:,}\n{rate_text}\n{bucket.padding:.0%} padding",
            (place, height),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            va="bottom",
            **LABEL_STYLE,
        )
    handles = [
        Patch(facecolor="tab:blue", edgecolor="black", linewidth=0.5, label="real tokens/s"),
        Patch(facecolor="white", edgecolor="tab:blue", hatch="///", linewidth=0.5, label="padding tokens/s"),
    ]
    per_rank = plan.world_size
    epoch = plan.tokens_per_s
    if epoch is not None:
        handles.append(axes.axhline(epoch, color="black", linestyle="--", linewidth=1, label="buckets, whole epoch"))
    packing = plan.packing
    if packing is not None and packing.tokens_per_s is not None:
        handles.append(
            axes.axhline(
                packing.tokens_per_s,
                color="tab:orange",
                linestyle=":",
                linewidth=1.5,
                label=f"packing to {packing.pack_length:,}, batch {packing.batch_size:,}",
            )
        )
    axes.set_xticks(places, [bucket_label(b) for b in buckets], fontsize=8)
    axes.set_xlim(-0.6, max(len(buckets), 1) - 0.4)
    axes.set_ylim(0, top * 1.6)  # room above the tallest bar for its label, and the legend above that
    axes.yaxis.set_major_formatter(lambda value, _: compact_rate(value) if value else "0")
    axes.set_xlabel("bucket (lengths, padded to the longest)")
    axes.set_ylabel("tokens/s" + (" per rank" if per_rank > 1 else ""))
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(handles=handles, loc="upper center", ncol=2, fontsize=8)
    best = plan.best_layout
    axes.set_title("buckets" + ("" if best is None else f" (faster here, measured: {best})"), fontsize=10)


def _references(plan: LengthPlan) -> list[float]:
    """The reference lines' heights, so that the panel's top holds them."""
    found = []
    if plan.tokens_per_s is not None:
        found.append(plan.tokens_per_s)
    if plan.packing is not None and plan.packing.tokens_per_s is not None:
        found.append(plan.packing.tokens_per_s)
    return found


def _budget(axes: Any, plan: LengthPlan, budget: TokenBudget) -> None:
    """Rows against length: the budget's ``max_tokens // s``, the measured max and safe batch, the
    compositions run, the binding length."""
    points = plan.frontier.points
    lengths = sorted({p.seq_len for p in points} | {plan.shortest, plan.longest})
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    low, high = min(lengths), max(lengths)
    steps = 96
    xs = [round(2 ** (math.log2(low) + (math.log2(high) - math.log2(low)) * i / steps)) for i in range(steps + 1)]
    xs = sorted({x for x in xs if x >= 1} | set(lengths))
    axes.plot(xs, [budget.max_tokens // x for x in xs], "-", color="tab:purple", linewidth=1.2, zorder=2)
    measured = [p.seq_len for p in points]
    budget_line = axes.plot(
        measured,
        [budget.max_tokens // s for s in measured],
        "D",
        color="tab:purple",
        markersize=5,
        zorder=4,
        label=f"rows the budget admits: {budget.max_tokens:,} // length",
    )
    max_line = axes.plot(
        measured, [p.max_batch for p in points], "o-", color="tab:blue", markersize=5, label="max batch (measured)"
    )
    safe_line = axes.plot(
        measured, [p.safe_batch for p in points], "o--", color="tab:green", markersize=5, label="safe batch (verified)"
    )
    handles = [*budget_line, *max_line, *safe_line]
    ran = (*budget.compositions, *budget.rejected)  # the rejected: a higher budget's, which did not fit
    fits = [c for c in ran if c.fits]
    failed = [c for c in ran if not c.fits]
    if fits:
        handles.append(
            axes.scatter(
                [c.seq_len for c in fits],
                [c.rows for c in fits],
                s=130,
                facecolors="none",
                edgecolors="black",
                linewidths=1.5,
                zorder=5,
                label="composition run: fits",
            )
        )
    if failed:
        handles.append(
            axes.scatter(
                [c.seq_len for c in failed],
                [c.rows for c in failed],
                s=110,
                marker="X",
                color="tab:red",
                zorder=5,
                label="composition run: out of memory",
            )
        )
    right = 0
    for c in sorted(ran, key=lambda c: (c.seq_len, c.rows)):
        peak = "" if c.peak_bytes is None else f", {format_bytes(c.peak_bytes)}"
        left = c.seq_len > math.sqrt(low * high)  # labels point inwards, clear of the axes' edges
        drop = 12 + (LINE * right if left else 0)  # neighbours at the long end stack downwards, under the curve
        right += left
        axes.annotate(
            f"{c.rows:,} x {c.seq_len:,} ({KIND_TEXT.get(c.kind, c.kind)}{peak})",
            (c.seq_len, c.rows),
            textcoords="offset points",
            xytext=(-10 if left else 10, -drop),
            ha="right" if left else "left",
            va="top",
            color="tab:red" if not c.fits else "black",
            **LABEL_STYLE,
        )
    handles.append(
        axes.axvline(
            budget.binding_length,
            color="tab:red",
            alpha=0.35,
            linewidth=6,
            zorder=1,
            label=f"binds at length {budget.binding_length:,}",
        )
    )
    rows = [budget.max_tokens // x for x in xs] + [p.max_batch for p in points] + [c.rows for c in ran]
    rows = [r for r in rows if r >= 1] or [1]
    axes.set_xlim(2 ** (math.log2(low) - 0.4), 2 ** (math.log2(high) + 0.4))
    axes.set_ylim(2 ** (math.log2(min(rows)) - 1.3), 2 ** (math.log2(max(rows)) + 0.8))  # room for stacked labels
    ticks = lengths
    axes.set_xticks(ticks, [f"{t:,}" for t in ticks], fontsize=7, rotation=45)
    axes.minorticks_off()
    axes.yaxis.set_major_formatter(lambda value, _: f"{value:,.0f}" if value >= 1 else "")
    axes.set_xlabel("length of the batch's longest row (tokens)")
    axes.set_ylabel("rows in the batch")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(handles=handles, loc="lower left", fontsize=7)
    axes.set_title(
        f"token budget: max_tokens={budget.max_tokens:,} (rows x longest row), {budget.steps:,} steps an epoch",
        fontsize=10,
    )


def _title(plan: LengthPlan) -> str:
    frontier = plan.frontier
    device = frontier.device
    name = device.name if device.name and device.index is None else device_text(device)
    budget = "-" if frontier.budget_bytes is None else format_bytes(frontier.budget_bytes)
    ranks = f", {plan.world_size} ranks a step" if plan.world_size > 1 else ""
    return (
        f"batchfit buckets on {name}, budget {budget}: {plan.rows:,} rows, lengths {plan.shortest:,}-{plan.longest:,} "
        f"(median {plan.median:,}){ranks}; {len(plan.buckets)} buckets, {plan.epoch_steps:,} steps, "
        f"{plan.padding:.0%} padding"
    )

"""A fit's words, table and pictures: ``str(fit)`` (the table and a text chart) and ``Fit.plot(path)``.

The chart and the image show the same thing: the largest batch against blocks checkpointed (the
measured policies marked, the others as their memory lines predict), the target as a line, and
the samples/s each timed candidate reached. matplotlib is optional and imported only when an
image is drawn (`batchfit.report.frontier_plot.require_matplotlib`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from batchfit.report.frontier_plot import require_matplotlib
from batchfit.report.text import device_text
from batchfit.units import format_bytes

if TYPE_CHECKING:
    from batchfit.report.checkpointing import Fit, PolicyRow

__all__ = ["fit_chart", "fit_text", "save_fit_plot"]

#: The widest bar of the text chart, in characters.
BAR_WIDTH = 40


def fit_text(fit: Fit) -> str:
    """The fit as a person reads it: what was asked, a row per policy measured, the chart, the choice."""
    budget = "no limit" if fit.budget_bytes is None else format_bytes(fit.budget_bytes)
    lines = [
        f"batchfit fit: target batch {fit.target_batch} per optimizer step on {device_text(fit.device)}, "
        f"budget {budget}",
        f"{len(fit.blocks)} repeated blocks ({fit.blocks_from}); {fit.trials} trials in {fit.elapsed_s:.1f} s",
        "",
        f"{'policy':<28} {'max':>6} {'safe':>6}  {'memory (fixed + per sample)':<30} {'target as':<12} "
        f"{'samples/s':>9}",
    ]
    for index, row in enumerate(fit.rows):
        mark = "  <- recommended" if index == fit.chosen else ""
        lines.append(
            f"{row.policy.label:<28} {row.max_batch:>6} {row.safe_batch:>6}{'' if row.safe_verified else '?'} "
            f"{_equation(row):<30} {_split(row):<12} {_rate(row):>9}{mark}"
        )
    lines += ["", *fit_chart(fit), "", f"recommended: {fit.policy.label}, {fit.recommendation.split()}"]
    lines.append(f"  {fit.recommendation.reason}")
    lines += [f"note: {note}" for note in fit.notes]
    return "\n".join(lines)


def fit_chart(fit: Fit) -> list[str]:
    """Max batch against blocks checkpointed as text bars (``#`` measured, ``=`` predicted), the target marked."""
    top = max([b for _, b in fit.predicted] + [fit.target_batch, 1])
    target_at = round(fit.target_batch / top * BAR_WIDTH)
    lines = [f"max batch by {_axis(fit)} (# measured, = predicted, | target {fit.target_batch})"]
    measured = {row.policy.k for row in fit.rows}
    for k, batch in fit.predicted:
        bar = list(("#" if k in measured else "=") * round(batch / top * BAR_WIDTH))
        bar += [" "] * (BAR_WIDTH + 1 - len(bar))
        bar[min(target_at, BAR_WIDTH)] = "|"
        lines.append(f"  {k:>3} {''.join(bar)} {batch}")
    return lines


def save_fit_plot(fit: Fit, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
    """Draw the fit to ``path``: max batch against blocks checkpointed, samples/s of the timed
    candidates on a second axis. `PlotUnavailableError` without matplotlib."""
    plt = require_matplotlib("a fit")
    figure, axis = plt.subplots(figsize=(7, 4.2))
    try:
        ks = [k for k, _ in fit.predicted]
        axis.plot(ks, [b for _, b in fit.predicted], "-", color="tab:blue", label="max batch (predicted)")
        rows = fit.rows
        measured = ([r.policy.k for r in rows], [r.max_batch for r in rows])
        axis.plot(*measured, "o", color="tab:blue", label="max (measured)")
        axis.axhline(fit.target_batch, color="grey", linestyle="--", label=f"target {fit.target_batch}")
        axis.set_xlabel(_axis(fit))
        axis.set_xticks(ks)
        axis.set_ylabel("batch size")
        axis.set_ylim(bottom=0, top=1.15 * max([b for _, b in fit.predicted] + [fit.target_batch]))
        timed = [r for r in rows if r.samples_per_s is not None]
        if timed:
            rate_axis = axis.twinx()
            rate_axis.plot([r.policy.k for r in timed], [r.samples_per_s for r in timed], "s", color="tab:orange")
            for r in timed:
                text = f"{_split(r)}: {r.samples_per_s:.1f}/s"
                rate_axis.annotate(text, (r.policy.k, r.samples_per_s), textcoords="offset points", xytext=(6, -12))
            rate_axis.set_ylabel("samples/s at the target (squares)", color="tab:orange")
            rate_axis.set_ylim(bottom=0, top=1.3 * max(r.samples_per_s or 0 for r in timed))
        axis.set_title(f"recommended: {fit.policy.label}, {fit.recommendation.split()}", fontsize=9)
        axis.legend(loc="lower right", fontsize=8)
        figure.tight_layout()
        figure.savefig(os.fspath(path), dpi=dpi)
    finally:
        plt.close(figure)
    return os.fspath(path)


def _axis(fit: Fit) -> str:
    """What k counts: blocks, or budget steps of 0.1 below 1.0."""
    if any(row.policy.budget is not None for row in fit.rows):
        return f"compile budget steps below 1.0 (1/{fit.rows[0].policy.blocks} each)"
    return "blocks checkpointed"


def _equation(row: PolicyRow) -> str:
    if row.fixed_bytes is None or row.per_sample_bytes is None:
        return "-"
    return f"{format_bytes(row.fixed_bytes)} + {format_bytes(round(row.per_sample_bytes))}/sample"


def _split(row: PolicyRow) -> str:
    if row.micro_batch is None:
        return "-"
    return f"{row.micro_batch}" + (f" x {row.accumulation}" if (row.accumulation or 1) > 1 else "")


def _rate(row: PolicyRow) -> str:
    return "-" if row.samples_per_s is None else f"{row.samples_per_s:.1f}"

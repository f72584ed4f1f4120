"""An image of a frontier (``Frontier.plot(path)``, ``batchfit frontier --plot``): batch against length.

matplotlib is optional (``pip install 'batchfit[plot]'``) and imported only when a plot is drawn,
with the Agg backend (no display), so ``batchfit.report`` stays free of it. Drawn here, beside the
frontier's text, rather than among the terminal's views: a record's own ``plot()`` may only reach
its layer.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from batchfit.report.frontier_text import compact_rate
from batchfit.report.text import device_text
from batchfit.units import format_bytes

if TYPE_CHECKING:
    from batchfit.report.frontier import Frontier

#: What the error says when matplotlib is missing.
PLOT_EXTRA = "install the plot extra: pip install 'batchfit[plot]'"


class PlotUnavailableError(ImportError):
    """matplotlib is not installed: the message says how to install it."""


def require_matplotlib() -> Any:
    """The ``matplotlib.pyplot`` module on the Agg backend; :class:`PlotUnavailableError` (an
    ``ImportError``) saying how to install it when matplotlib is missing. A front end calls it
    before a probe, so a missing extra is said before minutes of trials, not after."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailableError(f"plotting a frontier needs matplotlib: {PLOT_EXTRA}") from exc
    matplotlib.use("Agg", force=True)  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def save_frontier_plot(frontier: Frontier, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
    """Draw ``frontier`` to ``path`` (the format from its suffix: ``.png``, ``.svg``, ``.pdf``) and
    return the path written.

    Batch size against sequence length, both axes log2: the max batch and the safe batch as lines
    with markers, each safe batch labelled with its tokens/s and coloured by it, the fitted surface
    at the budget as a dotted curve, the longest length at batch 1 as a star. The title names the
    device and the budget.

    Raises:
        PlotUnavailableError: matplotlib is not installed (an ``ImportError``: install the ``plot`` extra).
        OSError: the file cannot be written.
    """
    plt = require_matplotlib()
    points = frontier.points
    lengths = [p.seq_len for p in points]
    figure, axes = plt.subplots(figsize=(8, 5), layout="constrained")
    try:
        axes.set_xscale("log", base=2)
        axes.set_yscale("log", base=2)
        if points:
            axes.plot(lengths, [p.max_batch for p in points], "o-", color="tab:blue", label="max batch")
            axes.plot(lengths, [p.safe_batch for p in points], "s--", color="tab:green", label="safe batch")
        _surface(axes, frontier)
        _rates(axes, frontier, figure)
        _longest(axes, frontier)
        for point in points:
            axes.annotate(
                f"{point.max_batch:,}",
                (point.seq_len, point.max_batch),
                textcoords="offset points",
                xytext=(0, 7),
                ha="center",
                fontsize=8,
                color="tab:blue",
            )
        ticks = sorted({*lengths, *([frontier.longest_at_batch_1] if frontier.longest_at_batch_1 else [])})
        if ticks:
            axes.set_xticks(ticks, [f"{t:,}" for t in ticks])
            axes.minorticks_off()
        axes.yaxis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1 else ""))
        axes.set_xlabel("sequence length (tokens)")
        axes.set_ylabel("batch size (sequences)")
        axes.grid(True, which="major", alpha=0.3)
        axes.legend(loc="upper right", fontsize=8)
        axes.set_title(_title(frontier), fontsize=10)
        figure.savefig(os.fspath(path), dpi=dpi)
    finally:
        plt.close(figure)
    return os.fspath(path)


def _title(frontier: Frontier) -> str:
    budget = format_bytes(frontier.budget_bytes)
    counts = ", reserved" if frontier.budget_counts == "reserved" else ""
    kind = "ESTIMATE: " if frontier.estimated else ""
    return f"{kind}batchfit frontier on {device_text(frontier.device)}\nbudget {budget}{counts}; token budget " + (
        f"{frontier.token_budget:,} (safe {frontier.safe_token_budget:,})" if frontier.points else "-"
    )


def _surface(axes: Any, frontier: Frontier) -> None:
    """The fitted surface's largest batch at the budget, across the lengths drawn (when it counts
    what the budget counts)."""
    surface, budget = frontier.surface, frontier.budget_bytes
    if surface is None or not budget or surface.unit != frontier.budget_counts or not frontier.points:
        return
    low = min(p.seq_len for p in frontier.points)
    high = max([p.seq_len for p in frontier.points] + [frontier.longest_at_batch_1 or 0])
    if high <= low:
        return
    steps = 64
    xs = [2 ** (math.log2(low) + (math.log2(high) - math.log2(low)) * i / steps) for i in range(steps + 1)]
    curve = [(x, surface.largest_batch(x, budget)) for x in xs]
    curve = [(x, y) for x, y in curve if math.isfinite(y) and y >= 1]
    if curve:
        axes.plot(*zip(*curve), ":", color="grey", linewidth=1, label="fitted surface at the budget")


def _rates(axes: Any, frontier: Frontier, figure: Any) -> None:
    """Each safe batch coloured by its tokens/s (a colour bar beside), labelled with it."""
    timed = [p for p in frontier.points if p.tokens_per_s]
    if not timed:
        return
    scatter = axes.scatter(
        [p.seq_len for p in timed],
        [p.safe_batch for p in timed],
        c=[p.tokens_per_s for p in timed],
        cmap="viridis",
        s=60,
        zorder=3,
        edgecolors="black",
        linewidths=0.5,
    )
    bar = figure.colorbar(scatter, ax=axes, label="tokens/s at the safe batch", pad=0.01)
    bar.ax.yaxis.set_major_formatter(lambda value, _: compact_rate(value))
    for point in timed:
        axes.annotate(
            f"{compact_rate(point.tokens_per_s)} tok/s",
            (point.seq_len, point.safe_batch),
            textcoords="offset points",
            xytext=(0, -13),
            ha="center",
            fontsize=8,
        )


def _longest(axes: Any, frontier: Frontier) -> None:
    longest = frontier.longest_at_batch_1
    if longest is None:
        return
    axes.plot([longest], [1], "*", color="tab:red", markersize=14, zorder=4, label="longest at batch 1")
    axes.annotate(
        f"{longest:,} ({frontier.longest_limited_by or '?'})",
        (longest, 1),
        textcoords="offset points",
        xytext=(0, 9),
        ha="center",
        fontsize=8,
        color="tab:red",
    )

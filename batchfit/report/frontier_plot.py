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
    from batchfit.report.records import DeviceInfo

#: What the error says when matplotlib is missing.
PLOT_EXTRA = "install the plot extra: pip install 'batchfit[plot]'"


class PlotUnavailableError(ImportError):
    """matplotlib is not installed: the message says how to install it."""


def require_matplotlib(what: str = "a frontier") -> Any:
    """The ``matplotlib.pyplot`` module on the Agg backend; `PlotUnavailableError` (an
    ``ImportError``) saying how to install it when matplotlib is missing. A front end calls it
    before a probe, so a missing extra is said before minutes of trials, not after."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailableError(f"plotting {what} needs matplotlib: {PLOT_EXTRA}") from exc
    matplotlib.use("Agg", force=True)  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def save_frontier_plot(frontier: Frontier, path: str | os.PathLike[str], *, dpi: int = 120) -> str:
    """Draw ``frontier`` to ``path`` (the format from its suffix: ``.png``, ``.svg``, ``.pdf``) and
    return the path written. What is drawn: `frontier_figure`.

    Raises:
        PlotUnavailableError: matplotlib is not installed (an ``ImportError``: install the ``plot`` extra).
        OSError: the file cannot be written.
    """
    plt = require_matplotlib()
    return save_figure(plt, frontier_figure(frontier), path, dpi)


def save_figure(plt: Any, figure: Any, path: str | os.PathLike[str], dpi: int) -> str:
    """Write ``figure`` to ``path`` (the format from its suffix) and close it on every way out
    (pyplot keeps each open figure alive until closed); the path written."""
    try:
        figure.savefig(os.fspath(path), dpi=dpi)
    finally:
        plt.close(figure)
    return os.fspath(path)


#: Marker sizes in points: the circle of a max or safe batch, the star of the longest length at batch 1.
POINT_SIZE = 7.0
STAR_SIZE = 14.0
#: Points between a marker's edge and its label.
GAP = 2.0
#: Each label on a white ground over the lines it meets (markers it never meets: see ``_label``).
LABEL_STYLE: dict[str, Any] = {
    "fontsize": 8,
    "zorder": 6,
    "bbox": {"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
}


def frontier_figure(frontier: Frontier) -> Any:
    """``frontier`` drawn on a new matplotlib figure, which the caller saves and closes.

    Batch size against sequence length, both axes log2: the max batch (blue circles on a line)
    and the safe batch (circles on a dashed line, coloured by tokens/s where timed, a colour bar
    beside), each point labelled with its batch (the safe one with its tokens/s too), the fitted
    surface at the budget as a dotted curve, the longest length at batch 1 as a star. Every label
    sits clear of the markers, inside the axes; the legend shows the markers drawn. The title
    names the device and the budget."""
    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(8, 5), layout="constrained")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    star = (frontier.longest_at_batch_1, 1) if frontier.longest_at_batch_1 is not None else None
    handles = [
        *_max_batches(axes, frontier, star),
        *_safe_batches(axes, frontier, figure, star),
        *_surface(axes, frontier),
        *_longest(axes, frontier),
    ]
    _frame(axes, frontier, plt)
    if handles:
        axes.legend(handles=handles, loc="upper right", fontsize=8)
    axes.set_title(_title(frontier), fontsize=10)
    return figure


def _label(axes: Any, text: str, at: tuple[int, int], above: bool, star: tuple[int, int] | None, **style: Any) -> None:
    """``text`` centred above or below the marker at ``at``, clear of it (and of the star, larger,
    where the star is drawn at the same place)."""
    radius = (STAR_SIZE if at == star else POINT_SIZE) / 2 + GAP
    axes.annotate(
        text,
        at,
        textcoords="offset points",
        xytext=(0, radius if above else -radius),
        ha="center",
        va="bottom" if above else "top",
        **LABEL_STYLE,
        **style,
    )


def _max_batches(axes: Any, frontier: Frontier, star: tuple[int, int] | None) -> list[Any]:
    """The max batch at each length: circles on a line, each labelled above with its batch."""
    points = frontier.points
    if not points:
        return []
    (line,) = axes.plot(
        [p.seq_len for p in points],
        [p.max_batch for p in points],
        "o-",
        color="tab:blue",
        markersize=POINT_SIZE,
        label="max batch",
        zorder=3,
    )
    for point in points:
        _label(axes, f"{point.max_batch:,}", (point.seq_len, point.max_batch), True, star, color="tab:blue")
    return [line]


def _safe_batches(axes: Any, frontier: Frontier, figure: Any, star: tuple[int, int] | None) -> list[Any]:
    """The safe batch at each length: circles on a dashed line, coloured by tokens/s where timed
    (a colour bar beside), each labelled below with its batch and tokens/s. The legend's handle
    is the same circle on the same dashed line."""
    from matplotlib.lines import Line2D

    points = frontier.points
    if not points:
        return []
    axes.plot([p.seq_len for p in points], [p.safe_batch for p in points], "--", color="tab:green", zorder=2)
    circles = {"s": POINT_SIZE**2, "zorder": 4, "edgecolors": "black", "linewidths": 0.5}
    timed = [p for p in points if p.tokens_per_s]
    untimed = [p for p in points if not p.tokens_per_s]
    face = "tab:green"
    if timed:
        rates = [p.tokens_per_s for p in timed]
        scatter = axes.scatter(
            [p.seq_len for p in timed], [p.safe_batch for p in timed], c=rates, cmap="viridis", **circles
        )
        bar = figure.colorbar(scatter, ax=axes, label="tokens/s at the safe batch", pad=0.01)
        bar.ax.yaxis.set_major_formatter(lambda value, _: compact_rate(value))
        face = scatter.cmap(0.5)
    if untimed:
        axes.scatter([p.seq_len for p in untimed], [p.safe_batch for p in untimed], color="tab:green", **circles)
    for point in points:
        rate = f" \u00b7 {compact_rate(point.tokens_per_s)} tok/s" if point.tokens_per_s else ""
        _label(axes, f"{point.safe_batch:,}{rate}", (point.seq_len, point.safe_batch), False, star, color="darkgreen")
    handle = Line2D(
        [],
        [],
        linestyle="--",
        color="tab:green",
        marker="o",
        markersize=POINT_SIZE,
        markerfacecolor=face,
        markeredgecolor="black",
        markeredgewidth=0.5,
        label="safe batch (colour: tokens/s)" if timed else "safe batch",
    )
    return [handle]


def _frame(axes: Any, frontier: Frontier, plt: Any) -> None:
    """Ticks at the lengths drawn, the axes' labels and grid, and room around the points (a log2
    axis pads by whole fractions of a doubling) so that the first and last labels stay inside."""
    lengths = [p.seq_len for p in frontier.points]
    longest = [frontier.longest_at_batch_1] if frontier.longest_at_batch_1 else []
    ticks = sorted({*lengths, *longest})
    batches = [b for p in frontier.points for b in (p.max_batch, p.safe_batch)] + ([1] if longest else [])
    if ticks:
        axes.set_xticks(ticks, [f"{t:,}" for t in ticks])
        axes.minorticks_off()
        low, high = math.log2(ticks[0]), math.log2(ticks[-1])
        pad = max(0.4, 0.1 * (high - low))
        axes.set_xlim(2 ** (low - pad), 2 ** (high + pad))
    if batches:
        low, high = math.log2(min(batches)), math.log2(max(batches))
        pad = max(0.5, 0.12 * (high - low))
        axes.set_ylim(2 ** (low - pad), 2 ** (high + pad))
    axes.yaxis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1 else ""))
    new = frontier.new_tokens
    axes.set_xlabel(f"prompt length (tokens), each row then generating {new:,}" if new else "sequence length (tokens)")
    axes.set_ylabel("batch size (sequences)")
    axes.grid(True, which="major", alpha=0.3)


def _title(frontier: Frontier) -> str:
    budget = format_bytes(frontier.budget_bytes)
    counts = ", reserved" if frontier.budget_counts == "reserved" else ""
    kind = "ESTIMATE: " if frontier.estimated else ""
    return f"{kind}batchfit frontier on {_device(frontier.device)}\nbudget {budget}{counts}; token budget " + (
        f"{frontier.token_budget:,} (safe {frontier.safe_token_budget:,})" if frontier.points else "-"
    )


def _device(device: DeviceInfo) -> str:
    """The device as the title names it: its name, with ``(kind:index)`` where an index tells
    devices apart (``"NVIDIA H100 80GB HBM3 (cuda:0)"``); not ``"CPU: AMD EPYC (cpu)"``, which
    says the kind twice."""
    return device.name if device.name and device.index is None else device_text(device)


def _surface(axes: Any, frontier: Frontier) -> list[Any]:
    """The fitted surface's largest batch at the budget, across the lengths drawn (when it counts
    what the budget counts)."""
    surface, budget = frontier.surface, frontier.budget_bytes
    if surface is None or not budget or surface.unit != frontier.budget_counts or not frontier.points:
        return []
    low = min(p.seq_len for p in frontier.points)
    high = max([p.seq_len for p in frontier.points] + [frontier.longest_at_batch_1 or 0])
    if high <= low:
        return []
    steps = 64
    xs = [2 ** (math.log2(low) + (math.log2(high) - math.log2(low)) * i / steps) for i in range(steps + 1)]
    curve = [(x, surface.largest_batch(x + frontier.new_tokens, budget)) for x in xs]  # generating: at the context
    curve = [(x, y) for x, y in curve if math.isfinite(y) and y >= 1]
    if not curve:
        return []
    return axes.plot(*zip(*curve), ":", color="grey", linewidth=1, label="fitted surface at the budget")  # type: ignore[no-any-return]


def _longest(axes: Any, frontier: Frontier) -> list[Any]:
    """The longest length at batch 1: a star at batch 1, labelled to its left with the length and
    what bounded it (the points' labels sit above and below theirs, and the star may share the
    last length's place)."""
    longest = frontier.longest_at_batch_1
    if longest is None:
        return []
    (star,) = axes.plot(
        [longest], [1], "*", color="tab:red", markersize=STAR_SIZE, zorder=5, label="longest at batch 1"
    )
    axes.annotate(
        f"{longest:,} ({frontier.longest_limited_by or '?'})",
        (longest, 1),
        textcoords="offset points",
        xytext=(-(STAR_SIZE / 2 + GAP), 0),
        ha="right",
        va="center",
        color="tab:red",
        **LABEL_STYLE,
    )
    return [star]

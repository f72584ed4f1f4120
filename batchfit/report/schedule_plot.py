"""An image of runs' batch schedules (``ScheduleState.plot(path)``): the realised global batch
against the measured noise scale.

One panel, the batch on a log2 axis against samples (or optimizer steps): per run, its global batch
as a step line from the start to where the run stands, each change marked; the smoothed simple
noise scale ``B_simple`` of each metered step of a noise-driven run as dots in the run's colour, so
the picture shows the batch following (and staying under) what was measured; the most the rule
allows (``max_accumulation``) as a dotted line. Several runs side by side (``{"noise": ...,
"ramp": ...}``) compare a closed loop with its open-loop baselines.

matplotlib is optional and imported only when drawing (`require_matplotlib`), as for
`batchfit.report.frontier_plot`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from batchfit.report.frontier_plot import require_matplotlib, save_figure

if TYPE_CHECKING:
    from batchfit.report.schedule import ScheduleState

__all__ = ["plot_schedule", "schedule_figure", "schedule_runs"]

Axis = Literal["samples", "steps"]
AXES: tuple[str, ...] = ("samples", "steps")
#: What each x axis is called under the panel.
X_LABEL = {"samples": "samples trained (all ranks)", "steps": "optimizer steps"}


def plot_schedule(
    states: Mapping[str, ScheduleState] | ScheduleState,
    path: str | os.PathLike[str],
    *,
    x: Axis = "samples",
    dpi: int = 120,
) -> Path:
    """Draw ``states`` (one run, or runs by name) to ``path`` (the format from its suffix: ``.png``,
    ``.svg``, ``.pdf``); the path written. What is drawn: `schedule_figure`.

    Raises:
        ValueError: no run, or ``x`` neither ``"samples"`` nor ``"steps"``.
        TypeError: a run that is not a ``ScheduleState``.
        PlotUnavailableError: matplotlib is not installed (an ``ImportError``: install the ``plot`` extra).
        OSError: the file cannot be written.
    """
    runs = schedule_runs(states, x)
    plt = require_matplotlib("a batch schedule")
    return Path(save_figure(plt, _figure(plt, runs, x), path, dpi))


def schedule_figure(states: Mapping[str, ScheduleState] | ScheduleState, *, x: Axis = "samples") -> Any:
    """``states`` drawn on a new matplotlib figure (see the module), which the caller saves and closes."""
    runs = schedule_runs(states, x)
    return _figure(require_matplotlib("a batch schedule"), runs, x)


def schedule_runs(states: Mapping[str, ScheduleState] | ScheduleState, x: str) -> dict[str, ScheduleState]:
    """The runs to draw by label (one state is labelled by its policy), checked before anything is drawn."""
    if x not in AXES:
        raise ValueError(f"x must be one of {', '.join(AXES)}, got {x!r}")
    if isinstance(states, Mapping):
        runs = dict(states)
    else:  # one run, named by its policy
        runs = {str(getattr(getattr(states, "rule", None), "policy", "run")): states}
    if not runs:
        raise ValueError("states holds no run: pass a ScheduleState, or a mapping of names to them")
    for label, state in runs.items():
        if not all(hasattr(state, name) for name in ("rule", "changes", "noise", "steps")):  # a duck: see TYPE_CHECKING
            raise TypeError(f"the run {label!r} must be a ScheduleState, got {type(state).__name__}")
    return runs


def _figure(plt: Any, runs: dict[str, ScheduleState], x: str) -> Any:
    figure, axes = plt.subplots(figsize=(9.5, 4.8), layout="constrained")
    axes.set_yscale("log", base=2)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    heights: list[float] = []
    for index, (label, state) in enumerate(runs.items()):
        color = colors[index % len(colors)]
        heights += _run(axes, label, state, x, color)
    ceilings = sorted({state.rule.global_batch(state.rule.max_accumulation) for state in runs.values()})
    for ceiling in ceilings:
        axes.axhline(ceiling, color="grey", linestyle=":", linewidth=1, zorder=1, label=f"most allowed: {ceiling:,}")
    heights += ceilings
    low, high = min(heights), max(heights)
    axes.set_ylim(2 ** (math.floor(math.log2(low)) - 0.3), 2 ** (math.ceil(math.log2(high)) + 0.3))
    ticks = [2**k for k in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)]
    axes.set_yticks(ticks, [f"{t:,}" for t in ticks])
    axes.minorticks_off()
    axes.set_xlabel(X_LABEL[x])
    axes.set_ylabel("global batch (samples a step)")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside: clear of the data
    axes.set_title(_title(runs, x), fontsize=10)
    return figure


def _run(axes: Any, label: str, state: ScheduleState, x: str, color: str) -> list[float]:
    """One run: its batch as a step line (changes marked) and its noise scale as dots; the heights drawn."""
    at = 1 if x == "samples" else 0  # the place in (step, samples, global_batch) of the x axis
    points = state.steps()
    end = state.samples if x == "samples" else state.step
    xs = [p[at] for p in points] + [max(end, points[-1][at])]
    ys = [p[2] for p in points] + [state.global_batch]
    axes.plot(xs, ys, drawstyle="steps-post", color=color, linewidth=2, zorder=3, label=f"{label}: global batch")
    changes = points[1:]
    if changes:
        axes.plot(
            [p[at] for p in changes],
            [p[2] for p in changes],
            "o",
            color=color,
            markersize=6,
            markeredgecolor="black",
            zorder=5,
            label=f"{label}: {len(changes)} change{'s' if len(changes) > 1 else ''}",
        )
    measured = [p for p in state.noise if p.b_simple is not None and p.b_simple > 0]
    if measured:
        axes.plot(
            [p.samples if x == "samples" else p.step for p in measured],
            [p.b_simple for p in measured],
            ".",
            color=color,
            alpha=0.6,
            markersize=5,
            zorder=4,
            label=f"{label}: B_simple (smoothed)",
        )
    return [float(y) for y in ys] + [float(p.b_simple) for p in measured if p.b_simple is not None]


def _title(runs: dict[str, ScheduleState], x: str) -> str:
    first = next(iter(runs.values())).rule
    ranks = f" x {first.world_size} ranks" if first.world_size > 1 else ""
    noise = next((state.rule for state in runs.values() if state.rule.policy == "noise"), None)
    rule = "" if noise is None else f"; noise: doubles once {noise.fraction:g} x B_simple reaches the doubled batch"
    return (
        f"batch schedule: global batch against {x}" + (", with the measured noise scale" if noise else "") + "\n"
        f"micro-batch {first.micro_batch:,}{ranks} x accumulation{rule}"
    )

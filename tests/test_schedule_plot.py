"""The picture of a run's batch schedule (``ScheduleState.plot``): the realised batch as a step line
against the smoothed noise scale it followed. The states drawn are built step by step by the rule
(`ScheduleState.after_step`) from metered windows; what the picture must show is read back from the
figure's lines and compared with the states' numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchfit.report.schedule import ScheduleState, Window
from batchfit.report.schedule_plot import plot_schedule, schedule_figure
from batchfit.report.schedule_rule import ScheduleRule

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def noise_run() -> ScheduleState:
    """A closed loop whose noise scale grows with the steps (``B_noise = 2 + 3 x step``)."""
    rule = ScheduleRule(micro_batch=4, accumulation=2, max_accumulation=32, every=2, min_steps=3, settle=2)
    state = ScheduleState.start(rule)
    for step in range(60):
        window = None
        if state.meters():
            b_noise, batch = 2.0 + 3 * step, state.global_batch
            window = Window(small=1 + b_noise / 4, big=1 + b_noise / batch, small_batch=4, big_batch=batch)
        state = state.after_step(window)
    return state


def ramp_run() -> ScheduleState:
    rule = ScheduleRule(micro_batch=4, accumulation=2, max_accumulation=32, policy="ramp", thresholds=(100, 400, 1200))
    state = ScheduleState.start(rule)
    for _ in range(60):
        state = state.after_step()
    return state


def lines(figure: Any) -> dict[str, Any]:
    (axes,) = figure.axes
    return {line.get_label(): line for line in axes.get_lines()}


def close(figure: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_the_picture_draws_each_runs_batch_its_changes_and_the_noise_scale() -> None:
    noise, ramp = noise_run(), ramp_run()
    assert len(noise.changes) >= 2 and len(ramp.changes) == 3 and noise.noise
    figure = schedule_figure({"noise": noise, "ramp": ramp})
    try:
        drawn = lines(figure)
        for label, state in (("noise", noise), ("ramp", ramp)):
            batch = drawn[f"{label}: global batch"]
            assert batch.get_drawstyle() == "steps-post"
            assert list(batch.get_xdata()) == [s for _, s, _ in state.steps()] + [state.samples]
            assert list(batch.get_ydata()) == [b for _, _, b in state.steps()] + [state.global_batch]
            marked = drawn[f"{label}: {len(state.changes)} changes"]
            assert list(marked.get_xdata()) == [c.samples for c in state.changes]
            assert list(marked.get_ydata()) == [c.global_batch for c in state.changes]
        dots = drawn["noise: B_simple (smoothed)"]
        assert list(dots.get_xdata()) == [p.samples for p in noise.noise]
        assert list(dots.get_ydata()) == pytest.approx([p.b_simple for p in noise.noise])
        assert "ramp: B_simple (smoothed)" not in drawn  # an open loop measures nothing
        (axes,) = figure.axes
        assert axes.get_yscale() == "log" and axes.get_xlabel() == "samples trained (all ranks)"
        title = axes.get_title()
        assert title.startswith("batch schedule: global batch against samples, with the measured noise scale")
        assert "noise: doubles once 0.5 x B_simple reaches the doubled batch" in title
        assert any(line.get_label() == "most allowed: 128" for line in axes.get_lines())
    finally:
        close(figure)


def test_the_picture_against_steps() -> None:
    noise = noise_run()
    figure = schedule_figure(noise, x="steps")
    try:
        drawn = lines(figure)
        assert list(drawn["noise: global batch"].get_xdata()) == [s for s, _, _ in noise.steps()] + [noise.step]
        assert list(drawn["noise: B_simple (smoothed)"].get_xdata()) == [p.step for p in noise.noise]
        assert figure.axes[0].get_xlabel() == "optimizer steps"
    finally:
        close(figure)


def test_the_state_saves_its_picture_as_a_png(tmp_path: Path) -> None:
    noise = noise_run()
    written = noise.plot(tmp_path / "schedule.png")
    assert written == tmp_path / "schedule.png" and written.read_bytes().startswith(PNG_MAGIC)
    both = plot_schedule({"noise": noise, "ramp": ramp_run()}, str(tmp_path / "both.png"), x="steps")
    assert isinstance(both, Path) and both.read_bytes().startswith(PNG_MAGIC)


def test_a_bad_picture_request_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="x must be one of samples, steps, got 'tokens'"):
        noise_run().plot(tmp_path / "x.png", x="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="states holds no run"):
        plot_schedule({}, tmp_path / "x.png")
    with pytest.raises(TypeError, match="the run 'noise' must be a ScheduleState, got int"):
        plot_schedule({"noise": 3}, tmp_path / "x.png")  # type: ignore[dict-item]
    assert not (tmp_path / "x.png").exists()

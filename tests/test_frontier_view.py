"""A frontier as people see it: its text, the terminal's chart and views, the image, its JSON, and
``batchfit frontier`` on the command line (issue 21).

The frontier drawn is real: a tiny GPT-style model probed on CPU under a small limit, one
:func:`batchfit.find` per length (as :func:`batchfit.frontier` measures each length), the surface
fitted through their memory lines. The command line runs :func:`batchfit.frontier` itself once.
"""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import batchfit
from batchfit.cli import main
from batchfit.examples import GPT
from batchfit.report import Frontier, FrontierPoint, Surface
from batchfit.report.frontier_plot import PlotUnavailableError, save_frontier_plot
from batchfit.report.frontier_text import compact_rate, render_frontier
from batchfit.view.frontier_chart import chart_text, frontier_chart
from batchfit.view.frontier_view import FrontierProgress, FrontierView

LENGTHS = (16, 32, 64)
VOCAB = 64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

#: A frontier command of a few seconds: three short lengths, a small limit, the positions bounding
#: the longest length's search.
FAST = ["--device", "cpu", "--memory-limit", "4MiB", "--verify-steps", "2", "--max-batch", "256"]

TARGET = """
import torch
from batchfit.examples import GPT


def build():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=128, d_model=32, n_layers=1, n_heads=2)

    def make_batch(batch_size, seq_len):
        ids = torch.randint(0, 64, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
        return {"input_ids": ids, "labels": ids.clone()}

    return {"model": model, "make_batch": make_batch}
"""


def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny steps on a busy 2-core machine: one intra-op thread (two threads wait on each other
    when other processes hold the cores, and a step of milliseconds takes most of a second)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def frontier() -> Frontier:
    """A real frontier: one probe per length of a tiny GPT on CPU, the surface fitted through them."""
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, seq_len=128, d_model=32, n_layers=1, n_heads=2)
    points = []
    for seq_len in LENGTHS:
        result = batchfit.find(
            model,
            make_batch=lambda b, s=seq_len: make_batch(b, s),
            device="cpu",
            memory_limit="4MiB",
            max_batch=256,
            verify_steps=2,
        )
        points.append(FrontierPoint.of(seq_len, result))
    surface = Surface.fit([(p.seq_len, p.result.memory.fixed_bytes, p.result.memory.per_sample_bytes) for p in points])
    first = points[0].result
    return Frontier(
        points=tuple(points),
        surface=surface,
        budget_bytes=first.budget_bytes,
        budget_counts=first.budget_counts,
        device=first.device,
        elapsed_s=sum(p.result.elapsed_s for p in points),
        longest_at_batch_1=128,
        longest_limited_by="positions",
        longest_trials=1,
        notes=("a note [with brackets] rich must not read as markup",),
    )


# the text ------------------------------------------------------------------------------------------
def test_the_text_has_a_row_per_length_and_what_they_add_up_to(frontier: Frontier) -> None:
    text = render_frontier(frontier)

    assert str(frontier) == text
    for point in frontier.points:
        cells = rf"^\s+{point.seq_len}\s+{point.max_batch}\s+{point.safe_batch} verified\s+([\d,]+)"
        row = re.search(cells, text, re.M)
        assert row, text
        assert row.group(1) == f"{point.tokens:,}"
    assert re.search(r"^longest at batch 1\s+128 +\(limited by positions", text, re.M)
    assert f"{frontier.token_budget:,} tokens per batch" in text
    assert f"{frontier.safe_token_budget:,} at the safe batches" in text
    assert re.search(r"^memory surface\s+.+ \+ b x \(.+ x s \+ .+ x s\^2\)", text, re.M)
    assert frontier.surface is not None and frontier.surface.meaning() in text
    fastest = frontier.fastest
    assert fastest is not None and re.search(rf"^fastest\s+seq_len {fastest.seq_len} at batch", text, re.M)
    assert re.search(rf"^trials\s+{frontier.trials} in ", text, re.M)
    assert re.search(r"^measured\s+real steps$", text, re.M)
    assert "note: a note [with brackets]" in text


def test_an_estimate_says_so_first_and_times_nothing(frontier: Frontier) -> None:
    estimate = replace(
        frontier,
        estimated=True,
        points=tuple(replace(p, tokens_per_s=None) for p in frontier.points),
        longest_at_batch_1=None,
        longest_limited_by=None,
        assumptions=("the allocator as modelled",),
    )

    lines = render_frontier(estimate).splitlines()

    assert lines[0].startswith("ESTIMATE:")
    assert any(re.match(r"^longest at batch 1\s+not searched$", line) for line in lines)
    assert any(re.match(r"^fastest\s+not measured: an estimate times nothing$", line) for line in lines)
    assert "assumes: the allocator as modelled" in lines


# the chart -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [40, 72, 100])
def test_the_chart_shows_every_length_and_batch_within_its_width(frontier: Frontier, width: int) -> None:
    chart = chart_text(frontier, width)
    lines = chart.splitlines()

    assert all(len(line) <= width for line in lines), chart
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] in (["seq_len"], ["max"], ["safe"])}
    assert rows["seq_len"] == [str(s) for s in LENGTHS] + ["128"]  # the longest length at batch 1 last
    assert rows["max"] == [str(p.max_batch) for p in frontier.points] + ["1"]
    assert rows["safe"] == [str(p.safe_batch) for p in frontier.points]
    assert "M" in chart and "L" in chart and "\x1b" not in chart
    assert any(line.startswith("tok/s") for line in lines)


def test_the_chart_labels_each_point_with_its_tokens_per_second(frontier: Frontier) -> None:
    from batchfit.report.frontier_text import compact_rate

    chart = chart_text(frontier, 100)

    for point in frontier.points:
        assert compact_rate(point.tokens_per_s) in chart


def test_too_narrow_a_chart_says_why_instead(frontier: Frontier) -> None:
    assert chart_text(frontier, 30) == "no chart: it needs at least 40 columns"
    assert chart_text(replace(frontier, points=())) == "no chart: no length was measured"


def test_the_rich_chart_is_the_same_picture_in_colour(frontier: Frontier) -> None:
    from rich.console import Console

    chart = frontier_chart(frontier, 80, unicode=True)
    assert not isinstance(chart, str)
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=80, color_system="standard").print(chart.rich())

    assert chart.rich().plain == chart.plain()
    assert "┤" in out.getvalue() and "\x1b[" in out.getvalue()


# the views ------------------------------------------------------------------------------------------------
def run_view(view: FrontierView, frontier: Frontier) -> None:
    view.start(["batchfit: frontier of GPT"], [p.seq_len for p in frontier.points])
    for point in frontier.points:
        for trial in point.result.trials:
            view.trial_started(trial.batch_size, trial.kind)
            view.trial_finished(trial)
        view.point_finished(point)
    view.summary(frontier)


@pytest.mark.parametrize("width", [None, 60])
def test_the_plain_view_prints_a_line_per_length_then_the_table_and_chart(
    frontier: Frontier, width: int | None
) -> None:
    out = io.StringIO()
    run_view(FrontierView(out, plain=True, width=width), frontier)
    text = out.getvalue()

    assert "\x1b" not in text
    for point in frontier.points:
        assert re.search(rf"^seq_len {point.seq_len}: max batch {point.max_batch}, safe {point.safe_batch}", text, re.M)
    assert render_frontier(frontier).splitlines()[0][:40] in text
    assert re.search(r"^seq_len\s+16\s+32\s+64\s+128$", text, re.M)  # the chart's axis
    if width is not None:
        assert all(len(line) <= width for line in text.splitlines()), text


def test_the_quiet_view_prints_one_line(frontier: Frontier) -> None:
    out = io.StringIO()
    run_view(FrontierView(out, quiet=True), frontier)

    (line,) = out.getvalue().splitlines()
    points = " ".join(f"{p.seq_len}:{p.max_batch}/{p.safe_batch}" for p in frontier.points)
    assert line.startswith(f"seq_len:max/safe {points} token_budget={frontier.token_budget} ")
    assert "longest_at_batch_1=128" in line


def test_the_live_view_draws_rows_and_the_coloured_chart(frontier: Frontier) -> None:
    out = io.StringIO()
    run_view(FrontierView(out, plain=False), frontier)
    text = out.getvalue()

    assert "length 1 of 3: trial 1 at batch" in text  # the spinner counts the lengths
    assert "┤" in text and "[with brackets]" in text
    assert text.count("\x1b[?25h") >= 1  # the cursor came back


def test_progress_feeds_the_view_and_still_calls_the_users_callbacks(frontier: Frontier) -> None:
    seen: dict[str, list[Any]] = {"point": [], "trial": [], "start": [], "started": []}
    out = io.StringIO()
    with FrontierProgress(
        "GPT",
        LENGTHS,
        seen["point"].append,
        seen["trial"].append,
        lambda b, k: seen["start"].append((b, k)),
        lambda d, b: seen["started"].append(b),
        stream=out,
    ) as shown:
        hooks = shown.callbacks()
        assert sorted(hooks) == ["callback", "on_point", "on_start", "on_trial_start"]
        for point in frontier.points:
            shown.length_started(point.seq_len)
            hooks["on_start"](point.result.device, point.result.budget_bytes)
            for trial in point.result.trials:
                hooks["on_trial_start"](trial.batch_size, trial.kind)
                hooks["callback"](trial)
            hooks["on_point"](point)
        shown.length_started(None)
        shown.summary(frontier)

    text = out.getvalue()
    assert text.count("batchfit: frontier of GPT on ") == 1  # the header once, not once per length
    assert seen["point"] == list(frontier.points)
    assert len(seen["trial"]) == len(seen["start"]) == sum(p.trials for p in frontier.points)
    assert len(seen["started"]) == len(frontier.points)
    assert "memory surface" in text


# the image ---------------------------------------------------------------------------------------------
def test_plot_writes_a_png(frontier: Frontier, tmp_path: Path) -> None:
    path = tmp_path / "frontier.png"

    assert frontier.plot(path) == str(path)

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_plot_draws_an_estimate_and_an_svg(frontier: Frontier, tmp_path: Path) -> None:
    estimate = replace(frontier, estimated=True, points=tuple(replace(p, tokens_per_s=None) for p in frontier.points))
    path = tmp_path / "estimate.svg"

    save_frontier_plot(estimate, path)

    assert path.read_text().lstrip().startswith("<?xml") and "ESTIMATE" in path.read_text()


def drawn(frontier: Frontier) -> Any:
    """The frontier's figure, drawn (so that every text has its place), to read what it shows."""
    from batchfit.report.frontier_plot import frontier_figure

    figure = frontier_figure(frontier)
    figure.canvas.draw()
    return figure


def close(figure: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def marker_of(artist: Any) -> Any:
    """The marker's outline an artist draws at each of its points (``None``: a line without markers)."""
    from matplotlib.lines import Line2D
    from matplotlib.markers import MarkerStyle

    if isinstance(artist, Line2D):
        if artist.get_marker() in (None, "None", "", " "):
            return None
        style = MarkerStyle(artist.get_marker())
        return style.get_path().transformed(style.get_transform())
    return artist.get_paths()[0]


def points_of(artist: Any) -> set[tuple[float, float]]:
    from matplotlib.lines import Line2D

    data = artist.get_xydata() if isinstance(artist, Line2D) else artist.get_offsets()
    return {(float(x), float(y)) for x, y in data}


def as_estimated(frontier: Frontier) -> Frontier:
    """The frontier as an estimate draws it: no tokens/s, so no colours."""
    return replace(frontier, estimated=True, points=tuple(replace(p, tokens_per_s=None) for p in frontier.points))


def a_small_last_length(frontier: Frontier) -> Frontier:
    """The last length trains at batch 1 only, and is the longest the model takes: its point, its
    labels and the star of the longest length at batch 1 meet in one corner."""
    *head, last = frontier.points
    return replace(
        frontier,
        points=(*head, replace(last, result=replace(last.result, max_batch=2, safe_batch=1))),
        longest_at_batch_1=last.seq_len,
        longest_limited_by="positions",
    )


@pytest.mark.parametrize("timed", [True, False])
def test_the_legend_shows_the_marker_each_series_is_drawn_with(frontier: Frontier, timed: bool) -> None:
    import numpy as np

    if not timed:
        frontier = as_estimated(frontier)
    figure = drawn(frontier)
    axes = figure.axes[0]
    legend = axes.get_legend()
    shown = {text.get_text(): marker_of(handle) for text, handle in zip(legend.get_texts(), legend.legend_handles)}
    shown = {
        label: mark for text, mark in shown.items() for label in ("max batch", "safe batch") if text.startswith(label)
    }
    series = {
        "max batch": {(float(p.seq_len), float(p.max_batch)) for p in frontier.points},
        "safe batch": {(float(p.seq_len), float(p.safe_batch)) for p in frontier.points},
    }
    for label, at in series.items():
        artists = [a for a in [*axes.lines, *axes.collections] if marker_of(a) is not None and at <= points_of(a)]
        assert artists, label
        for artist in artists:  # every marker drawn at the series' points is the legend's marker
            mark, key = marker_of(artist).vertices, shown[label].vertices
            assert mark.shape == key.shape and np.allclose(mark, key), (label, artist)
    close(figure)


@pytest.mark.parametrize("timed", [True, False])
def test_every_point_is_labelled_with_its_batch(frontier: Frontier, timed: bool) -> None:
    if not timed:
        frontier = as_estimated(frontier)
    figure = drawn(frontier)
    labels = [(tuple(map(float, text.xy)), text.get_text()) for text in figure.axes[0].texts]
    for point in frontier.points:
        for batch in (point.max_batch, point.safe_batch):
            at = (float(point.seq_len), float(batch))
            assert any(xy == at and f"{batch:,}" in text for xy, text in labels), (at, labels)
        if timed:
            rate = f"{compact_rate(point.tokens_per_s)} tok/s"
            assert any(xy == (point.seq_len, point.safe_batch) and rate in text for xy, text in labels)
    close(figure)


@pytest.mark.parametrize("corner", [False, True])
def test_no_label_covers_a_point_or_leaves_the_picture(frontier: Frontier, corner: bool) -> None:
    frontier = a_small_last_length(frontier) if corner else frontier
    figure = drawn(frontier)
    axes = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    marks = []  # (centre in pixels, radius in pixels) of every marker drawn
    for line in axes.lines:
        if marker_of(line) is not None:
            radius = line.get_markersize() / 2 * figure.dpi / 72
            marks += [(xy, radius) for xy in axes.transData.transform(line.get_xydata())]
    for collection in axes.collections:
        radius = float(collection.get_sizes()[0]) ** 0.5 / 2 * figure.dpi / 72
        marks += [(xy, radius) for xy in axes.transData.transform(collection.get_offsets())]
    for text in axes.texts:
        box = text.get_window_extent(renderer)
        for (x, y), radius in marks:
            covered = box.x0 - radius < x < box.x1 + radius and box.y0 - radius < y < box.y1 + radius
            assert not covered, f"{text.get_text()!r} covers the marker at {(round(x), round(y))}"
        inside = axes.bbox
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, (
            f"{text.get_text()!r} leaves the plot"
        )
    close(figure)


def test_the_title_names_the_device_kind_once(frontier: Frontier) -> None:
    figure = drawn(frontier)
    title = figure.axes[0].get_title().splitlines()[0]
    close(figure)
    assert frontier.device.name in title
    assert title.lower().count("cpu") == frontier.device.name.lower().count("cpu") == 1

    gpu = replace(frontier.device, type="xpu", index=1, name="Intel(R) Data Center GPU Max 1550")
    figure = drawn(replace(frontier, device=gpu))
    title = figure.axes[0].get_title().splitlines()[0]
    close(figure)
    assert title.endswith("Intel(R) Data Center GPU Max 1550 (xpu:1)")  # the index tells devices apart


def test_plot_without_matplotlib_says_how_to_install_it(
    frontier: Frontier, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError

    with pytest.raises(ImportError, match=re.escape("install the plot extra: pip install 'batchfit[plot]'")) as err:
        frontier.plot(tmp_path / "f.png")

    assert isinstance(err.value, PlotUnavailableError)
    assert not (tmp_path / "f.png").exists()


def test_the_report_imports_no_matplotlib() -> None:
    import subprocess

    code = "import sys, batchfit.report, batchfit.view; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# JSON ------------------------------------------------------------------------------------------------------
def test_the_json_document_round_trips(frontier: Frontier) -> None:
    assert Frontier.from_json(frontier.to_json()) == frontier
    plain = replace(frontier, surface=None, longest_at_batch_1=None, longest_limited_by=None, budget_bytes=None)
    assert Frontier.from_json(plain.to_json(indent=None)) == plain
    assert json.loads(frontier.to_json())["schema"] == "batchfit.frontier/1"


# the command line ------------------------------------------------------------------------------------
def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("batchfit: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def target(tmp_path: Path) -> str:
    path = tmp_path / "lm_target.py"
    path.write_text(TARGET)
    return f"{path}:build"


@pytest.mark.slow
def test_frontier_command_prints_writes_json_and_plots(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, image = tmp_path / "f.json", tmp_path / "f.png"

    code = main(["frontier", target, "--seq-lens", "16,32,64", *FAST, "--json", str(out), "--plot", str(image)])

    captured = capsys.readouterr()
    assert code == 0, captured.err
    frontier = Frontier.from_json(out.read_text())
    assert [p.seq_len for p in frontier.points] == [16, 32, 64]
    assert frontier.longest_at_batch_1 is not None
    text = captured.out
    for point in frontier.points:
        assert re.search(rf"^seq_len {point.seq_len}: max batch {point.max_batch}\b", text, re.M)
        assert re.search(rf"^\s+{point.seq_len}\s+{point.max_batch}\s+{point.safe_batch} verified", text, re.M)
    assert re.search(r"^seq_len\s+16\s+32\s+64\b", text, re.M)  # the chart
    assert f"plot written to {image}" in text
    assert image.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("value", ["128,abc", "0,128", "128,128", "", "128;256"])
def test_a_bad_seq_lens_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["frontier", "batchfit.examples:gpt", "--seq-lens", value, *FAST])

    assert exited.value.code == 2
    assert error_line(capsys.readouterr().err).startswith("batchfit: error: argument --seq-lens: ")


def test_seq_lens_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["frontier", "batchfit.examples:gpt", *FAST])

    assert exited.value.code == 2
    assert "--seq-lens" in error_line(capsys.readouterr().err)


def test_a_target_without_make_batch_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["frontier", "batchfit.examples:gpt", "--seq-lens", "16,32", *FAST])

    assert code == 2
    assert "make_batch(batch_size, seq_len)" in error_line(capsys.readouterr().err)


def test_a_make_batch_of_one_argument_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "one_arg.py"
    path.write_text(
        "import torch\n"
        "def build():\n"
        "    return {'model': torch.nn.Linear(4, 4), 'make_batch': lambda b: torch.randn(b, 4)}\n"
    )

    code = main(["frontier", f"{path}:build", "--seq-lens", "16", *FAST])

    assert code == 2
    assert "must take (batch_size, seq_len)" in error_line(capsys.readouterr().err)


def test_plot_without_matplotlib_fails_before_the_target_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = tmp_path / "loaded"
    path = tmp_path / "marked.py"
    path.write_text(f"from pathlib import Path\nPath({str(loaded)!r}).touch()\nfrom batchfit.examples import gpt\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    code = main(["frontier", f"{path}:gpt", "--seq-lens", "16", *FAST, "--plot", str(tmp_path / "f.png")])

    assert code == 2
    assert error_line(capsys.readouterr().err).endswith("install the plot extra: pip install 'batchfit[plot]'")
    assert not loaded.exists()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--plot", "f.txt"], "name an image file"),
        (["--plot", "-"], "needs a file name"),
        (["--plot", "/no/such/folder/f.png"], "cannot write --plot"),
        (["--max-seq-len", "512", "--no-longest"], "drop --no-longest"),
    ],
)
def test_bad_output_options_fail_before_the_target_loads(
    option: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = tmp_path / "loaded"
    path = tmp_path / "marked.py"
    path.write_text(f"from pathlib import Path\nPath({str(loaded)!r}).touch()\nfrom batchfit.examples import gpt\n")

    code = main(["frontier", f"{path}:gpt", "--seq-lens", "16", *FAST, *option])

    assert code == 2
    assert message in error_line(capsys.readouterr().err)
    assert not loaded.exists()


@pytest.mark.slow
def test_estimate_with_seq_lens_prints_and_writes_the_estimated_frontier(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, image = tmp_path / "e.json", tmp_path / "e.png"
    limit = ["--device", "cpu", "--memory-limit", "4MiB", "--max-batch", "256"]

    code = main(["estimate", target, "--seq-lens", "16,64", *limit, "--json", str(out), "--plot", str(image)])

    captured = capsys.readouterr()
    assert code == 0, captured.err
    estimated = Frontier.from_json(out.read_text())
    assert estimated.estimated and [p.seq_len for p in estimated.points] == [16, 64]
    measured = batchfit_frontier_of(target)
    assert [p.max_batch for p in estimated.points] == [p.max_batch for p in measured.points]
    assert image.read_bytes()[:8] == PNG_MAGIC
    for wrong in (["--seq-len", "16"], ["--target-batch", "64"]):
        assert main(["estimate", target, "--seq-lens", "16,64", *limit, *wrong]) == 2
        assert "go with one length, not with --seq-lens" in error_line(capsys.readouterr().err)
    assert main(["estimate", target, *limit, "--plot", str(image)]) == 2
    assert "--plot go with --seq-lens" in error_line(capsys.readouterr().err)


def batchfit_frontier_of(target: str) -> Frontier:
    import batchfit
    from batchfit.targets import load_target

    loaded = load_target(target)
    return batchfit.frontier(
        loaded.model,
        loaded.extras["make_batch"],
        seq_lens=[16, 64],
        memory_limit="4MiB",
        max_batch=256,
        longest_at_batch_1=False,
        verify_steps=0,
    )


def test_progress_takes_lengths_from_a_generator_and_shows_them(capsys: pytest.CaptureFixture[str]) -> None:
    """``progress=True`` reads ``seq_lens`` once, as the algorithm does: a generator of numpy ints
    is probed and shown whole, not consumed by the view first (issue 32)."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, seq_len=128, d_model=32, n_layers=1, n_heads=2)
    answer = batchfit.frontier(
        model,
        make_batch=make_batch,
        seq_lens=(s for s in np.array([8, 16])),
        longest_at_batch_1=False,
        device="cpu",
        memory_limit="4MiB",
        max_batch=256,
        verify_steps=2,
        progress=True,
    )
    assert [p.seq_len for p in answer.points] == [8, 16]
    shown = capsys.readouterr().err
    assert "8, 16" in shown or "8 16" in shown or ("length 8" in shown and "length 16" in shown), shown

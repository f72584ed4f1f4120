"""The image of a length plan (``LengthPlan.plot``, issue 50): tokens/s and padding per bucket, and
the token budget's binding compositions.

The plan drawn is real: `batchfit.buckets` on a GPT-2 built from a config, with a long-tailed set
of lengths, under a small CPU limit, with packing; what the picture must show is read back from
the drawn figure's artists and compared with the plan's numbers.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import batchfit
from batchfit.report.frontier_plot import PlotUnavailableError
from batchfit.report.frontier_text import compact_rate
from batchfit.report.varlen import LengthPlan
from batchfit.report.varlen_plot import bucket_label, length_figure, save_length_plot

transformers = pytest.importorskip("transformers")


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VOCAB = 64


def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny steps on a busy small machine: one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plan() -> LengthPlan:
    """A real plan: buckets, a verified token budget and packing, for a long-tailed length set."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, n_positions=256, vocab_size=VOCAB, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    lengths = torch.distributions.LogNormal(3.0, 0.6).sample((300,)).clamp(4, 96).long().tolist()
    return batchfit.buckets(
        model, make_batch, lengths=lengths, memory_limit="6MiB", pack_length=128, max_batch=256, verify_steps=2
    )


def drawn(plan: LengthPlan) -> Any:
    """The plan's figure, drawn (so that every text has its place), to read what it shows."""
    pytest.importorskip("matplotlib")
    figure = length_figure(plan)
    figure.canvas.draw()
    return figure


def close(figure: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_the_plan_has_what_the_picture_draws(plan: LengthPlan) -> None:
    assert plan.buckets and plan.token_budget is not None and plan.packing is not None
    assert plan.token_budget.compositions and all(b.samples_per_s for b in plan.buckets)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_plot_writes_a_png_and_an_svg(plan: LengthPlan, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png, svg = tmp_path / "plan.png", tmp_path / "plan.svg"

    assert plan.plot(png, dpi=60) == str(png)
    assert save_length_plot(plan, svg) == str(svg)

    assert png.read_bytes()[:8] == PNG_MAGIC
    assert svg.read_text().lstrip().startswith("<?xml")


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_each_bucket_is_a_bar_of_real_tokens_under_its_padding(plan: LengthPlan) -> None:
    figure = drawn(plan)
    axes = figure.axes[0]
    bars = [patch for container in axes.containers for patch in container]
    real, padding = bars[: len(plan.buckets)], bars[len(plan.buckets) :]
    for bucket, solid, hatched in zip(plan.buckets, real, padding):
        rate = bucket.tokens_per_s
        assert rate is not None and bucket.samples_per_s is not None
        assert solid.get_height() == pytest.approx(rate)
        assert hatched.get_y() == pytest.approx(rate)  # stacked on the real tokens
        assert solid.get_height() + hatched.get_height() == pytest.approx(bucket.samples_per_s * bucket.longest)
        assert hatched.get_height() / (solid.get_height() + hatched.get_height()) == pytest.approx(bucket.padding)
    ticks = [label.get_text() for label in axes.get_xticklabels()]
    assert ticks == [bucket_label(b) for b in plan.buckets]
    assert all(f"{b.longest:,}\n{b.rows:,} rows" in tick for b, tick in zip(plan.buckets, ticks))
    texts = [text.get_text() for text in axes.texts]
    for bucket in plan.buckets:
        assert any(
            f"batch {bucket.batch_size:,}" in t and f"{bucket.padding:.0%} padding" in t
            and f"{compact_rate(bucket.tokens_per_s or 0)} tok/s" in t
            for t in texts
        ), (bucket, texts)  # fmt: skip
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_packing_and_the_epoch_are_reference_lines(plan: LengthPlan) -> None:
    figure = drawn(plan)
    axes = figure.axes[0]
    lines = {line.get_label(): line.get_ydata()[0] for line in axes.lines}
    packing = plan.packing
    assert packing is not None and packing.tokens_per_s is not None and plan.tokens_per_s is not None
    assert lines[f"packing to {packing.pack_length:,}, batch {packing.batch_size:,}"] == pytest.approx(
        packing.tokens_per_s
    )
    assert lines["buckets, whole epoch"] == pytest.approx(plan.tokens_per_s)
    assert f"faster here, measured: {plan.best_layout}" in axes.get_title()
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_the_budget_panel_shows_the_rows_it_admits_under_the_measured_batches(plan: LengthPlan) -> None:
    budget = plan.token_budget
    assert budget is not None
    figure = drawn(plan)
    axes = figure.axes[1]
    series = {line.get_label(): list(zip(*line.get_data())) for line in axes.lines}
    points = plan.frontier.points
    admits = series[f"rows the budget admits: {budget.max_tokens:,} // length"]
    assert admits == [(p.seq_len, budget.max_tokens // p.seq_len) for p in points]
    assert series["max batch (measured)"] == [(p.seq_len, p.max_batch) for p in points]
    assert series["safe batch (verified)"] == [(p.seq_len, p.safe_batch) for p in points]
    assert all(rows <= p.safe_batch for (_, rows), p in zip(admits, points))  # the budget holds where measured
    binding = series[f"binds at length {budget.binding_length:,}"]
    assert {x for x, _ in binding} == {budget.binding_length}
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_every_composition_run_is_marked_and_labelled(plan: LengthPlan) -> None:
    budget = plan.token_budget
    assert budget is not None
    failed = replace(budget.compositions[0], fits=False)
    shown = replace(plan, token_budget=replace(budget, compositions=(failed, *budget.compositions[1:])))
    figure = drawn(shown)
    axes = figure.axes[1]
    marks = {c.get_label(): {tuple(map(float, xy)) for xy in c.get_offsets()} for c in axes.collections}
    assert marks["composition run: out of memory"] == {(float(failed.seq_len), float(failed.rows))}
    assert marks["composition run: fits"] == {(float(c.seq_len), float(c.rows)) for c in budget.compositions[1:]}
    labels = {tuple(map(float, text.xy)): text for text in axes.texts}
    for c in (failed, *budget.compositions[1:]):
        text = labels[(float(c.seq_len), float(c.rows))]
        assert re.match(rf"{c.rows:,} x {c.seq_len:,} \(", text.get_text()), text.get_text()
        assert (text.get_color() == "tab:red") == (not c.fits)
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_a_rejected_composition_is_marked_out_of_memory_beside_those_kept(plan: LengthPlan) -> None:
    budget = plan.token_budget
    assert budget is not None
    first = budget.compositions[0]
    rejected = replace(first, rows=first.rows + 1, fits=False)  # a higher budget's, which did not fit
    figure = drawn(replace(plan, token_budget=replace(budget, rejected=(rejected,))))
    axes = figure.axes[1]
    marks = {c.get_label(): {tuple(map(float, xy)) for xy in c.get_offsets()} for c in axes.collections}
    assert marks["composition run: out of memory"] == {(float(rejected.seq_len), float(rejected.rows))}
    assert marks["composition run: fits"] == {(float(c.seq_len), float(c.rows)) for c in budget.compositions}
    label = {tuple(map(float, text.xy)): text for text in axes.texts}[(float(rejected.seq_len), float(rejected.rows))]
    assert label.get_color() == "tab:red"
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_the_epoch_line_is_per_rank_whatever_the_world_size(plan: LengthPlan) -> None:
    ranks = replace(plan, world_size=2, buckets=tuple(replace(b, world_size=2) for b in plan.buckets))
    assert ranks.tokens_per_s == pytest.approx(plan.tokens_per_s)  # a rank's rate: the ranks do not change it
    figure = drawn(ranks)
    axes = figure.axes[0]
    lines = {line.get_label(): line.get_ydata()[0] for line in axes.lines}
    assert lines["buckets, whole epoch"] == pytest.approx(ranks.tokens_per_s)
    assert axes.get_ylabel() == "tokens/s per rank"
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_no_label_leaves_its_panel_or_covers_another(plan: LengthPlan) -> None:
    figure = drawn(plan)
    renderer = figure.canvas.get_renderer()
    for axes in figure.axes:
        boxes = [text.get_window_extent(renderer) for text in axes.texts]
        inside = axes.bbox
        for text, box in zip(axes.texts, boxes):
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, (
                f"{text.get_text()!r} leaves the panel"
            )
        for i, one in enumerate(boxes):
            for other in boxes[i + 1 :]:
                assert not one.overlaps(other), (axes.texts[i].get_text(), boxes.index(other))
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_a_plan_without_a_budget_or_timing_draws_one_panel(plan: LengthPlan) -> None:
    untimed = replace(
        plan,
        token_budget=None,
        packing=None,
        buckets=tuple(replace(b, samples_per_s=None) for b in plan.buckets),
    )
    figure = drawn(untimed)
    assert len(figure.axes) == 1
    axes = figure.axes[0]
    assert sum("not timed" in text.get_text() for text in axes.texts) == len(plan.buckets)
    assert not axes.lines  # no epoch rate, no packing to compare with
    close(figure)


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_plot_without_matplotlib_says_how_to_install_it(
    plan: LengthPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError

    with pytest.raises(PlotUnavailableError, match=re.escape("plotting a length plan needs matplotlib")):
        plan.plot(tmp_path / "p.png")

    assert not (tmp_path / "p.png").exists()


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_the_plot_survives_the_json_round_trip(plan: LengthPlan, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    again = LengthPlan.from_json(plan.to_json())

    assert again.plot(tmp_path / "again.png", dpi=50) == str(tmp_path / "again.png")


@pytest.mark.slow  # the real plan: a few seconds, once for the module
def test_no_legend_covers_a_label(plan: LengthPlan) -> None:
    figure = drawn(plan)
    renderer = figure.canvas.get_renderer()
    for axes in figure.axes:
        legend = axes.get_legend().get_window_extent(renderer)
        for text in axes.texts:
            assert not legend.overlaps(text.get_window_extent(renderer)), text.get_text()
    close(figure)


def test_the_image_module_imports_no_matplotlib() -> None:
    import subprocess

    code = "import sys, batchfit.report.varlen, batchfit.report.varlen_plot; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

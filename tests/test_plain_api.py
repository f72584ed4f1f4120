"""The plain API as new users call it: (inputs, targets) data, DataLoaders, Hugging Face models
without labels, progress, sane CPU defaults, and the first screen of the command line."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import batchfit
from batchfit.report import Trial


def _classifier() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))


def test_inputs_and_targets_without_a_criterion_get_a_hint() -> None:
    model, x, y = _classifier()
    with pytest.raises(TypeError, match="positional argument") as raised:
        batchfit.find(model, (x, y), memory_limit="16MiB")
    assert any("criterion=" in note for note in getattr(raised.value, "__notes__", []))


@pytest.mark.slow
def test_criterion_runs_the_step_a_training_loop_runs() -> None:
    """``out = model(x); loss = criterion(out, y)``: the output lives until the step ends, as in a
    training loop, so it holds the logits a step_fn (which drops them) does not: a little more."""
    model, x, y = _classifier()
    loss = nn.CrossEntropyLoss()
    with_criterion = batchfit.find(model, (x, y), criterion=loss, memory_limit="16MiB")
    by_hand = batchfit.find(model, (x, y), step_fn=lambda m, batch: loss(m(batch[0]), batch[1]), memory_limit="16MiB")
    assert 0.97 * by_hand.max_batch <= with_criterion.max_batch <= by_hand.max_batch
    logits_per_sample = 10 * 4
    at = with_criterion.trials[0].batch_size
    held = with_criterion.trials[0].peak_bytes - by_hand.trial(at).peak_bytes  # type: ignore[union-attr, operator]
    assert 0 <= held <= 2 * logits_per_sample * at


def test_criterion_needs_pairs_and_is_one_way_to_say_the_loss() -> None:
    model, x, y = _classifier()
    with pytest.raises(ValueError, match="tuple or list of two"):
        batchfit.find(model, x, criterion=nn.CrossEntropyLoss(), memory_limit="16MiB")
    with pytest.raises(ValueError, match="criterion"):
        batchfit.find(model, (x, y), criterion=nn.CrossEntropyLoss(), loss_fn=lambda o, b: o.sum())


@pytest.mark.slow
def test_a_dataloader_is_a_sample_source_and_says_so() -> None:
    model, x, y = _classifier()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    from_loader = batchfit.find(model, loader, criterion=nn.CrossEntropyLoss(), memory_limit="16MiB")
    from_batch = batchfit.find(model, (x, y), criterion=nn.CrossEntropyLoss(), memory_limit="16MiB")
    assert from_loader.max_batch == from_batch.max_batch
    assert any("first batch of the DataLoader (batch size 4)" in note for note in from_loader.notes)
    batches = iter([(x, y)])  # any iterable of batches works the same way
    assert batchfit.find(model, batches, criterion=nn.CrossEntropyLoss(), memory_limit="16MiB").max_batch == (
        from_batch.max_batch
    )
    with pytest.raises(ValueError, match="empty"):
        batchfit.find(model, DataLoader(TensorDataset(x[:0], y[:0]), batch_size=4), criterion=nn.CrossEntropyLoss())


@pytest.mark.slow
def test_a_hugging_face_model_without_labels_is_flagged() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (2, 64))
    without = batchfit.find(model, {"input_ids": ids}, memory_limit="48MiB")
    with_labels = batchfit.find(model, {"input_ids": ids, "labels": ids}, memory_limit="48MiB")
    assert any("no 'labels'" in note for note in without.notes)
    assert not any("no 'labels'" in note for note in with_labels.notes)
    assert without.max_batch > with_labels.max_batch  # what the note warns of: logits.mean() over-estimates


def test_progress_shows_the_command_lines_view_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    model, x, y = _classifier()
    result = batchfit.find(model, (x, y), criterion=nn.CrossEntropyLoss(), memory_limit="16MiB", progress=True)
    shown = capsys.readouterr()
    assert shown.out == ""
    assert "batchfit: probing Sequential" in shown.err and f"max batch        {result.max_batch}" in shown.err
    assert shown.err.count("search") >= len(result.search_trials)  # one row per trial


def test_the_cpu_default_limit_keeps_a_probe_short() -> None:
    model, x, y = _classifier()
    prober = batchfit.Prober(model, (x, y), criterion=nn.CrossEntropyLoss())
    assert prober.limit_bytes is not None and prober.limit_bytes <= 2**30
    assert "memory_limit=" in prober.limit_source or "available" in prober.limit_source


def test_str_of_a_result_marks_failure_bounds_and_formats_times() -> None:
    model, x, y = _classifier()
    result = batchfit.find(model, (x, y), criterion=nn.CrossEntropyLoss(), memory_limit="16MiB")
    text = str(result)
    failed = [t for t in result.trials if not t.fits]
    assert failed and ">=" in text
    assert " ms" in text or " s " in text


def test_the_live_view_reads_whole_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchfit.view.live import LiveView

    monkeypatch.setenv("COLUMNS", "80")
    stream = io.StringIO()
    view = LiveView(stream, no_color=True)
    view.set_budget(64 * 2**20)
    view.trial_finished(Trial(batch_size=2048, fits=True, peak_bytes=60 * 2**20, step_time_s=0.1234,
                              samples_per_s=16_595.4, steps=1))  # fmt: skip
    view.trial_finished(Trial(batch_size=4096, fits=False, phase="backward", peak_bytes=70 * 2**20, steps=0))
    view.trial_started(3000, "search")
    view.console.print(view._render())
    text = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())  # bold headers: escape codes take no column
    assert all(len(line) <= 80 for line in text.splitlines())
    for whole in ("batch", "outcome", "samples/s", "OOM in backward", ">=70.00 MiB", "16,595.4", "123.4 ms"):
        assert whole in text
    assert "…" not in text and "..." not in text


@pytest.mark.slow
def test_the_first_screen_is_batchfits_own_even_without_numpy() -> None:
    code = (
        "import sys; sys.modules['numpy'] = None\n"  # as on a fresh install without NumPy
        "from batchfit import cli\n"
        "sys.exit(cli.main(['probe', 'batchfit.examples:mlp', '--memory-limit', '16MiB', '-q']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr
    assert done.stdout.startswith("max_batch=")

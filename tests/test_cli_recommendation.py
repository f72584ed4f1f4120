"""``batchfit probe`` ends with the batch to train with; ``--noise-scale`` measures the noise scale first.

Real probes on CPU of a tiny regression model whose target hands out a ``DataLoader`` (real
batches, what the noise scale is measured from), in-process through ``main()``: the lines, the
JSON and the exit codes are what is checked (``tests/test_cli.py`` runs the command in a process).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from batchfit import Result
from batchfit.cli import main

TARGETS = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset


    def _model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


    def loader():
        """Real batches: y = 2 x0 + noise, 16 at a time, shuffled."""
        model = _model()
        x = torch.randn(4096, 32)
        y = 2 * x[:, :1] + 0.5 * torch.randn(4096, 1)
        data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
        return {"model": model, "sample": data, "criterion": nn.MSELoss()}


    def one_batch():
        return {"model": _model(), "sample": (torch.randn(16, 32), torch.randn(16, 1)), "criterion": nn.MSELoss()}


    def built():
        return {"model": _model(), "make_batch": lambda n: (torch.randn(n, 32), torch.randn(n, 1)),
                "criterion": nn.MSELoss()}
    '''
)

#: A probe of a second or two: the safe batch lands near 130 under this limit.
SMALL = ["--device", "cpu", "--memory-limit", "160KiB", "--verify-steps", "1"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("targets") / "recommend_targets.py"
    path.write_text(TARGETS)
    return path


def _tail(out: str) -> list[str]:
    """The lines from the first recommendation line (or the noise scale's) to the end."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("noise scale ", "recommended ")))
    return lines[start:]


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("batchfit: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_probe_ends_with_the_recommendation_and_the_json_carries_it(
    targets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    code = main(["probe", f"{targets}:loader", *SMALL, "--json", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    result = Result.from_json(out.read_text())
    rec = result.recommendation
    tail = _tail(stdout)
    assert tail == rec.lines()  # the last lines, nothing after them
    assert tail[0] == f"recommended      {rec.decision()}" and tail[0].startswith("recommended      train at ")
    assert tail[1] == f"why              {rec.reason}"
    assert any(line.startswith("caveat ") and "--noise-scale" in line for line in tail)
    assert json.loads(out.read_text())["recommendation"]["reason"] == rec.reason
    assert rec.batch_size <= result.safe_batch


def test_the_recommendation_takes_the_target_batch(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", f"{targets}:loader", *SMALL, "--target-batch", "1000"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    lines = stdout.splitlines()
    plan = next(i for i, line in enumerate(lines) if line.startswith("plan "))
    tail = _tail(stdout)
    assert lines.index(tail[0]) > plan  # the plan, then the recommendation
    assert tail[0].startswith("recommended      train at ") and tail[0].endswith("decided by the target")
    assert tail[1].startswith("why              the target global batch 1000")


def test_quiet_keeps_its_one_line(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --timed-steps 0: the warm timing after the search is the one phase whose trials depend on the
    # clock (its neighbourhood runs until a deadline), and in-process steps run on every core: on a
    # loaded machine it decided what this test ran. What it checks is the line, not the timing.
    code = main(["probe", f"{targets}:loader", *SMALL, "--timed-steps", "0", "--quiet"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert len(stdout.splitlines()) == 1 and stdout.startswith("max_batch=")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--noise-passes", "16"], "--noise-passes goes with --noise-scale"),
        (
            ["--noise-scale", "--require-batch", "8"],
            "--require-batch runs a gate, not a full probe: drop --noise-scale",
        ),
        (["--noise-scale", "--nproc-per-trial", "2"], "--noise-scale needs the model here"),
    ],
)
def test_noise_options_that_cannot_go_together_exit_2(
    targets: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["probe", f"{targets}:loader", *SMALL, *args])
    stdout, err = capsys.readouterr()
    assert code == 2
    assert message in _error_line(err)
    assert stdout == ""


@pytest.mark.parametrize(("factory", "given"), [("one_batch", "one batch (a tuple)"), ("built", "no sample")])
def test_noise_scale_without_real_batches_exits_2_before_probing(
    targets: Path, factory: str, given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["probe", f"{targets}:{factory}", *SMALL, "--noise-scale"])
    stdout, err = capsys.readouterr()
    assert code == 2
    line = _error_line(err)
    assert "--noise-scale measures the gradient noise scale from real batches" in line
    assert f"{targets}:{factory} gives {given}" in line and "DataLoader" in line
    assert "search" not in stdout  # no trial ran


def test_noise_passes_below_four_is_a_usage_error(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["probe", f"{targets}:loader", "--noise-scale", "--noise-passes", "3"])
    assert exit.value.code == 2
    assert "'3' must be at least 4" in capsys.readouterr().err


def test_noise_options_reach_the_probe(
    targets: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import batchfit.probe

    seen: list[tuple[bool, int]] = []
    real = batchfit.probe.find_with

    def spy(model: Any, sample: Any, options: Any, **kwargs: Any) -> Any:
        seen.append((options.noise_scale, options.noise_passes))
        return real(model, sample, options, **kwargs)

    monkeypatch.setattr(batchfit.probe, "find_with", spy)
    import batchfit.cli.probe as command

    if hasattr(command, "find_with"):  # the command imports it at module level
        monkeypatch.setattr(command, "find_with", spy)
    # --timed-steps 0: the flags are what is checked, not the timing after the search (seconds on a CPU).
    untimed = [*SMALL, "--timed-steps", "0"]
    assert main(["probe", f"{targets}:loader", *untimed, "--noise-scale", "--noise-passes", "16"]) == 0
    assert main(["probe", f"{targets}:loader", *untimed]) == 0
    capsys.readouterr()
    assert seen == [(True, 16), (False, 128)]


# Needs find_with to measure the noise scale when Options(noise_scale=True) asks (batchfit.probe.noise_measure).
def test_the_command_measures_the_noise_scale_and_recommends_with_it(
    targets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    for name in ("COLUMNS", "FORCE_COLOR", "NO_COLOR"):  # as a plain shell runs the command
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps on a busy machine
    try:
        code = main(["probe", f"{targets}:loader", *SMALL, "--noise-scale", "--noise-passes", "32", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    stdout, err = capsys.readouterr()
    assert code == 0, err
    result = Result.from_json(out.read_text())
    noise = result.noise_scale
    assert noise is not None and noise.passes <= 32
    rec = result.recommendation
    assert rec.noise_low == noise.low and rec.noise_scale == noise.b_simple
    tail = _tail(stdout)
    assert tail[0].startswith("noise scale      ")
    assert f"from batches {noise.small_batch} and {noise.big_batch}" in tail[0]
    assert tail[1:] == rec.lines()
    assert any("SGD" in line for line in tail) and not any("--noise-scale measures" in line for line in tail)
    assert json.loads(out.read_text())["noise_scale"]["passes"] == noise.passes

"""batchfit.testing: assert_fits / check_fits on real runs, and the `cuda` pytest marker."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_same_state, state_of
from torch import nn

from batchfit import Trial
from batchfit.testing import GateReport, assert_fits, check_fits

REPO = Path(__file__).resolve().parents[1]
LIMIT = "4MiB"


class Wide(nn.Module):
    """Much activation memory per sample and almost no compute: a boundary at a few dozen
    samples under 4 MiB, found in milliseconds per trial."""

    def __init__(self, width: int = 4096) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.tanh(x * self.scale)
        return self.head(x)


def wide() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Wide(), torch.randn(2, 4096)


def test_assert_fits_passes_with_one_trial() -> None:
    model, sample = wide()
    seen: list[Trial] = []

    report = assert_fits(model, sample, batch_size=8, memory_limit=LIMIT, device="cpu", callback=seen.append)

    assert report.fits and report.search is None and report.largest_fit is None
    assert [t.batch_size for t in seen] == [8] and seen[0].kind == "gate"
    assert report.trial.peak_bytes is not None and 0 < report.trial.peak_bytes <= report.budget_bytes
    assert report.budget_bytes == 4 * 2**20


@pytest.mark.slow
def test_assert_fits_fails_with_peak_limit_and_largest_fit() -> None:
    model, sample = wide()
    before = state_of(model)
    seen: list[Trial] = []

    with pytest.raises(AssertionError) as failure:
        assert_fits(model, sample, batch_size=256, memory_limit=LIMIT, device="cpu", callback=seen.append)

    assert_same_state(before, state_of(model))
    message = str(failure.value)
    gate, *search = seen
    assert gate.batch_size == 256 and not gate.fits
    # Only the search below the required size ran, and it found a real boundary there.
    assert search and all(t.batch_size < 256 for t in search)
    largest = max(t.batch_size for t in search if t.fits)
    assert any(not t.fits and t.batch_size == largest + 1 for t in search)
    assert "batch 256 does not fit within 4.00 MiB" in message
    assert f"needing at least {_mib(gate.peak_bytes)}" in message
    assert f"the largest batch that fit is {largest} (peak " in message

    # What it reported as the largest fit does pass, and one more does not.
    assert assert_fits(model, sample, batch_size=largest, memory_limit=LIMIT, device="cpu").fits
    assert not check_fits(model, sample, batch_size=largest + 1, memory_limit=LIMIT, device="cpu").fits


def test_nothing_fits_says_so() -> None:
    model, sample = wide()

    with pytest.raises(AssertionError, match="no smaller batch fits either"):
        assert_fits(model, sample, batch_size=4, memory_limit="64KiB", device="cpu")


def test_check_fits_report_round_trips_through_json() -> None:
    model, sample = wide()

    report = check_fits(model, sample, batch_size=128, memory_limit=LIMIT, device="cpu", steps_per_trial=2)

    assert not report.fits and report.search is not None
    assert report.search.settings.steps_per_trial == 2 and report.search.settings.max_batch == 127
    assert GateReport.from_json(report.to_json()) == report


def test_a_gate_report_is_read_with_the_result_checks() -> None:
    """GateReport.from_json reads with the codec Result.from_json uses: the same field checks, each one
    ValueError naming the field (issue 19, item 10)."""
    import json

    model, sample = wide()
    report = check_fits(model, sample, batch_size=128, memory_limit=LIMIT, device="cpu", steps_per_trial=2)
    assert report.search is not None and report.search.throughput is not None
    text = report.to_json()

    def refused(change: dict | str, fragment: str) -> None:
        if isinstance(change, str):
            corrupt = change
        else:
            document = json.loads(text)
            for path, value in change.items():
                *parents, last = path.split(".")
                inner = document
                for key in parents:
                    inner = inner[int(key) if key.isdigit() else key]
                inner[int(last) if last.isdigit() else last] = value
            corrupt = json.dumps(document)
        with pytest.raises(ValueError) as raised:
            GateReport.from_json(corrupt)
        assert str(raised.value).startswith("not a batchfit gate report: "), str(raised.value)
        assert fragment in str(raised.value), str(raised.value)

    refused({"batch_size": -1}, "field 'batch_size' must be an int in [1, 2**63), got int -1")
    refused({"largest_fit": -1}, "field 'largest_fit' must be an int in [0, 2**63) or null, got int -1")
    refused({"budget_bytes": 10**400}, "field 'budget_bytes' must be an int in [0, 2**63) or null, got int 1000")
    refused({"elapsed_s": -1.0}, "field 'elapsed_s' must be a number >= 0, got float -1.0")
    refused({"device.type": "tpu"}, "field 'device.type' must be one of 'cpu', 'cuda', 'xpu'")
    refused({"trial.phase_peaks.0": ["loss", 1]}, "field 'trial.phase_peaks[0][0]' must be one of 'batch'")
    refused({"search.settings.headroom": 1.5}, "field 'search.settings.headroom' must be a number in [0, 1)")
    refused(
        {"search.settings.mode": "serve"},
        "field 'search.settings.mode' must be one of 'train', 'inference', 'eval', 'generate'",
    )
    refused({"search.max_batch": -2}, "field 'search.max_batch' must be an int in [1, 2**63), got int -2")
    refused({"search.schema": "batchfit.result/2"}, "field 'search.schema' is 'batchfit.result/2'")
    refused({"fits": "yes"}, "field 'fits' must be true or false, got str 'yes'")
    refused({"extra": 1}, "unknown field 'extra'")
    refused({"schema": "batchfit.gate/2"}, "schema is 'batchfit.gate/2', expected 'batchfit.gate/1'")
    refused("[]", "the document is a list, not an object")
    refused("{", "invalid JSON")
    refused("[" * 100_000, "nested too deeply")
    assert GateReport.from_json(text) == report


def test_check_fits_rejects_keywords_it_cannot_honour() -> None:
    model, sample = wide()
    with pytest.raises(TypeError, match="max_batch"):
        check_fits(model, sample, batch_size=8, memory_limit=LIMIT, max_batch=16)
    with pytest.raises(TypeError, match="bogus"):
        check_fits(model, sample, batch_size=8, memory_limit=LIMIT, bogus=1)
    with pytest.raises(ValueError, match="batch_size"):
        check_fits(model, sample, batch_size=0, memory_limit=LIMIT)


def _mib(nbytes: int | None) -> str:
    from batchfit.units import format_bytes

    return format_bytes(nbytes)


# The pytest plugin ------------------------------------------------------------------------------
MARKED = textwrap.dedent(
    """
    import pytest

    @pytest.mark.cuda
    def test_needs_a_gpu():
        import torch
        assert torch.cuda.is_available()

    def test_plain():
        pass
    """
)


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A separate pytest run with only this plugin loaded explicitly (autoload off, so an
    installed entry point does not register it twice)."""
    (tmp_path / "test_marked.py").write_text(MARKED)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "batchfit.testing.pytest_plugin", "-p", "no:cacheprovider", "-rs"]
        + list(args),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_cuda_marker_is_registered_and_skips_without_a_device(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--strict-markers", "test_marked.py")

    if torch.cuda.is_available():
        assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout
        assert "1 passed, 1 skipped" in proc.stdout
        assert "no CUDA device" in proc.stdout


@pytest.mark.slow
def test_require_cuda_turns_the_skip_into_a_failure(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--require-cuda", "test_marked.py")

    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stdout
    else:
        assert proc.returncode == 1 and "1 passed, 1 error" in proc.stdout, proc.stdout
        assert "--require-cuda: no CUDA device" in proc.stdout


def test_markers_list_mentions_cuda(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--markers")

    assert "@pytest.mark.cuda: needs a CUDA device" in proc.stdout


def test_installed_package_declares_the_plugin_entry_point() -> None:
    try:
        dist = importlib.metadata.distribution("batchfit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("batchfit is not installed (running from the source tree)")
    plugins = {ep.name: ep.value for ep in dist.entry_points if ep.group == "pytest11"}
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert plugins == {"batchfit": "batchfit.testing.pytest_plugin"}
    assert scripts == {"batchfit": "batchfit.cli:main"}


@pytest.mark.cuda
def test_assert_fits_on_cuda_under_a_limit() -> None:
    model, sample = wide()

    report = assert_fits(model, sample, batch_size=8, memory_limit="256MiB", device="cuda")
    assert report.device.type == "cuda" and report.budget_bytes == 256 * 2**20
    with pytest.raises(AssertionError, match="does not fit within 256.00 MiB"):
        assert_fits(model, sample, batch_size=65536, memory_limit="256MiB", device="cuda")

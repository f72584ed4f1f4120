"""The GPU proof's judging (``benchmarks/gpu.py``), on CPU: what it reads a GPU run by.

A GPU is lent for minutes; a proof that misreads a healthy run wastes them. So how it counts the
CUDA tests' skips (only tests marked ``cuda``, only for a reason it lists) and how wide it lets the
estimate be (one batch either side of ``find()``'s max at least) are checked here, from a real
pytest run's JUnit XML where one can be made on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import proof_checks as pc  # noqa: E402  (benchmarks/ is no package)

from batchfit.testing.pytest_plugin import CUDA_PROPERTY  # noqa: E402


def test_the_proof_reads_the_property_the_plugin_writes() -> None:
    assert pc.CUDA_PROPERTY == CUDA_PROPERTY


def test_a_real_junit_report_counts_skips_of_cuda_tests_only(tmp_path: Path) -> None:
    """A module that skips itself at collection (ray missing) is no CUDA test; a CUDA test that
    skips for a reason not listed is (here: no CUDA device, as on this machine)."""
    (tmp_path / "test_needs_ray.py").write_text(
        "import pytest\npytest.importorskip('batchfit_no_such_module')\n\ndef test_x():\n    pass\n"
    )
    (tmp_path / "test_gpu.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.cuda
            def test_on_the_gpu():
                pass

            def test_plain():
                pass

            def test_broken():
                assert False
            """
        )
    )
    xml = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "batchfit.testing.pytest_plugin", "-p", "no:cacheprovider"]
        + ["-q", f"--junitxml={xml}", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env={**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert xml.exists(), done.stdout + done.stderr
    cases = pc.read_junit(xml)
    assert list(cases.skipped) == ["test_gpu::test_on_the_gpu"]  # no CUDA here, and that is no listed reason
    assert cases.skipped["test_gpu::test_on_the_gpu"].startswith("no CUDA device")
    assert len(cases.other_skips) == 1 and "batchfit_no_such_module" in next(iter(cases.other_skips.values()))
    assert cases.failed == ["test_gpu::test_broken"]
    assert cases.ran == [] and cases.allowed_skips == {}  # test_plain ran, but it is no CUDA test


def test_a_cuda_test_skipped_for_a_listed_reason_is_allowed(tmp_path: Path) -> None:
    """As pytest writes a CUDA test that skipped itself on a one-GPU box (tests/test_cuda.py)."""
    xml = tmp_path / "report.xml"
    xml.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_a_probe_on_cuda_1"><properties>'
        '<property name="batchfit-marker" value="cuda" /></properties>'
        '<skipped type="pytest.skip" message="needs two visible CUDA devices (cuda:1)">skip</skipped></testcase>'
        '<testcase classname="tests.test_cuda" name="test_ran"><properties>'
        '<property name="batchfit-marker" value="cuda" /></properties></testcase>'
        "</testsuite></testsuites>"
    )
    cases = pc.read_junit(xml)
    assert list(cases.allowed_skips) == ["tests.test_cuda::test_a_probe_on_cuda_1"]
    assert cases.skipped == {} and cases.failed == [] and cases.ran == ["tests.test_cuda::test_ran"]


@pytest.mark.parametrize(
    ("estimated", "found", "passes"),
    [
        (19, 18, True),  # one batch above: the band alone (x1.056) failed it
        (17, 18, True),
        (20, 18, False),
        (15, 18, False),
        (2, 1, True),
        (3, 1, False),
        (105, 100, True),
        (106, 100, False),
        (85, 100, True),
        (84, 100, False),
    ],
)
def test_the_estimate_passes_within_the_band_or_one_batch(estimated: int, found: int, passes: bool) -> None:
    assert pc.estimate_within_band(estimated, found) is passes


@pytest.mark.parametrize(
    ("tail", "finished"),
    [
        # the third H200 run: every test passed, then the slice's end came before pytest exited
        ("....s....\n31 passed, 3 skipped, 1617 deselected in 147.01s (0:02:27)\n\n[timed out", True),
        # the same run's part 2: stopped mid-run, pytest still prints the count of what ran
        ("!!!! KeyboardInterrupt !!!!\n2 failed, 2 skipped, 1643 deselected, 15 warnings in 149.96s\n", False),
        ("........\n[timed out after 150 s]", False),
    ],
)
def test_a_pytest_run_that_printed_its_closing_count_is_not_read_as_stopped(tail: str, finished: bool) -> None:
    assert pc.pytest_finished(tail) is finished

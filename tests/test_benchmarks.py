"""Smoke test: benchmarks/compare.py runs end to end on its smallest case, so it cannot rot.

Benchmarks are not tests: nothing here looks at a timing. It checks that the script runs, that
the exhaustive scan and both batchfit strategies agree on the boundary (the CPU meter is
deterministic), and that Lightning and Accelerate rows either ran or say they were skipped
because the package is not installed (CI installs only the dev extra). The GPU proof command,
``benchmarks/gpu.py``, only has its ``--help`` checked here: its judging is tested in
``tests/test_gpu_proof.py`` and its two parts run on CPU as a step of ``.ci/run``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "compare.py"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--case", "cnn", "--cap", "1MB", "--steps", "1", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (written,) = out.glob("compare-cpu-*.json")
    return done.stdout, json.loads(written.read_text())


@pytest.mark.slow
def test_table_and_json_are_written(smoke: tuple[str, dict]) -> None:
    stdout, document = smoke
    assert "exhaustive scan" in stdout and "batchfit" in stdout and "knee" in stdout
    assert document["schema"] == "batchfit.benchmark/1"
    assert {"date", "machine", "versions", "oom_recognition"} <= document.keys()
    assert document["versions"]["torch"]
    (case,) = document["cases"]
    assert case["model"] == "cnn" and case["cap_bytes"] == 1_000_000
    assert case["throughput"]["exhaustive"]["knee"] is not None


@pytest.mark.slow
def test_batchfit_strategies_find_the_exhaustive_truth(smoke: tuple[str, dict]) -> None:
    (case,) = smoke[1]["cases"]
    truth = case["truth"]
    assert truth >= 1
    rows = {(r["finder"], r["setting"]): r for r in case["rows"]}
    for strategy in ("binary", "interpolate"):
        row = rows[("batchfit", strategy)]
        assert row["found"] == truth and row["delta"] == 0
        assert row["trials"] == len(row["sizes"]) >= 2


@pytest.mark.slow
@pytest.mark.parametrize(("module", "finder"), [("lightning", "Lightning"), ("accelerate", "Accelerate")])
def test_peers_run_or_are_skipped_cleanly(smoke: tuple[str, dict], module: str, finder: str) -> None:
    stdout, document = smoke
    rows = [r for r in document["cases"][0]["rows"] if r["finder"] == finder]
    assert rows
    if importlib.util.find_spec(module) is None:
        assert len(rows) == 1 and rows[0]["skipped"] == f"{module} is not installed"
        assert f"skipped: {module} is not installed" in stdout
        assert module not in document["oom_recognition"]
    else:
        assert all(r["skipped"] is None and r["trials"] for r in rows)
        assert all(document["oom_recognition"][module].values()), "peer does not recognise the cap's OOM"


def test_gpu_proof_command_starts() -> None:
    """``benchmarks/gpu.py --help`` runs without torch or a GPU (its parent process never imports torch)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--deadline" in done.stdout and "--part" in done.stdout and "--out" in done.stdout

"""Smoke test: ``benchmarks/buckets.py --quick`` runs end to end, so the script cannot rot.

Benchmarks are not tests: nothing here looks at a timing or a rate. It checks what the CPU meter
makes deterministic: the script runs, writes its JSON, every bucket's exact max is the plain
``find()``'s at that length, and the epochs at the plan's bucket sizes and token budget replay
with 0 OOM (issue 50's soak goal).
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
SCRIPT = ROOT / "benchmarks" / "buckets.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the cases are transformers models"),
]


def test_quick_run_writes_its_goals(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--rounds", "1", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (written,) = tmp_path.glob("buckets-cpu-*.json")
    (case,) = json.loads(written.read_text())["cases"]
    assert case["goals"]["zero_oom"]["held"], case["goals"]["zero_oom"]
    assert case["goals"]["bucket_max_exact"]["held"], case["buckets"]
    names = [policy["policy"] for policy in case["policies"]]
    assert names == ["buckets", "token budget", "fixed", "verl padded", "verl packed", "packing"]
    assert "goal analysis_le_3x" in done.stdout

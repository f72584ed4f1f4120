"""Smoke test: ``benchmarks/schedule.py --quick`` runs end to end, so the script cannot rot.

Benchmarks are not tests: nothing here looks at a timing, a loss or a step count. It checks what the
script promises whatever the numbers: its JSON and picture are written, every policy trained the same
samples from the same micro-batch, never above the verified safe batch, with no step out of memory, and
each run's realised schedule reads back.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.report.schedule import ScheduleState

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "schedule.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the script draws its picture"),
]


def test_quick_run_writes_its_goals_and_picture(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (written,) = tmp_path.glob("schedule-cpu-*.json")
    assert written.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(written.read_text())
    assert {r["policy"] for r in document["runs"]} == {"constant", "ramp", "seesaw", "noise"}
    micro = document["micro_batch"]
    assert micro <= document["safe_batch"]
    for run in document["runs"]:
        assert run["largest_micro_batch"] == micro and run["oom"] == 0
        state = ScheduleState.from_dict(run["state"])
        assert state.rule.micro_batch == micro and state.samples == run["samples"]
    assert set(document["goals"]) >= {"meter overhead <= 2%", "no micro-batch above the safe batch, 0 OOM"}

"""`batchfit.schedule` under DDP: the big batch is the all-reduced gradient, every rank holds the
same window, and the run's weights are those of the same run without the meter
(``tests/schedule_ddp_job.py`` on two gloo ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@pytest.mark.distributed
def test_under_ddp_the_big_batch_is_the_all_reduced_gradient_and_the_ranks_agree(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(TESTS / "schedule_ddp_job.py"), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert "crash" not in record, f"rank {rank}:\n{record['crash']}"
    for accumulation in (1, 2):
        metered, plain = (records[0][f"{policy}{accumulation}"] for policy in ("noise", "constant"))
        assert metered["reduces"] and len(metered["windows"]) == 4
        for rank_record in records:
            mine = rank_record[f"noise{accumulation}"]
            assert mine["windows"] == metered["windows"]  # every rank holds the same window
            assert mine["accumulation"] == metered["accumulation"]
        for (small, big, big_batch), reduced in zip(metered["windows"], metered["reduced"]):
            assert big == pytest.approx(reduced, rel=1e-5)  # the all-reduced gradient's squared norm
            assert big_batch == 4 * accumulation * 2 and small > big
        assert metered["weights"] == plain["weights"]  # the measuring all-reduce reduces as DDP's does

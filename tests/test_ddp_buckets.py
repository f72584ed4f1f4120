"""DDP's gradient buckets count: each rank's answer is what real synchronised DDP steps fit.

A synchronised DDP step holds the gradients' bytes once more in DDP's buckets, made when the model
was wrapped, which the CPU meter used to miss: every rank's max batch came out one too large (issue
48). ``tests/ddp_buckets_job.py`` probes two real models on two gloo ranks with different limits,
then runs real synchronised DDP steps at each rank's own max batch and one more, on a fresh model
wrapped under an independent live-tensor meter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@pytest.mark.distributed
@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_each_ranks_max_batch_is_what_synchronised_ddp_steps_fit(tmp_path: Path, model: str) -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, str(TESTS / "ddp_buckets_job.py"), str(tmp_path), model],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert "crash" not in record, f"rank {rank}:\n{record['crash']}"
    per_rank = records[0]["per_rank"]
    assert records[1]["per_rank"] == per_rank and per_rank[0] > per_rank[1]  # the limits differ in what fits
    assert records[0]["max_batch"] == min(per_rank)  # the group's answer: what fits on every rank
    for rank, record in enumerate(records):
        mine, limit = per_rank[rank], record["limit_bytes"]
        fits, beyond = record["peaks"][str(mine)], record["peaks"][str(mine + 1)]
        said = f"rank {rank} under {limit:,} B: max {mine} peaks {fits:,} B, {mine + 1} peaks {beyond:,} B"
        assert fits <= limit < beyond, said

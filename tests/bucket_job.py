"""Two ranks (gloo, CPU) where rank 1 can hold a step's gradients but not the all-reduce's bucket, for
``tests/test_ranks.py``.

Run as ``python tests/bucket_job.py OUT_DIR``: two spawned processes join one process group through a
file store in ``OUT_DIR`` and search a DDP-wrapped MLP together with plain SGD (no state, updates in
place: the only memory the optimizer step adds is the buffer the gradient buckets are all-reduced
through). Rank 1's limit holds the weights, the gradients and that buffer at small batches only, so
the search's larger trials run out of memory on rank 1 making that buffer, while rank 0 has room for
it. Each rank writes the result it got (or the error it raised) to ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from helpers import join_gloo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import batchfit

WORLD = 2
TIMEOUT_S = 20.0
FEATURES = 128
MAX_BATCH = 64


def mlp() -> nn.Module:
    """Big weights, small activations: the step, with its gradient bucket, is the peak phase."""
    return nn.Sequential(nn.Linear(FEATURES, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16))


def run_rank(rank: int, out: str) -> None:
    record: dict[str, Any] = {}
    try:
        join_gloo(rank, out, WORLD)
        torch.manual_seed(0)
        ddp = DistributedDataParallel(mlp())
        weights = sum(p.numel() * p.element_size() for p in ddp.parameters())  # one bucket: under DDP's 25 MiB
        record["bucket_bytes"] = weights
        # Weights, DDP's own buckets, gradients and the all-reduce's buffer: 4 x the weights; then room
        # for the batch of about 16 samples.
        limit = 4 * weights + 16 * 1024 if rank == 1 else 16 * weights
        result = batchfit.find(
            ddp,
            torch.randn(4, FEATURES),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
            memory_limit=limit,
            max_batch=MAX_BATCH,
            rank_timeout=TIMEOUT_S,
        )
        record["result"] = {
            "max_batch": result.max_batch,
            "safe_batch": result.safe_batch,
            "trials": [[t.batch_size, t.fits, t.phase, t.message] for t in result.trials],
            "per_rank": [[a.rank, a.max_batch, a.safe_batch] for a in result.per_rank],
        }
    except BaseException as exc:
        record["crash"] = traceback.format_exc()
        record["raised"] = type(exc).__name__
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    mp.spawn(run_rank, args=(sys.argv[1],), nprocs=WORLD, join=True)

"""Two ranks (gloo, CPU) with 2:1 memory train one global batch unevenly, for ``tests/test_uneven.py``.

Run as ``python tests/uneven_job.py OUT_DIR``: two spawned processes join one process group through
a file store in ``OUT_DIR``, probe a DDP-wrapped MLP together with ``batchfit.find(...,
distributed=True)`` under their own memory limits (rank 0 twice rank 1's), split a global batch
``G`` unevenly with ``recommend(target_batch=G, uneven=True)``, and run one DDP step with
`batchfit.distributed.uneven_split`'s slices and loss weights. Each rank writes its gradient, the
gradient of one process on all ``G`` samples, and the probe's answer to ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from helpers import join_gloo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import batchfit
from batchfit.distributed import uneven_split

WORLD = 2
LIMITS = ("8MiB", "4MiB")
TIMEOUT_S = 60.0
FEATURES = 64


def mlp() -> nn.Module:
    """Wide activations, small weights: the batch moves the peak."""
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def run_rank(rank: int, out: str) -> None:
    record: dict[str, Any] = {}
    try:
        join_gloo(rank, out, WORLD)
        torch.manual_seed(0)
        model = mlp()
        reference = copy.deepcopy(model)  # the same weights, one process on every sample
        ddp = DistributedDataParallel(model)
        started = time.monotonic()
        result = batchfit.find(
            ddp, torch.randn(4, FEATURES), memory_limit=LIMITS[rank], distributed=True, rank_timeout=TIMEOUT_S
        )
        record["probe_s"] = time.monotonic() - started
        record["result"] = result.to_json()
        safe = [answer.safe_batch for answer in result.per_rank]
        target = 2 * sum(safe) + 1 if sum(safe) % 2 else 2 * sum(safe) - 2  # not a multiple of the ranks' sum
        rec = result.recommend(target_batch=target, uneven=True)
        record["recommendation"] = str(rec)
        record["target"] = target
        share = uneven_split(rec, rank)
        record["share"] = (share.part.start, share.part.stop, share.weight, share.accumulation, share.pass_batch)
        # The same global batch on every rank (one seed); each rank takes its part of every pass.
        data = torch.Generator().manual_seed(1)
        split = rec.uneven
        assert split is not None
        x = torch.randn(split.global_batch, FEATURES, generator=data)
        y = torch.randn(split.global_batch, 1, generator=data)
        loss_fn = nn.MSELoss()
        for step in range(split.accumulation):
            passed = slice(step * split.pass_batch, (step + 1) * split.pass_batch)
            xs, ys = x[passed][share.part], y[passed][share.part]
            (share.weight * loss_fn(ddp(xs), ys) / split.accumulation).backward()
        record["uneven"] = grads(ddp)
        ddp.zero_grad(set_to_none=True)
        for step in range(split.accumulation):  # the same split without the weights: not the mean
            passed = slice(step * split.pass_batch, (step + 1) * split.pass_batch)
            (loss_fn(ddp(x[passed][share.part]), y[passed][share.part]) / split.accumulation).backward()
        record["unweighted"] = grads(ddp)
        loss_fn(reference(x), y).backward()
        record["reference"] = grads(reference)
    except BaseException:
        record["crash"] = traceback.format_exc()
    torch.save(record, Path(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    mp.spawn(run_rank, args=(sys.argv[1],), nprocs=WORLD, join=True)

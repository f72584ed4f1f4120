"""Two gloo ranks train a DDP-wrapped GPT under `batchfit.schedule`, for ``tests/test_schedule_ddp.py``.

Run as ``python tests/schedule_ddp_job.py OUT_DIR``. Each rank draws its own batches. With one
micro-batch per step (DDP alone) and with two (``no_sync`` on the first, as Lightning and Accelerate
do): the meter's big batch is the all-reduced gradient (read here from ``p.grad`` before the
optimizer step), the window is the same on both ranks, and the weights after the run are those of
the same run without the meter, to the bit. Each rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp
from helpers import join_gloo
from torch.nn.parallel import DistributedDataParallel

import batchfit
from batchfit.examples import gpt, text_loader

WORLD = 2
SEQ = 16


def train(rank: int, accumulation: int, policy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, _ = gpt(vocab_size=256, seq_len=SEQ, d_model=32, n_layers=1, n_heads=2)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    schedule = batchfit.schedule(
        ddp, optimizer, micro_batch=4, accumulation=accumulation, policy=policy, every=1, min_steps=1, settle=1,
        decay=0.0, max_accumulation=4,
    )  # fmt: skip
    batches = iter(text_loader(seq_len=SEQ, batch_size=4, seed=rank))
    windows, reduced = [], []
    for _ in range(4):
        schedule.begin_step()
        micro = list(schedule.micro_batches(batches))
        for index, batch in enumerate(micro):
            last = index == len(micro) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                (ddp(**batch)["loss"] / len(micro)).backward()
        reduced.append(sum(float(p.grad.double().pow(2).sum()) for p in ddp.parameters()))
        meter = schedule.meter
        if meter is not None and meter.active:
            window = meter.stop(schedule.accumulation)
            windows.append(None if window is None else [window.small, window.big, window.big_batch])
            meter.start()  # end_step closes a window of its own; the one measured above is kept
        optimizer.step()
        optimizer.zero_grad()
        schedule.end_step()
    return {
        "windows": windows,
        "reduced": reduced,
        "accumulation": schedule.accumulation,
        "weights": [p.detach().double().sum().item() for p in model.parameters()],
        "reduces": schedule.meter is not None and schedule.meter.reduces,
    }


def run_rank(rank: int, out: str) -> None:
    record: dict[str, Any] = {}
    try:
        join_gloo(rank, out, WORLD)
        for accumulation in (1, 2):
            for policy in ("noise", "constant"):
                record[f"{policy}{accumulation}"] = train(rank, accumulation, policy)
    except BaseException:
        record["crash"] = traceback.format_exc()
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    mp.spawn(run_rank, args=(sys.argv[1],), nprocs=WORLD, join=True)

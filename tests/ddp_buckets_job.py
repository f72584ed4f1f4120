"""Two ranks (gloo, CPU) with different limits probe a real model in DDP, then check each rank's
answer with real synchronised DDP steps, for ``tests/test_ddp_buckets.py``.

Run as ``python tests/ddp_buckets_job.py OUT_DIR MODEL`` (``bert``: Hugging Face BERT from a small
config; ``gpt``: the built-in GPT): two spawned processes join one process group through a file
store in ``OUT_DIR``, probe the DDP-wrapped model with ``batchfit.find(..., distributed=True)``
under their own limits, then measure, at their own max batch and one more, the live-tensor peak
of two real synchronised DDP steps from a fresh AdamW (the probe's default) on a fresh copy of the
model, wrapped under the meter so that DDP's gradient buckets are counted like every other tensor.
Each rank writes its limit, the answers and those peaks to ``OUT_DIR/rank{r}.json``.
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
from batchfit.backends import LiveTensorMeter
from batchfit.examples import gpt
from batchfit.units import parse_memory_limit

WORLD = 2
TIMEOUT_S = 60.0
#: Per rank: limits where DDP's gradient buckets (the weights' bytes) decide the max batch.
LIMITS = {"bert": ("63.5MB", "38.3MB"), "gpt": ("40MiB", "28MiB")}


def bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=256,
        vocab_size=4096, max_position_embeddings=128,
    )  # fmt: skip
    ids = torch.randint(0, 4096, (2, 128), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}
    return transformers.BertForSequenceClassification(config), sample


BUILD = {"bert": bert, "gpt": gpt}


def synchronised_peak(name: str, batch_size: int) -> int:
    """The live-tensor peak of two real synchronised DDP steps at ``batch_size`` (every rank calls it)."""
    model, sample = BUILD[name]()
    rows = torch.arange(batch_size) % next(iter(sample.values())).shape[0]
    meter = LiveTensorMeter(None, None, tensors=[*model.parameters(), *model.buffers(), *sample.values()])
    with meter.active(), meter.tracking():
        ddp = DistributedDataParallel(model)  # its buckets are made here, under the meter
        optimizer = torch.optim.AdamW(ddp.parameters())
        batch = {key: value[rows] for key, value in sample.items()}
        with meter.phase("steps"):
            for _ in range(2):
                loss = ddp(**batch)["loss"]
                loss.backward()  # DDP all-reduces the gradients through its buckets
                del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        del batch, optimizer, ddp
    return meter.phase_peaks()["steps"]


def run_rank(rank: int, out: str, name: str) -> None:
    record: dict[str, Any] = {}
    try:
        join_gloo(rank, out, WORLD)
        model, sample = BUILD[name]()
        limit = LIMITS[name][rank]
        result = batchfit.find(
            DistributedDataParallel(model), sample, memory_limit=limit, distributed=True, rank_timeout=TIMEOUT_S
        )
        mine = result.per_rank[rank].max_batch
        record.update(
            limit_bytes=parse_memory_limit(limit, None),
            weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            max_batch=result.max_batch,
            per_rank=[answer.max_batch for answer in result.per_rank],
            peaks={size: synchronised_peak(name, size) for size in (mine, mine + 1)},
        )
    except BaseException:
        record["crash"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    mp.spawn(run_rank, args=(sys.argv[1], sys.argv[2]), nprocs=WORLD, join=True)

"""A target for ``batchfit probe --nproc-per-trial``: an MLP sharded with FSDP2 (``fully_shard``).

Its factory runs on every rank of a trial job after the process group is up. On rank 1 a
``Hog`` between two FSDP units holds 64 KiB more per sample through forward, so rank 1 alone runs
out of memory in forward at sizes where rank 0 fits and walks on into the next unit's all-gather:
in one process that is the hang (rank 0 waits for a rank that will never come).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


class Hog(nn.Module):
    """On rank 1 only: 16384 floats per sample kept alive until the next forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            self.held = torch.zeros(x.shape[0], 16384)
        return x


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    first, second = nn.Linear(256, 1024), nn.Linear(1024, 16)
    model = nn.Sequential(first, nn.ReLU(), Hog(), second)
    fully_shard(first)
    fully_shard(second)
    fully_shard(model)
    return model, torch.randn(4, 256)

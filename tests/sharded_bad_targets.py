"""Targets a sharded estimate must refuse by name, before any trace (``tests/test_sharded_estimate.py``)."""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from batchfit import examples


def not_sharded() -> tuple[Any, Any]:
    """The built-in GPT, never wrapped with fully_shard."""
    return examples.gpt(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2)


def mesh_too_big() -> tuple[Any, Any]:
    """A 2 x 2 mesh (HSDP over four ranks): not buildable in a group of two."""
    model, sample = not_sharded()
    fully_shard(model, mesh=init_device_mesh("cpu", (2, 2)))
    return model, sample


def on_cuda() -> tuple[Any, Any]:
    """The model put on CUDA, as a cluster's script would: this machine may have none."""
    model, sample = not_sharded()
    return model.cuda(), sample

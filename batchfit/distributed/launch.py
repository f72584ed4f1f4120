"""``batchfit probe`` under ``torchrun``: one process per rank, one probe for the group.

``torchrun --nproc-per-node N -m batchfit probe TARGET ...`` starts N copies of the CLI with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in their environment. Each copy loads the target,
joins the default process group (NCCL on CUDA, gloo on the CPU), takes the GPU of its local
rank, wraps the target's model in ``DistributedDataParallel`` when it is not already (and the
header says so), and calls ``find()``: the ranks probe together (``batchfit.distributed.ranks``). Only rank 0
prints and writes ``--json``; the others stay silent unless they fail themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Launch:
    """This process's place in a ``torchrun`` job."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def device_for(self, device: str) -> str:
        """This rank's device: ``cuda`` becomes ``cuda:LOCAL_RANK``; an explicit index stays."""
        kind, _, index = device.partition(":")
        return f"{kind}:{self.local_rank}" if kind != "cpu" and not index else device

    def start(self, device: str) -> tuple[str, bool]:
        """Take this rank's device and join the default process group (unless the target
        already did); the group's backend and whether this process started the group (and so
        ends it, :meth:`finish`)."""
        import torch
        import torch.distributed as dist

        from batchfit.backends import backend_for

        placed = torch.device(device)
        backend = backend_for(placed)
        backend.bind(placed)
        if dist.is_initialized():
            return str(dist.get_backend()), False
        dist.init_process_group(backend=backend.process_group_backend)
        return backend.process_group_backend, True

    def wrap(self, model: Any, device: str) -> tuple[Any, bool]:
        """The model in ``DistributedDataParallel`` on ``device`` (as is when it already is one),
        and whether it was wrapped here."""
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from batchfit.backends import backend_for

        if isinstance(model, DistributedDataParallel) or _sharded(model):
            return model, False  # a sharded model is refused by the probe, with where to go instead
        placed = torch.device(device)
        model = model.to(placed)
        return DistributedDataParallel(model, device_ids=backend_for(placed).ddp_device_ids(placed)), True

    def finish(self, owned: bool) -> None:
        """Leave the process group this process started."""
        import torch.distributed as dist

        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _sharded(model: Any) -> bool:
    """Whether FSDP (1 or 2) already wraps the model: DDP on top would be wrong."""
    return any(
        cls.__name__ in ("FullyShardedDataParallel", "FSDPModule")
        for module in model.modules()
        for cls in type(module).__mro__
    )


def from_environment(environ: dict[str, str] | None = None) -> Launch | None:
    """The ``torchrun`` job this process is a rank of, ``None`` outside one (or a job of one:
    a single rank probes alone, as ``batchfit probe`` without ``torchrun`` does)."""
    env = os.environ if environ is None else environ
    try:
        rank, local_rank, world_size = (int(env[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except (KeyError, ValueError):
        return None
    if world_size < 2:
        return None
    return Launch(rank=rank, local_rank=local_rank, world_size=world_size)

"""``batchfit probe`` under ``torchrun``: one process per rank, one probe for the group.

``torchrun --nproc-per-node N -m batchfit probe TARGET ...`` starts N copies of the CLI with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in their environment. Each copy loads the target,
joins the default process group (NCCL on CUDA, gloo on the CPU), takes the GPU of its local
rank, wraps the target's model in ``DistributedDataParallel`` when it is not already (and the
header says so), and calls ``find()``: the ranks probe together (``batchfit.distributed.ranks``). Only rank 0
prints and writes ``--json``; the others stay silent unless they fail themselves.

Any launcher that sets the same variables and ``MASTER_ADDR``/``MASTER_PORT`` works too (``srun``
with one task per GPU, a pod per rank). No agent watches such a job, so joining the group is
bounded by the rank timeout (`Launch.start`): a rank that died before joining ends the
others with an error saying so, not after gloo's default 30 minutes.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from batchfit.backends import backend_for
from batchfit.backends.select import is_host
from batchfit.errors import RanksTimeoutError, first_line


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
        return f"{kind}:{self.local_rank}" if not is_host(kind) and not index else device

    def start(self, device: str, timeout_s: float) -> tuple[str, bool]:
        """Take this rank's device and join the default process group (unless the target
        already did); the group's backend and whether this process started the group (and so
        ends it, `finish`).

        ``timeout_s`` (the rank timeout) bounds the joining: the store's rendezvous (rank 0
        waiting for every rank to connect, the others for rank 0's store) and the group's
        setup take ``init_process_group``'s timeout. Without it a rank that died before joining
        leaves the others waiting gloo's default 30 minutes when nothing else watches the job
        (``srun``, a plain pod: torchrun's agent would have ended it). It is also the group's
        timeout for the data collectives (DDP's gradient all-reduce), which a probe starts only
        once every rank agreed to, so no rank waits long in them."""
        placed = torch.device(device)
        backend = backend_for(placed)
        backend.bind(placed)
        if dist.is_initialized():
            return str(dist.get_backend()), False
        try:
            dist.init_process_group(
                backend=backend.process_group_backend, timeout=datetime.timedelta(seconds=timeout_s)
            )
        except dist.DistError as exc:
            raise RanksTimeoutError(self._not_joined(timeout_s, exc)) from None
        return backend.process_group_backend, True

    def _not_joined(self, timeout_s: float, exc: BaseException) -> str:
        where = f" at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if "MASTER_PORT" in os.environ else ""
        return (
            f"rank {self.rank} of {self.world_size} could not join the process group{where} within {timeout_s:g} s "
            "(--rank-timeout): a rank failed or died before joining (its own output says why), was never started, "
            f"or the address is wrong ({first_line(exc)})"
        )

    def wrap(self, model: Any, device: str) -> tuple[Any, bool]:
        """The model in ``DistributedDataParallel`` on ``device`` (as is when it already is one),
        and whether it was wrapped here."""
        if isinstance(model, DistributedDataParallel) or _sharded(model):
            return model, False  # a sharded model is refused by the probe, with where to go instead
        placed = torch.device(device)
        model = model.to(placed)
        return DistributedDataParallel(model, device_ids=backend_for(placed).ddp_device_ids(placed)), True

    def finish(self, owned: bool) -> None:
        """Leave the process group this process started."""
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _sharded(model: Any) -> bool:
    """Whether FSDP (1 or 2) already wraps the model: DDP on top would be wrong."""
    return any(
        cls.__name__ in ("FullyShardedDataParallel", "FSDPModule")
        for module in model.modules()
        for cls in type(module).__mro__
    )


#: Where a launcher says a rank's place on its node, in the order read: torchrun's, then srun's and
#: the MPI launchers' own (``srun`` sets ``SLURM_LOCALID``, not ``LOCAL_RANK``).
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def from_environment(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The job this process is a rank of (``RANK`` and ``WORLD_SIZE``, the local rank from
    `LOCAL_RANK_VARIABLES`), ``None`` outside one (or a job of one: a single rank probes
    alone, as ``batchfit probe`` without ``torchrun`` does). ``ValueError`` for a job whose rank
    has no local rank: each rank probing alone would be a wrong answer, not a slow one."""
    env = os.environ if environ is None else environ
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world_size < 2:
        return None
    local = next((name for name in LOCAL_RANK_VARIABLES if env.get(name, "").strip().isdigit()), None)
    if local is None:
        raise ValueError(
            f"RANK={rank} and WORLD_SIZE={world_size} are set but no local rank is "
            f"({', '.join(LOCAL_RANK_VARIABLES)}): set LOCAL_RANK to this rank's place on its node "
            "(under srun: LOCAL_RANK=$SLURM_LOCALID), or launch with torchrun"
        )
    return Launch(rank=rank, local_rank=int(env[local]), world_size=world_size)

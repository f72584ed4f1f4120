"""The processes a probe runs on: this one alone, or every rank of a ``torch.distributed`` job.

* `solo`: `Solo`, this process alone, and the interface every
  set of ranks implements (the probe only ever talks to that interface);
* `ranks`: `Group`, every rank of the default process group,
  meeting after every phase of every step so that one rank's out-of-memory fails the trial on all
  of them and none hangs (its module docs say why and how); `ranks_for` picks one;
* `launch`: ``batchfit probe`` under ``torchrun`` (joining the group,
  binding a rank to its device, wrapping the model in DDP);
* `uneven`: `uneven_split`, a rank's part of each pass and its loss weight when one global batch
  is split unevenly over ranks that fit different batches (``Result.recommend(uneven=True)``).

Sharded models (FSDP) are probed a job per trial instead: `batchfit.probe.job_runner`.
"""

from batchfit.distributed.launch import Launch, from_environment
from batchfit.distributed.ranks import combine_trials, leads, ranks_for
from batchfit.distributed.solo import PeerOutOfMemory, Solo
from batchfit.distributed.uneven_share import uneven_split

__all__ = [
    "Launch",
    "PeerOutOfMemory",
    "Solo",
    "combine_trials",
    "from_environment",
    "leads",
    "ranks_for",
    "uneven_split",
]

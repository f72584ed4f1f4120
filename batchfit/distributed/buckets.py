"""DDP's gradient buckets: memory every DDP step holds beside the gradients, and how a probe counts it.

``DistributedDataParallel`` gives each group of gradients (up to ``bucket_cap_mb``) one flat *bucket*:
a synchronised backward copies every gradient into its bucket, all-reduces the bucket and copies it
back (with ``gradient_as_bucket_view=True`` the gradient stays a view into it). The buckets are made
when the model is wrapped and live as long as it: one more gradient's worth of memory beside the
weights, the gradients and the optimizer state, in every step, whether it synchronises or not (a probe
step runs under ``no_sync()``: ``batchfit.distributed.ranks``).

A device's allocator counts them like any other allocation: they were allocated before the probe, so
they are in every trial's peak. The CPU's live-tensor meter counts what it sees made during a trial
and the tensors it is told exist (the weights, the sample), and the buckets are neither: DDP made them
in C++ before the probe, and no Python object reaches them. So the meter is told of them too
(`Buckets.held`): one stand-in per bucket, a CPU tensor of that bucket's size as DDP records it (its
logging data's ``bucket_sizes``), never written. Without them every DDP answer on the CPU was measured
without the buckets: a rank's max batch was one too large where their bytes decided it (BERT on two
gloo ranks: 12 and 6 where real synchronised steps fit 11 and 5).

DDP rebuilds its buckets once, in the forward after its first synchronised backward (in the order
the gradients became ready). On the CPU the meter sees the new buckets made there (under a DDP probed
with ``distributed=False``, or one that synchronised once just before the probe) and counts them
from then on, so the stand-ins go at the end of that trial (`Buckets.settle`); that one trial counted
the buckets twice from the rebuild on, erring on the safe side.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchfit.backends.select import is_host

__all__ = ["Buckets", "bucket_bytes", "ddp_of", "grad_buckets"]


def ddp_of(model: nn.Module) -> Any:
    """``model`` when it is a ``DistributedDataParallel``, else ``None``."""
    from torch.nn.parallel import DistributedDataParallel

    return model if isinstance(model, DistributedDataParallel) else None


def bucket_bytes(ddp: Any) -> list[int]:
    """Every bucket's size in bytes, as DDP recorded it when it made them. A DDP without that record
    holds one slot per trainable parameter's gradient: their bytes, as one."""
    recorded = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    sizes = [int(size) for size in recorded.split(",") if size.strip()]
    return sizes or [sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)]


class Buckets:
    """The stand-ins a CPU meter counts for a DDP model's gradient buckets during one probe."""

    def __init__(self) -> None:
        self._ddp: Any = None
        self._stand_ins: list[torch.Tensor] = []
        self._rebuilt = True

    def held(self, model: nn.Module) -> list[torch.Tensor]:
        """One stand-in per bucket of ``model`` on the CPU, to hand the meter with the weights; none
        for a model that is not DDP, or whose buckets are on a device (its allocator counts them)."""
        ddp = ddp_of(model)
        if ddp is None or not all(is_host(p.device) for p in ddp.parameters()):
            return []
        self._ddp, self._rebuilt = ddp, bool(getattr(ddp, "_has_rebuilt_buckets", True))
        # Never written: the bytes are counted, the pages never touched.
        self._stand_ins = [torch.empty(size, dtype=torch.uint8) for size in bucket_bytes(ddp)]
        return list(self._stand_ins)

    def settle(self) -> None:
        """At a trial's end: where DDP rebuilt its buckets during it, the meter saw the new ones
        made and counts them from now on, so the stand-ins go (see the module docs)."""
        if self._ddp is not None and not self._rebuilt and getattr(self._ddp, "_has_rebuilt_buckets", False):
            self._stand_ins, self._rebuilt = [], True

    def drop(self) -> None:
        """The probe is over: nothing is counted any more."""
        self._ddp, self._stand_ins = None, []


def grad_buckets(grads: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """``grads`` in order, in runs of one dtype and device of at most ``cap_bytes`` (a gradient
    larger than the cap is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > cap_bytes or (last[0].dtype, last[0].device) != (grad.dtype, grad.device):
            buckets.append([grad])
            size = nbytes
        else:
            last.append(grad)
            size += nbytes
    return buckets

"""The gradient noise scale *during* training, from gradients the step computes anyway: `NoiseMeter`.

Under gradient accumulation a step's ``K`` micro-batch gradients ``r_i`` are added into ``p.grad``
one backward at a time. A hook on each trainable parameter (``Tensor.register_hook``) sees every
``r_i`` *before* it is added, so a metered step costs two dot products per parameter and micro-batch,
no copy of any gradient:

* ``small``: ``sum_i |r_i|^2`` (the micro-batches' squared norms);
* ``big``: ``|sum_i r_i|^2``, kept as it grows: ``|A + r|^2 = |A|^2 + 2 <A, r> + |r|^2`` with ``A`` the
  ``p.grad`` the hook finds (``None`` or zeros after ``zero_grad``).

The loss of each micro-batch is divided by ``K`` (Lightning, the Trainer and
[`BatchSchedule`][batchfit.probe.batch_schedule.BatchSchedule] do), so ``r_i = g_i / K``; in the units
of one micro-batch's mean loss the window is ``small = K sum_i |r_i|^2`` and ``big = |sum_i r_i|^2``,
exactly the two-batch-size estimator's inputs (McCandlish et al. 2018, ``batchfit.report.noise``).
A ``GradScaler``'s scale (read when the step begins) is taken out of both.

Under DDP the big batch is the all-reduced gradient of ``K x b x world_size`` rows: a communication
hook (``register_comm_hook``, doing what DDP's default all-reduce does: divide by the world size
and sum) adds each bucket's squared norm as it arrives, and the ranks average their ``small`` and
``big`` in one all-reduce of two numbers, so every rank holds the same window, to the bit, and decides
the same change. A DDP
model that already has a communication hook is measured on its micro-batches alone (``K >= 2``).

Nothing the step computes changes: the hooks return ``None`` (the gradient passes through as it
came) and the communication hook returns the very tensor the default all-reduce would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from batchfit.report.schedule import Window

__all__ = ["NoiseMeter"]


class NoiseMeter:
    """Squared norms of one step's micro-batch gradients (see the module docs).

    Args:
        model: the module trained, DDP-wrapped where it trains data-parallel.
        micro_batch: rows per micro-batch on each rank.
    """

    def __init__(self, model: nn.Module, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters: there is no gradient to measure")
        #: Where the ranks' numbers are all-reduced: the weights' device, which the process group reduces on.
        self.device = self.params[0].device
        self._handles: list[Any] = []
        self._small: list[torch.Tensor] = []
        self._big: list[torch.Tensor] = []
        self._reduced: dict[int, torch.Tensor] = {}
        self._scale = 1.0
        self.reduces = self.ddp is not None and self._hooked_reduction(self.ddp)

    @property
    def active(self) -> bool:
        """Whether the current step is being metered."""
        return bool(self._handles)

    def start(self, loss_scale: float = 1.0) -> None:
        """Meter the step about to run; ``loss_scale``: a ``GradScaler``'s scale for its backward passes."""
        self.stop_without_window()
        self._scale = float(loss_scale)
        self._handles = [p.register_hook(self._hook_for(p)) for p in self.params]

    def stop(self, accumulation: int) -> Window | None:
        """The metered step's window (``None`` when it has no second batch size), the hooks removed."""
        small_sum, big, reduced = self._sums()
        self.stop_without_window()
        k = accumulation
        small = k * small_sum / self._scale**2
        if self.reduces and reduced is not None:
            big_batch, window_big = k * self.micro_batch * self.world_size, reduced / self._scale**2
        elif k < 2:
            return None
        else:
            big_batch, window_big = k * self.micro_batch, big / self._scale**2
        if self.world_size > 1:
            # The ranks average their numbers, so every rank holds the same window by construction: even the
            # all-reduced gradient's norm may differ in its last bits between ranks (a float32 dot product's
            # summation order follows the buffer's alignment), and a decision must not.
            totals = torch.tensor([small, window_big], dtype=torch.float64, device=self.device)
            dist.all_reduce(totals)
            small, window_big = (float(v) / self.world_size for v in totals)
        return Window(small, window_big, self.micro_batch, big_batch)

    def stop_without_window(self) -> None:
        """Remove the hooks and forget what they saw (a step abandoned, or the run ending)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._small, self._big, self._reduced = [], [], {}

    def _hook_for(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if grad.is_sparse:
                raise ValueError(
                    "the noise meter reads dense gradients; a sparse one (nn.Embedding(sparse=True)) has no norm here"
                )
            incoming = grad.detach().reshape(-1).float()
            square = torch.dot(incoming, incoming)
            self._small.append(square)
            held = param.grad
            if held is None:
                self._big.append(square)
            else:
                self._big.append(square + 2 * torch.dot(held.detach().reshape(-1).float(), incoming))

        return hook

    def _sums(self) -> tuple[float, float, float | None]:
        """``sum |r_i|^2``, ``|sum r_i|^2`` and the all-reduced gradient's (or ``None``), with one sync."""
        reduced = list(self._reduced.values())
        parts = [torch.stack(v).double().sum() if v else None for v in (self._small, self._big, reduced)]
        small, big, reduced = (None if p is None else float(p) for p in parts)
        return small or 0.0, big or 0.0, reduced

    def _hooked_reduction(self, ddp: DistributedDataParallel) -> bool:
        """Register the all-reduce that also measures, for whichever meter the model names now (a second
        schedule on the same model takes it over: DDP takes one hook, once); ``False`` when the model has
        a hook of its own."""
        if getattr(ddp, "_batchfit_meter", None) is not None:
            ddp._batchfit_meter = self  # type: ignore[assignment]
            return True
        if getattr(ddp, "_comm_hooks", None):
            return False
        world = self.world_size

        # No annotations: DDP compares them with dist.GradBucket, and under postponed evaluation they are strings.
        def allreduce_and_measure(state, bucket):  # type: ignore[no-untyped-def]
            index = bucket.index()
            tensor = bucket.buffer().div_(world)
            future = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr]

            def measured(done: torch.futures.Future[Any]) -> torch.Tensor:
                reduced: torch.Tensor = done.value()[0]
                meter: NoiseMeter = ddp._batchfit_meter  # type: ignore[assignment]
                if meter.active:
                    flat = reduced.reshape(-1).float()
                    meter._reduced[index] = torch.dot(flat, flat)  # a later reduction of a bucket replaces it
                return reduced

            return future.then(measured)

        ddp.register_comm_hook(None, allreduce_and_measure)
        ddp._batchfit_meter = self  # type: ignore[assignment]
        return True

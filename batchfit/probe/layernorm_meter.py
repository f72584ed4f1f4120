"""The noise scale from per-example gradients of the LayerNorms alone: `LayerNormMeter`.

Gray et al. (NeurIPS 2024) observed that the per-example gradient norms of a transformer's LayerNorm
parameters are almost free to compute and that the noise scale they give tracks the whole model's.
For ``y = gamma * x_hat + beta`` over the last dimension, example ``n``'s gradients are
``sum(dy_n * x_hat_n)`` and ``sum(dy_n)`` over its other positions: the output's gradient ``dy`` (a
tensor hook on the output) and ``x_hat`` (recomputed in the backward from the input autograd keeps
anyway) give every example's squared norm for a few reductions of the activation's size.

Each micro-batch is then a window of two batch sizes, ``1`` (an example) and ``b`` (the micro-batch):
``small`` the mean over examples of ``|g_n|^2``, ``big`` the micro-batch's ``|mean_n g_n|^2``, in
the units of one example's loss (the loss a mean over rows; the micro-batch's scaled by ``1/K``
under accumulation, as `NoiseMeter` assumes). So it needs neither accumulation nor DDP: one process,
one micro-batch per step, has both sizes. A step's windows (one per micro-batch, and under DDP every
rank's) are averaged, so every rank holds the same. Only ``nn.LayerNorm`` modules with an affine
weight are read, each used once per forward (a shared one's per-example gradients would add up before
their norm), and not under activation checkpointing (a forward recomputed in the backward would be
counted again: use ``meter="micro-batches"`` there); nothing the step computes changes (the hooks
return nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchfit.report.schedule import Window

__all__ = ["LayerNormMeter"]


class LayerNormMeter:
    """Per-example squared gradient norms of the LayerNorm parameters (see the module docs).

    Args:
        model: the module trained (DDP-wrapped or not).
        micro_batch: rows per micro-batch (at least 2: an example and the micro-batch).
    """

    reduces = False

    def __init__(self, model: nn.Module, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        self.norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm) and m.weight is not None]
        if not self.norms:
            raise ValueError(
                "the per-example (LayerNorm) noise meter reads nn.LayerNorm layers with weights, and the model has "
                "none: use meter='micro-batches' (gradient accumulation or DDP gives the second batch size)"
            )
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        #: Where the ranks' numbers are all-reduced: the weights' device, which the process group reduces on.
        self.device = self.norms[0].weight.device
        self._handles: list[Any] = []
        self._examples: list[torch.Tensor] = []  # per backward of a layer: each example's squared norm
        self._batches: list[torch.Tensor] = []  # per backward of a layer: its micro-batch gradient's
        self._scale = 1.0

    @property
    def active(self) -> bool:
        """Whether the current step is being metered."""
        return bool(self._handles)

    def start(self, loss_scale: float = 1.0) -> None:
        """Meter the step about to run; ``loss_scale``: a ``GradScaler``'s scale for its backward passes."""
        self.stop_without_window()
        self._scale = float(loss_scale)
        self._handles = [norm.register_forward_hook(self._forward_hook) for norm in self.norms]

    def stop(self, accumulation: int) -> Window | None:
        """The step's window, averaged over its micro-batches (and the ranks); the hooks removed."""
        examples, batches = self._examples, self._batches
        self.stop_without_window()
        if not examples:
            return None
        rows = examples[0].numel()
        # The layers' parameters are disjoint: an example's squared norm is the sum of its layers' parts.
        # A contribution is c_n = g_n / (K b) (the loss a mean over b rows, divided by K), times the scale.
        k, scale = accumulation, self._scale**2
        examples_sum = float(torch.stack([e.double().sum() for e in examples]).sum())
        batches_sum = float(torch.stack([b.double() for b in batches]).sum())
        small = (k * rows) ** 2 * examples_sum / (k * rows) / scale  # the mean |g_n|^2 over the step's rows
        big = k**2 * batches_sum / k / scale  # the mean over micro-batches of |mean_n g_n|^2
        if self.world_size > 1:
            totals = torch.tensor([small, big], dtype=torch.float64, device=self.device)
            dist.all_reduce(totals)
            small, big = (float(v) / self.world_size for v in totals)
        return Window(small, big, 1, rows)

    def stop_without_window(self) -> None:
        """Remove the hooks and forget what they saw."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._examples, self._batches = [], [], []

    def _forward_hook(self, module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        if not torch.is_grad_enabled() or not output.requires_grad:
            return
        norm: nn.LayerNorm = module  # type: ignore[assignment]
        output.register_hook(self._backward_for(norm, inputs[0]))

    def _backward_for(self, norm: nn.LayerNorm, x: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                dims = tuple(range(-len(norm.normalized_shape), 0))
                x32 = x.detach().float()
                mean = x32.mean(dims, keepdim=True)
                var = x32.var(dims, unbiased=False, keepdim=True)
                x_hat = (x32 - mean) * torch.rsqrt(var + norm.eps)
                dy = grad.detach().float()
                keep = (0, *range(dy.dim() - len(dims), dy.dim()))
                summed = tuple(d for d in range(dy.dim()) if d not in keep)  # the positions of each example
                weight = (dy * x_hat).sum(summed) if summed else dy * x_hat
                parts = [weight]
                if norm.bias is not None:
                    parts.append(dy.sum(summed) if summed else dy)
                flat = torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)
                self._examples.append(flat.pow(2).sum(1))
                total = flat.sum(0)
                self._batches.append(total @ total)

        return hook

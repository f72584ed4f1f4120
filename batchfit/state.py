"""Snapshot and exact restore of everything a probe touches on the user's objects.

A probe runs real training steps, which change parameters (optimizer steps), buffers
(BatchNorm running statistics), gradients, the random number generators and, with
``device=``, where the model lives. :class:`Snapshot` records all of it before the first trial
and puts it back in a ``finally``, so an OOM, a bug in the model or Ctrl-C leaves the user's
model and optimizer bit-for-bit as they were.

The copies live on the host. That matters when the device fails for good (a device-side
assert, an illegal address): then every call on the device fails, so :meth:`Snapshot.restore`
with ``device_usable=False`` rebinds each tensor that lived on the failed device to its host
copy instead of copying into it. The model comes back with its exact values, on the CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from batchfit.backends.base import Backend


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


@dataclass
class Snapshot:
    """What :func:`take` saw; :meth:`restore` puts it back. Not a public type."""

    model: nn.Module
    values: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    devices: list[tuple[torch.Tensor, torch.device]] = field(default_factory=list)
    grads: list[tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    requires_grad: list[tuple[nn.Parameter, bool]] = field(default_factory=list)
    training: list[tuple[nn.Module, bool]] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    optimizer_state: dict[Any, dict[str, Any]] = field(default_factory=dict)
    optimizer_groups: list[dict[str, Any]] = field(default_factory=list)
    cpu_rng: torch.Tensor | None = None
    backend: Backend | None = None
    device: torch.device | None = None
    device_rng: Any = None

    def restore(self, device_usable: bool = True) -> None:
        """Put everything back: device, values, grads, flags, optimizer state, RNG.

        ``device_usable=False``: the probe's device failed for good; tensors on it are rebound
        to their host copies and nothing is asked of the device (see the module docs).
        """
        failed = None if device_usable else self.device
        with torch.no_grad():
            for (tensor, device), (_, saved) in zip(self.devices, self.values):
                if _on(tensor, failed):
                    tensor.data = saved
                elif tensor.device != device:
                    tensor.data = tensor.data.to(device)
            for tensor, saved in self.values:
                if tensor.data_ptr() != saved.data_ptr():
                    tensor.copy_(saved)
        for param, grad in self.grads:
            param.grad = None if grad is None else (grad if _on(param, failed) else grad.to(param.device))
        for param, flag in self.requires_grad:
            param.requires_grad_(flag)
        for module, flag in self.training:
            module.training = flag
        self._restore_optimizer(failed)
        if self.cpu_rng is not None:
            torch.random.set_rng_state(self.cpu_rng)
        if device_usable and self.backend is not None and self.device is not None:
            self.backend.set_rng_state(self.device, self.device_rng)

    def _restore_optimizer(self, failed: torch.device | None) -> None:
        if self.optimizer is None:
            return
        state = self.optimizer.state
        for param in list(state):
            if param not in self.optimizer_state:
                del state[param]
        with torch.no_grad():
            for param, entries in self.optimizer_state.items():
                restored = {}
                for key, (original, saved) in entries.items():
                    if isinstance(original, torch.Tensor) and _on(original, failed):
                        original.data = saved
                        restored[key] = original
                    elif isinstance(original, torch.Tensor):
                        original.copy_(saved)
                        restored[key] = original
                    else:
                        restored[key] = saved
                state[param] = restored
        for group, saved in zip(self.optimizer.param_groups, self.optimizer_groups):
            for key, value in saved.items():
                group[key] = value


def _on(tensor: torch.Tensor, device: torch.device | None) -> bool:
    """Whether ``tensor`` lives on ``device`` (``None``: no device failed, so never)."""
    return device is not None and tensor.device.type == device.type and tensor.device.index == device.index


def take(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    backend: Backend | None = None,
    device: torch.device | None = None,
) -> Snapshot:
    """Record the model's parameters, buffers, grads, flags, the optimizer's state, and the RNG
    of the CPU and (through ``backend``) of the probe's device."""
    snap = Snapshot(model=model, backend=backend, device=device)
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        snap.values.append((tensor, _host_copy(tensor)))
        snap.devices.append((tensor, tensor.device))
    for param in model.parameters():
        snap.grads.append((param, None if param.grad is None else _host_copy(param.grad)))
        snap.requires_grad.append((param, param.requires_grad))
    snap.training = [(module, module.training) for module in model.modules()]
    if optimizer is not None:
        snap.optimizer = optimizer
        for param, entries in optimizer.state.items():
            snap.optimizer_state[param] = {
                key: (value, _host_copy(value)) if isinstance(value, torch.Tensor) else (value, copy.deepcopy(value))
                for key, value in entries.items()
            }
        snap.optimizer_groups = [
            {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups
        ]
    snap.cpu_rng = torch.random.get_rng_state()
    if backend is not None and device is not None:
        snap.device_rng = backend.get_rng_state(device)
    return snap

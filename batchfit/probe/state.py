"""Snapshot and exact restore of everything a probe touches on the user's objects.

A probe runs real training steps, which change parameters (optimizer steps), buffers
(BatchNorm running statistics, counters a forward reassigns), gradients, the random number
generators and, with ``device=``, where the model lives. `Snapshot` records all of it
before the first trial and puts it back in a ``finally``, so an OOM, a bug in the model or
Ctrl-C leaves the user's model and optimizer bit-for-bit as they were.

What is restored, and how:

* every module's parameter, buffer and submodule *slots* (``_parameters``, ``_buffers``,
  ``_modules``): a forward that reassigns a buffer (``self.steps = self.steps + 1``) or registers
  a new one is undone by putting the original objects back in their slots and dropping new ones;
* the values of every parameter and buffer, and of every parameter the user's optimizer holds
  outside the model (a temperature, a loss weight), copied back *into the original tensors*, so
  references the user holds stay valid; their device too;
* gradients: a gradient that is a view of a larger buffer (DDP's ``gradient_as_bucket_view``,
  flat-buffer optimizers) is restored into the original view, so the aliasing survives; other
  gradients come back as new tensors with the same values (holding the originals would keep
  their memory away from the probe);
* ``requires_grad`` flags, every module's train/eval flag, the user's optimizer state and
  hyperparameters (its own tensors, refilled in place);
* the CPU generator and the probe device's generators (``restore_rng=False`` leaves them: see
  [`Options`][batchfit.Options]). A private ``torch.Generator`` the model owns is *not*
  restored: batchfit cannot see it.

The copies live on the host. That matters when the device fails for good (a device-side
assert, an illegal address): then every call on the device fails, so `Snapshot.restore`
with ``device_usable=False`` rebinds each tensor that lived on the failed device to its host
copy instead of copying into it. The model comes back with its exact values, on the CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from batchfit.backends import Backend


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


@dataclass
class _Slots:
    """One module's registered parameters, buffers and submodules, by name."""

    module: nn.Module
    parameters: dict[str, Any]
    buffers: dict[str, Any]
    non_persistent: set[str]
    modules: dict[str, Any]

    @classmethod
    def of(cls, module: nn.Module) -> _Slots:
        return cls(
            module,
            dict(module._parameters),
            dict(module._buffers),
            set(module._non_persistent_buffers_set),
            dict(module._modules),
        )

    def restore(self) -> None:
        for live, saved in (
            (self.module._parameters, self.parameters),
            (self.module._buffers, self.buffers),
            (self.module._modules, self.modules),
        ):
            if live.keys() != saved.keys() or any(live[k] is not v for k, v in saved.items()):
                live.clear()
                live.update(saved)
        if self.module._non_persistent_buffers_set != self.non_persistent:
            self.module._non_persistent_buffers_set.clear()
            self.module._non_persistent_buffers_set.update(self.non_persistent)


@dataclass
class _Grad:
    """A parameter's gradient: ``None``, a host copy, and the original tensor when it is a view."""

    param: torch.Tensor
    host: torch.Tensor | None
    view: torch.Tensor | None


@dataclass
class Snapshot:
    """What `take` saw; `restore` puts it back. Not a public type."""

    model: nn.Module
    slots: list[_Slots] = field(default_factory=list)
    values: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    devices: list[tuple[torch.Tensor, torch.device]] = field(default_factory=list)
    grads: list[_Grad] = field(default_factory=list)
    requires_grad: list[tuple[torch.Tensor, bool]] = field(default_factory=list)
    training: list[tuple[nn.Module, bool]] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    optimizer_state: dict[Any, dict[str, Any]] = field(default_factory=dict)
    optimizer_groups: list[dict[str, Any]] = field(default_factory=list)
    cpu_rng: torch.Tensor | None = None
    backend: Backend | None = None
    device: torch.device | None = None
    device_rng: Any = None

    def restore(self, device_usable: bool = True, restore_rng: bool = True) -> None:
        """Put everything back: slots, device, values, grads, flags, optimizer state, RNG.

        ``device_usable=False``: the probe's device failed for good; tensors on it are rebound
        to their host copies and nothing is asked of the device (see the module docs).
        """
        failed = None if device_usable else self.device
        for slots in self.slots:
            slots.restore()
        with torch.no_grad():
            for (tensor, device), (_, saved) in zip(self.devices, self.values):
                if _on(tensor, failed):
                    tensor.data = saved
                elif tensor.device != device:
                    tensor.data = tensor.data.to(device)
            for tensor, saved in self.values:
                if tensor.shape != saved.shape or tensor.dtype != saved.dtype:
                    # Resized or re-typed in place (resize_, set_): the same tensor object gets
                    # the saved values in a storage of the saved shape.
                    tensor.data = saved.to(tensor.device, copy=True)
                elif tensor.data_ptr() != saved.data_ptr():
                    tensor.copy_(saved)
            for grad in self.grads:
                _restore_grad(grad, failed)
        for param, flag in self.requires_grad:
            param.requires_grad_(flag)
        for module, flag in self.training:
            module.training = flag
        self._restore_optimizer(failed)
        if not restore_rng:
            return
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


def _restore_grad(grad: _Grad, failed: torch.device | None) -> None:
    param = grad.param
    if grad.host is None:
        param.grad = None
    elif _on(param, failed):
        param.grad = grad.host
    elif grad.view is not None:
        grad.view.copy_(grad.host)
        param.grad = grad.view
    else:
        param.grad = grad.host.to(param.device)


def _on(tensor: torch.Tensor, device: torch.device | None) -> bool:
    """Whether ``tensor`` lives on ``device`` (``None``: no device failed, so never)."""
    return device is not None and tensor.device.type == device.type and tensor.device.index == device.index


def _optimizer_params(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [param for group in optimizer.param_groups for param in group["params"]]


def take(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    backend: Backend | None = None,
    device: torch.device | None = None,
) -> Snapshot:
    """Record the model's slots, parameters, buffers, grads and flags, the optimizer's state and
    the parameters it holds outside the model, and the RNG of the CPU and (through ``backend``)
    of the probe's device."""
    snap = Snapshot(model=model, backend=backend, device=device)
    snap.slots = [_Slots.of(module) for module in model.modules()]
    params = list(dict.fromkeys([*model.parameters(), *_optimizer_params(optimizer)]))
    for tensor in dict.fromkeys([*params, *model.buffers()]):
        snap.values.append((tensor, _host_copy(tensor)))
        snap.devices.append((tensor, tensor.device))
    for param in params:
        grad = param.grad
        view = grad if grad is not None and grad._base is not None else None
        snap.grads.append(_Grad(param, None if grad is None else _host_copy(grad), view))
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

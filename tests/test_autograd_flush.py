"""The autograd flush after an out-of-memory in backward runs on the trial's device (issue 31, item 7).

The CPU half of the same defect (the CPU autocast leak the flush clears) is
``test_out_of_memory_in_backward_under_autocast_leaves_nothing_behind`` in ``tests/test_find.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from helpers import plain_workload
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from batchfit.backends import LiveTensorMeter
from batchfit.probe.trial import run_trial


class _OutOfMemoryInBackward(torch.autograd.Function):
    """Identity whose backward fails as a device too small for the gradients does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[Any]) -> torch.Tensor:
        ctx.log = log
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        ctx.log.append("out of memory")
        raise torch.OutOfMemoryError("out of memory in backward")


class FailsInBackward(nn.Module):
    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 8)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OutOfMemoryInBackward.apply(self.fc(x), self.log)


class DeviceLog(TorchDispatchMode):
    """Logs the device types of every operator's outputs (it observes; it changes nothing)."""

    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.log.append({t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)})
        return out


def test_the_autograd_flush_after_an_oom_in_backward_runs_on_the_trials_device() -> None:
    """An accelerator's backward runs on its device's own autograd thread, which keeps the failed
    graph after an exception (pytorch #82218) until a backward runs there again: a flush on the CPU
    alone would leave it (a false leak). A whole trial on the meta device, whose backward fails,
    shows where the flush runs; ``test_find.py`` shows it still clears the CPU autocast leak."""
    log: list[Any] = []
    device = torch.device("meta")
    model = FailsInBackward(log).to(device)
    sample = torch.randn(4, 64, device=device)
    workload = plain_workload(model, sample, device)
    meter = LiveTensorMeter(budget_bytes=None, total_bytes=None)
    with DeviceLog(log):
        run = run_trial(workload, meter, batch_size=8, steps=1)
    assert not run.trial.fits and run.trial.phase == "backward"
    after = log[log.index("out of memory") + 1 :]
    assert any("meta" in devices for devices in after), after  # the flush on the trial's device
    assert any("cpu" in devices for devices in after), after  # and on the CPU, as before

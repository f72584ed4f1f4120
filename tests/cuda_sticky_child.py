"""Child process of ``tests/test_cuda.py``: a probe whose model triggers a device-side assert.

Not a test module (pytest does not collect it). A device-side assert poisons the process's CUDA
context for good, so it runs here, alone: a model whose forward indexes an ``nn.Embedding`` out
of range from ``BOMB_AT`` rows on, probed with ``batchfit.find``. It prints one line,
``BATCHFIT-CHILD {json}``: the exception's type, message and notes, whether the model's tensors
equal a CPU copy taken before the probe, where they are now, and then leaves with ``os._exit``
(the interpreter's teardown would ask the dead context to free memory).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch import nn

import batchfit

BOMB_AT = 8
CHILD_MARK = "BATCHFIT-CHILD "


class Bomb(nn.Module):
    """Embedding, BatchNorm (buffers too), a head; indices out of range from ``at`` rows on."""

    def __init__(self, at: int, vocab: int = 16, width: int = 32) -> None:
        super().__init__()
        self.at = at
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] >= self.at:
            ids = ids + 1000  # the embedding kernel asserts srcIndex < srcSelectDimSize on the device
        return self.head(self.norm(self.embed(ids).mean(1)))


def main() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Bomb(BOMB_AT).cuda()
    sample = torch.randint(0, 16, (2, 5))
    before = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    report: dict[str, Any] = {"bomb_at": BOMB_AT, "error": None, "message": "", "notes": [], "cause": None}
    try:
        batchfit.find(model, sample, max_batch=64, verify_steps=0)
    except Exception as exc:
        report["error"] = type(exc).__name__
        report["message"] = str(exc)[:2000]
        report["notes"] = [str(note) for note in getattr(exc, "__notes__", [])]
        report["cause"] = None if exc.__cause__ is None else type(exc.__cause__).__name__
    after = model.state_dict()
    same = before.keys() == after.keys()
    for name, value in after.items():
        if value.device.type != "cpu":
            same = False  # still on the failed device: its values cannot be read any more
        elif name in before:
            same = same and value.dtype == before[name].dtype and torch.equal(value, before[name])
    report["same_values"] = same
    report["devices"] = sorted({str(value.device) for value in after.values()})
    report["grads_none"] = all(p.grad is None for p in model.parameters())
    report["training"] = all(m.training for m in model.modules())
    return report


if __name__ == "__main__":
    try:
        result = main()
    except BaseException as exc:  # report rather than die, so that the parent sees what happened
        result = {"error": f"child crashed: {type(exc).__name__}: {exc}"[:2000]}
    sys.stdout.write(CHILD_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)

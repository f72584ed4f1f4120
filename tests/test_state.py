"""The user's model, optimizer and RNG come back bit-exactly, whatever happens in the probe."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import assert_same_state, state_of
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import batchfit


class Net(nn.Module):
    """Linear + BatchNorm (running stats) + Dropout (RNG) + a frozen layer; ``trap`` lets a
    test make forward raise at a chosen batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4096, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.1)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(32, 10)
        self.trap: tuple[int, BaseException] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trap is not None and x.shape[0] >= self.trap[0]:
            raise self.trap[1]
        return self.out(self.frozen(self.drop(torch.relu(self.norm(self.inp(x))))))


def _used_model() -> tuple[Net, torch.optim.Optimizer, torch.Tensor]:
    """A model that has trained a step (optimizer state, stale grads) and has mixed modes."""
    torch.manual_seed(0)
    model = Net()
    sample = torch.randn(4, 4096)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    model(sample).mean().backward()
    optimizer.step()
    model(sample).square().mean().backward()  # leave grads behind, as a paused loop would
    model.eval()
    model.norm.train()  # mixed flags must come back as they were
    return model, optimizer, sample


def _phase_peaks(sample: torch.Tensor, batch_size: int) -> dict[str, int]:
    model, _, _ = _used_model()
    with batchfit.Prober(model, sample, memory_limit="1GiB", steps_per_trial=1) as prober:
        return prober.trial(batch_size).peaks_by_phase


def test_state_is_restored_after_a_normal_search() -> None:
    model, optimizer, sample = _used_model()
    before = state_of(model, optimizer)
    result = batchfit.find(model, sample, optimizer=optimizer, memory_limit="4MB", steps_per_trial=2)
    assert result.boundary_reached
    assert_same_state(before, state_of(model, optimizer))


@pytest.mark.parametrize("phase", ["batch", "forward", "backward", "step"])
def test_state_is_restored_after_an_oom_in_each_phase(phase: str) -> None:
    _, _, sample = _used_model()
    peaks = _phase_peaks(sample, 16)
    order = ["batch", "forward", "backward", "step"]
    assert [peaks[p] for p in order] == sorted(peaks[p] for p in order), peaks
    index = order.index(phase)
    # A cap right at the peak of the phase before makes exactly this phase run out of memory.
    cap = peaks[order[index - 1]] if index else peaks["batch"] - 1
    model, optimizer, sample = _used_model()
    before = state_of(model, optimizer)
    with pytest.raises(batchfit.NothingFitsError) as info:
        batchfit.find(model, sample, optimizer=optimizer, memory_limit=cap, init_batch=16, steps_per_trial=1)
    assert info.value.phase == phase
    assert_same_state(before, state_of(model, optimizer))


@pytest.mark.parametrize(
    "error",
    [ValueError("shape mismatch in user code"), KeyboardInterrupt()],
    ids=["non-oom-error", "ctrl-c"],
)
def test_state_is_restored_when_a_step_raises(error: BaseException) -> None:
    model, optimizer, sample = _used_model()
    before = state_of(model, optimizer)
    model.trap = (8, error)  # batches 2 and 4 train for real first, then the step raises
    seen: list[int] = []
    with pytest.raises(type(error)) as info:
        batchfit.find(
            model,
            sample,
            optimizer=optimizer,
            memory_limit="64MiB",
            strategy="binary",
            callback=lambda t: seen.append(t.batch_size),
        )
    assert info.value is error  # propagated unchanged, never taken for an OOM
    assert seen == [2, 4]
    model.trap = None
    assert_same_state(before, state_of(model, optimizer))


def test_non_oom_error_names_the_batch_size() -> None:
    model, _, sample = _used_model()
    model.trap = (4, RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"))
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_EXECUTION_FAILED") as info:
        batchfit.find(model, sample, memory_limit="64MiB")
    notes: list[Any] = getattr(info.value, "__notes__", [])
    assert any("batch size 4" in note and "forward" in note for note in notes)


def test_probe_optimizer_is_a_fresh_one_like_the_users() -> None:
    model, optimizer, sample = _used_model()
    steps = {id(p): s["step"].clone() for p, s in optimizer.state.items()}
    seen: list[tuple[bool, type, float]] = []  # not the optimizers: holding them would leak their state

    def spy(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        seen.append((opt is optimizer, type(opt), opt.param_groups[0]["weight_decay"]))

    hook = register_optimizer_step_pre_hook(spy)
    try:
        result = batchfit.find(
            model, sample, optimizer=optimizer, memory_limit="8MB", steps_per_trial=1, verify_steps=0
        )
    finally:
        hook.remove()
    assert seen and set(seen) == {(False, torch.optim.AdamW, 0.05)}
    assert all(torch.equal(s["step"], steps[id(p)]) for p, s in optimizer.state.items())
    assert result.memory is not None and result.memory.optimizer_state_bytes > 0
    assert all(t.leaked_bytes == 0 for t in result.trials)

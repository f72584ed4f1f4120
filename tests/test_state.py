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
        batchfit.find(model, sample, memory_limit="64MiB", strategy="binary")
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


# What a model does to itself in forward, and what the optimizer holds outside the model -------
class SelfChanging(nn.Module):
    """Reassigns a buffer in forward (a step counter, a running mean updated out of place) and
    registers a new buffer lazily the first time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        if not hasattr(self, "lazy"):
            self.register_buffer("lazy", torch.ones(3))
        return self.fc(x)


def test_buffers_reassigned_or_registered_in_forward_are_restored_by_attribute() -> None:
    model, sample = SelfChanging(), torch.randn(2, 64)
    steps, mean = model.steps, model.mean
    before = state_of(model)
    keys = set(model.state_dict())
    batchfit.find(model, sample, memory_limit="8MiB", max_batch=32)
    assert model.steps is steps and model.mean is mean  # the original objects, back in their slots
    assert set(model.state_dict()) == keys and not hasattr(model, "lazy")
    assert_same_state(before, state_of(model))


def test_parameters_the_optimizer_holds_outside_the_model_are_restored() -> None:
    model = nn.Linear(64, 8)
    temperature = nn.Parameter(torch.tensor(2.0))
    optimizer = torch.optim.AdamW([{"params": model.parameters()}, {"params": [temperature], "lr": 0.5}])

    def loss_fn(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return (output / temperature).square().mean()

    value, sample = temperature.detach().clone(), torch.randn(2, 64)
    before = state_of(model, optimizer)
    batchfit.find(model, sample, optimizer=optimizer, loss_fn=loss_fn, memory_limit="8MiB", max_batch=32)
    assert torch.equal(temperature.detach(), value) and temperature.grad is None
    assert_same_state(before, state_of(model, optimizer))


def test_gradients_that_are_views_of_one_buffer_stay_views() -> None:
    """DDP's gradient_as_bucket_view and flat-buffer optimizers keep every grad as a view of one
    flat buffer; a restore that copies them breaks the aliasing for good."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for param in params:
        param.grad = flat[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    flat.normal_()
    values = flat.clone()
    batchfit.find(model, torch.randn(2, 64), memory_limit="8MiB", max_batch=32)
    offset = 0
    for param in params:
        assert param.grad is not None and param.grad.data_ptr() == flat[offset:].data_ptr()
        offset += param.numel()
    assert torch.equal(flat, values)
    flat.add_(1.0)  # still one buffer: writing it writes every grad
    assert torch.equal(params[0].grad.flatten(), values[: params[0].numel()] + 1.0)


def test_a_compiled_model_still_compiles_after_a_cpu_probe() -> None:
    """The CPU meter is a dispatch mode, under which dynamo skips frames and remembers the skip:
    probing the compiled model itself left it never compiling again in the process."""
    from torch._dynamo.utils import counters

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    compiled = torch.compile(model, backend="eager")
    result = batchfit.find(compiled, torch.randn(2, 32), memory_limit="8MiB", max_batch=16, verify_steps=0)
    assert any("probed eagerly" in note for note in result.notes)
    counters.clear()
    compiled(torch.randn(5, 32))
    assert counters["frames"]["ok"] >= 1, dict(counters["frames"])

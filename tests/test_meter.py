"""The CPU live-tensor meter against torch's own profiler, and its limit."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import batchfit
from batchfit import examples
from batchfit.backends import LiveTensorMeter
from batchfit.probe.batches import tile
from batchfit.probe.workload import call_model, default_loss


def _training_step(model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer) -> None:
    output = call_model(model, batch)
    loss = default_loss(output)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del output, loss


def _profiler_peak(fn: Callable[[], None]) -> int:
    """Peak of the running sum of the CPU allocator's allocation events during ``fn``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
    current = peak = 0
    for _, nbytes in sorted(events):
        current += nbytes
        peak = max(peak, current)
    return peak


def _meter_peak(fn: Callable[[], None]) -> int:
    meter = LiveTensorMeter(budget_bytes=None, total_bytes=None, baseline_bytes=0)
    meter.begin_trial()
    with meter.tracking(), meter.phase("all"):
        fn()
    return meter.phase_peaks()["all"]


@pytest.mark.parametrize(
    ("factory", "rows"),
    [(lambda: examples.mlp(), 32), (lambda: examples.gpt(), 8)],
    ids=["mlp", "gpt"],
)
def test_meter_agrees_with_the_profiler_on_a_training_step(factory: Callable[[], Any], rows: int) -> None:
    model, sample = factory()
    batch = tile(sample, rows, 4 if isinstance(sample, torch.Tensor) else 2)
    for warm in (False, True):  # the first step allocates AdamW state, later ones reuse it
        optimizer = torch.optim.AdamW(model.parameters())
        if warm:
            _training_step(model, batch, optimizer)
        live = _meter_peak(lambda opt=optimizer: _training_step(model, batch, opt))
        optimizer = torch.optim.AdamW(model.parameters())
        if warm:
            _training_step(model, batch, optimizer)
        profiled = _profiler_peak(lambda opt=optimizer: _training_step(model, batch, opt))
        # The profiler also sees the allocator's tiny bookkeeping allocations (tens of bytes).
        assert abs(profiled - live) <= 1024, (warm, live, profiled)


def test_limit_raises_a_real_out_of_memory_error_in_the_allocating_op() -> None:
    meter = LiveTensorMeter(budget_bytes=4096, total_bytes=None, baseline_bytes=0)
    meter.begin_trial()
    kept = []
    with meter.tracking():
        kept.append(torch.empty(512, dtype=torch.float32))  # 2 KiB: fits
        with pytest.raises(torch.OutOfMemoryError, match="DefaultCPUAllocator: can't allocate memory"):
            torch.empty(1024, dtype=torch.float32)  # +4 KiB: over the cap
    assert meter.allocated_bytes() == 2048  # the failed tensor is gone again
    kept.clear()
    assert meter.allocated_bytes() == 0


def test_views_and_in_place_ops_cost_nothing() -> None:
    base = torch.zeros(1000)
    meter = LiveTensorMeter(budget_bytes=None, total_bytes=None, baseline_bytes=0)
    meter.begin_trial()
    with meter.tracking():
        view = base.view(10, 100).t()
        base.add_(1)
        new = base * 2
        assert meter.allocated_bytes() == new.untyped_storage().nbytes() == 4000
        del view, new
    assert meter.allocated_bytes() == 0


def test_cnn_scratch_memory_is_what_the_meter_does_not_see() -> None:
    """Documented difference: CPU convolutions may allocate scratch inside the kernel. The meter
    counts live tensors only, so it can be below the allocator's peak, never above."""
    model, sample = examples.cnn()
    batch = tile(sample, 16, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    live = _meter_peak(lambda: _training_step(model, batch, optimizer))
    optimizer = torch.optim.AdamW(model.parameters())
    profiled = _profiler_peak(lambda: _training_step(model, batch, optimizer))
    assert live <= profiled + 1024


def test_the_failing_allocation_is_released_before_the_error_reaches_the_caller() -> None:
    meter = LiveTensorMeter(budget_bytes=4096, total_bytes=None, baseline_bytes=0)
    meter.begin_trial()
    with meter.tracking():
        try:
            torch.empty(2048, dtype=torch.float32)  # 8 KiB: over the cap
        except torch.OutOfMemoryError:
            # Still inside the handler, traceback alive: live memory is back under the cap.
            assert meter.allocated_bytes() == 0
        else:
            raise AssertionError("the cap did not raise")


class Growing(nn.Module):
    """Each forward grows storages in place: a buffer through ``resize_``, a scratch tensor
    through ``out=``. Neither creates a new storage, so a meter that only counts new storages
    misses all of it."""

    def __init__(self, per_row: int) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(0))
        self.per_row = per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        self.cache.resize_(rows * self.per_row)  # a buffer grown in place
        scratch = torch.empty(0)
        torch.mul(torch.ones(rows * self.per_row), 2.0, out=scratch)  # out= grows a fresh storage
        return self.fc(x) + scratch[:1].sum() * 0


@pytest.mark.slow
def test_memory_grown_in_place_counts_against_the_limit() -> None:
    per_row = 16 * 1024  # 64 KiB of float32 per row, twice
    model = Growing(per_row)
    result = batchfit.find(model, torch.randn(2, 16), memory_limit="8MiB", max_batch=4096, verify_steps=0)
    # Two grown storages of 64 KiB per row fit 8 MiB only below 64 rows (the old meter said 4096).
    assert result.boundary_reached and result.max_batch < 64
    assert model.cache.numel() == 0  # and the buffer came back as it was


def test_an_oom_from_the_meter_frees_the_failed_step_without_the_garbage_collector() -> None:
    """The meter's OOM must not sit in a reference cycle with the frames it passes through (a
    real allocator's, raised from C++, does not): then a retry loop that catches it, as
    Accelerate's does, gets the failed step's memory back as soon as its ``except`` ends."""
    meter = LiveTensorMeter(budget_bytes=1 << 20, total_bytes=None, baseline_bytes=0)

    def step() -> None:
        activations = torch.ones(64 * 1024)  # 256 KiB, live when the next op goes over the limit
        (activations.repeat(8) * 2).sum()

    gc.disable()
    try:
        with meter.tracking():
            try:
                step()
            except torch.OutOfMemoryError:
                pass
            assert meter.allocated_bytes() == 0
    finally:
        gc.enable()

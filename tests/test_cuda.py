"""CUDA-only paths: the allocator limit, recovery with empty_cache, NVML device info.

These carry ``@pytest.mark.cuda`` and skip on machines without a CUDA device (the marker is
registered by batchfit's pytest plugin, ``batchfit.pytest_plugin``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_state, state_of

import batchfit
from batchfit import examples

pytestmark = pytest.mark.cuda


def test_cuda_limit_finds_a_boundary_and_restores_the_fraction() -> None:
    model, sample = examples.gpt(d_model=256, n_layers=4, seq_len=256)
    model = model.cuda()
    before = state_of(model)
    fraction = torch.cuda.get_per_process_memory_fraction(0)
    result = batchfit.find(model, sample, memory_limit="2GiB")
    assert torch.cuda.get_per_process_memory_fraction(0) == fraction
    assert result.device.type == "cuda" and result.device.total_bytes
    assert result.boundary_reached and result.budget_bytes == 2 * 2**30
    failed = [t for t in result.trials if not t.fits]
    assert failed and all(t.phase for t in failed)
    assert all(t.peak_bytes <= result.budget_bytes for t in result.trials if t.fits)
    assert all(t.leaked_bytes == 0 for t in result.trials)
    assert_same_state(before, state_of(model))


def test_device_argument_moves_a_cpu_model_and_back() -> None:
    model, sample = examples.mlp()
    before = state_of(model)
    result = batchfit.find(model, sample, device="cuda", memory_limit="1GiB", max_batch=4096)
    assert result.device.type == "cuda"
    assert next(model.parameters()).device.type == "cpu"
    assert_same_state(before, state_of(model))


def test_memory_returns_after_an_oom() -> None:
    model, sample = examples.gpt(d_model=256, n_layers=4, seq_len=256)
    model = model.cuda()
    torch.cuda.empty_cache()
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(batchfit.NothingFitsError):
        batchfit.find(model, sample, memory_limit=allocated + 2**20)
    assert torch.cuda.memory_allocated() == allocated


def test_nvml_reports_the_device_name() -> None:
    pynvml = pytest.importorskip("pynvml")
    model, sample = examples.mlp()
    result = batchfit.find(model.cuda(), sample, max_batch=8)
    pynvml.nvmlInit()
    try:
        names = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())
        ]
    finally:
        pynvml.nvmlShutdown()
    assert result.device.name in [n.decode() if isinstance(n, bytes) else n for n in names]

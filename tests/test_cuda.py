"""CUDA-only paths: the allocator limit, reserved-byte accounting, the warm-up, fp16, sticky errors.

These carry ``@pytest.mark.cuda`` and skip on machines without a CUDA device (the marker is
registered by batchfit's pytest plugin, ``batchfit.testing.pytest_plugin``; ``--require-cuda`` turns the
skip into a failure). The CPU halves of the same defects are in ``tests/test_device_seam.py``.

Two tests run in a child process, because what they check needs one: the first trial of a
fresh process (no cuBLAS workspace exists yet), and a device-side assert (it poisons the
process's CUDA context for good).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_state, expected_steps, state_of
from torch import nn

import batchfit
from batchfit import examples
from batchfit.errors import LimitError, NoOptimizerStepError
from batchfit.probe.workload import default_loss
from batchfit.report import DeviceInfo, MemoryModel, Result, Trial
from batchfit.testing import check_fits

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parent.parent
MiB, GiB = 2**20, 2**30
#: What a child process prints before its JSON report, so that library output cannot be mistaken for it.
CHILD_MARK = "BATCHFIT-CHILD "


@pytest.fixture(autouse=True)
def _clean_device() -> Iterator[None]:
    """Every test starts without cached blocks left by the one before (runs only where CUDA is)."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _fraction(index: int | None = None) -> float:
    return torch.cuda.get_per_process_memory_fraction(torch.cuda.current_device() if index is None else index)


def _total(index: int | None = None) -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).total_memory


def _run_child(args: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> dict[str, Any]:
    """Run ``python args...`` in a fresh process (repository root on the path) and return the JSON
    report it printed after :data:`CHILD_MARK`."""
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=environment, cwd=ROOT
    )
    reports = [line[len(CHILD_MARK) :] for line in done.stdout.splitlines() if line.startswith(CHILD_MARK)]
    assert done.returncode == 0 and reports, (
        f"child exited with {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )
    return json.loads(reports[-1])


def _fitting(result: Result) -> list[Trial]:
    return [t for t in result.trials if t.fits]


# The existing paths, in the units a CUDA limit counts -------------------------------------------
def test_cuda_limit_finds_a_boundary_and_restores_the_fraction() -> None:
    model, sample = examples.gpt(d_model=256, n_layers=4, seq_len=256)
    model = model.cuda()
    before = state_of(model)
    fraction, total = _fraction(), _total()
    during: list[float] = []
    result = batchfit.find(model, sample, memory_limit="2GiB", callback=lambda _: during.append(_fraction()))
    assert _fraction() == pytest.approx(fraction)
    # The allocator's cap is the limit while the probe runs (the fraction is of the runtime's total).
    assert during and all(f == pytest.approx(min(fraction, 2 * GiB / total), rel=1e-6) for f in during)
    assert result.device.type == "cuda" and result.device.total_bytes
    assert result.boundary_reached and result.budget_bytes == 2 * GiB
    failed = [t for t in result.trials if not t.fits]
    assert failed and all(t.phase for t in failed)
    # The cap counts reserved bytes (the allocator's segments): so does every fitting peak.
    assert all(t.reserved_peak_bytes <= result.budget_bytes for t in _fitting(result))
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
    # A first probe makes the process's one-time allocations (cuBLAS workspaces), which stay.
    batchfit.find(model, sample, max_batch=2, verify_steps=0)
    gc.collect()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    # Room for what the probe holds before its first trial (the sample), not for a step's
    # gradients (13 MB) and AdamW state: not even batch 2 fits, but the limit is enforceable.
    with pytest.raises(batchfit.NothingFitsError):
        batchfit.find(model, sample, memory_limit=reserved + 8 * MiB)
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


# 1. A warm cache: the fraction is only checked when a new segment is reserved --------------------
def _wide_mlp() -> tuple[nn.Module, torch.Tensor]:
    """About 25 MB of weights and 37 KB of activations per sample: activations dominate at 16k."""
    model, sample = examples.mlp(in_features=1024, hidden=2048, depth=2, classes=10)
    return model.cuda(), sample


def _train(model: nn.Module, sample: torch.Tensor, batch_size: int, steps: int = 2) -> None:
    """Plain AdamW steps at ``batch_size``, as a test or a notebook cell before the probe would run."""
    optimizer = torch.optim.AdamW(model.parameters())
    rows = sample.repeat((batch_size + len(sample) - 1) // len(sample), 1)[:batch_size].cuda()
    for _ in range(steps):
        model(rows).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def _warm_cache(model: nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """Leave the blocks of training at twice ``batch_size`` in the allocator's cache, and return a
    limit strictly between what the process holds (weights, workspaces) and what training at
    ``batch_size`` needs from an empty cache, in reserved bytes.

    Whatever must stay allocated through the probe (weights, their copies in ``state_of``, the
    cuBLAS workspaces) is allocated before, in segments of its own: a live block carved out of a
    cached segment would keep the whole segment reserved after ``empty_cache()``."""
    _train(copy.deepcopy(model), sample, 8)  # one-time allocations (cuBLAS workspaces), from an empty cache
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    _train(copy.deepcopy(model), sample, batch_size)
    need = torch.cuda.max_memory_reserved()
    _train(copy.deepcopy(model), sample, 2 * batch_size)  # freed, so cached: a superset of what batch_size takes
    gc.collect()
    held = torch.cuda.memory_allocated()
    limit = held + (need - held) // 2
    assert need - held > 256 * MiB, "the workload is too small to tell a cache from a fit"
    assert torch.cuda.memory_reserved() > limit and torch.cuda.memory_allocated() < limit  # cached, not held
    return limit


def test_the_gate_on_a_warm_cache_does_not_pass_a_batch_above_the_limit() -> None:
    """``assert_fits`` / ``--require-batch`` run exactly one trial: served from a cache above the
    limit, it would "fit" without the allocator ever checking the cap."""
    model, sample = _wide_mlp()
    before = state_of(model)
    batch = 16384
    limit = _warm_cache(model, sample, batch)
    reserved_at_start: list[int] = []
    report = check_fits(
        model,
        sample,
        batch_size=batch,
        memory_limit=limit,
        on_start=lambda info, budget: reserved_at_start.append(torch.cuda.memory_reserved()),
    )
    assert reserved_at_start and reserved_at_start[0] <= limit, "the cache was not emptied before the trial"
    assert not report.fits, f"batch {batch} needs more than {limit} bytes reserved, yet the gate passed it"
    assert report.largest_fit is not None and 0 < report.largest_fit < batch
    assert report.search is not None
    assert all(t.reserved_peak_bytes <= report.budget_bytes for t in _fitting(report.search))
    assert_same_state(before, state_of(model))


def test_a_search_on_a_warm_cache_respects_the_limit() -> None:
    model, sample = _wide_mlp()
    batch = 16384
    limit = _warm_cache(model, sample, batch)
    result = batchfit.find(model, sample, memory_limit=limit, max_batch=2 * batch, verify_steps=1)
    assert result.boundary_reached and result.max_batch < batch
    assert all(t.reserved_peak_bytes <= result.budget_bytes for t in _fitting(result))


def test_without_a_limit_the_first_trial_does_not_count_a_warm_cache() -> None:
    """Without ``memory_limit`` nothing is capped, but the peaks are still read in reserved bytes:
    a cache left by earlier work must not inflate the first trial (and the jump the interpolating
    search takes from it, and the memory equation)."""
    model, sample = examples.mlp()
    model = model.cuda()
    block = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    del block
    assert torch.cuda.memory_reserved() >= GiB
    result = batchfit.find(model, sample, max_batch=8, verify_steps=0)
    first = result.trials[0]
    assert first.fits and first.reserved_peak_bytes < GiB, (
        f"the first trial of a tiny MLP counted {first.reserved_peak_bytes} reserved bytes: the warm cache"
    )


def test_tensors_held_above_the_limit_refuse_the_probe() -> None:
    model, sample = examples.mlp()
    model = model.cuda()
    before, fraction = state_of(model), _fraction()
    hog = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")  # live: emptying the cache cannot free it
    try:
        with pytest.raises(LimitError, match="already holds"):
            batchfit.find(model, sample, memory_limit="256MiB", max_batch=8)
        with pytest.raises(LimitError):
            check_fits(model, sample, batch_size=8, memory_limit="256MiB")
    finally:
        del hog
    assert _fraction() == pytest.approx(fraction)
    assert_same_state(before, state_of(model))


# 2. fp16: a trial only fits once the optimizer really stepped --------------------------------------
def _overflowing_loss(output: Any, batch: Any) -> torch.Tensor:
    """Its fp16 gradients overflow at the GradScaler's first scales (2**16, 2**15, ...)."""
    return default_loss(output) * 1e4


def test_fp16_trials_hold_the_optimizer_state_although_the_scaler_skipped_steps() -> None:
    model, sample = examples.mlp()
    model = model.cuda()
    before = state_of(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result = batchfit.find(
        model, sample, amp="fp16", loss_fn=_overflowing_loss, memory_limit="1GiB", max_batch=512, verify_steps=1
    )
    assert result.memory is not None and result.memory.optimizer_state_bytes >= 2 * weights  # AdamW's moments
    assert result.trials[0].skipped_steps > 0
    assert any("GradScaler" in note for note in result.notes)
    # Search trials run a warm step before the timed one on CUDA (the first after a release runs
    # cold); the table is the one the CPU half of this test asserts (tests/test_device_seam.py).
    assert [t.steps for t in _fitting(result)] == expected_steps(result, cold_after_release=True)
    for trial in _fitting(result):
        # During the optimizer step: weights, gradients and both moments (fp32) are all live.
        assert dict(trial.phase_peaks)["step"] >= 4 * weights, f"batch {trial.batch_size}: no optimizer state"
    assert_same_state(before, state_of(model))


def test_fp16_that_never_steps_is_an_error_not_a_fit() -> None:
    model, sample = examples.mlp()
    model = model.cuda()
    before = state_of(model)

    def infinite(output: Any, batch: Any) -> torch.Tensor:
        return default_loss(output) * float("inf")

    with pytest.raises(NoOptimizerStepError, match="optimizer never stepped"):
        batchfit.find(model, sample, amp="fp16", loss_fn=infinite, memory_limit="1GiB", max_batch=64)
    assert_same_state(before, state_of(model))


# 3. Units: the budget, the search and the safe batch count reserved bytes ------------------------
def test_the_budget_counts_reserved_bytes_and_the_safe_batch_keeps_its_headroom_in_them() -> None:
    model, sample = examples.gpt(d_model=256, n_layers=4, seq_len=256)
    result = batchfit.find(model.cuda(), sample, memory_limit="2GiB")
    assert result.budget_counts == "reserved"
    assert result.memory is not None and result.memory.unit == "reserved"
    # Fitted on the trials whose reserved peak did not press against the cap (it piles up there).
    pressed = result.budget_bytes - max(20 * MiB, 0.02 * result.budget_bytes)
    free = [t for t in result.search_trials if t.fits and t.reserved_peak_bytes < pressed]
    fitted = free if len({t.batch_size for t in free}) >= 2 else result.search_trials
    assert result.memory.lines == MemoryModel.fit(fitted, unit="reserved").lines
    for trial in result.trials:
        if trial.reserved_peak_bytes is not None and trial.peak_bytes is not None:
            assert trial.reserved_peak_bytes >= trial.peak_bytes, f"batch {trial.batch_size}"
        if trial.fits:
            allocated, reserved = dict(trial.phase_peaks), dict(trial.phase_reserved_peaks)
            assert allocated.keys() == reserved.keys()
            assert all(reserved[phase] >= allocated[phase] for phase in allocated), f"batch {trial.batch_size}"
    # The safe batch leaves its headroom of the budget free in what the cap counts.
    assert result.safe_verified
    verified = [t for t in result.trials if t.kind == "verify" and t.batch_size == result.safe_batch][-1]
    target = (1 - result.settings.headroom) * result.budget_bytes
    assert verified.reserved_peak_bytes <= target, (
        f"safe batch {result.safe_batch} reserved {verified.reserved_peak_bytes} bytes, more than {target:.0f}"
    )
    assert "counts reserved bytes" in str(result)


# 4. No false leak on the first trial of a fresh process --------------------------------------------
LEAK_CHILD = f"""
import json, sys
import batchfit
from batchfit import examples
amp = sys.argv[1] or None
model, sample = examples.mlp()
result = batchfit.find(model.cuda(), sample, amp=amp, memory_limit="2GiB", max_batch=256)
print({CHILD_MARK!r} + json.dumps({{"leaked": [t.leaked_bytes for t in result.trials], "notes": list(result.notes)}}))
"""


@pytest.mark.parametrize("amp", ["", "bf16", "fp16"], ids=["fp32", "bf16", "fp16"])
def test_the_first_trial_of_a_fresh_process_leaks_nothing(amp: str) -> None:
    """cuBLAS/cuBLASLt take their workspaces on the first matmul of each thread and keep them:
    made inside the first trial they would read as a leak (and shift its peak)."""
    report = _run_child(["-c", LEAK_CHILD, amp])
    assert report["leaked"] and all(leaked == 0 for leaked in report["leaked"]), report
    assert not any("left" in note and "allocated after release" in note for note in report["notes"]), report


# 5. The memory fraction: never raise a lower one the user set -------------------------------------
def test_a_lower_fraction_the_user_set_is_kept_during_the_probe_and_after() -> None:
    index = torch.cuda.current_device()
    model, sample = examples.mlp()
    model = model.cuda()
    during: list[float] = []
    torch.cuda.set_per_process_memory_fraction(0.5, index)
    try:
        batchfit.find(
            model,
            sample,
            memory_limit=int(0.9 * _total(index)),
            max_batch=64,
            verify_steps=1,
            on_start=lambda info, budget: during.append(_fraction(index)),
            callback=lambda _: during.append(_fraction(index)),
        )
        after = _fraction(index)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    # The allocator stores the fraction as bytes of the total: it reads back within a byte of it.
    assert during and max(during) <= 0.5 + 1e-9
    assert after == pytest.approx(0.5)


def test_a_lower_fraction_the_user_set_bounds_the_budget() -> None:
    """The allocator stops at the user's fraction whatever the limit: a budget above it would aim the
    search, and size the safe batch's headroom, at memory the process cannot have."""
    index = torch.cuda.current_device()
    total = _total(index)
    model, sample = examples.mlp()
    model = model.cuda()
    torch.cuda.set_per_process_memory_fraction(0.5, index)
    try:
        limited = batchfit.find(model, sample, memory_limit=int(0.9 * total), max_batch=8, verify_steps=0)
        unlimited = batchfit.find(model, sample, max_batch=8, verify_steps=0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    assert limited.budget_bytes <= 0.5 * total
    assert unlimited.budget_bytes <= 0.5 * total


# 6. Another device than the current one --------------------------------------------------------------
def test_a_probe_on_cuda_1_runs_there_and_the_model_comes_back() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible CUDA devices (cuda:1)")
    model, sample = examples.mlp()
    model = model.to("cuda:0")
    before = state_of(model)
    current = torch.cuda.current_device()
    fractions = [_fraction(0), _fraction(1)]
    rng = torch.cuda.get_rng_state_all()
    gc.collect()
    torch.cuda.empty_cache()
    held_on_0 = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    where: list[set[torch.device]] = []
    result = batchfit.find(
        model,
        sample,
        device="cuda:1",
        memory_limit="1GiB",
        max_batch=256,
        verify_steps=1,
        callback=lambda _: where.append({p.device for p in model.parameters()}),
    )
    assert result.device.type == "cuda" and result.device.index == 1
    assert result.device.total_bytes == _total(1)
    assert where and all(devices == {torch.device("cuda", 1)} for devices in where)
    assert torch.cuda.max_memory_allocated(0) <= held_on_0, "the probe on cuda:1 allocated on cuda:0"
    assert torch.cuda.current_device() == current
    assert [_fraction(0), _fraction(1)] == pytest.approx(fractions)
    assert all(torch.equal(a, b) for a, b in zip(rng, torch.cuda.get_rng_state_all()))
    assert_same_state(before, state_of(model))  # back on cuda:0 with the same values


def test_the_cuda_rng_state_is_restored() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 1)).cuda()
    rng = torch.cuda.get_rng_state_all()
    batchfit.find(model, torch.randn(4, 64), memory_limit="1GiB", max_batch=32, verify_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(rng, torch.cuda.get_rng_state_all()))


# 7. A sticky device error ------------------------------------------------------------------------------
@pytest.mark.parametrize("blocking", ["1", "0"], ids=["launch-blocking", "asynchronous"])
def test_a_device_side_assert_is_device_failed_and_the_model_comes_back_on_the_cpu(blocking: str) -> None:
    """After a device-side assert every CUDA call of the process fails: the error must stay
    ``DeviceFailedError`` and the model come back from the host copies, exact, on the CPU."""
    child = str(ROOT / "tests" / "cuda_sticky_child.py")
    report = _run_child([child], env={"CUDA_LAUNCH_BLOCKING": blocking}, timeout=120)
    assert report["error"] == "DeviceFailedError", report
    failed_at = re.search(r"batch size (\d+)", report["message"])
    assert failed_at and int(failed_at.group(1)) >= report["bomb_at"], report
    assert report["devices"] == ["cpu"], report
    assert report["same_values"] is True, report
    assert report["grads_none"] is True and report["training"] is True, report
    assert any("restored" in note and "CPU" in note for note in report["notes"]), report


# 8. DeviceInfo: one total for arithmetic, NVML's beside it, the configuration ------------------------
def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_device_info_uses_the_runtime_total_and_records_the_config() -> None:
    index = torch.cuda.current_device()
    model, sample = examples.mlp()
    model = model.cuda()
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = not benchmark
    try:
        result = batchfit.find(model, sample, memory_limit=0.25, max_batch=4, verify_steps=0)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    total = torch.cuda.get_device_properties(index).total_memory
    info = result.device
    assert info.index == index and info.total_bytes == total
    assert result.settings.memory_limit_bytes == int(0.25 * total)  # a fraction of the runtime's total
    if _nvml_works():
        assert info.nvml_total_bytes is not None and info.nvml_total_bytes >= info.total_bytes
    config = dict(info.config)
    assert config["allocator"] == torch.cuda.get_allocator_backend()
    assert config["cudnn.benchmark"] == str(not benchmark)
    assert "matmul fp32" in config and "cuda runtime" in config
    assert DeviceInfo.from_dict(json.loads(result.to_json())["device"]) == info


# 9. reserve: memory a card of that size loses outside the caching allocator -------------------------
def test_reserve_auto_sets_aside_what_lives_outside_the_allocator() -> None:
    model, sample = examples.mlp()
    model = model.cuda()
    # 1 GiB in the allocator's cache: the allocator's, so not "outside" it.
    block = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    del block
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    result = batchfit.find(model, sample, memory_limit="4GiB", reserve="auto", max_batch=64, verify_steps=0)
    reserve = result.settings.reserve_bytes
    assert reserve > 0, "the CUDA context lives outside the allocator"
    assert reserve < outside + 256 * MiB, f"reserve {reserve} counts the allocator's cache (outside: {outside})"
    assert result.budget_bytes == 4 * GiB - reserve < 4 * GiB
    assert "less reserve" in result.settings.limit_source


def test_a_given_reserve_is_taken_off_the_limit() -> None:
    model, sample = examples.mlp()
    result = batchfit.find(model.cuda(), sample, memory_limit="4GiB", reserve="600MiB", max_batch=64, verify_steps=0)
    assert result.settings.reserve_bytes == 600 * MiB
    assert result.budget_bytes == 4 * GiB - 600 * MiB
    assert all(t.reserved_peak_bytes <= result.budget_bytes for t in _fitting(result))


# 10. A limit is not a bigger GPU ------------------------------------------------------------------------
def test_a_limit_above_the_device_is_clipped_to_what_is_reachable_and_said() -> None:
    total = _total()
    model, sample = examples.mlp()
    reachable: list[int] = []

    def on_start(info: DeviceInfo, budget: int | None) -> None:
        free, _ = torch.cuda.mem_get_info()
        reachable.append(free + torch.cuda.memory_reserved())

    result = batchfit.find(
        model.cuda(), sample, memory_limit=10 * total, max_batch=64, verify_steps=0, on_start=on_start
    )
    assert result.settings.memory_limit_bytes == 10 * total
    assert result.budget_bytes is not None and result.budget_bytes <= total
    assert reachable and abs(result.budget_bytes - reachable[0]) <= 64 * MiB
    assert any("can reach" in note for note in result.notes), result.notes
    assert all(t.reserved_peak_bytes <= result.budget_bytes for t in _fitting(result))

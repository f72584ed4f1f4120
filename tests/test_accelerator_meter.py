"""The accelerator meter's memory fraction and notes, driven on a CPU (issue 31, items 2 and 9).

The meter and backend are batchfit's own; only the device module under them is a stand-in: the
few ``torch.cuda`` calls they make, answering as torch does on a card with nothing allocated,
including ``set_per_process_memory_fraction``'s checks.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from batchfit.backends.accelerator import AcceleratorBackend, AllocatorMeter
from batchfit.backends.alloc_conf import AllocatorConfig

GiB = 2**30
TOTAL = 80 * GiB
#: What torch reports under backend:cudaMallocAsync with no fraction set (pytorch#110194): the
#: unset limit, the largest 64-bit size, over the device's memory.
UNSET_ASYNC_FRACTION = (2**64 - 1) / TOTAL


class DeviceModule:
    """The memory-fraction and statistics calls of ``torch.cuda``, with nothing allocated; keeps
    every fraction written, and refuses a bad one as ``torch.cuda.set_per_process_memory_fraction``."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.written: list[float] = []

    def get_per_process_memory_fraction(self, device: torch.device) -> float:
        return self.fraction

    def set_per_process_memory_fraction(self, fraction: float, device: torch.device) -> None:
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.written.append(fraction)
        self.fraction = fraction  # a fraction set is read back as set, under either backend

    def get_device_properties(self, device: torch.device) -> Any:
        return SimpleNamespace(name="a card", total_memory=TOTAL)

    def memory_reserved(self, device: torch.device) -> int:
        return 0

    def memory_allocated(self, device: torch.device) -> int:
        return 0

    def max_memory_reserved(self, device: torch.device) -> int:
        return 0

    def max_memory_allocated(self, device: torch.device) -> int:
        return 0

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        pass

    def empty_cache(self) -> None:
        self.emptied = getattr(self, "emptied", 0) + 1


class Backend(AcceleratorBackend):
    """The accelerator backend over :class:`DeviceModule`, with the allocator settings given."""

    def __init__(self, device_module: DeviceModule, settings: AllocatorConfig) -> None:
        super().__init__("cuda")
        self.device_module = device_module
        self.settings = settings

    @property
    def module(self) -> Any:
        return self.device_module

    @property
    def memory(self) -> Any:
        return self.device_module

    def allocator_settings(self) -> AllocatorConfig:
        return self.settings


def _meter(conf: str, fraction: float, budget: int | None, limit: int | None) -> tuple[AllocatorMeter, DeviceModule]:
    module = DeviceModule(fraction)
    backend = Backend(module, AllocatorConfig.parse(conf))
    meter = backend.make_meter(torch.device("cuda", 0), budget, limit, [])
    assert isinstance(meter, AllocatorMeter)
    return meter, module


# (2) under cudaMallocAsync an unset fraction reads as about 2e8 -----------------------------------
def test_an_unset_fraction_read_under_cuda_malloc_async_is_never_written_back() -> None:
    """torch refuses a fraction over 1 (ValueError): restoring the one read would fail the probe as
    it ends. The limit is set, a lower cap inside it comes and goes, and 1.0 is restored at the end."""
    meter, module = _meter("backend:cudaMallocAsync", UNSET_ASYNC_FRACTION, budget=None, limit=40 * GiB)
    with meter.active():
        assert module.written == [0.5]
        with meter.capped(20 * GiB):
            assert module.written[-1] == 0.25
        assert module.written[-1] == 0.5  # the limit's fraction, read back inside the probe
    assert module.written == [0.5, 0.25, 0.5, 1.0]


def test_a_cap_without_a_limit_under_cuda_malloc_async_restores_one() -> None:
    """``capped`` with no limit in force reads the unset fraction itself."""
    meter, module = _meter("backend:cudaMallocAsync", UNSET_ASYNC_FRACTION, budget=40 * GiB, limit=None)
    with meter.active():
        assert module.written == []
        with meter.capped(20 * GiB):
            assert module.written == [0.25]
    assert module.written == [0.25, 1.0]


def test_a_lower_fraction_the_user_set_is_kept_and_restored() -> None:
    """A real fraction (at most 1) is still honoured: never raised, and written back as it was."""
    meter, module = _meter("backend:cudaMallocAsync", 0.125, budget=None, limit=40 * GiB)
    with meter.active():
        assert module.written == [0.125]
    assert module.written == [0.125, 0.125]


# (9) expandable segments: the cap checks whole segments, a card maps only missing pages ----------
EXPANDABLE_NOTE = "expandable segments, under which the cap can fail a step within a page of the limit"
ASYNC_NOTE = "the allocator is backend:cudaMallocAsync, whose memory fraction caps requested bytes"


def _said(meter: AllocatorMeter, note: str) -> int:
    return sum(note in said for said in meter.notes())


@pytest.mark.parametrize(
    ("conf", "expandable", "caps_requested"),
    [
        ("expandable_segments:True", 1, 0),
        ("", 0, 0),
        ("expandable_segments:False", 0, 0),
        ("backend:cudaMallocAsync,expandable_segments:True", 0, 1),  # the driver's pool: no segments
    ],
)
def test_a_limit_says_what_the_allocator_settings_change_and_the_result_keeps_it(
    conf: str, expandable: int, caps_requested: int
) -> None:
    """Said once a cap is in force, and still said after the probe: the result reads the notes then."""
    meter, _ = _meter(conf, 1.0, budget=None, limit=40 * GiB)
    assert meter.notes() == []  # no cap in force yet
    with meter.active():
        assert (_said(meter, EXPANDABLE_NOTE), _said(meter, ASYNC_NOTE)) == (expandable, caps_requested)
        with meter.capped(20 * GiB):
            pass
    assert (_said(meter, EXPANDABLE_NOTE), _said(meter, ASYNC_NOTE)) == (expandable, caps_requested)


def test_a_lowered_cap_without_a_limit_says_it_too() -> None:
    """The safe batch's verification caps the allocator (``capped``) even with no memory limit."""
    meter, _ = _meter("expandable_segments:True", 1.0, budget=40 * GiB, limit=None)
    with meter.active():
        assert _said(meter, EXPANDABLE_NOTE) == 0  # no limit: no cap yet
        with meter.capped(20 * GiB):
            pass
    assert _said(meter, EXPANDABLE_NOTE) == 1


def test_without_any_cap_nothing_is_said() -> None:
    meter, _ = _meter("expandable_segments:True", 1.0, budget=40 * GiB, limit=None)
    with meter.active():
        with meter.capped(None):
            pass
    assert meter.notes() == []


# (issue 50) a soak keeps the cache between its steps; a search empties it ---------------------------
def test_release_empties_the_cache_unless_a_soak_keeps_it() -> None:
    meter, module = _meter("", 1.0, 8 * GiB, 8 * GiB)
    meter.release(0)
    emptied = getattr(module, "emptied", 0)
    assert emptied >= 1  # a search's trial leaves nothing cached for the next
    meter.keeps_cache = True
    meter.release(0)
    assert getattr(module, "emptied", 0) == emptied  # a training loop's steps keep the cache: so does a soak
    meter.keeps_cache = False
    meter.release(0)
    assert getattr(module, "emptied", 0) == emptied + 1

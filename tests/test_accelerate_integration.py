"""``batchfit.accelerate.find_executable_batch_size`` on a real model with real out-of-memory errors.

The memory is batchfit's CPU live-tensor limit: a :class:`batchfit.Prober` owns the meter, and the
user's training function runs inside ``meter.tracking()``. Any operation that takes live tensor
memory over the cap raises a real ``torch.OutOfMemoryError`` with the CPU allocator's wording,
so both batchfit's and Accelerate's OOM checks recognise it. This is how
``benchmarks/compare.py`` drives Accelerate too. The truth is checked by calling the same
undecorated function directly under the same meter: the size found fits and the next one does not.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import batchfit
from batchfit import examples
from batchfit.accelerate import NoExecutableBatchSizeError, find_executable_batch_size
from batchfit.backends import Meter
from batchfit.search import Grid, search

FEATURES, CLASSES = 64, 10
#: The live-tensor cap; with this MLP it puts the boundary at a size that is no power of two
#: (174 when written), so doubling, bisection and the 0.9 steps all have work to do.
CAP = "800KiB"
PROBE_STEPS, REAL_STEPS = 2, 3


@dataclass
class Rig:
    """A model whose training steps run under a live-tensor meter with a cap."""

    model: torch.nn.Module
    meter: Meter
    #: ``(batch_size, probe)`` of every call of the training function, in order.
    calls: list[tuple[int, bool]]

    def steps(self, batch_size: int, steps: int) -> None:
        """What the user's function does: fresh AdamW, ``steps`` steps on random data."""
        model = self.model
        with self.meter.tracking():
            model.zero_grad(set_to_none=True)  # a step that died in the optimizer left grads
            optimizer = torch.optim.AdamW(model.parameters())
            generator = torch.Generator().manual_seed(batch_size)
            inputs = torch.randn(batch_size, FEATURES, generator=generator)
            targets = torch.randint(0, CLASSES, (batch_size,), generator=generator)
            for _ in range(steps):
                loss = F.cross_entropy(model(inputs), targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    def fits(self, batch_size: int) -> bool:
        """A direct call, not decorated: the truth for one size."""
        try:
            self.steps(batch_size, PROBE_STEPS)
        except torch.OutOfMemoryError as exc:
            exc.__traceback__ = None  # its frames hold the failed step's tensors
            return False
        return True

    def with_probe(self) -> Callable[..., tuple[int, int]]:
        """A training function that accepts ``probe``: a few steps when probing, else the run."""

        def train(batch_size: int, probe: bool = False) -> tuple[int, int]:
            self.calls.append((batch_size, probe))
            steps = PROBE_STEPS if probe else REAL_STEPS
            self.steps(batch_size, steps)
            return batch_size, steps

        return train

    def without_probe(self) -> Callable[[int], int]:
        """Accelerate's kind of function: every call is the whole run."""

        def train(batch_size: int) -> int:
            self.calls.append((batch_size, False))
            self.steps(batch_size, REAL_STEPS)
            return batch_size

        return train


@dataclass(frozen=True)
class Verdict:
    """An answer of the synthetic oracle that gives the expected sequence of probes."""

    fits: bool
    peak_bytes: int | None = None


@contextlib.contextmanager
def capped(cap: str = CAP) -> Iterator[Rig]:
    model, sample = examples.mlp(in_features=FEATURES, hidden=128, depth=2, classes=CLASSES)
    with batchfit.Prober(model, sample, memory_limit=cap) as prober:
        assert prober.meter is not None
        yield Rig(model, prober.meter, [])


@pytest.fixture
def rig() -> Iterator[Rig]:
    with capped() as made:
        yield made


def assert_boundary(rig: Rig, size: int) -> None:
    assert rig.fits(size) and not rig.fits(size + 1), f"{size} is not the boundary"


def accelerate_steps(start: int, fits: Callable[[int], bool]) -> list[tuple[int, bool]]:
    """The fallback's sequence, Accelerate's: 10% less after each failure until a size fits."""
    sequence, size = [], start
    while True:
        ok = fits(size)
        sequence.append((size, ok))
        if ok:
            return sequence
        size = min(size - 1, math.floor(size * 0.9 + 1e-9))


# with probe: the exact boundary, one real run ---------------------------------------------------------
@pytest.mark.slow
def test_probe_finds_the_exact_boundary_and_trains_once(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    margin = 0.0  # the default: the real run is at the exact largest fit (a margin is tested below)
    train = find_executable_batch_size(starting_batch_size=8)(rig.with_probe())
    with caplog.at_level(logging.INFO, logger="batchfit"):
        result = train()

    largest = train.largest_fit
    assert largest is not None
    assert_boundary(rig, largest)
    chosen = math.floor(largest * (1 - margin) + 1e-9)
    assert train.batch_size == chosen and result == (chosen, REAL_STEPS)
    # One real call, the last one, at the chosen size; everything before it was a probe.
    assert [call for call in rig.calls if not call[1]] == [(chosen, False)] and rig.calls[-1] == (chosen, False)
    # The probes are batchfit's pure search (doubling from 8, then bisection), call for call.
    expected = search(lambda size: Verdict(size <= largest), Grid(8, 32768)).attempts
    assert train.trials == [(a.batch_size, a.fits) for a in expected] + [(chosen, True)]
    assert f"largest batch size that fits {largest}" in caplog.text and f"training at {chosen}" in caplog.text


@pytest.mark.slow
def test_probe_searches_down_from_a_start_above_the_boundary(rig: Rig) -> None:
    train = find_executable_batch_size(starting_batch_size=1024, margin=0.0)(rig.with_probe())
    assert train() == (train.largest_fit, REAL_STEPS)  # no margin: the real run is at the boundary
    assert train.largest_fit is not None
    assert_boundary(rig, train.largest_fit)
    probes = [size for size, probe in rig.calls if probe]
    assert probes[:4] == [1024, 512, 256, 128]  # halving until a size fits, then bisection
    assert len(probes) == len(set(probes)), "a size was probed twice"
    assert len(probes) <= 4 + (256 - 128 - 1).bit_length()


@pytest.mark.slow
def test_a_real_run_that_runs_out_of_memory_is_retried_lower(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """The probes saw less than the real run needs (here 1/8 more samples per batch, as longer
    real data would): the real call fails and is retried 10% lower, Accelerate's way."""

    def train(batch_size: int, probe: bool = False) -> int:
        rig.calls.append((batch_size, probe))
        rig.steps(batch_size if probe else batch_size + batch_size // 8, PROBE_STEPS)
        return batch_size

    wrapped = find_executable_batch_size(train, starting_batch_size=64, margin=0.0)
    with caplog.at_level(logging.WARNING, logger="batchfit"):
        result = wrapped()
    largest = wrapped.largest_fit
    assert largest is not None
    assert_boundary(rig, largest)
    expected, size = [], largest
    while True:
        fits = rig.fits(size + size // 8)
        expected.append((size, fits))
        if fits:
            break
        size = math.floor(size * 0.9)
    assert len(expected) > 1 and wrapped.trials[-len(expected) :] == expected
    assert result == wrapped.batch_size == size
    assert [call for call in rig.calls if not call[1]] == [(s, False) for s, _ in expected]
    assert f"batch size {largest} ran out of memory" in caplog.text


@pytest.mark.slow
def test_an_evaluation_loop_is_sized_by_its_own_decorated_function_beside_the_training_state(rig: Rig) -> None:
    """The module docs' evaluation use: a decorated evaluation loop, called once after an optimizer
    step (AdamW's moments live, gradients freed), finds its own exact boundary, above training's;
    later evaluations reuse it through ``__wrapped__`` without searching again."""
    model = rig.model
    train = find_executable_batch_size(starting_batch_size=64, margin=0.0)(rig.with_probe())
    train()
    assert train.largest_fit is not None
    with rig.meter.tracking():  # the run's state where it evaluates: one step taken, its moments kept
        optimizer = torch.optim.AdamW(model.parameters())
        F.cross_entropy(model(torch.randn(2, FEATURES)), torch.zeros(2, dtype=torch.long)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def evaluation_steps(batch_size: int, steps: int) -> int:
        correct = 0
        with rig.meter.tracking(), torch.no_grad():
            inputs = torch.randn(batch_size, FEATURES, generator=torch.Generator().manual_seed(batch_size))
            for _ in range(steps):
                correct += int((model(inputs).argmax(dim=1) == 0).sum())
        return correct

    def evaluation_fits(batch_size: int) -> bool:
        try:
            evaluation_steps(batch_size, PROBE_STEPS)
        except torch.OutOfMemoryError as exc:
            exc.__traceback__ = None
            return False
        return True

    @find_executable_batch_size(starting_batch_size=64)
    def evaluate(batch_size: int, probe: bool = False) -> int:
        rig.calls.append((batch_size, probe))
        return evaluation_steps(batch_size, PROBE_STEPS if probe else REAL_STEPS)

    evaluate()
    size = evaluate.largest_fit
    assert size is not None and size == evaluate.batch_size > train.largest_fit
    assert evaluation_fits(size) and not evaluation_fits(size + 1)
    calls = len(rig.calls)
    evaluate.__wrapped__(evaluate.batch_size)  # a later evaluation: one call, no search
    assert rig.calls[calls:] == [(size, False)]


@pytest.mark.slow
def test_multiple_of_finds_the_largest_multiple_that_fits(rig: Rig) -> None:
    train = find_executable_batch_size(starting_batch_size=128, multiple_of=16, margin=0.0)(rig.with_probe())
    train()
    assert train.largest_fit is not None and train.largest_fit % 16 == 0
    assert rig.fits(train.largest_fit) and not rig.fits(train.largest_fit + 16)
    assert all(size % 16 == 0 for size, _ in train.trials)


# without probe: Accelerate's semantics, bisecting down -----------------------------------------------------
@pytest.mark.slow
def test_without_probe_the_first_success_is_returned_after_accelerates_steps(rig: Rig) -> None:
    train = find_executable_batch_size(starting_batch_size=1024)(rig.without_probe())
    result = train()
    expected = accelerate_steps(1024, rig.fits)
    assert train.trials == expected and rig.calls == [(size, False) for size, _ in expected]
    assert result == train.batch_size == expected[-1][0]
    assert train.largest_fit is None  # the search ended at its first success: not a boundary


def test_without_probe_a_start_that_fits_returns_at_once(rig: Rig) -> None:
    train = find_executable_batch_size(starting_batch_size=8)(rig.without_probe())
    assert train() == 8 and train.trials == [(8, True)]


# errors ---------------------------------------------------------------------------------------------------
def test_a_non_oom_error_propagates_unchanged(rig: Rig) -> None:
    def train(batch_size: int, probe: bool = False) -> None:
        rig.calls.append((batch_size, probe))
        if batch_size > 64:  # a real bug that shows only at bigger sizes: wrong feature width
            rig.model(torch.randn(batch_size, FEATURES + 1))
        rig.steps(batch_size, PROBE_STEPS)

    wrapped = find_executable_batch_size(train, starting_batch_size=16)
    with pytest.raises(RuntimeError, match="cannot be multiplied") as raised:
        wrapped()
    assert type(raised.value) is RuntimeError and not isinstance(raised.value, NoExecutableBatchSizeError)
    assert rig.calls == [(16, True), (32, True), (64, True), (128, True)]


@pytest.mark.slow
def test_nothing_fits_raises_a_runtime_error_caused_by_the_oom() -> None:
    with capped("200KiB") as tiny:  # weights, gradients and AdamW state alone do not fit
        train = find_executable_batch_size(starting_batch_size=8)(tiny.without_probe())
        with pytest.raises(NoExecutableBatchSizeError) as raised:
            train()
    assert isinstance(raised.value, RuntimeError) and isinstance(raised.value, batchfit.NothingFitsError)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    assert train.trials == [(size, False) for size in (8, 7, 6, 5, 4, 3, 2, 1)]  # Accelerate's steps, down to 1


def test_arguments_are_checked_like_accelerate(rig: Rig) -> None:
    with pytest.raises(ValueError, match="multiple of"):
        find_executable_batch_size(rig.with_probe(), starting_batch_size=10, multiple_of=8)
    with pytest.raises(ValueError, match="max_batch_size"):
        find_executable_batch_size(rig.with_probe(), starting_batch_size=64, max_batch_size=32)
    train = find_executable_batch_size(rig.without_probe(), starting_batch_size=8)
    with pytest.raises(TypeError, match="passed into `train` as its first argument"):
        train(8)
    assert rig.calls == []


def test_reduce_batch_size_fn_must_shrink_and_zero_means_nothing_fits(rig: Rig) -> None:
    stuck = find_executable_batch_size(rig.without_probe(), starting_batch_size=1024, reduce_batch_size_fn=lambda: 1024)
    with pytest.raises(ValueError, match="must shrink"):
        stuck()
    zero = find_executable_batch_size(rig.without_probe(), starting_batch_size=1024, reduce_batch_size_fn=lambda: 0)
    with pytest.raises(NoExecutableBatchSizeError, match="reached zero") as raised:
        zero()
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


# against Accelerate ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_accelerate_lands_at_or_below_the_exact_boundary(rig: Rig, record_property: Callable[..., None]) -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    start = 256  # above the boundary, as Accelerate needs: it never searches up

    theirs = accelerate_utils.find_executable_batch_size(rig.without_probe(), starting_batch_size=start)()
    their_calls = len(rig.calls)
    ours = find_executable_batch_size(rig.with_probe(), starting_batch_size=start, margin=0.0)
    ours()
    assert ours.largest_fit is not None
    assert_boundary(rig, ours.largest_fit)
    assert rig.fits(theirs) and theirs <= ours.largest_fit

    # reduce_batch_size_fn, given Accelerate's own 0.9 rule, reproduces Accelerate's answer.
    size = start

    def reduce() -> int:
        nonlocal size
        size = int(size * 0.9)
        return size

    same = find_executable_batch_size(rig.without_probe(), starting_batch_size=start, reduce_batch_size_fn=reduce)
    assert same() == theirs and len(same.trials) == their_calls
    fallback = find_executable_batch_size(rig.without_probe(), starting_batch_size=start)
    fallback()
    for name, value in [
        ("accelerate_size", theirs),
        ("accelerate_calls", their_calls),
        ("batchfit_probe_size", ours.largest_fit),
        ("batchfit_probe_calls", len(ours.trials)),
        ("batchfit_no_probe_size", fallback.batch_size),
        ("batchfit_no_probe_calls", len(fallback.trials)),
    ]:
        record_property(name, value)


@pytest.mark.slow
def test_importing_needs_no_accelerate(tmp_path: Path) -> None:
    """The module imports nothing of Accelerate: with ``accelerate`` unimportable it still works."""
    child = textwrap.dedent(
        """
        import sys
        sys.modules["accelerate"] = None  # any `import accelerate` now raises ImportError
        from batchfit.accelerate import find_executable_batch_size

        @find_executable_batch_size(starting_batch_size=4, margin=0.0, max_batch_size=64)
        def train(batch_size, probe=False):
            if batch_size > 20:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
            return batch_size

        assert train() == 20, train.trials
        print("ok")
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

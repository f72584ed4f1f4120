"""Ctrl-C is never swallowed and never leaves a half-restored model: real SIGINTs, real probes."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_same_state, state_of
from torch import nn

import batchfit
from batchfit.probe.runner import opened

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import faults  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")


@pytest.mark.slow
def test_real_sigints_at_many_points_of_a_probe_all_surface_with_the_state_restored() -> None:
    """One SIGINT per child process, at offsets spread over a whole probe (the same harness as
    ``benchmarks/faults.py``). Before the fix about one in five was swallowed inside the CPU
    meter's weakref finalizers and ``find()`` returned normally."""
    duration, outcomes = faults.run(runs=8, model_name="gpt", limit="24MiB", concurrency=2)
    counts = faults.summarise(outcomes)
    assert counts["lost"] == 0, outcomes
    assert counts["errors"] == 0, outcomes
    assert counts["swallowed_in_finalizer"] == 0, outcomes
    assert counts["interrupted"] >= 6, outcomes  # the offsets lie inside the probe
    assert counts["restored"] == counts["interrupted"] + counts["after"], outcomes


class Interrupting(nn.Module):
    """Sends this process a real SIGINT in forward at ``at`` rows and more, and again, if asked,
    when the restore sets its train/eval flag back (a second Ctrl-C during the restore)."""

    def __init__(self, at: int, during_restore: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.norm = nn.BatchNorm1d(256)
        self.drop = nn.Dropout(0.2)
        self.at = at
        self.during_restore = during_restore
        self.fired = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.at and self.fired == 0:
            self.fired = 1
            os.kill(os.getpid(), signal.SIGINT)
        return self.drop(self.norm(self.fc(x)))

    def __setattr__(self, name: str, value: object) -> None:
        if name == "training" and getattr(self, "fired", 0) == 1 and self.during_restore and value is False:
            self.__dict__["fired"] = 2
            os.kill(os.getpid(), signal.SIGINT)
        super().__setattr__(name, value)


@pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler, reason="needs Python's default SIGINT handler"
)
@pytest.mark.parametrize("during_restore", [False, True], ids=["mid-forward", "and-again-during-restore"])
def test_a_sigint_in_forward_surfaces_after_a_complete_restore(during_restore: bool) -> None:
    torch.manual_seed(0)
    model = Interrupting(at=16, during_restore=during_restore)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sample = torch.randn(4, 256)
    model(sample).sum().backward()
    optimizer.step()
    model.eval()  # flags the restore must bring back: the second signal fires as it does
    before = state_of(model, optimizer)
    with pytest.raises(KeyboardInterrupt):
        batchfit.find(model, sample, optimizer=optimizer, memory_limit="64MiB")
    assert model.fired == (2 if during_restore else 1)
    model.__dict__["fired"] = 0
    assert_same_state(before, state_of(model, optimizer))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back


def test_restore_rng_false_leaves_the_generators_to_the_process() -> None:
    """A probe in a background thread must not replay random numbers other threads drew:
    ``restore_rng=False`` leaves the generators as the probe's steps left them."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Linear(64, 4))  # dropout draws numbers
    sample = torch.randn(2, 64)
    results: dict[str, bool] = {}

    def probe(restore: bool) -> None:
        before = torch.random.get_rng_state()
        batchfit.find(model, sample, memory_limit="8MiB", max_batch=8, verify_steps=0, restore_rng=restore)
        results[str(restore)] = torch.equal(before, torch.random.get_rng_state())

    for restore in (True, False):
        thread = threading.Thread(target=probe, args=(restore,))
        thread.start()
        thread.join()
    assert results == {"True": True, "False": False}


class Stuck(nn.Module):
    """At ``at`` rows forward gets Ctrl-C, then waits in plain Python (no tensor operation, so no
    safe point comes) and gets a second Ctrl-C; ``escaped`` says it waited to the end."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.at = at
        self.escaped = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.at:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(20):
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200):  # a second press must end this at once
                time.sleep(0.005)
            self.escaped = True
        return self.fc(x)


@pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler, reason="needs Python's default SIGINT handler"
)
def test_a_second_sigint_stops_code_that_never_reaches_a_safe_point() -> None:
    torch.manual_seed(0)
    model, sample = Stuck(at=8), torch.randn(2, 16)
    before = state_of(model)
    with pytest.raises(KeyboardInterrupt):
        batchfit.find(model, sample, memory_limit="8MiB", max_batch=64)
    assert not model.escaped
    assert_same_state(before, state_of(model))


def _exit_with_a_second_sigint_at(nth: int) -> tuple[int, object, bool]:
    """Exit a probe whose first Ctrl-C is pending, with a second one landing at the ``nth`` line run
    by the way out (the guard's code, and the probe's ``__exit__`` / ``close`` / ``_finish`` on their way to it;
    ``nth=0``: none). Returns the lines that way ran, the SIGINT handler in place afterwards, and
    whether the model came back as it was."""
    import batchfit.interrupts as interrupts
    import batchfit.probe.prober as prober_module

    torch.manual_seed(0)
    model, sample = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(2, 16)
    before = state_of(model)
    files = {interrupts.__file__: None, prober_module.__file__: {"__exit__", "close", "_finish"}}
    seen = 0

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal seen
        names = files.get(frame.f_code.co_filename, ())
        if names != None and frame.f_code.co_name not in names:  # noqa: E711 (None: every function)
            return None
        seen += 1
        if seen == nth:
            signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, handled at the next bytecode
        return tracer

    prober = batchfit.Prober(model, sample, memory_limit="16MiB")
    prober.__enter__()
    prober.trial(2)
    signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: recorded by the guard, not yet raised
    try:
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                prober.__exit__(None, None, None)
        finally:
            sys.settrace(None)
            handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # never leave a broken handler to later tests
    try:
        assert_same_state(before, state_of(model))
        restored = True
    except AssertionError:
        restored = False
    return seen, handler, restored


@pytest.mark.slow
@pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler, reason="needs Python's default SIGINT handler"
)
def test_a_second_sigint_anywhere_in_the_way_out_leaves_the_model_restored_and_pythons_handler() -> None:
    """Issue 19, item 13: the first Ctrl-C is pending when the probe exits, and a second one lands
    at each line of the way out in turn: the guard's code (the window between the end of the
    restore's critical section and Python's handler being put back included) and the probe's own
    ``__exit__`` on its way there. Whatever the point, the probe raises ``KeyboardInterrupt``, the
    model is restored, and Python's own SIGINT handler is in place afterwards."""
    lines, _, _ = _exit_with_a_second_sigint_at(0)
    assert lines >= 5
    wrong = []
    for nth in range(1, lines + 1):
        _, handler, restored = _exit_with_a_second_sigint_at(nth)
        if handler is not signal.default_int_handler or not restored:
            wrong.append(f"line {nth} of {lines}: handler {getattr(handler, '__name__', handler)}, restored {restored}")
    assert not wrong, "\n".join(wrong)


def test_the_runner_seams_way_out_is_the_guards_way_out() -> None:
    """`search_with` closes a runner through `opened.__exit__` and `Runner.close`
    (``batchfit.probe.runner``): a second Ctrl-C landing there is only recorded, as in ``__exit__``,
    so it cannot skip the restore."""
    model, sample = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(2, 16)
    prober = batchfit.Prober(model, sample, memory_limit="16MiB")
    ways_out = {batchfit.Prober.__exit__, batchfit.Prober.close, batchfit.Prober._finish, opened.__exit__}
    assert {way.__code__ for way in ways_out} <= prober._interrupts._exit_code

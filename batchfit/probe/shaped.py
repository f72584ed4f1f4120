"""Trials at any ``(rows, seq_len)``: one runner for batches of changing shape.

Why: a token budget's compositions and an epoch's replay run one real trial per shape, in one
probe (one set-up, the optimizer's state live from the first step on, as in training), where a
frontier runs one probe per length. The runner's ``make_batch`` reads the length of the shape
being run; each batch it builds is checked to be that long.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from batchfit.probe.lengths import ProberFactory, check_length
from batchfit.probe.options import Options
from batchfit.probe.runner import Setup, TrialRequest, opened
from batchfit.report import Trial, TrialKind

__all__ = ["ShapedTrials", "shaped_trials"]


class ShapedTrials:
    """An open runner whose trials take a shape: `run` ``rows`` rows of ``seq_len`` tokens."""

    def __init__(self, runner: Any, setup: Setup, length: list[int]) -> None:
        self.setup = setup
        self._runner = runner
        self._length = length

    @contextlib.contextmanager
    def cache_kept(self) -> Iterator[None]:
        """Trials inside leave a caching allocator's cache as it is between them (`Meter.keeps_cache`):
        a soak's steps, as a training loop runs them. A runner without a meter is left as it is."""
        meter = getattr(self._runner, "meter", None)
        if meter is None:
            yield
            return
        meter.keeps_cache = True
        try:
            yield
        finally:
            meter.keeps_cache = False

    def run(
        self,
        rows: int,
        seq_len: int,
        *,
        kind: TrialKind = "verify",
        steps: int | None = None,
        cap_bytes: int | None = None,
        from_scratch: bool = False,
    ) -> Trial:
        """One real trial of ``rows`` rows of ``seq_len`` tokens (`Runner.run`)."""
        self._length[0] = seq_len
        return self._runner.run(TrialRequest(rows, steps, kind, cap_bytes=cap_bytes, from_scratch=from_scratch))


@contextlib.contextmanager
def shaped_trials(
    make_batch: Callable[[int, int], Any], options: Options, make_prober: ProberFactory, what: str
) -> Iterator[ShapedTrials]:
    """A runner ``make_prober`` builds, open, its batches ``make_batch(rows, seq_len)`` of the
    shape each `ShapedTrials.run` names; ``what`` names the trials in a wrong length's error."""
    length = [1]

    def at_current_length(batch_size: int) -> Any:
        batch = make_batch(batch_size, length[0])
        check_length(batch, batch_size, length[0], f" ({what})")
        return batch

    shaped = replace(options, make_batch=at_current_length, seq_len=None, init_batch=1, multiple_of=1)
    runner = make_prober(shaped)
    with opened(runner) as setup:
        yield ShapedTrials(runner, setup, length)

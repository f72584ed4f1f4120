"""The frontier for a device you do not own: [`batchfit.frontier`][batchfit.frontier]'s algorithm over fake trials.

[`batchfit.estimate`][batchfit.estimate] with ``seq_lens=`` lands here once it has read the target and the
budget: the same `frontier_with` that measures a frontier with real steps runs over `FakeProbe` (one
per length), so the points, the length axis and the surface are found the same way and mean the
same, and every point is marked as the estimate it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from batchfit.backends import EstimateTarget
from batchfit.estimation.fake_trials import FakeProbe, Untraceable
from batchfit.probe import Options, frontier_with
from batchfit.report import Frontier, Trial

__all__ = ["estimate_frontier"]


def estimate_frontier(
    model: nn.Module,
    make_batch: Callable[[int, int], Any],
    seq_lens: Sequence[int],
    options: Options,
    target: EstimateTarget,
    budget: int,
    *,
    longest_at_batch_1: bool,
    max_seq_len: int | None,
    callback: Callable[[Trial], None] | None,
    started: float,
) -> tuple[Frontier, set[str]]:
    """The estimated frontier (``estimated=True``; the caller marks each point's result with the
    estimate's device name and assumptions), and the optimizers whose ``foreach`` the trace
    resolved as the target would. A model that cannot be traced on fake tensors is a ``ValueError``: the
    single-length estimate falls back to real CPU steps and extrapolates, which a frontier's
    exact points cannot."""
    switched: set[str] = set()

    def make_prober(at_length: Options) -> FakeProbe:
        probe = FakeProbe(model, None, at_length, target, budget)
        probe.foreach_switched = switched  # one record for every length's probe
        return probe

    try:
        frontier = frontier_with(
            model,
            make_batch,
            seq_lens,
            options,
            make_prober,
            longest_at_batch_1=longest_at_batch_1,
            max_seq_len=max_seq_len,
            callback=callback,
            started=started,
            real_steps=False,  # fake trials: make_batch may build meta tensors
        )
    except Untraceable as untraceable:
        raise ValueError(
            f"the model cannot be traced on fake tensors ({untraceable}), so its frontier cannot be estimated: "
            "measure it with real steps, batchfit.frontier(model, make_batch, seq_lens=...)"
        ) from None
    return replace(frontier, estimated=True), switched

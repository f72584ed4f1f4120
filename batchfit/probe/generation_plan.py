"""Buckets for generation-shaped data (RL rollouts, evaluation): prompt and response, two axes.

Why its own path: a generated row's memory is its prompt's prefill and a KV cache that grows to
``prompt + response`` tokens (issue 36's equation, `batchfit.report.Generation`), so a bucket is
bounded on both axes. Each candidate end is a prompt length (`prompt_ends`: the prompts'
quantiles) paired with the longest response of any row whose prompt is at most that long; a point
measured there bounds every bucket that ends there, whichever rows it starts at. Each end is one
exact generation search (``mode="generate"``, ``max_new_tokens`` its response), so every bucket's
batch is exact at its worst row; the buckets are then chosen as for training
(`choose_buckets`), their tokens the new ones.

A token budget is not offered here: a generation's budget is a serving engine's KV budget, which
[`batchfit.frontier`][batchfit.frontier] with ``mode="generate"`` gives (`Frontier.token_budget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from batchfit.probe.keywords import ProbeStartCallback, StartCallback, TrialCallback
from batchfit.probe.lengths import PointCallback, ProberFactory, frontier_with
from batchfit.probe.options import Options
from batchfit.report import Frontier, FrontierPoint, LengthPlan
from batchfit.report.bucketing import Measured, choose_buckets, median_of, prompt_ends

__all__ = ["plan_generation"]

NO_BUDGET = (
    "generation-shaped lengths: no padded token budget is offered (a generation's budget is a serving engine's KV "
    "budget: batchfit.frontier(..., mode='generate') gives it as token_budget)"
)


def plan_generation(
    model: nn.Module,
    make_batch: Callable[[int, int], Any],
    pairs: Mapping[tuple[int, int], int],
    options: Options,
    make_prober: ProberFactory,
    *,
    boundaries: Sequence[int] | None = None,
    max_buckets: int,
    world_size: int = 1,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    on_point: PointCallback | None = None,
) -> LengthPlan:
    """The plan for ``pairs`` (``{(prompt, response): rows}``; see the module)."""
    started = time.monotonic()
    longest_prompt = max(prompt for prompt, _ in pairs)
    if boundaries is None:
        ends = prompt_ends(pairs, options.multiple_of)
    else:
        if max(boundaries) < longest_prompt:
            raise ValueError(f"boundaries end at {max(boundaries)}, below the longest prompt ({longest_prompt})")
        ends = tuple((end, max(r for (p, r) in pairs if p <= end)) for end in sorted(set(boundaries)))
    points: dict[int, FrontierPoint] = {}
    frontier: Frontier | None = None
    for prompt, response in reversed(ends):  # the longest first: its search is the cheapest
        at = replace(options, mode="generate", max_new_tokens=response)
        frontier = frontier_with(
            model,
            make_batch,
            [prompt],
            at,
            make_prober,
            longest_at_batch_1=False,
            callback=callback,
            on_trial_start=on_trial_start,
            on_start=on_start if not points else None,
            on_point=on_point,
            started=started,
        )
        points[prompt] = frontier.points[0]
    assert frontier is not None
    prompts: dict[int, int] = {}
    generated: dict[int, tuple[int, int]] = {}
    for (prompt, response), rows in pairs.items():
        prompts[prompt] = prompts.get(prompt, 0) + rows
        tokens, _ = generated.get(prompt, (0, 0))
        generated[prompt] = (tokens + response * rows, 0)
    for end, response in ends:
        generated[end] = (generated.get(end, (0, 0))[0], response)
    measured = [
        Measured(end, points[end].safe_batch, points[end].max_batch, _rows_per_s(points[end], response))
        for end, response in ends
    ]
    combined = replace(
        frontier,
        points=tuple(points[end] for end, _ in ends),
        surface=None,
        elapsed_s=time.monotonic() - started,
        notes=(
            "each prompt length was searched generating the longest response of any row whose prompt is at most "
            "that long (one exact generation search per end)",
        ),
    )
    total = sum(prompts.values())
    return LengthPlan(
        buckets=choose_buckets(prompts, measured, max_buckets, world_size, generated),
        token_budget=None,
        packing=None,
        frontier=combined,
        rows=total,
        shortest=min(prompts),
        median=median_of(prompts),
        longest=longest_prompt,
        world_size=world_size,
        notes=(NO_BUDGET,),
    )


def _rows_per_s(point: FrontierPoint, response: int) -> float | None:
    """Rows a second at the point's safe batch: its new tokens/s over the tokens each row generated."""
    return None if not point.tokens_per_s else point.tokens_per_s / response

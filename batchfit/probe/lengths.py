"""The frontier: the exact largest batch at each sequence length, for a fraction of the trials.

`frontier_with` reads top to bottom as what [`batchfit.frontier`][batchfit.frontier] does:

1. check the lengths against the model before any trial (a length longer than its position
   embeddings is an error now, not an ``IndexError`` in a trial), and the batch ``make_batch``
   builds at each: as long as asked (a ``make_batch`` that ignores ``seq_len`` would measure one
   length under another's label), with values to train on (`check_batches`);
2. search the longest length from the smallest batch, as [`batchfit.find`][batchfit.find] does (its boundary
   is the smallest, so the full search is cheapest there), and fit the surface
   ``fixed + b (a s + q s^2)`` ([`Surface`][batchfit.Surface]) through it;
3. search every further length from the boundary the surface predicts there
   (`batchfit.search.search_near`), its first trial the verification of the safe batch the
   surface predicts: when the prediction holds, that trial, the boundary and one more that fails
   are the whole length. The surface is refitted after each length: the longest's neighbour comes
   next (the surface has no ``s^2`` term from one length, and a near length keeps that error
   small), then the shortest, then the lengths between, interpolated;
4. search the length axis at batch 1 the same way, from the length the surface predicts, up to
   the model's position limit (or ``max_seq_len``);
5. hand back a frozen [`Frontier`][batchfit.Frontier].

Each length is a probe of its own (`search_with`, its safe batch
verified by real steps, the user's objects restored after it), exactly as
``find(model, make_batch=make_batch, seq_len=s)`` runs it. It runs over any prober: the real
one, or the estimate's fake trials (``batchfit.estimation``), which is how
[`batchfit.estimate`][batchfit.estimate] gives the same frontier.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from batchfit.backends import backend_for, resolve_device
from batchfit.errors import annotate
from batchfit.probe.batches import META_BATCH, check_has_values, tensor_leaves
from batchfit.probe.finder import described, search_with, verdict
from batchfit.probe.keywords import ProbeStartCallback, StartCallback, TrialCallback
from batchfit.probe.options import Options, check_takes_length
from batchfit.probe.positions import generation_positions, position_limit
from batchfit.probe.probing import FromLine
from batchfit.probe.real_data import sequence_dims
from batchfit.probe.runner import Runner, TrialRequest, opened
from batchfit.report import Frontier, FrontierPoint, LongestLimit, Result, Surface
from batchfit.search import Attempt, Grid, SearchReport, search_near
from batchfit.search.near import HEDGE
from batchfit.units import positive_int

__all__ = [
    "LENGTH_CEILING",
    "PointCallback",
    "ProberFactory",
    "check_batches",
    "check_lengths",
    "frontier_with",
]

#: ``options -> runner``: what runs trials (a `batchfit.probe.runner.Runner`: ``batchfit.probe.Prober``,
#: or the estimate's ``FakeProbe``) for the options given (their ``make_batch`` bound to one length).
ProberFactory = Callable[[Options], Runner]
#: Called with each point once its length is done (the CLI's view draws it).
PointCallback = Callable[[FrontierPoint], None]
#: How far the length-axis search may go when neither the model nor ``max_seq_len`` bounds it.
LENGTH_CEILING = 2**20
#: What a batch of the wrong length on the length axis was for, and how to do without it.
SEARCHING_LONGEST = (
    " (this length was tried in the search for the longest length at batch 1: pass longest_at_batch_1=False "
    "or max_seq_len= to keep to the lengths make_batch builds)"
)


def check_lengths(
    model: nn.Module,
    make_batch: Any,
    seq_lens: Any,
    max_seq_len: Any,
    new_tokens: int = 0,
) -> tuple[tuple[int, ...], int | None, tuple[int, str] | None]:
    """The lengths, sorted; the ceiling of the length axis; the model's position limit and where
    it was read (less ``new_tokens``, which a generation adds to every prompt). Every error names
    the argument, before any trial."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if make_batch is None or not callable(make_batch):
        raise TypeError(
            f"frontier() needs make_batch: a callable (batch_size, seq_len) -> batch, got {type(make_batch).__name__}"
        )
    check_takes_length(make_batch, "make_batch must take (batch_size, seq_len) for a frontier")
    lengths = [positive_int(f"seq_lens[{i}]", value) for i, value in enumerate(_listed(seq_lens))]
    if not lengths:
        raise ValueError("seq_lens is empty: give at least one sequence length")
    twice = sorted({s for s in lengths if lengths.count(s) > 1})
    if twice:
        raise ValueError(f"seq_lens has {', '.join(map(str, twice))} more than once")
    if max_seq_len is not None:
        max_seq_len = positive_int("max_seq_len", max_seq_len)
    limit = position_limit(model)
    if limit is not None and new_tokens:
        fed = generation_positions(0, new_tokens)  # every new token but the last is fed back after the prompt
        limit = (limit[0] - fed, f"{limit[1]}, less {fed:,} of max_new_tokens={new_tokens:,} fed back after the prompt")
    if limit is not None:
        too_long = [s for s in lengths if s > limit[0]]
        if too_long:
            raise ValueError(
                f"seq_lens {', '.join(map(str, too_long))} exceed what the model takes: its position embeddings "
                f"hold {limit[0]:,} positions ({limit[1]}); drop those lengths or extend the model's positions"
            )
        if max_seq_len is not None and max_seq_len > limit[0]:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds what the model takes: {limit[0]:,} positions ({limit[1]})"
            )
    if max_seq_len is not None and max_seq_len < max(lengths):
        raise ValueError(f"max_seq_len={max_seq_len} is below the longest of seq_lens ({max(lengths)})")
    ceilings = [c for c in (max_seq_len, None if limit is None else limit[0]) if c is not None]
    return tuple(sorted(lengths)), min(ceilings) if ceilings else None, limit


def _listed(seq_lens: Any) -> list[Any]:
    """The lengths given, as a list: a list or tuple, a numpy array (``np.arange(...)``), a 1-d
    tensor, any iterable of numbers; not a string or a mapping."""
    wrong = TypeError(f"seq_lens must be a list of ints (sequence lengths), got {type(seq_lens).__name__}")
    if isinstance(seq_lens, (str, bytes, Mapping)) or not isinstance(seq_lens, Iterable):
        raise wrong
    try:
        return list(seq_lens)
    except TypeError:  # a 0-d array or tensor: iterable by type, not by value
        raise wrong from None


def check_batches(
    model: nn.Module, make_batch: Callable[[int, int], Any], lengths: Sequence[int], options: Options, real_steps: bool
) -> None:
    """``make_batch(1, s)`` at every length, checked before any trial: its sequence dimension
    must be ``s`` long (a ``make_batch`` that ignores ``seq_len``, a closure or a
    ``functools.partial`` that fixed it, would label one length's points with others), and, for
    ``real_steps``, its tensors must hold values (not the ``meta`` device, which an estimate's
    fake trials take). The random generators are left as they were: these batches are not the
    trials'."""
    with _generators_kept(model, options), torch.no_grad():
        for s in lengths:
            try:
                batch = make_batch(1, s)
            except Exception as exc:
                annotate(exc, f"batchfit: raised by make_batch(1, {s}), built before any trial to check its length")
                raise
            if real_steps:
                check_has_values(batch, f"make_batch(1, {s})", META_BATCH)
            check_length(batch, 1, s)


def check_length(batch: Any, batch_size: int, seq_len: int, searching: str = "") -> None:
    """``ValueError`` unless ``batch``, built by ``make_batch(batch_size, seq_len)``, is ``seq_len``
    long along its sequence dimension (`sequence_dims`; where that
    dimension cannot be told apart, some dimension beyond the batch must be ``seq_len`` long).
    ``searching`` says what was searched, for a length no one listed."""
    leaves = list(tensor_leaves(batch, "batch"))
    shapes = ", ".join(f"{path} {tuple(tensor.shape)}" for path, tensor in leaves) or "no tensor"
    said = f"make_batch({batch_size}, {seq_len}) built a batch"
    fix = (
        "make_batch(batch_size, seq_len) must build sequences seq_len long; does it ignore seq_len (a closure or "
        "functools.partial that fixed the length, a tokenizer's max_length)?" + searching
    )
    try:
        dim = next(iter(sequence_dims(batch, seq_len).values()))
    except ValueError:  # no dimension, or several, is the sequence: one of them must have the length
        if not any(seq_len in tuple(tensor.shape[1:]) for _, tensor in leaves):
            raise ValueError(f"{said} with no dimension of length {seq_len} ({shapes}): {fix}") from None
        return
    built = next(tensor.shape[dim] for _, tensor in leaves if tensor.dim() > dim)
    if built != seq_len:
        raise ValueError(f"{said} of length {built}, not {seq_len} (dim {dim} of {shapes}): {fix}")


@contextlib.contextmanager
def _generators_kept(model: nn.Module, options: Options) -> Iterator[None]:
    """The CPU's random generator and the probe device's, put back as they were on the way out."""
    device = resolve_device(options.device, model)
    backend = backend_for(device)
    cpu, on_device = torch.random.get_rng_state(), backend.get_rng_state(device)
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if on_device is not None:
            backend.set_rng_state(device, on_device)


def frontier_with(
    model: nn.Module,
    make_batch: Callable[[int, int], Any],
    seq_lens: Sequence[int],
    options: Options,
    make_prober: ProberFactory,
    *,
    longest_at_batch_1: bool = True,
    max_seq_len: int | None = None,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    on_point: PointCallback | None = None,
    on_length: Callable[[int | None], None] | None = None,
    started: float | None = None,
    real_steps: bool = True,
) -> Frontier:
    """The frontier of ``model`` over ``seq_lens`` (see the module), each length probed by a
    prober ``make_prober`` builds from ``options`` with ``make_batch`` bound to the length.
    ``on_length`` is told each length before its trials (``None``: the length axis at batch 1).
    ``real_steps``: the prober runs real steps, so the batches must hold values (an estimate's
    fake trials take meta tensors: ``False``)."""
    started = time.monotonic() if started is None else started
    if on_point is not None and not callable(on_point):
        raise TypeError(f"on_point must be callable, got {type(on_point).__name__}")
    if not isinstance(longest_at_batch_1, bool):
        raise TypeError(f"longest_at_batch_1 must be True or False, got {longest_at_batch_1!r}")
    # Generating, a length is the prompt's: the context (and the surface's length) is new_tokens longer.
    offset = options.max_new_tokens or 0
    lengths, ceiling, limit = check_lengths(model, make_batch, seq_lens, max_seq_len, offset)
    check_batches(model, make_batch, lengths, options, real_steps)
    notes: list[str] = []
    results: dict[int, Result] = {}
    points: dict[int, FrontierPoint] = {}
    surface: Surface | None = None
    fixed: float | None = None
    hedge = HEDGE

    for s in _order(lengths):
        if on_length is not None:
            on_length(s)
        # find(make_batch, seq_len=s); a point's tokens/s is its verification's warm steps, no
        # sizes are timed again after each length's search
        at_length = replace(options, make_batch=make_batch, seq_len=s).untimed()
        predicted: list[float] = []
        plan = None  # the first length: find()'s search from init_batch
        if surface is not None:
            line = (surface.fixed_bytes, surface.per_sample_bytes(s + offset))
            plan = FromLine(*line, options.headroom, hedge, bool(at_length.verify_steps), predicted)
        result = search_with(
            make_prober(at_length),
            at_length,
            started,
            callback=callback,
            on_trial_start=on_trial_start,
            on_start=on_start if not results else None,
            plan=plan,
        )
        results[s] = result = described(result, None, at_length)
        if predicted and result.boundary_reached:
            # A surface that predicted this boundary exactly aims at the next one directly.
            hedge = 0.0 if math.isfinite(predicted[0]) and math.floor(predicted[0]) == result.max_batch else HEDGE
        if fixed is None:
            fixed = float(result.memory.fixed_bytes) if result.memory is not None else 0.0
        surface = Surface.fit(
            [line for length, r in results.items() if (line := _line_of(length + offset, r, fixed)) is not None],
            unit=result.budget_counts,
        )
        points[s] = FrontierPoint.of(s, result)
        if on_point is not None:
            on_point(points[s])

    first = results[lengths[-1]]
    longest: tuple[int, LongestLimit, int] | None = None
    if longest_at_batch_1:
        by_positions = limit is not None and ceiling == limit[0]
        if ceiling == lengths[-1]:
            # The longest length asked for is the ceiling, and it trained at batch >= 1: no trial needed.
            longest = (ceiling, "positions" if by_positions else "max_seq_len", 0)
        else:
            if on_length is not None:
                on_length(None)
            longest = _longest_at_batch_1(
                make_batch, options, make_prober, surface, ceiling, by_positions, started, callback, on_trial_start
            )
        if limit is not None and longest[1] == "positions":
            notes.append(f"batch 1 trains at every length the model takes: {limit[0]:,} positions ({limit[1]})")
        elif limit is None and max_seq_len is None:
            notes.append(
                "the model states no position limit (no config.max_position_embeddings or position embedding "
                f"found): the length axis was searched up to {LENGTH_CEILING:,}; pass max_seq_len= to bound it"
            )
    if len(lengths) > 1:
        notes.append(
            f"length {lengths[-1]:,} was searched from batch {first.settings.init_batch}; every other length from "
            "the boundary the fitted surface predicts there, closed by real trials "
            "(see docs/how-to/real-data.md#the-frontier-every-length-at-once)"
        )
    return Frontier(
        points=tuple(points[s] for s in lengths),
        surface=surface,
        budget_bytes=first.budget_bytes,
        budget_counts=first.budget_counts,
        device=first.device,
        elapsed_s=time.monotonic() - started,
        longest_at_batch_1=None if longest is None else longest[0],
        longest_limited_by=None if longest is None else longest[1],
        longest_trials=0 if longest is None else longest[2],
        notes=tuple(notes),
    )


def _order(lengths: tuple[int, ...]) -> list[int]:
    """The longest first (the full search is cheapest where the boundary is smallest), then its
    neighbour (with one length measured the surface has no ``s^2`` term yet: a near length keeps
    that error small, at small batches), then the shortest (two lengths give the surface its
    curve), then the rest from long to short, between measured lengths."""
    if len(lengths) <= 3:
        return list(reversed(lengths))
    return [lengths[-1], lengths[-2], lengths[0], *reversed(lengths[1:-2])]


def _bound_to(make_batch: Callable[[int, int], Any], length: list[int]) -> Callable[[int], Any]:
    """``make_batch`` at the length ``length[0]`` holds when called (the length-axis search moves
    it), each batch checked to be that long: these lengths were not checked before the trials."""

    def at_current_length(batch_size: int) -> Any:
        batch = make_batch(batch_size, length[0])
        check_length(batch, batch_size, length[0], SEARCHING_LONGEST)
        return batch

    return at_current_length


def _line_of(seq_len: int, result: Result, fixed: float) -> tuple[int, float, float] | None:
    """``(seq_len, fixed, bytes per sample)`` at one length, from its largest fit's peak: the
    fixed part is the first full search's, so one fit per length pins its slope. ``None`` where
    the boundary was not reached (everything up to ``max_batch`` fitted)."""
    trial = result.trial(result.max_batch)
    peak = None if trial is None else trial.peak_in(result.budget_counts)
    if peak is None or not result.boundary_reached:  # a size capped by max_batch says nothing of memory
        return None
    per_sample = (peak - fixed) / result.max_batch
    return (seq_len, fixed, per_sample) if per_sample > 0 else None


def _longest_at_batch_1(
    make_batch: Callable[[int, int], Any],
    options: Options,
    make_prober: ProberFactory,
    surface: Surface | None,
    ceiling: int | None,
    by_positions: bool,
    started: float,
    callback: TrialCallback | None,
    on_trial_start: StartCallback | None,
) -> tuple[int, LongestLimit, int]:
    """The longest length that trains at batch 1: the exact search of the length axis, from the
    length the surface predicts, with real trials at batch 1. ``ceiling`` bounds it (the model's
    positions when ``by_positions``, else ``max_seq_len``; `LENGTH_CEILING` without either)."""
    length = [1]
    one = replace(options, make_batch=_bound_to(make_batch, length), init_batch=1, max_batch=1, multiple_of=1)
    top = LENGTH_CEILING if ceiling is None else ceiling
    trials = [0]
    runner = make_prober(one)
    with opened(runner) as setup:
        budget, unit = setup.budget_bytes, setup.counts

        def oracle(seq_len: int) -> Attempt:
            length[0] = seq_len
            if on_trial_start is not None:
                on_trial_start(1, "search")
            trial = runner.run(TrialRequest(1))
            trials[0] += 1
            if callback is not None:
                callback(trial)
            seen = verdict(trial, unit)
            return replace(seen, batch_size=seq_len)

        def out_of_time() -> bool:
            return options.time_budget is not None and time.monotonic() - started > options.time_budget

        guess, slope = float(top), 0.0
        offset = options.max_new_tokens or 0  # generating: the surface's length is the context
        if surface is not None and budget is not None:
            guess = max(1.0, min(float(top), surface.longest_length(1, budget) - offset))
            slope = surface.per_token_bytes + 2 * surface.per_token_squared_bytes * (guess + offset)  # d peak/d s
        report: SearchReport = search_near(oracle, Grid(init=1, maximum=top), guess, slope, budget, out_of_time)
    if report.stop_reason != "max_batch":
        return report.largest_fit, "memory", trials[0]
    return report.largest_fit, ("positions" if by_positions else "max_seq_len"), trials[0]

"""``batchfit.estimate()``: the answer for a memory size before you own the device.

A model is estimated here; a target with ``world_size`` (one rank of a sharded job) in a process
of its own (`batchfit.estimation.rank_estimate`). What the estimate is for, and the assumptions
both state: `batchfit.estimation.estimate_setup`.

The probe's own search (`search_with`) over fake trials (`FakeProbe`, whose module says how they
count), with the target's fixed costs stated as assumptions; a real CPU probe under a cap where a
model cannot be traced on fake tensors (`_extrapolate`). Nothing is timed, so an estimate has no
throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

from batchfit.backends import EstimateTarget
from batchfit.errors import NothingFitsError
from batchfit.estimation.estimate_setup import (
    FAKE_TRACE,
    FALLBACK_CAP,
    EstimateSetup,
    for_device_of,
    foreach_assumption,
    split_memory,
)
from batchfit.estimation.fake_lengths import estimate_frontier
from batchfit.estimation.fake_trials import FakeProbe, Untraceable
from batchfit.estimation.rank_estimate import ESTIMATE_TIMEOUT_S, estimate_sharded
from batchfit.probe import Options, find_with
from batchfit.probe.checks import check_work
from batchfit.probe.finder import described, search_with
from batchfit.probe.options import renamed
from batchfit.probe.positions import check_seq_len
from batchfit.probe.real_data import worst_batch
from batchfit.report import Frontier, Result, SizedOn, Trial
from batchfit.units import format_bytes

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from batchfit.probe.keywords import EstimateOptions

__all__ = ["estimate", "refuse_sharded", "split_memory"]


def estimate(
    model_or_target: nn.Module | str,
    sample: Any = None,
    *,
    world_size: int | None = None,
    memory_limit: int | str | None = None,
    for_device: str | None = None,
    reserve: int | str | None = None,
    timeout_s: float | None = ESTIMATE_TIMEOUT_S,
    seq_lens: Sequence[int] | None = None,
    longest_at_batch_1: bool = True,
    max_seq_len: int | None = None,
    callback: Callable[[Trial], None] | None = None,
    device: str | None = None,
    memory: int | str | None = None,
    **options: Unpack[EstimateOptions],
) -> Result | Frontier:
    """Estimate [`batchfit.find`][batchfit.find]'s answer for a device with ``memory_limit`` bytes, without it.

    Runs the probe's search over fake trials (see the module docs): no device, no memory, seconds.
    The [`Result`][batchfit.Result] has ``estimated=True`` and its ``assumptions`` listed;
    ``str()`` says "estimate". No throughput (nothing real is timed).

    The keywords are [`batchfit.find`][batchfit.find]'s, with the same names and the same checks,
    for the same things (a ``DataLoader`` as the sample, sized on its worst batch; ``seq_len=``,
    ``criterion=``, an optimizer object...); an estimate has nothing to time, to verify, to
    interrupt or to spread over ranks, so ``find``'s keywords for those are not taken.

    A target, ``"package.module:factory"`` or ``"path/to/file.py:factory"`` with
    ``world_size=N``, is one rank of an FSDP2 job of N ranks, estimated in a fresh process
    ([`estimate_sharded`][batchfit.estimate_sharded], the same call: its docs say how).

    Args:
        model_or_target: the `nn.Module` to estimate, or a target as ``batchfit estimate`` takes it.
        world_size: a target's ranks; batch sizes are per rank. Refused with a model (the ranks of
            a model are those launched: estimate it alone, its answer is per rank).
        memory_limit: the device's memory: bytes or a size (``"80GiB"``, ``"24GB"``; a fraction
            needs a device to be a fraction of). ``memory=`` is its old name, still accepted with
            a ``DeprecationWarning``.
        for_device: the card estimated for (`batchfit.estimation.estimate_setup.TARGETS`), not where
            anything runs (``device=``, its old name, still works with a ``DeprecationWarning``): the
            CPU (the live-tensor meter's count, equal to what ``find()`` measures there under the
            same ``memory_limit``; the default),
            CUDA (the caching allocator's reserved bytes, modelled; see the assumptions), or
            ``"rocm"``: the same allocator with hipBLAS/hipBLASLt's workspaces (2 x (128 + 76) MiB,
            not cuBLAS's 2 x 33 MiB). On a GPU target an optimizer that leaves ``foreach`` to torch
            steps with the foreach implementation, as torch's does there (an assumption, stated).
        reserve: taken off ``memory_limit`` for what lives outside the allocator. Default:
            nothing on the CPU; on a GPU 1 GiB for the context with its kernels and handles, the
            top of the 0.5-1 GiB that CUDA 12 takes, so the estimate errs safe (an assumption,
            stated with the range; ``reserve=`` sets what a measured card keeps).
        timeout_s: a target's limit on its process, in seconds (``None``: no limit).

        **options: [`EstimateOptions`][batchfit.probe.keywords.EstimateOptions], as `find` takes them.

    A model that cannot be traced on fake tensors
    is not an error: real CPU steps answer instead (see the module docs).

    A length axis: ``seq_lens=[...]`` with ``make_batch(batch_size, seq_len)`` returns a
    [`Frontier`][batchfit.Frontier] (``estimated=True``), [`batchfit.frontier`][batchfit.frontier]'s answer
    from fake trials: per length the exact largest and the safe batch, the longest length at
    batch 1 (``longest_at_batch_1``, up to ``max_seq_len`` or the model's positions) and the
    memory surface. A model that cannot be traced on fake tensors is a ``ValueError`` there.

    Raises:
        NothingFitsError: not even ``init_batch`` fits the memory.
        TypeError, ValueError: bad arguments.
    """
    memory_limit, limit_name = renamed("estimate", "memory", memory, "memory_limit", memory_limit)
    for_device = for_device_of("estimate", for_device, device)
    if isinstance(model_or_target, str) and ":" not in model_or_target.strip(":"):
        raise TypeError(
            f"model must be a torch.nn.Module, got str {model_or_target!r} (a target is 'module:factory' or "
            "'path/to/file.py:factory', with world_size=)"
        )
    if isinstance(model_or_target, str):
        lengths = {"sample": sample, "seq_lens": seq_lens, "max_seq_len": max_seq_len, "callback": callback}
        given = [f"{name}=" for name, value in lengths.items() if value is not None]
        given += ["longest_at_batch_1="] * (longest_at_batch_1 is not True)
        if given:
            raise TypeError(
                f"estimate({model_or_target!r}) got {', '.join(given)}: a target's factory returns its sample, and "
                "its estimate runs in a process of its own, one length, no callback"
            )
        if world_size is None:
            raise TypeError(f"estimate({model_or_target!r}) needs world_size=: the ranks of the job it shards over")
        return estimate_sharded(
            model_or_target,
            world_size,
            memory_limit=memory_limit,
            for_device=for_device,
            reserve=reserve,
            timeout_s=timeout_s,
            **options,
        )
    if world_size is not None:
        raise TypeError(
            f"estimate() of a model got world_size={world_size!r}: the ranks of a model are the ones launched, and "
            "its answer is per rank already; world_size= is for a target, 'module:factory', sharded over that many"
        )
    if timeout_s != ESTIMATE_TIMEOUT_S:
        raise TypeError("estimate() of a model got timeout_s=: it bounds a target's process; a model's runs here")
    return _estimate_model(
        model_or_target, sample, memory_limit, for_device, reserve, seq_lens, longest_at_batch_1, max_seq_len, callback,
        limit_name, options,
    )  # fmt: skip


def _estimate_model(
    model: nn.Module,
    sample: Any,
    memory_limit: int | str | None,
    for_device: str,
    reserve: int | str | None,
    seq_lens: Sequence[int] | None,
    longest_at_batch_1: bool,
    max_seq_len: int | None,
    callback: Callable[[Trial], None] | None,
    limit_name: str,
    options: EstimateOptions,
) -> Result | Frontier:
    """`estimate` of a model, in this process (see its docs)."""
    started = time.monotonic()
    setup = EstimateSetup.of(memory_limit, for_device, reserve, options, limit_name)
    target, budget, assumptions, options = setup.target, setup.budget, setup.assumptions, setup.options

    def marked(result: Result, sized_on: SizedOn | None = None) -> Result:
        return setup.marked(result, started, sized_on)

    if seq_lens is not None:
        return _frontier(
            model,
            sample,
            options,
            target,
            budget,
            seq_lens,
            longest_at_batch_1,
            max_seq_len,
            callback,
            started,
            assumptions,
            marked,
        )
    refuse_sharded(model)
    check_seq_len(model, options.seq_len)  # before a loader is scanned
    sample, drawn, sized_on = worst_batch(sample, options)
    check_work(model, sample, options)

    try:
        probe = FakeProbe(model, sample, options, target, budget)
        probe.sized_on = sized_on
        if drawn is not None:
            probe.notes.append(drawn)
        result = search_with(probe, options, started, callback=callback)
        if probe.foreach_switched:
            assumptions.append(foreach_assumption(sorted(probe.foreach_switched)))
    except Untraceable as untraceable:
        result, said = _extrapolate(model, sample, options, budget, untraceable, started)
        # Real steps ran instead: the fake trace's own assumption no longer holds.
        assumptions[:] = [line for line in assumptions if line != FAKE_TRACE] + [said]
    return marked(described(result, sample, options), sized_on)


def refuse_sharded(model: Any) -> None:
    """Refuse a model already sharded in this process: `FakeProbe` swaps fake tensors into its
    parameter slots, which an FSDP2 shard (a ``DTensor`` FSDP owns) cannot take, and a trace cut
    short there would leave FSDP's lazy initialisation half done. Raised before anything runs."""
    if not isinstance(model, nn.Module) or not any(hasattr(p, "to_local") for p in model.parameters()):
        return
    raise ValueError(
        f"the model ({type(model).__name__}) is sharded (its parameters are DTensors, as fully_shard makes them): "
        "estimate() cannot swap fake tensors into them. Estimate the sharded job from its target instead, in a "
        "process of its own: batchfit.estimate_sharded('module:factory', world_size) or batchfit estimate TARGET "
        "--world-size W"
    )


def _frontier(
    model: nn.Module,
    sample: Any,
    options: Options,
    target: EstimateTarget,
    budget: int,
    seq_lens: Sequence[int],
    longest_at_batch_1: bool,
    max_seq_len: int | None,
    callback: Callable[[Trial], None] | None,
    started: float,
    assumptions: list[str],
    marked: Callable[[Result], Result],
) -> Frontier:
    """``estimate(..., seq_lens=...)``: [`batchfit.frontier`][batchfit.frontier]'s answer from fake trials."""
    if sample is not None or options.seq_len is not None:
        given = "sample" if sample is not None else "seq_len"
        raise TypeError(
            f"estimate() with seq_lens= builds each length's batches with make_batch(batch_size, seq_len); "
            f"{given}= does not go with it (one length: pass seq_len= without seq_lens=)"
        )
    frontier, switched = estimate_frontier(
        model,
        options.make_batch,  # type: ignore[arg-type]  # checked by frontier_with
        seq_lens,
        replace(options, make_batch=None),
        target,
        budget,
        longest_at_batch_1=longest_at_batch_1,
        max_seq_len=max_seq_len,
        callback=callback,
        started=started,
    )
    if switched:
        assumptions.append(foreach_assumption(sorted(switched)))
    points = tuple(replace(point, result=marked(point.result)) for point in frontier.points)
    return replace(
        frontier,
        points=points,
        device=points[0].result.device,
        assumptions=tuple(assumptions),
        elapsed_s=time.monotonic() - started,
    )


def _extrapolate(
    model: nn.Module, sample: Any, options: Options, budget: int, why: Untraceable, started: float
) -> tuple[Result, str]:
    """The fallback for models fake tensors cannot trace: a real probe on the CPU under
    ``min(budget, FALLBACK_CAP)`` of live tensors. Under the cap that *is* the answer (for the
    CPU); above it, the answer is read off the memory lines of the real trials, which reach sizes
    where the per-sample bytes show (a few small sizes would see only the fixed costs). Returns
    the result and the assumption that says which it was."""
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"the model does data-dependent work that fake tensors cannot trace ({why}), and its weights are on the "
            "meta device, so no real step can run instead: build it with real weights on the CPU"
        ) from None
    cap = min(budget, FALLBACK_CAP)
    # The sample is already the batch to size on, at seq_len: only make_batch still needs the length.
    seq_len = options.seq_len if sample is None else None
    real = find_with(model, sample, replace(options, memory_limit=cap, distributed=False, seq_len=seq_len))
    trials = tuple(replace(t, step_time_s=None, samples_per_s=None, step_times_s=()) for t in real.trials)
    untimed = replace(real, trials=trials, throughput=None)
    if cap == budget:
        return untimed, (
            f"ran real CPU steps under the live-tensor meter instead: the model does data-dependent work that fake "
            f"tensors cannot trace ({why})"
        )
    memory = real.memory
    if memory is None:
        raise NothingFitsError(real.max_batch, None, budget, None, "fewer than two sizes fitted to fit memory lines")
    grid = options.grid()
    largest = max(real.max_batch, grid.floor(memory.largest_batch_within(budget, ceiling=grid.top)))
    # Read off a line, the answer stops where the line leaves the budget, or at max_batch.
    stop_reason = "max_batch" if largest >= grid.top else "stopped"
    safe = max(grid.init, grid.floor(memory.largest_batch_within(budget * (1 - options.headroom), ceiling=largest)))
    sizes = sorted({t.batch_size for t in real.trials if t.fits})
    result = replace(
        untimed,
        max_batch=largest,
        safe_batch=safe,
        best_throughput_batch=largest,
        budget_bytes=budget,
        boundary_reached=False,
        stop_reason=stop_reason,
        safe_verified=False,
        notes=(
            *real.notes,
            f"max and safe batch are read off the memory line {format_bytes(memory.fixed_bytes)} + "
            f"{format_bytes(memory.per_sample_bytes)} x batch fitted to real CPU steps up to batch {sizes[-1]} "
            f"(under {format_bytes(cap)}): no size near the answer ran",
        ),
    )
    return result, (
        f"extrapolated from real CPU steps at batch {', '.join(map(str, sizes))} (live tensors up to "
        f"{format_bytes(cap)}): the model does data-dependent work that fake tensors cannot trace ({why})"
    )

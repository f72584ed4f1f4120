"""``batchfit.estimate()``: the answer for a memory size before you own the device.

The probe's own search (`search_with`) over fake trials (`FakeProbe`, whose module says how they
count), with the target's fixed costs stated as assumptions; a real CPU probe under a cap where a
model cannot be traced on fake tensors (`_extrapolate`). Nothing is timed, so an estimate has no
throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from batchfit.backends import ESTIMATE_TARGETS, EstimateTarget, estimate_target
from batchfit.errors import NothingFitsError
from batchfit.estimation.fake_lengths import estimate_frontier
from batchfit.estimation.fake_trials import FakeProbe, Untraceable
from batchfit.probe import Options, find_with
from batchfit.probe.checks import check_work
from batchfit.probe.finder import described, search_with
from batchfit.probe.keywords import EstimateOptions
from batchfit.probe.options import options_from, renamed
from batchfit.probe.positions import check_seq_len
from batchfit.probe.real_data import worst_batch
from batchfit.report import Frontier, Result, SizedOn, Trial
from batchfit.units import format_bytes, parse_memory_limit, parse_reserve

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FALLBACK_CAP", "TARGETS", "EstimateSetup", "estimate", "refuse_sharded", "split_memory"]

#: The devices an estimate can be for: the device types, and the variants of one (``"rocm"``).
TARGETS = tuple(target.name for base in ESTIMATE_TARGETS.values() for target in (base, *base.variants))


#: Live tensor bytes the real CPU steps of the fallback may use (see `_extrapolate`).
FALLBACK_CAP = 256 * 2**20


def estimate(
    model: nn.Module,
    sample: Any = None,
    *,
    memory_limit: int | str | None = None,
    device: str = "cpu",
    reserve: int | str | None = None,
    seq_lens: Sequence[int] | None = None,
    longest_at_batch_1: bool = True,
    max_seq_len: int | None = None,
    callback: Callable[[Trial], None] | None = None,
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

    Args:
        memory_limit: the device's memory: bytes or a size (``"80GiB"``, ``"24GB"``; a fraction
            needs a device to be a fraction of). ``memory=`` is its old name, still accepted with
            a ``DeprecationWarning``.
        device: what to estimate for (`TARGETS`): the CPU (the live-tensor meter's count,
            equal to what ``find()`` measures there under the same ``memory_limit``; the default),
            CUDA (the caching allocator's reserved bytes, modelled; see the assumptions), or
            ``"rocm"``: the same allocator with hipBLAS/hipBLASLt's workspaces (2 x (128 + 76) MiB,
            not cuBLAS's 2 x 33 MiB). On a GPU target an optimizer that leaves ``foreach`` to torch
            steps with the foreach implementation, as torch's does there (an assumption, stated).
        reserve: taken off ``memory_limit`` for what lives outside the allocator. Default:
            nothing on the CPU; on a GPU 1 GiB for the context with its kernels and handles, the
            top of the 0.5-1 GiB that CUDA 12 takes, so the estimate errs safe (an assumption,
            stated with the range; ``reserve=`` sets what a measured card keeps).

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
    started = time.monotonic()
    memory_limit, limit_name = renamed("estimate", "memory", memory, "memory_limit", memory_limit)
    setup = EstimateSetup.of(memory_limit, device, reserve, options, limit_name)
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
    sample, drawn, sized_on = worst_batch(sample, scan_batches=options.scan_batches, seq_len=options.seq_len)
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


#: The first assumption of an estimate that traced the model on fake tensors.
FAKE_TRACE = "traced on fake tensors: no step ran, no memory was used; nothing is timed, so no throughput"


def foreach_assumption(optimizers: list[str]) -> str:
    """The line that says the trace stepped ``optimizers`` with foreach, as a GPU would (``foreach_as_on``)."""
    return (
        f"foreach optimizer as on CUDA: {', '.join(optimizers)} left foreach to torch, which picks the foreach "
        "implementation for GPU parameters (one intermediate per parameter live at once in the step, the "
        "trainable weights' size for AdamW); the CPU would run the for-loop"
    )


@dataclass
class EstimateSetup:
    """What an estimate is for, read once from its arguments (`estimate`, ``estimate_sharded``):
    the target device, its memory and what of it the trials may use, the assumptions, the options."""

    device: str
    target: EstimateTarget
    total: int
    budget: int
    assumptions: list[str]
    options: Options

    @classmethod
    def of(
        cls,
        memory_limit: Any,
        device: str,
        reserve: int | str | None,
        given: Mapping[str, Any],
        limit_name: str = "memory_limit",
        extra_reserve: tuple[int, str] | None = None,
    ) -> EstimateSetup:
        """Checked, before anything is traced. ``extra_reserve``: bytes (and why) kept aside beside
        the assumed context when ``reserve`` is not given (a sharded job's NCCL buffers)."""
        if memory_limit is None:
            raise TypeError("estimate() needs memory_limit=: the memory of the device to estimate for, e.g. '80GiB'")
        target = estimate_target(device)
        total, kept_aside = split_memory(target, memory_limit, reserve, limit_name)
        assumptions = _assumptions(target, given.get("amp"))
        if kept_aside:
            said = f"{format_bytes(kept_aside)} of the {format_bytes(total)} are outside the allocator"
            assumptions.append(f"{said}: {target.context_note}" if reserve is None and target.context_note else said)
        if extra_reserve is not None and reserve is None and extra_reserve[0]:
            kept_aside += extra_reserve[0]
            assumptions.append(f"{format_bytes(extra_reserve[0])} more are kept aside: {extra_reserve[1]}")
        budget = total - kept_aside
        if budget <= 0:
            assumed = " (the CUDA context a GPU keeps outside the allocator, assumed)" if reserve is None else ""
            raise ValueError(
                f"reserve {format_bytes(kept_aside)}{assumed} leaves nothing of {limit_name} {format_bytes(total)}: "
                f"estimate for a device with more memory, pass reserve= what that device keeps outside the allocator, "
                f"or device='cpu'"
            )
        options = options_from("estimate", given, EstimateOptions, device="cpu", memory_limit=budget, distributed=False)
        return cls(device, target, total, budget, assumptions, options)

    def marked(self, result: Result, started: float, sized_on: SizedOn | None = None) -> Result:
        """``result`` as an estimate: for the target device's memory, with the assumptions, timed from ``started``."""
        return replace(
            result,
            device=replace(result.device, name=f"estimate for {self.device}", total_bytes=self.total),
            estimated=True,
            assumptions=tuple(self.assumptions),
            elapsed_s=time.monotonic() - started,
            sized_on=sized_on,
        )


def split_memory(
    target: EstimateTarget, memory_limit: Any, reserve: int | str | None, limit_name: str = "memory_limit"
) -> tuple[int, int]:
    """``(total, kept_aside)``: the device's memory, and what of it lives outside the allocator.

    One reading for [`estimate`][batchfit.estimate] and ``batchfit estimate`` (which checks it before loading the
    target, to say what to do in its own option names). ``reserve=None`` takes the target's
    assumed context (1 GiB on a GPU, the top of CUDA 12's range; nothing on the CPU); ``0`` means
    nothing is kept aside.
    """
    if isinstance(memory_limit, float) or not isinstance(memory_limit, (int, str)):
        raise TypeError(
            f"{limit_name} must be bytes or a size such as '80GiB' (an estimate has no device to take a fraction "
            f"of), got {type(memory_limit).__name__} {memory_limit!r}"
        )
    total = parse_memory_limit(memory_limit, None, name=limit_name)
    if reserve is None:
        return total, target.outside_allocator_bytes
    if reserve in (0, "0"):
        return total, 0  # nothing outside the allocator: the whole memory is the budget
    parsed = parse_reserve(reserve)
    if parsed == "auto":
        raise ValueError("reserve='auto' measures a real device: an estimate takes a size")
    return total, int(parsed)


def _assumptions(target: EstimateTarget, amp: str | None) -> list[str]:
    said = [FAKE_TRACE]
    said += target.assumptions
    if amp is not None and target.amp_assumption:
        said.append(f"amp {amp}: {target.amp_assumption}")
    return said


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

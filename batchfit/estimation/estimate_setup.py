"""What an estimate is for, read once from its arguments: the card, its memory, what of it the trials may use.

Shared by the estimate of a model (`batchfit.estimation.estimator`) and of a target's ranks
(`batchfit.estimation.rank_estimate`), with the assumptions both state, so that neither imports the other's entry point.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from batchfit.backends import ESTIMATE_TARGETS, EstimateTarget, estimate_target
from batchfit.probe import Options
from batchfit.probe.keywords import EstimateOptions
from batchfit.probe.options import options_from, renamed
from batchfit.report import Result, SizedOn
from batchfit.units import format_bytes, parse_memory_limit, parse_reserve

__all__ = [
    "FAKE_TRACE",
    "FALLBACK_CAP",
    "TARGETS",
    "EstimateSetup",
    "for_device_of",
    "foreach_assumption",
    "split_memory",
]

#: The devices an estimate can be for: the device types, and the variants of one (``"rocm"``).
TARGETS = tuple(target.name for base in ESTIMATE_TARGETS.values() for target in (base, *base.variants))

#: Live tensor bytes the real CPU steps of the fallback may use (see `_extrapolate`).
FALLBACK_CAP = 256 * 2**20


#: The first assumption of an estimate that traced the model on fake tensors.
FAKE_TRACE = "traced on fake tensors: no step ran, no memory was used; nothing is timed, so no throughput"


def foreach_assumption(optimizers: list[str]) -> str:
    """The line that says the trace stepped ``optimizers`` with foreach, as a GPU would (``foreach_as_on``)."""
    return (
        f"foreach optimizer as on CUDA: {', '.join(optimizers)} left foreach to torch, which picks the foreach "
        "implementation for GPU parameters (one intermediate per parameter live at once in the step, the "
        "trainable weights' size for AdamW); the CPU would run the for-loop"
    )


def for_device_of(where: str, for_device: str | None, device: str | None) -> str:
    """The card ``where()`` estimates for: ``for_device``, or ``device=``, its old name, with a
    ``DeprecationWarning`` (``device`` is where ``find`` runs, not the card estimated for); the CPU by default."""
    given, _ = renamed(
        where, "device", device, "for_device", for_device, "the card estimated for (device= is where find runs)", 4
    )
    return "cpu" if given is None else given


@dataclass
class EstimateSetup:
    """What an estimate is for, read once from its arguments (`estimate`, ``estimate_sharded``):
    the target device, its memory and what of it the trials may use, the assumptions, the options."""

    for_device: str
    target: EstimateTarget
    total: int
    budget: int
    assumptions: list[str]
    options: Options

    @classmethod
    def of(
        cls,
        memory_limit: Any,
        for_device: str | None,
        reserve: int | str | None,
        given: Mapping[str, Any],
        limit_name: str = "memory_limit",
        extra_reserve: tuple[int, str] | None = None,
        *,
        device: str | None = None,
    ) -> EstimateSetup:
        """Checked, before anything is traced. ``for_device``: the card estimated for (`TARGETS`;
        ``None``: the CPU; ``device=``, its old name, warns). ``extra_reserve``: bytes (and why) kept
        aside beside the assumed context when ``reserve`` is not given (a sharded job's NCCL buffers)."""
        for_device = for_device_of("EstimateSetup.of", for_device, device)
        if memory_limit is None:
            raise TypeError("estimate() needs memory_limit=: the memory of the device to estimate for, e.g. '80GiB'")
        target = estimate_target(for_device)
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
                f"or for_device='cpu'"
            )
        options = options_from("estimate", given, EstimateOptions, device="cpu", memory_limit=budget, distributed=False)
        return cls(for_device, target, total, budget, assumptions, options)

    def marked(self, result: Result, started: float, sized_on: SizedOn | None = None) -> Result:
        """``result`` as an estimate: for the target device's memory, with the assumptions, timed from ``started``."""
        return replace(
            result,
            device=replace(result.device, name=f"estimate for {self.for_device}", total_bytes=self.total),
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

"""What-if: the same estimate under the levers of batch size, in one table.

``batchfit.what_if(model, sample, memory_limit="24GiB")`` runs [`batchfit.estimate`][batchfit.estimate] once as the
model is, then once per alternative, and puts max batch and memory side by side:

* ``amp=bf16``, ``amp=fp16``: the steps under autocast (activations in half precision);
* ``checkpointing``: activation checkpointing of every repeated block (the largest
  ``nn.ModuleList`` / ``nn.Sequential`` of modules of one type), as [`batchfit.fit`][batchfit.fit]
  applies it (`batchfit.probe.checkpointing_blocks`): a Hugging Face block by its own flag, any other under
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, so its activations are recomputed in
  backward instead of kept. It is undone afterwards;
* ``optimizer=sgd`` (no state), ``optimizer=adamw`` (two moments per parameter, the default),
  ``optimizer=adafactor`` (factored second moments: ``torch.optim.Adafactor``).

Every option is an estimate (fake tensors: seconds, no memory) and the model comes back untouched.
An option that does not apply (checkpointing a model with no repeated blocks) says why in its row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchfit.errors import NothingFitsError
from batchfit.estimation.estimate_setup import for_device_of
from batchfit.estimation.estimator import estimate
from batchfit.probe.checkpointing_blocks import NO_BLOCKS, applied, find_blocks, policy_for
from batchfit.probe.options import renamed
from batchfit.units import format_bytes, parse_memory_limit

__all__ = ["OPTIONS", "WhatIf", "WhatIfRow", "what_if"]

#: The alternatives `what_if` knows, by the name a user writes.
OPTIONS = ("amp=bf16", "amp=fp16", "checkpointing", "optimizer=sgd", "optimizer=adamw", "optimizer=adafactor")
DEFAULT_OPTIONS = ("amp=bf16", "checkpointing", "optimizer=sgd")

_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params),
    "adafactor": lambda params: torch.optim.Adafactor(params),
}


@dataclass(frozen=True)
class WhatIfRow:
    """One option's estimate, or why it does not apply: ``peak_bytes`` is the peak at
    ``max_batch`` in the unit the budget counts; ``fixed_bytes`` and ``per_sample_bytes`` the
    option's memory equation, the same one its result's summary shows (``result.memory``), so a
    row that fits more with more bytes per sample shows the smaller fixed part that pays for it."""

    option: str
    max_batch: int | None = None
    safe_batch: int | None = None
    peak_bytes: int | None = None
    per_sample_bytes: float | None = None
    note: str | None = None
    fixed_bytes: int | None = None


@dataclass(frozen=True)
class WhatIf:
    """The table [`what_if`][batchfit.what_if] returns: ``rows[0]`` is the model as it is."""

    memory_bytes: int
    device: str
    rows: tuple[WhatIfRow, ...]

    def row(self, option: str) -> WhatIfRow:
        """The row of ``option`` (``"baseline"`` for the model as it is)."""
        for row in self.rows:
            if row.option == option:
                return row
        raise KeyError(option)

    def __str__(self) -> str:
        lines = [
            f"what if (estimates for {self.device} with {format_bytes(self.memory_bytes)}):",
            f"  {'option':<20} {'max batch':>9} {'safe':>6} {'peak at max':>12} {'fixed':>11} {'per sample':>11}",
        ]
        base = self.rows[0].max_batch
        for row in self.rows:
            if row.max_batch is None:
                lines.append(f"  {row.option:<20} {'-':>9} {'-':>6} {'-':>12} {'-':>11} {'-':>11}  {row.note or ''}")
                continue
            gain = f"  x{row.max_batch / base:.2f}" if base and row is not self.rows[0] else ""
            peak = format_bytes(row.peak_bytes) if row.peak_bytes is not None else "-"
            fixed = format_bytes(row.fixed_bytes) if row.fixed_bytes is not None else "-"
            slope = format_bytes(row.per_sample_bytes) if row.per_sample_bytes is not None else "-"
            lines.append(
                f"  {row.option:<20} {row.max_batch:>9} {row.safe_batch:>6} {peak:>12} {fixed:>11} {slope:>11}{gain}"
                + (f"  {row.note}" if row.note else "")
            )
        return "\n".join(lines)


def parse_option(option: str) -> tuple[str, str | None]:
    """``"amp=bf16"`` -> ``("amp", "bf16")``; ``"checkpointing"`` -> ``("checkpointing", None)``;
    ``ValueError`` naming the known options for anything else."""
    if not isinstance(option, str) or option not in OPTIONS:
        raise ValueError(f"unknown what-if option {option!r}: choose from {', '.join(OPTIONS)}")
    name, _, value = option.partition("=")
    return name, value or None


def what_if(
    model: nn.Module,
    sample: Any = None,
    *,
    memory_limit: int | str | None = None,
    for_device: str | None = None,
    options: Sequence[str] = DEFAULT_OPTIONS,
    memory: int | str | None = None,
    device: str | None = None,
    **estimate_kwargs: Any,
) -> WhatIf:
    """Estimate the model as it is and under each of ``options`` (see the module docs).

    ``memory_limit`` and ``for_device`` are [`batchfit.estimate`][batchfit.estimate]'s (``memory=`` and
    ``device=``, their old names, still work with a ``DeprecationWarning``); ``estimate_kwargs`` go
    to every [`batchfit.estimate`][batchfit.estimate] call
    with the same names as [`batchfit.find`][batchfit.find] (``optimizer``, ``amp``, ``criterion``,
    ``loss_fn``, ``reserve``...); an option overrides the keyword it is about.
    """
    memory_limit, limit_name = renamed("what_if", "memory", memory, "memory_limit", memory_limit)
    for_device = for_device_of("what_if", for_device, device)
    if memory_limit is None:
        raise TypeError("what_if() needs memory_limit=: the memory of the device to estimate for, e.g. '24GiB'")

    if isinstance(options, str):
        raise TypeError("options must be a list of option names, e.g. ['amp=bf16', 'checkpointing']")
    parsed = [(option, *parse_option(option)) for option in options]
    rows = []
    for option, name, value in [("baseline", "baseline", None), *parsed]:
        kwargs = dict(estimate_kwargs)
        if name == "amp":
            kwargs["amp"] = value
        elif name == "optimizer":
            assert value is not None
            kwargs["optimizer"] = _OPTIMIZERS[value]
        context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if name == "checkpointing":
            if not _has_blocks(model):
                rows.append(WhatIfRow(option, note=NO_BLOCKS))
                continue
            context = checkpointing(model)
        try:
            with context as how:
                result = estimate(model, sample, memory_limit=memory_limit, for_device=for_device, **kwargs)
        except NothingFitsError as exc:
            rows.append(WhatIfRow(option, note=f"nothing fits: batch {exc.batch_size} does not"))
            continue
        at_max = [t for t in result.trials if t.fits and t.batch_size == result.max_batch]
        rows.append(
            WhatIfRow(
                option,
                max_batch=result.max_batch,
                safe_batch=result.safe_batch,
                peak_bytes=at_max[-1].peak_in(result.budget_counts) if at_max else None,
                fixed_bytes=result.memory.fixed_bytes if result.memory is not None else None,
                per_sample_bytes=result.memory.per_sample_bytes if result.memory is not None else None,
                note=how if isinstance(how, str) else None,
            )
        )
    memory_bytes = parse_memory_limit(memory_limit, None, name=limit_name)
    return WhatIf(memory_bytes=memory_bytes, device=for_device, rows=tuple(rows))


@contextlib.contextmanager
def checkpointing(model: nn.Module) -> Iterator[str]:
    """Every repeated block of ``model`` checkpointed for the block inside (`batchfit.probe.checkpointing_blocks`:
    a Hugging Face block by its own flag, any other by a wrapper), undone afterwards; yields what was
    done. ``ValueError`` when the model has nothing to checkpoint."""
    blocks = find_blocks(model)
    with applied(model, policy_for(blocks.names, len(blocks.names))):
        yield f"checkpointed the {len(blocks.names)} blocks of {blocks.found_in}"


def _has_blocks(model: nn.Module) -> bool:
    try:
        find_blocks(model)
    except ValueError:
        return False
    return True

"""The gradient noise scale of the user's own batches: `measure_noise`.

``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018) says roughly up to which batch size more
samples per step still buy fewer steps. It is measured here from real gradients; the statistics
(the unbiased two-batch-size estimator and its bootstrap interval) are the pure
[`from_windows`][batchfit.report.noise.NoiseScale.from_windows]'s.

How a measurement runs:

* the data is a ``DataLoader`` or any iterable of batches, never one batch: tiled copies of one
  sample carry no gradient noise (`check_noise_data`). Its batches are cut into micro-batches
  of ``micro_batch`` rows (default: the first batch's size; a larger one is measured at that size,
  with a note: rows of several batches are never joined); a batch with fewer rows (a short last
  batch) is skipped; a batch made of other tensors than the first's (``batches.structure``: labels
  gone, a dict then a tuple) is refused, naming it, as it would mix two objectives. A window's
  micro-batches are drawn before it runs, so none is spent on a window the data cannot complete;
  the measurement stops when ``passes`` are spent or the data runs out (at least two windows,
  else ``ValueError``);
* one process: a *window* is ``per_window`` micro-batches, each one forward and backward pass
  (``passes``); its small batch is a micro-batch (``|g_b|^2``, their mean) and its big batch
  their mean gradient (``B = per_window x b``). Under DDP (the probe's ranks, ``world_size > 1``):
  a window is one micro-batch on every rank, its small batch a rank's local gradient (backward
  runs without DDP's all-reduce, ``Solo.deferred_sync``) and its big batch the all-reduced mean
  (``K = world_size``): ``source="ranks"``. The model must be DDP-wrapped there; with
  ``distributed=False`` each rank measures alone, on the module inside DDP (no gradient sync);
* the model runs in train mode (dropout on), as training runs it. Gradients are read in fp32
  (under fp16 autocast the loss is scaled as a ``GradScaler`` would, and a pass whose gradients
  overflow runs again at half the scale: those passes count too); squared norms add up in float64.
  On one process a window's gradients add up in one fp32 copy of the trainable weights: the
  measurement holds the weights, their gradients and that copy, never an optimizer's state;
* it runs inside a [`Prober`][batchfit.Prober] (the probe device, the memory limit,
  the snapshot), so the weights, buffers, gradients, the given optimizer, train/eval flags and
  the random generators come back bit-exact, also on an error or Ctrl-C (which surfaces as
  ``KeyboardInterrupt`` after the restore). No optimizer steps: nothing is trained. A loader is
  drawn from with its generators kept (``real_data.generators_kept``), so its next epoch is the
  one it would have been; a one-shot iterator (a generator) is consumed by what was drawn;
* ``step_fn`` must return the loss and leave the weights alone: one that runs backward itself or
  changes the weights (steps an optimizer) is refused at the first pass, with what to pass instead.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from batchfit.backends import is_oom
from batchfit.errors import annotate
from batchfit.probe.batches import batch_size_of, check_structure, map_tensors, structure, to_device
from batchfit.probe.options import Options
from batchfit.probe.prober import Prober
from batchfit.probe.real_data import generators_kept, is_batch_source
from batchfit.probe.runner import opened
from batchfit.report import NoiseScale
from batchfit.units import positive_int

__all__ = ["check_noise_data", "measure_noise"]

#: fp16: the first loss scale (a ``GradScaler``'s), and the most times a pass runs again at half of it.
FP16_SCALE = 2.0**16
MAX_RESCALES = 24
#: Batches with fewer rows than the micro-batch skipped in a row before the data is called unusable.
MAX_SKIPPED_IN_A_ROW = 64
#: What ``_Stream._draw`` returns once the data ran out (a batch may itself be ``None``: that is refused).
_END = object()


def check_noise_data(data: Any) -> None:
    """Refuse, before anything runs, what gives no noise scale: a single batch (``ValueError``:
    tiled copies of one sample carry no gradient noise), no data, or a value that is no batch source
    (``TypeError`` naming its type)."""
    if data is None:
        raise ValueError(
            "the gradient noise scale is measured from real batches, and no data was given (make_batch builds "
            "batches, it does not draw them): pass a DataLoader or an iterable of batches"
        )
    if isinstance(data, (torch.Tensor, Mapping, tuple, list)):
        raise ValueError(
            f"a single batch (a {type(data).__name__}) gives no noise scale, since tiled copies of one sample carry "
            "no gradient noise: pass a DataLoader or an iterable of batches "
            "(see docs/how-to/batch-to-train.md#the-gradient-noise-scale)"
        )
    if not is_batch_source(data):
        raise TypeError(
            f"the gradient noise scale needs a DataLoader or an iterable of batches, got {type(data).__name__}"
        )


def measure_noise(
    model: nn.Module,
    data: Any,
    options: Options,
    *,
    micro_batch: int | None = None,
    passes: int | None = None,
    per_window: int = 8,
    confidence: float = 0.9,
    seed: int = 0,
) -> NoiseScale:
    """The gradient noise scale of ``model`` at its current weights on ``data`` (see the module docs).

    Measure from the weights you train from, a checkpoint or after warm-up steps: at initialisation
    the gradient is large and consistent, and ``B_simple`` is near zero. ``options``: the work
    (``loss_fn`` / ``step_fn`` / ``criterion``, ``amp``, ``device``, ``memory_limit``, ``optimizer``
    to restore, ``restore_rng``, ``distributed``); ``passes`` defaults to ``options.noise_passes``.
    ``seed``: the bootstrap's. Stops when the passes are spent or the data runs out (at least two
    windows, else ``ValueError``); the notes say what was left out.
    """
    started = time.monotonic()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_noise_data(data)
    if options.mode != "train":
        raise ValueError("the noise scale is measured from training gradients: mode must be 'train'")
    if micro_batch is not None:
        positive_int("micro_batch", micro_batch)
    budget = options.noise_passes if passes is None else positive_int("passes", passes, minimum=4)
    positive_int("per_window", per_window, minimum=2)
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be a fraction in (0, 1), got {confidence!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    options = replace(options, make_batch=None, seq_len=None)
    if options.distributed is False:
        model = getattr(model, "module", model) if _is_ddp(model) else model  # this rank alone, without DDP's sync
    notes: list[str] = []
    if per_window * 2 > budget:
        notes.append(f"per_window={per_window} is more than half of {budget} passes: windows of {budget // 2}")
        per_window = budget // 2
    with generators_kept(data) if options.restore_rng else contextlib.nullcontext():
        stream = _Stream(iter(data), micro_batch)
        try:
            with opened(prober := Prober(model, stream.first, options=options)):
                run = _Run(prober, stream, budget, per_window)
                run.measure()
        finally:
            stream.close()
    notes += _loss_notes(model, stream.first, options) + stream.notes(data, run.planned, len(run.windows))
    world = prober.ranks.world_size
    if len(run.windows) < 2:
        raise ValueError(
            f"the data gave {len(run.windows)} window(s) of {run.per_window} micro-batches of {stream.size} rows "
            f"({stream.batches} batches drawn, {stream.skipped} too small): the noise scale needs at least 2; pass "
            "more batches, a smaller micro_batch or a smaller per_window"
        )
    return NoiseScale.from_windows(
        run.windows,
        stream.size,
        stream.size * run.per_window * world,
        passes=run.passes,
        samples=run.passes * stream.size * world,
        elapsed_s=time.monotonic() - started,
        confidence=confidence,
        seed=seed,
        source="ranks" if world > 1 else "micro-batches",
        world_size=world,
        notes=notes,
    )


class _Stream:
    """Micro-batches of ``size`` rows cut from the data's batches, in order, drawn on demand."""

    def __init__(self, iterator: Iterator[Any], micro_batch: int | None) -> None:
        self._iterator: Iterator[Any] | None = iterator
        self.batches = self.skipped = self.unused_rows = 0
        self.exhausted = False
        self._pending: deque[Any] = deque()
        first = self._draw()
        if first is _END:
            raise ValueError("the data yielded no batch: it is empty")
        self.first = first
        self.rows = batch_size_of(first, "batch 1 of the data")
        self.structure = structure(first)
        self.asked = micro_batch
        self.size = self.rows if micro_batch is None else min(micro_batch, self.rows)
        self._pending.extend(self._cut(first, self.rows))

    def _draw(self) -> Any:
        """The next batch, or ``_END`` once the data ran out."""
        if self._iterator is None:
            return _END
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.exhausted = True
            self.close()
            return _END
        self.batches += 1
        return batch

    def _cut(self, batch: Any, rows: int) -> list[Any]:
        self.unused_rows += rows % self.size
        size = self.size
        return [map_tensors(batch, lambda t, i=i: t[i * size : (i + 1) * size]) for i in range(rows // size)]

    def next(self) -> Any | None:
        """The next micro-batch, or ``None`` once the data ran out."""
        in_a_row = 0
        while not self._pending:
            batch = self._draw()
            if batch is _END:
                return None
            rows = batch_size_of(batch, f"batch {self.batches} of the data")
            check_structure(
                self.structure,
                batch,
                f"batch {self.batches} of the data",
                "its passes would mix two objectives (or two inputs) in one noise scale; pass batches that all "
                "hold the same tensors",
            )
            if rows < self.size:
                self.skipped += 1
                in_a_row += 1
                if in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    raise ValueError(
                        f"{in_a_row} batches in a row had fewer than micro_batch={self.size} rows (the first had "
                        f"{self.rows}): pass a smaller micro_batch"
                    )
                continue
            self._pending.extend(self._cut(batch, rows))
        return self._pending.popleft()

    def close(self) -> None:
        """Let go of the iterator (a loader's worker processes end with it)."""
        self._iterator = None
        self._pending.clear()

    def notes(self, data: Any, planned: int, measured: int) -> list[str]:
        said = []
        if self.asked is not None and self.asked > self.rows:
            said.append(
                f"micro_batch={self.asked} is more than the data's batches hold ({self.rows} rows): measured at "
                f"{self.rows} (B_simple does not depend on the batch it is measured at; rows of several batches are "
                "never joined)"
            )
        if self.skipped:
            said.append(f"{self.skipped} batch(es) with fewer than {self.size} rows were skipped (a short last batch)")
        if self.unused_rows:
            said.append(f"{self.unused_rows} rows were left out: the batches do not split into micro-batches evenly")
        if measured < planned and self.exhausted:
            said.append(f"the data ran out after {self.batches} batches: {measured} windows of the {planned} planned")
        from torch.utils.data import SequentialSampler

        if isinstance(getattr(data, "sampler", None), SequentialSampler):
            said.append(
                "the DataLoader does not shuffle: if neighbouring batches are alike (sorted or grouped data), the "
                "windows see less noise than training does and B_simple comes out low"
            )
        return said


@dataclass
class _Run:
    """One measurement inside an active prober: the windows' ``(small, big)`` squared norms."""

    prober: Prober
    stream: _Stream
    budget: int
    per_window: int
    windows: list[tuple[float, float]] = field(default_factory=list)
    passes: int = 0
    scale: float = 1.0
    checked: bool = False
    world: int = field(init=False)
    planned: int = field(init=False)
    ddp: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.world = self.prober.ranks.world_size
        if self.world > 1:
            self.per_window = 1  # the ranks are the window: one micro-batch each
            self.ddp = _ddp_of(self.prober.workload.model)
        self.planned = self.budget // self.per_window
        self.scale = FP16_SCALE if self.prober.options.amp == "fp16" else 1.0

    def measure(self) -> None:
        workload, ranks = self.prober.workload, self.prober.ranks
        params = workload.trainable_parameters()
        # A probe started under torch.no_grad() or inference_mode() still takes gradients.
        with torch.inference_mode(False), torch.enable_grad(), ranks.deferred_sync(workload.model):
            sums = [torch.zeros_like(p, dtype=torch.float32) for p in params] if self.world == 1 else []
            while len(self.windows) < self.planned:
                # A window's micro-batches are drawn before any runs: none is spent on a window the
                # data cannot complete (every rank stops when one runs out).
                fits = self.passes + self.per_window <= self.budget
                with ranks.meet("drawing the noise scale's batches", self.stream.size):
                    pieces = [self.stream.next() for _ in range(self.per_window)] if fits else [None]
                if ranks.any(any(piece is None for piece in pieces)):
                    return
                for total in sums:
                    total.zero_()
                smalls = [self._pass(params, to_device(piece, self.prober.device), sums) for piece in pieces]
                del pieces
                if self.world == 1:
                    big = _squared_norm(sums, 1.0 / self.per_window)
                    small = torch.stack(smalls).mean()
                else:
                    small, big = self._across_ranks(params, smalls[0])
                values = torch.stack([small, big]).tolist()
                self.windows.append((values[0], values[1]))

    def _pass(self, params: list[nn.Parameter], batch: Any, sums: list[torch.Tensor]) -> torch.Tensor:
        """One micro-batch's forward and backward (again at half the loss scale while fp16
        gradients overflow): its squared gradient norm; on one process its gradient joins ``sums``."""
        workload, ranks, meter = self.prober.workload, self.prober.ranks, self.prober.meter
        assert meter is not None
        size = self.stream.size
        for _ in range(MAX_RESCALES + 1):
            for param in params:
                param.grad = None
            versions = [param._version for param in params] if not self.checked else []
            meter.checkpoint()
            self.passes += 1
            try:
                with ranks.meet("the noise scale's forward", size):
                    output, loss = workload.forward(batch)
                    del output
                    self._check_step_fn(params, versions)
                meter.checkpoint()
                with ranks.meet("the noise scale's backward", size):
                    assert loss is not None
                    (loss * self.scale if self.scale != 1.0 else loss).backward()
                    del loss
            except Exception as exc:
                _explain(exc, size, self.passes)
                raise
            squared = _squared_norm([p.grad for p in params], 1.0 / self.scale)
            if self.scale == 1.0 or not ranks.any(not bool(torch.isfinite(squared))):
                for total, param in zip(sums, params):
                    if param.grad is not None:
                        total.add_(param.grad, alpha=1.0 / self.scale)
                return squared
            self.scale /= 2.0
        raise ValueError(
            f"the fp16 gradients overflowed at every loss scale down to {self.scale * 2:g}: they are inf or NaN "
            "whatever the scale; check the loss, or measure with amp='bf16'"
        )

    def _check_step_fn(self, params: list[nn.Parameter], versions: list[int]) -> None:
        """A ``step_fn`` must only return the loss: refuse one that ran backward or stepped."""
        if self.checked:
            return
        self.checked = True
        if self.prober.options.step_fn is None:
            return
        if any(param.grad is not None for param in params):
            raise ValueError(
                "step_fn ran backward itself: the noise scale takes the gradient of the loss step_fn returns; pass a "
                "step_fn that only returns the loss (or loss_fn=)"
            )
        if any(param._version != version for param, version in zip(params, versions)):
            raise ValueError(
                "step_fn changed the weights (did it step an optimizer?): the noise scale is measured at fixed "
                "weights; pass a step_fn that only returns the loss (or loss_fn=)"
            )

    def _across_ranks(self, params: list[nn.Parameter], local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Under DDP: the mean over the ranks of the local squared norms, and that of the
        all-reduced (mean) gradient, once every rank's backward worked."""
        import torch.distributed as dist

        ranks = self.prober.ranks
        with ranks.meet("the noise scale's all-reduce", self.stream.size):
            ranks.sync_gradients(self.prober.workload.model, "the noise scale's all-reduce", self.stream.size)
            big = _squared_norm([p.grad for p in params], 1.0 / self.scale)
            small = local.clone()
            dist.all_reduce(small, group=self.ddp.process_group)
        return small / self.world, big


def _loss_notes(model: nn.Module, batch: Any, options: Options) -> list[str]:
    """A Hugging Face model given no ``labels`` returns no loss, and the default loss is the
    logits' mean: the noise scale of that is not the training loss's (``checks.loss_notes``
    says the same for memory)."""
    if options.loss_fn or options.step_fn or options.criterion or not isinstance(batch, Mapping):
        return []
    inner = getattr(model, "module", model)  # DDP
    if "labels" in batch or not any(cls.__name__ == "PreTrainedModel" for cls in type(inner).__mro__):
        return []
    return [
        "the batches have no 'labels', so the Hugging Face model returns no loss and logits.mean() stood in for "
        "it: this is the noise scale of that, not of the training loss; put labels in the batches or pass loss_fn="
    ]


def _is_ddp(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _ddp_of(model: nn.Module) -> Any:
    if not _is_ddp(model):
        raise ValueError(
            "across ranks the noise scale compares each rank's gradient with DDP's all-reduced one: wrap the model "
            "in DistributedDataParallel, or pass distributed=False to measure on each rank alone"
        )
    return model


def _squared_norm(tensors: list[torch.Tensor | None], factor: float) -> torch.Tensor:
    """``|factor x tensors|^2`` as one float64 scalar (``None``: a zero gradient; there is always
    one that is not, or the loss would not have required grad)."""
    parts = [(t.coalesce().values() if t.is_sparse else t).double().square().sum() for t in tensors if t is not None]
    return torch.stack(parts).sum() * (factor * factor)


def _explain(exc: BaseException, size: int, passes: int) -> None:
    """Say where the measurement failed, and what helps after an out-of-memory."""
    said = f"batchfit: raised during the noise scale's pass {passes} at micro batch {size}"
    if is_oom(exc):
        said += ": pass a smaller micro_batch (or a larger memory_limit)"
    annotate(exc, said)

"""Size a Hugging Face ``Trainer``'s batch with batchfit before ``trainer.train()``.

[`autosize`][batchfit.transformers.autosize] probes the trainer's own model with the trainer's own
batch, loss and optimizer, then writes the safe batch where the ``Trainer`` reads it, so that the
run that follows is the run that was measured. Hugging Face's ``auto_find_batch_size=True`` answers
a different question (the first size, shrinking by 10% per OOM from ``per_device_train_batch_size``,
that survives a real run); batchfit finds the boundary itself, keeps headroom below it, and verifies
the result.

Import-safe: this module imports neither torch nor transformers at import time, so
``import batchfit.transformers`` works where transformers is not installed; [`autosize`][batchfit.transformers.autosize]
then raises an ``ImportError`` that names ``pip install 'batchfit[transformers]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchfit.api import plan
from batchfit.estimation import Plan
from batchfit.probe.options import find_options
from batchfit.report import Fit, Recommendation, Result

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import Trainer
    from typing_extensions import Unpack

    from batchfit.probe.keywords import FindKeywords

__all__ = ["Autosized", "autosize", "data_parallel_size", "first_batch", "trainer_amp", "trainer_step_fn"]

INSTALL_HINT = "pip install 'batchfit[transformers]'"


@dataclass(frozen=True)
class Autosized:
    """What [`autosize`][batchfit.transformers.autosize] measured and what it set on the trainer.

    A dataclass of its own rather than the bare [`Result`][batchfit.Result]: the trainer's
    new settings (and, with ``target_batch``, the [`Plan`][batchfit.Plan] they come
    from) belong with the probe's answer, and ``Result`` is batchfit's device-agnostic record,
    which knows nothing of trainers.

    Attributes:
        result: the probe's answer (``batchfit.find``), batch sizes per device; ``None`` with
            ``checkpointing`` (``fit`` holds the measurements).
        plan: with ``target_batch``, the split into micro-batch x accumulation steps x ranks that
            was applied; ``None`` without one.
        batch_size: the ``per_device_train_batch_size`` now set on ``trainer.args``.
        accumulation_steps: the ``gradient_accumulation_steps`` now set on ``trainer.args``
            (unchanged without ``target_batch``).
        previous_batch_size: ``per_device_train_batch_size`` before [`autosize`][batchfit.transformers.autosize].
        previous_accumulation_steps: ``gradient_accumulation_steps`` before
            [`autosize`][batchfit.transformers.autosize].
        data_parallel_size: the data-parallel replicas the global batch is spread over (ranks
            times GPUs under single-process ``DataParallel``).
        recommendation: the batch batchfit recommends ([`recommend`][batchfit.report.result.Result.recommend],
            with ``target_batch`` when given; with the noise scale when measured): advice, not set.
        fit: with ``checkpointing``, the [`Fit`][batchfit.Fit] whose policy was applied; ``applied`` says what.
    """

    result: Result | None
    plan: Plan | None
    batch_size: int
    accumulation_steps: int
    previous_batch_size: int
    previous_accumulation_steps: int
    data_parallel_size: int
    recommendation: Recommendation | None = None
    fit: Fit | None = None
    applied: str | None = None

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every replica: what the learning rate sees."""
        return self.batch_size * self.accumulation_steps * self.data_parallel_size

    @property
    def previous_global_batch(self) -> int:
        return self.previous_batch_size * self.previous_accumulation_steps * self.data_parallel_size

    def __str__(self) -> str:
        measured = self.result if self.result is not None else self.fit.rows[self.fit.chosen]  # type: ignore[union-attr]
        return (
            f"per_device_train_batch_size {self.previous_batch_size} -> {self.batch_size}, "
            f"gradient_accumulation_steps {self.previous_accumulation_steps} -> {self.accumulation_steps}, "
            f"global batch {self.previous_global_batch} -> {self.global_batch} (probe: max batch {measured.max_batch}, "
            f"safe batch {measured.safe_batch}{'' if measured.safe_verified else ', not verified'})"
        ) + (f"; {self.applied}" if self.applied else "")


def autosize(
    trainer: Trainer,
    *,
    target_batch: int | None = None,
    checkpointing: str | Sequence[str] | None = None,
    **find_kwargs: Unpack[FindKeywords],
) -> Autosized:
    """Probe ``trainer`` with batchfit and set the batch it trains with. Call before ``trainer.train()``.

    What is probed is what ``train()`` will run, as far as it exists before ``train()``:

    * **the batch**: the first batch of ``trainer.get_train_dataloader()`` (the trainer's dataset,
      sampler and data collator, with any column removal); batches of other sizes repeat its
      rows. With dynamic padding its sequence length is the first batch's: pad to a fixed length
      (or put the longest sample first) for a bound that holds for every batch. Drawing it
      consumes random numbers (the sampler's seed); the random generators (torch CPU and CUDA,
      ``random``, numpy) are put back afterwards, so ``train()`` shuffles as it would have.
    * **the loss**: ``trainer.compute_loss`` under ``trainer.compute_loss_context_manager()``
      (`trainer_step_fn`), so a subclass's loss or a ``compute_loss_func`` is what is
      measured.
    * **the optimizer**: ``trainer.optimizer`` when the trainer was given one, else the one
      ``trainer.create_optimizer()`` builds (its class, hyperparameters and param groups, weight
      decay split included). batchfit steps only fresh copies of it, never the instance. An
      optimizer created here is dropped again (``trainer.optimizer = None``): ``train()`` then
      creates its own as usual, at the point where it creates the learning-rate scheduler for the
      number of steps the new batch gives (and, under FSDP, after wrapping the model), so the run
      is exactly the one it would have been had the batch been set by hand.
    * **mixed precision**: ``args.bf16`` -> ``amp="bf16"``, ``args.fp16`` -> ``amp="fp16"``
      (`trainer_amp`): before ``train()`` Accelerate has not wrapped the model's forward in
      autocast yet, so batchfit does it.

    Then ``trainer.args.per_device_train_batch_size`` is set to the safe batch (and the
    ``Trainer``'s own ``_train_batch_size``, which its dataloader reads, as its
    ``auto_find_batch_size`` does). With ``target_batch`` the global batch (per-device batch x
    accumulation steps x data-parallel replicas) is kept at ``target_batch`` instead:
    [`batchfit.plan`][batchfit.plan] splits it into a micro-batch within the safe batch and accumulation
    steps, and both are set. Without ``target_batch`` the accumulation steps are left alone, so
    the global batch changes with the per-device batch; the log says so.

    Nothing else is left changed: batchfit's probe restores the model (values, gradients,
    train/eval flags) and the RNG state; ``trainer.state``, ``trainer.control`` and the callbacks
    (none is called) are untouched, ``trainer.optimizer`` is what it was (``None``, or the
    optimizer given, never stepped), and the dataloader drawn from is dropped from the
    Accelerator's registry again. The choice is logged with
    ``transformers.utils.logging.get_logger(__name__)``, a standard logger named
    ``batchfit.transformers`` (info; warnings where worth reading). It is not under the
    ``transformers`` logger, so ``transformers.logging.set_verbosity_*`` and ``args.log_level``
    do not reach it: configure it with `logging`.

    Under ``torch.distributed`` (``torchrun``/``accelerate launch``, several ranks) every rank
    calls ``autosize``; batchfit's ``find()`` then probes all ranks together automatically (see the
    README's "Many GPUs"), every rank gets the same per-device batch, and ``target_batch`` is split
    over the data-parallel ranks. Before ``train()`` the model is not wrapped yet, so under FSDP
    each rank probes the whole model (a conservative, possibly much smaller, batch); DeepSpeed,
    whose config holds its own batch size, is refused.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) with a ``train_dataset``.
        target_batch: a global batch to keep: set the micro-batch and the accumulation steps from
            ``batchfit.plan(result, target_batch=..., world_size=<data-parallel replicas>)``.
        checkpointing: with ``target_batch``, in one process: ``"auto"`` (or the blocks' names) runs
            [`batchfit.fit`][batchfit.fit] instead of ``find()``, applies the policy it recommends
            before ``train()`` (all blocks by the model's own ``activation_checkpointing_enable()``,
            k of them per block) and sets its micro-batch and accumulation; the log says what.
        **find_kwargs: [`batchfit.find`][batchfit.find]'s keywords
            ([`FindOptions`][batchfit.probe.keywords.FindOptions] and the hooks). ``step_fn``,
            ``optimizer`` and ``amp`` given here replace the trainer's. ``noise_scale=True`` measures
            the gradient noise scale from ``trainer.get_train_dataloader()`` at the batch size just set
            (random generators and the Accelerator's registry put back after), into
            ``result.noise_scale``, and logs it with ``trainer.log`` (``batchfit/noise_scale``, ``_low``,
            ``_high``, ``batchfit/recommended_batch``); too few batches for it is a warning, not an error.

    Returns:
        An [`Autosized`][batchfit.transformers.Autosized]: the probe's [`Result`][batchfit.Result], the plan, and the
        batch size and accumulation steps now set.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``trainer`` is not a ``transformers.Trainer``, or its batch is not a mapping.
        ValueError: the trainer uses DeepSpeed, or its train dataloader yields nothing.
        BatchfitError: batchfit's errors from ``find()`` (``NothingFitsError``, ...), unchanged.
    """
    transformers = _require_transformers()
    from batchfit.api import find, fit
    from batchfit.probe.recompute import keep_policy

    logger = transformers.utils.logging.get_logger(__name__)
    find_options("autosize", find_kwargs)  # a typo fails now, not after set-up
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"autosize() needs a transformers.Trainer, got {type(trainer).__name__}")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            "autosize() does not support DeepSpeed, whose config holds its own batch size: set the batch there, "
            "or use auto_find_batch_size"
        )
    args = trainer.args
    replicas = data_parallel_size(trainer)
    previous_batch, previous_steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    noise_scale = find_kwargs.pop("noise_scale", False)  # measured here, at the size set: not by find()
    if target_batch is not None and target_batch % replicas:
        raise ValueError(
            f"target_batch {target_batch} is not divisible by the {replicas} data-parallel replicas: every replica "
            "must get a whole share"
        )
    if checkpointing is not None and (target_batch is None or replicas > 1 or noise_scale or _checkpointing_pending(trainer)):  # noqa: E501
        raise ValueError("autosize(checkpointing=...) needs target_batch, one process, no noise_scale, and the "
                         "trainer's own gradient_checkpointing off: it chooses which blocks to checkpoint")
    if _checkpointing_pending(trainer):
        logger.warning(
            "batchfit: the trainer enables activation checkpointing in train(), after this probe: the probe ran "
            "without it, so the batch found is smaller than the one checkpointing allows. Call "
            "model.activation_checkpointing_enable() (gradient_checkpointing_enable() before transformers 5) "
            "before autosize() to probe what train() will run."
        )

    sample = first_batch(trainer)
    created = "optimizer" not in find_kwargs and trainer.optimizer is None
    fitted: Fit | None = None
    try:
        kwargs: dict[str, Any] = {
            "step_fn": trainer_step_fn(trainer),
            "amp": trainer_amp(args),
        }
        if "optimizer" not in find_kwargs:
            kwargs["optimizer"] = trainer.create_optimizer() if created else trainer.optimizer
        kwargs.update(find_kwargs)
        if checkpointing is not None:
            fitted = fit(trainer.model, sample, target_batch=target_batch, checkpointing=checkpointing, **kwargs)
        else:
            result = find(trainer.model, sample, **kwargs)
    finally:
        if created:
            # train() builds its optimizer (and the scheduler for the new step count) itself.
            trainer.optimizer = None
        del sample

    chosen_plan: Plan | None = None
    steps = previous_steps
    if fitted is not None:  # fit() timed its candidates: its recommendation is the plan
        recommended = fitted.recommendation
        _set_batch(trainer, recommended.batch_size, recommended.accumulation)
        applied = keep_policy(trainer.model, fitted.policy)
        logger.info(f"batchfit: applied {applied}; {recommended.split()}: {recommended.reason}")
        for note in fitted.notes:
            logger.warning(f"batchfit: {note}")
        return Autosized(
            None, None, recommended.batch_size, recommended.accumulation, previous_batch, previous_steps, replicas,
            recommended, fitted, applied,
        )
    if target_batch is not None:
        chosen_plan = plan(result, target_batch=target_batch, world_size=replicas)
        batch, steps = chosen_plan.micro_batch, chosen_plan.accumulation_steps
    else:
        batch = result.safe_batch
    _set_batch(trainer, batch, steps)
    if noise_scale:
        try:
            result = dataclasses.replace(result, noise_scale=_noise_of(trainer, kwargs, batch))
        except ValueError as exc:  # too few batches, say: advice is not worth failing the run for
            logger.warning(f"batchfit: no noise scale measured: {exc}")

    sized = Autosized(
        result=result,
        plan=chosen_plan,
        batch_size=batch,
        accumulation_steps=steps,
        previous_batch_size=previous_batch,
        previous_accumulation_steps=previous_steps,
        data_parallel_size=replicas,
        recommendation=result.recommend(target_batch=target_batch),
    )
    logger.info(f"batchfit: {sized}")
    if chosen_plan is not None:
        logger.info(f"batchfit: {chosen_plan}")
    elif sized.global_batch != sized.previous_global_batch:
        logger.info(
            f"batchfit: the global batch changed from {sized.previous_global_batch} to {sized.global_batch}; pass "
            f"target_batch={sized.previous_global_batch} to keep it (the learning rate was tuned for it)"
        )
    if result.noise_scale is not None and sized.recommendation is not None:
        trainer.log(sized.recommendation.metrics())  # to its reporting callbacks
        logger.info(f"batchfit: recommended {sized.recommendation.split()}: {sized.recommendation.reason}")
    if not result.safe_verified:
        logger.warning(f"batchfit: the safe batch {result.safe_batch} was not verified with extra steps")
    for note in result.notes:
        logger.warning(f"batchfit: {note}")
    if getattr(args, "auto_find_batch_size", False):
        logger.info(
            f"batchfit: auto_find_batch_size is on, so Accelerate still shrinks from {batch} if train() runs out of "
            "memory"
        )
    return sized


def trainer_step_fn(trainer: Trainer) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The probe's step: ``trainer.compute_loss(model, batch)`` as ``training_step`` calls it.

    It runs under ``trainer.compute_loss_context_manager()`` (a subclass's autocast lives there)
    and gets a shallow copy of the batch: ``compute_loss`` pops ``labels`` when a label smoother
    or ``compute_loss_func`` is set, and a probe runs several steps on one batch.
    ``num_items_in_batch`` is left out (the model averages the loss itself): it changes the loss's
    scale, not the memory a step takes.
    """

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        context = getattr(trainer, "compute_loss_context_manager", None)
        with context() if context is not None else contextlib.nullcontext():
            return trainer.compute_loss(model, dict(batch))

    return step


def trainer_amp(args: Any) -> str | None:
    """batchfit's ``amp`` for the trainer's arguments: ``"bf16"``, ``"fp16"`` or ``None``."""
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return None


def data_parallel_size(trainer: Trainer) -> int:
    """The replicas a global batch is spread over, as ``Trainer.get_total_train_batch_size``
    counts them: ranks divided by the tensor/context/sequence-parallel sizes, times the GPUs of a
    single-process ``DataParallel`` (whose per-process batch is per-device batch x GPUs)."""
    args = trainer.args
    ranks = int(args.world_size)
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        size = getattr(trainer, name, None)
        if callable(size):
            ranks //= max(1, int(size()))
    return max(1, ranks) * max(1, int(getattr(args, "n_gpu", 1) or 1))


def first_batch(trainer: Trainer) -> dict[str, Any]:
    """The first batch of the trainer's train dataloader, leaving no trace of the draw.

    The random generators are put back (the sampler drew its seed from them), and the dataloader
    is taken out of the Accelerator's list of prepared dataloaders again (``accelerator.prepare``
    registers each one, and ``save_state`` walks that list).
    """
    with _loader_kept(trainer) as loader:
        iterator = iter(loader)
        try:
            batch = next(iterator)
        except StopIteration:
            raise ValueError("the trainer's train dataloader yielded no batch: the train dataset is empty") from None
        finally:
            del iterator
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"the trainer's train dataloader yields {type(batch).__name__}, not a mapping of tensors: "
            "Trainer.compute_loss calls model(**batch)"
        )
    return dict(batch)


@contextlib.contextmanager
def _loader_kept(trainer: Trainer) -> Iterator[Any]:
    """``trainer.get_train_dataloader()``, drawn from under `_rng_kept`, then taken out of the
    Accelerator's list of prepared dataloaders again (``accelerator.prepare`` registers each one, and
    ``save_state`` walks that list)."""
    accelerator = getattr(trainer, "accelerator", None)
    registry = getattr(accelerator, "_dataloaders", None)
    registered = list(registry) if isinstance(registry, list) else None
    try:
        with _rng_kept():
            yield trainer.get_train_dataloader()
    finally:
        if registered is not None and isinstance(getattr(accelerator, "_dataloaders", None), list):
            accelerator._dataloaders[:] = registered  # type: ignore[union-attr]


def _noise_of(trainer: Trainer, kwargs: dict[str, Any], micro_batch: int) -> Any:
    """The noise scale of the trainer's own train batches at ``micro_batch``, with the probe's
    step, optimizer and autocast (``kwargs``, ``find()``'s; what ``Options`` does not take is left out)."""
    from batchfit.probe import measure_noise

    options = find_options("autosize", kwargs)
    with _loader_kept(trainer) as loader:
        return measure_noise(trainer.model, loader, options, micro_batch=micro_batch)


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Put torch's CPU generator and the accelerator's generators (through its backend, as a probe
    does), ``random`` and numpy's global generator back afterwards."""
    import torch

    from batchfit.backends import backend_for, default_device

    accelerator = torch.device(default_device())
    backend = backend_for(accelerator)
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cpu_state = torch.get_rng_state()
    device_state = backend.get_rng_state(accelerator)
    try:
        yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        torch.set_rng_state(cpu_state)
        backend.set_rng_state(accelerator, device_state)


def _set_batch(trainer: Trainer, batch_size: int, accumulation_steps: int) -> None:
    """Set the batch where the ``Trainer`` reads it.

    ``TrainingArguments`` is a mutable dataclass (transformers 4.35 froze it for one release;
    there ``dataclasses.replace`` is the way, and the trainer gets the new object). The
    ``Trainer`` copies ``args.train_batch_size`` into ``_train_batch_size`` at construction and
    builds its train dataloader from that copy, so it is set too, exactly as the ``Trainer``'s own
    ``auto_find_batch_size`` does.
    """
    changes = {"per_device_train_batch_size": batch_size, "gradient_accumulation_steps": accumulation_steps}
    try:
        for name, value in changes.items():
            setattr(trainer.args, name, value)
    except dataclasses.FrozenInstanceError:
        trainer.args = dataclasses.replace(trainer.args, **changes)
    trainer._train_batch_size = trainer.args.train_batch_size


def _checkpointing_pending(trainer: Trainer) -> bool:
    """Whether ``train()`` will turn on activation checkpointing that the model does not have yet."""
    args = trainer.args
    if not (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)):
        return False
    model = trainer.model
    # transformers 5 names it is_activation_checkpointing (is_gradient_checkpointing is deprecated there).
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return not bool(getattr(model, name))
    return True


def _require_transformers() -> Any:
    """transformers (and accelerate, which its Trainer needs), or an ImportError that says how to get them."""
    try:
        import accelerate  # noqa: F401
        import transformers
        import transformers.utils.logging  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"batchfit.transformers.autosize needs Hugging Face transformers and accelerate: {INSTALL_HINT} ({exc})"
        ) from exc
    return transformers

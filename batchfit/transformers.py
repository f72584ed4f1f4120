"""Size a Hugging Face ``Trainer``'s batch with batchfit before ``trainer.train()``.

[`autosize`][batchfit.transformers.autosize] probes the trainer's own model with the trainer's own
batch, loss and optimizer, then writes the safe batch where the ``Trainer`` reads it, so that the
run that follows is the run that was measured. With an ``eval_dataset`` it also sizes the trainer's
own evaluation step (``prediction_step``) next to the training state and sets
``per_device_eval_batch_size``. Hugging Face's ``auto_find_batch_size=True`` answers
a different question (the first size, shrinking by 10% per OOM from ``per_device_train_batch_size``,
that survives a real run); batchfit finds the boundary itself, keeps headroom below it, and verifies
the result.

Import-safe: this module imports neither torch nor transformers at import time, so
``import batchfit.transformers`` works where transformers is not installed; [`autosize`][batchfit.transformers.autosize]
then raises an ``ImportError`` that names ``pip install 'batchfit[transformers]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from batchfit._lazy import lazy_surface
from batchfit.api import find, fit
from batchfit.probe.options import find_options
from batchfit.report import Fit, Recommendation, Result
from batchfit.transformers_trainer import (
    INSTALL_HINT,
    checkpointing_pending,
    data_parallel_size,
    first_batch,
    loader_kept,
    require_transformers,
    set_batch,
    trainer_amp,
    trainer_eval_step,
    trainer_step_fn,
)

if TYPE_CHECKING:
    from transformers import Trainer
    from typing_extensions import Unpack

    from batchfit.probe.keywords import FindKeywords
    from batchfit.transformers_schedule import BatchSchedulerCallback

__all__ = [
    "INSTALL_HINT",
    "Autosized",
    "BatchSchedulerCallback",
    "autosize",
    "data_parallel_size",
    "first_batch",
    "trainer_amp",
    "trainer_eval_step",
    "trainer_step_fn",
]


#: `BatchSchedulerCallback` on first use: it subclasses transformers' ``TrainerCallback``, and importing
#: this module must import neither transformers nor torch.
__getattr__, __dir__ = lazy_surface(__name__, globals(), {"BatchSchedulerCallback": "batchfit.transformers_schedule"})


@dataclass(frozen=True)
class Autosized:
    """What [`autosize`][batchfit.transformers.autosize] measured and what it set on the trainer.

    A record of what was done to the trainer (its settings before and after), not a second answer:
    the batch to train with is the [`Recommendation`][batchfit.Recommendation] it carries, and
    ``Result`` is batchfit's device-agnostic record, which knows nothing of trainers.

    Attributes:
        result: the probe's answer (``batchfit.find``), batch sizes per device; ``None`` with
            ``checkpointing`` (``fit`` holds the measurements).
        batch_size: the ``per_device_train_batch_size`` now set on ``trainer.args``.
        accumulation_steps: the ``gradient_accumulation_steps`` now set on ``trainer.args``
            (unchanged without ``target_batch``).
        previous_batch_size: ``per_device_train_batch_size`` before [`autosize`][batchfit.transformers.autosize].
        previous_accumulation_steps: ``gradient_accumulation_steps`` before
            [`autosize`][batchfit.transformers.autosize].
        data_parallel_size: the data-parallel replicas the global batch is spread over (ranks
            times GPUs under single-process ``DataParallel``).
        recommendation: the batch batchfit recommends for the data-parallel replicas
            ([`recommend`][batchfit.report.result.Result.recommend] with ``world_size``; with the noise
            scale when measured). With ``target_batch`` it is the split that was applied
            (``batch_size`` and ``accumulation_steps`` are its own); without one, advice beside the
            safe batch that was set.
        fit: with ``checkpointing``, the [`Fit`][batchfit.Fit] whose policy was applied; ``applied`` says what.
        eval_batch_size: the ``per_device_eval_batch_size`` now set on ``trainer.args``: the eval
            step's safe batch (``result.eval_safe_batch``); ``None`` when evaluation was not sized.
        previous_eval_batch_size: ``per_device_eval_batch_size`` before
            [`autosize`][batchfit.transformers.autosize] (``None`` when evaluation was not sized).
    """

    result: Result | None
    batch_size: int
    accumulation_steps: int
    previous_batch_size: int
    previous_accumulation_steps: int
    data_parallel_size: int
    recommendation: Recommendation | None = None
    fit: Fit | None = None
    applied: str | None = None
    eval_batch_size: int | None = None
    previous_eval_batch_size: int | None = None

    @property
    def plan(self) -> Recommendation | None:
        """With ``target_batch``, the split that was applied (`recommendation`); ``None`` without one."""
        applied = self.recommendation
        return applied if applied is not None and applied.target is not None else None

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every replica: what the learning rate sees."""
        return self.batch_size * self.accumulation_steps * self.data_parallel_size

    @property
    def previous_global_batch(self) -> int:
        return self.previous_batch_size * self.previous_accumulation_steps * self.data_parallel_size

    def __str__(self) -> str:
        measured = self.result if self.result is not None else self.fit.rows[self.fit.chosen]  # type: ignore[union-attr]
        text = (
            f"per_device_train_batch_size {self.previous_batch_size} -> {self.batch_size}, "
            f"gradient_accumulation_steps {self.previous_accumulation_steps} -> {self.accumulation_steps}, "
            f"global batch {self.previous_global_batch} -> {self.global_batch} (probe: max batch {measured.max_batch}, "
            f"safe batch {measured.safe_batch}{'' if measured.safe_verified else ', not verified'})"
        )
        if self.eval_batch_size is not None:
            text += f", per_device_eval_batch_size {self.previous_eval_batch_size} -> {self.eval_batch_size}"
        return text + (f"; {self.applied}" if self.applied else "")


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
    * **evaluation**, when the trainer has an ``eval_dataset`` (or ``eval=True`` is passed;
      ``eval=False`` skips it): in the same ``find()`` call (``eval=True``), the trainer's own
      ``prediction_step`` (`trainer_eval_step`: its loss, the logits it keeps, a subclass's
      override) under ``torch.no_grad()`` with the model in ``eval()``, next to the training
      state that is live when ``train()`` evaluates (the optimizer's moments kept, gradients
      freed). It is sized on the same first *train* batch (the eval collator's batches are
      assumed to be alike; the train batch carries the labels the loss needs), so pad the eval
      set as the train set for the bound to hold. Only one step is sized: the evaluation loop
      also keeps every step's logits on the device until it ends unless
      ``eval_accumulation_steps`` is set (the log says so). ``per_device_eval_batch_size`` is set
      to ``result.eval_safe_batch``. Without an ``eval_dataset`` it is left alone, and with
      ``checkpointing`` evaluation is not sized (``eval=True`` is refused there).

    Then ``trainer.args.per_device_train_batch_size`` is set to the safe batch (and the
    ``Trainer``'s own ``_train_batch_size``, which its dataloader reads, as its
    ``auto_find_batch_size`` does). With ``target_batch`` the global batch (per-device batch x
    accumulation steps x data-parallel replicas) is kept at ``target_batch`` instead:
    [`recommend`][batchfit.report.result.Result.recommend] (``world_size=`` the replicas, the split
    [`batchfit.plan`][batchfit.plan] gives too) splits it into a micro-batch within the safe batch and
    accumulation steps, both are set, and that recommendation is the one reported. Without
    ``target_batch`` the accumulation steps are left alone, so the global batch changes with the
    per-device batch; the log says so.

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
            ``result.recommend(target_batch=..., world_size=<data-parallel replicas>)``.
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
        An [`Autosized`][batchfit.transformers.Autosized]: the probe's [`Result`][batchfit.Result], the
        recommendation, and the batch size, accumulation steps and eval batch size now set.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``trainer`` is not a ``transformers.Trainer``, or its batch is not a mapping.
        ValueError: the trainer uses DeepSpeed, or its train dataloader yields nothing, or
            ``eval=True`` comes with ``checkpointing``.
        BatchfitError: batchfit's errors from ``find()`` (``NothingFitsError``, ...), unchanged.
    """
    transformers = require_transformers()
    from batchfit.probe.checkpointing_blocks import keep_policy  # lazy: imports torch; this module must not

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
    if checkpointing is not None and (
        target_batch is None or replicas > 1 or noise_scale or checkpointing_pending(trainer)
    ):
        raise ValueError(
            "autosize(checkpointing=...) needs target_batch, one process, no noise_scale, and the "
            "trainer's own gradient_checkpointing off: it chooses which blocks to checkpoint"
        )
    if checkpointing is not None and find_kwargs.get("eval"):
        raise ValueError(
            "autosize(checkpointing=...) sizes training only: drop eval=True, or size the evaluation afterwards "
            "with batchfit.find(mode='eval')"
        )
    # Evaluation is sized where the trainer has an eval set to evaluate, unless the caller said otherwise.
    sizes_eval = checkpointing is None and bool(find_kwargs.get("eval", trainer.eval_dataset is not None))
    if checkpointing_pending(trainer):
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
        if sizes_eval:
            kwargs.update(eval=True, eval_step=trainer_eval_step(trainer))
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

    steps = previous_steps
    previous_eval = args.per_device_eval_batch_size
    if fitted is not None:  # fit() timed its candidates: its recommendation is the plan
        recommended = fitted.recommendation
        set_batch(trainer, recommended.batch_size, recommended.accumulation)
        applied = keep_policy(trainer.model, fitted.policy)
        logger.info(f"batchfit: applied {applied}; {recommended.split()}: {recommended.reason}")
        for note in fitted.notes:
            logger.warning(f"batchfit: {note}")
        return Autosized(
            result=None,
            batch_size=recommended.batch_size,
            accumulation_steps=recommended.accumulation,
            previous_batch_size=previous_batch,
            previous_accumulation_steps=previous_steps,
            data_parallel_size=replicas,
            recommendation=recommended,
            fit=fitted,
            applied=applied,
        )
    # The split applied is the one reported: the recommendation for these replicas (the one splitter).
    recommended = result.recommend(target_batch=target_batch, world_size=replicas)
    batch, steps = (recommended.batch_size, recommended.accumulation) if target_batch else (result.safe_batch, steps)
    set_batch(trainer, batch, steps, result.eval_safe_batch)
    if noise_scale:
        try:
            result = replace(result, noise_scale=_noise_of(trainer, kwargs, batch))
            # The noise scale adds caveats; a target's split is chosen on the trials and the safe batch alone.
            recommended = result.recommend(target_batch=target_batch, world_size=replicas)
        except ValueError as exc:  # too few batches, say: advice is not worth failing the run for
            logger.warning(f"batchfit: no noise scale measured: {exc}")

    sized = Autosized(
        result=result,
        batch_size=batch,
        accumulation_steps=steps,
        previous_batch_size=previous_batch,
        previous_accumulation_steps=previous_steps,
        data_parallel_size=replicas,
        recommendation=recommended,
        eval_batch_size=result.eval_safe_batch,
        previous_eval_batch_size=previous_eval if result.evaluation is not None else None,
    )
    logger.info(f"batchfit: {sized}")
    _log_evaluation(logger, trainer, result)
    if target_batch is not None:
        logger.info(f"batchfit: {recommended.summary()}")
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


def _noise_of(trainer: Trainer, kwargs: dict[str, Any], micro_batch: int) -> Any:
    """The noise scale of the trainer's own train batches at ``micro_batch``, with the probe's
    step, optimizer and autocast (``kwargs``, ``find()``'s; what ``Options`` does not take is left out)."""
    from batchfit.probe import measure_noise  # lazy: imports torch; this module must not

    options = find_options("autosize", kwargs)
    with loader_kept(trainer) as loader:
        return measure_noise(trainer.model, loader, options, micro_batch=micro_batch)


def _log_evaluation(logger: Any, trainer: Trainer, result: Result) -> None:
    """What the log says of the evaluation: sized or not, an unverified safe batch, and the
    logits the evaluation loop keeps on the device beyond the one step that was sized."""
    evaluation = result.evaluation
    if evaluation is None:
        if trainer.eval_dataset is not None:
            logger.info("batchfit: evaluation not sized (eval=False): per_device_eval_batch_size left as it was")
        return
    if not evaluation.safe_verified:
        logger.warning(f"batchfit: the eval safe batch {evaluation.safe_batch} was not verified with extra steps")
    args = trainer.args
    if not args.prediction_loss_only and args.eval_accumulation_steps is None:
        logger.info(
            "batchfit: the eval batch is sized for one evaluation step; the evaluation loop keeps every step's "
            "logits on the device until it ends (eval_accumulation_steps is unset): set eval_accumulation_steps "
            "for a long eval set"
        )

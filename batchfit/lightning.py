"""PyTorch Lightning: ``Trainer(callbacks=[BatchFit()])`` trains at the batch size batchfit measured.

At the start of ``fit`` (``on_fit_start``: the strategy has moved the model to its device, wrapped it
in DDP where it does, and built the optimizers), the callback draws one batch from the train
dataloader the trainer is about to use, probes with the user's own ``training_step`` and optimizer
([`batchfit.find`][batchfit.find], which restores the model, the optimizer and the RNG in memory, so no
checkpoint file is written as Lightning's ``BatchSizeFinder`` does), sets the safe batch where
Lightning reads the batch size (``lightning_setattr``: the module, its ``hparams`` or the
datamodule) and drops the loop's dataloaders as Lightning's tuner does, so that the fit loop
rebuilds them and the run that follows really trains at that size. With ``target_batch`` it keeps
the global batch instead, as micro-batch x gradient-accumulation steps x ranks
([`recommend`][batchfit.report.result.Result.recommend] with the trainer's ``world_size``: the split
[`batchfit.plan`][batchfit.plan] gives too, applied and reported as one record), and with
``checkpointing`` also the checkpointing policy ([`batchfit.fit`][batchfit.fit]).
``noise_scale=True`` also measures the gradient noise scale from the run's train dataloader and logs it
with the batch batchfit recommends (off by default: it costs passes).
Where the validation loader reads a batch size of its own (``eval_batch_size`` or ``val_batch_size``,
found where ``batch_size`` is), the same probe sizes the ``validation_step`` next to the training
state (``find(eval=True)``) and sets it there too.

What the probe must not change, it does not: ``self.log`` / ``self.log_dict`` are muted while it
runs (Lightning refuses a log call from ``on_fit_start``; the probe's losses are no metrics),
torchmetrics states ``training_step`` updates are put back, and the batch is drawn under
``isolate_rng``. Importing this module never needs Lightning; constructing
[`BatchFit`][batchfit.lightning.BatchFit] without it raises an ``ImportError`` saying what to install.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from batchfit.api import find, fit
from batchfit.lightning_schedule import BatchScheduler
from batchfit.lightning_trainer import (
    INSTALL_HINT,
    draw_batch,
    first_optimizer,
    forget_train_loader,
    log_noise,
    logging_muted,
    loss_of,
    metrics_kept,
    on_device,
    reload_dataloaders,
)
from batchfit.probe.options import find_options
from batchfit.units import format_bytes, positive_int

try:
    from lightning.pytorch import Callback as _Callback

    _MISSING: ImportError | None = None
except ImportError as _error:  # the class below still exists; constructing it says what to install
    _Callback = object  # type: ignore[assignment,misc]
    _MISSING = _error

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from typing_extensions import Unpack

    from batchfit.probe.keywords import FindKeywords
    from batchfit.report import Fit, Recommendation, Result

__all__ = ["EVAL_BATCH_ARG_NAMES", "INSTALL_HINT", "BatchFit", "BatchScheduler"]


#: ``find()`` keywords the callback fills in from the trainer: the batch comes from the train
#: dataloader, the step is the module's ``training_step``, the device is the strategy's.
_FROM_TRAINER = ("sample", "make_batch", "step_fn", "loss_fn", "criterion", "mode", "device")
#: Lightning's mixed-precision settings and the autocast batchfit runs its steps under.
_AMP = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
#: Where a validation loader's own batch size is looked for when ``eval_batch_arg_name`` is not
#: given, in this order (the names Lightning examples and datamodules use for it).
EVAL_BATCH_ARG_NAMES = ("eval_batch_size", "val_batch_size")


class BatchFit(_Callback):  # type: ignore[misc,valid-type]
    """Probe the largest batch that trains at the start of ``fit``, and train with its safe batch.

    Args:
        memory_limit: as [`batchfit.find`][batchfit.find] takes it; positionally too (`BatchFit("24GiB")`).
        batch_arg_name: the attribute the dataloaders read the batch size from, where Lightning's
            ``BatchSizeFinder`` looks: the module, its ``hparams``, the datamodule, its ``hparams``.
        eval_batch_arg_name: the attribute the validation dataloader reads its batch size from,
            looked up where ``batch_arg_name`` is. ``None`` (the default): ``eval_batch_size``, else
            ``val_batch_size``, if either exists. When one is found, the probe also sizes evaluation
            (``find(eval=True)``: ``validation_step`` when the module has one, else ``training_step``,
            under ``torch.no_grad()`` with the model in ``eval()``, next to the optimizer state the run
            keeps; on the first *train* batch, the one batch drawn) and sets its safe batch there
            (``result.eval_safe_batch``). When none is found the validation loader is not sized: it
            reads what it read before (often ``batch_size``: then the train batch set here, which
            evaluation holds too, its step taking less memory), and the log says so. A name given here
            must exist (refused at ``setup``). ``eval=False`` skips the evaluation probe; ``eval=True``
            runs it even with nothing to set (the answer is in `result`, and a warning says it was not set).
        target_batch: keep this global batch (over every rank and accumulation step): the batch size
            becomes the recommendation's micro-batch and ``trainer.accumulate_grad_batches`` its accumulation
            steps. ``None``: train with the safe batch, accumulation untouched.
        checkpointing: with ``target_batch``, one process: ``"auto"`` (or block names) runs `batchfit.fit`
            and applies the policy it recommends, with its micro-batch and accumulation (`fit`; logged).
        **find_kwargs: [`batchfit.find`][batchfit.find]'s other keywords
            ([`FindOptions`][batchfit.probe.keywords.FindOptions] and the hooks). ``optimizer`` and
            ``amp`` default to the trainer's (its first optimizer; ``"bf16-mixed"`` -> ``"bf16"``,
            ``"16-mixed"`` -> ``"fp16"``). ``noise_scale=True`` measures the gradient noise scale from the
            train dataloader at the size set, into `result`, and logs it to every logger (``batchfit/noise_scale``,
            ``_low``, ``_high``, ``batchfit/recommended_batch``, ``_global_batch``); too few batches: a warning.

    After ``fit`` has started, `result` holds the probe's [`Result`][batchfit.Result] (with
    ``result.evaluation`` when evaluation was sized) and
    [`recommendation`][batchfit.report.result.Result.recommendation] the batch batchfit recommends for
    the trainer's ranks ([`recommend`][batchfit.report.result.Result.recommend] with ``world_size``):
    with ``target_batch`` the split that was applied (`plan` is the same record), without one advice
    beside the safe batch that was set.

    Raises:
        ImportError: Lightning is not installed.
        TypeError, ValueError: an argument is invalid (checked here, before any training).
    """

    def __init__(
        self,
        memory_limit: int | float | str | None = None,
        /,
        *,
        batch_arg_name: str = "batch_size",
        eval_batch_arg_name: str | None = None,
        target_batch: int | None = None,
        checkpointing: str | Sequence[str] | None = None,
        **find_kwargs: Unpack[FindKeywords],
    ) -> None:
        if _MISSING is not None:
            raise ImportError(
                f"batchfit.lightning.BatchFit needs PyTorch Lightning (the 'lightning' package): {INSTALL_HINT}"
            ) from _MISSING
        super().__init__()
        for name, value in (("batch_arg_name", batch_arg_name), ("eval_batch_arg_name", eval_batch_arg_name)):
            if value is None and name == "eval_batch_arg_name":
                continue  # looked for under EVAL_BATCH_ARG_NAMES
            if not isinstance(value, str) or not value.isidentifier():
                raise TypeError(f"{name} must be an attribute name, got {value!r}")
        if target_batch is not None:
            positive_int("target_batch", target_batch)
        if checkpointing is not None and target_batch is None:  # the batch the policy must train
            raise ValueError("BatchFit(checkpointing=...) needs target_batch")
        self.batch_arg_name, self.target_batch, self.checkpointing = batch_arg_name, target_batch, checkpointing
        #: With ``checkpointing``, the [`Fit`][batchfit.Fit] whose policy was applied.
        self.fit: Fit | None = None
        given: dict[str, Any] = dict(find_kwargs)
        if memory_limit is not None:
            if "memory_limit" in given:
                raise TypeError("BatchFit() got memory_limit twice: positionally and as a keyword")
            given["memory_limit"] = memory_limit
        self.find_kwargs = _checked_find_kwargs(given)
        if checkpointing is not None and self.find_kwargs.get("eval"):
            raise ValueError("BatchFit(checkpointing=...) sizes training only: drop eval=True")
        self.eval_batch_arg_name = eval_batch_arg_name
        #: The attribute the validation loader's batch size is set on (found at ``setup``), or ``None``.
        self.eval_attribute: str | None = None
        # Measured here, from the loader, not by find().
        self.noise_scale: bool = self.find_kwargs.pop("noise_scale", False)
        #: The probe's answer, once ``fit`` has started.
        self.result: Result | None = None
        #: The batch batchfit recommends for the trainer's ranks, with the noise scale when measured:
        #: with ``target_batch``, the split applied.
        self.recommendation: Recommendation | None = None

    @property
    def plan(self) -> Recommendation | None:
        """With ``target_batch``, the split applied (`recommendation`); ``None`` without one."""
        return self.recommendation if self.target_batch is not None else None

    # Lightning hooks ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        """Refuse, before any work, what the callback cannot do (only ``fit`` is probed)."""
        if stage == "fit":
            _check_fit(trainer, pl_module, self.batch_arg_name, self.target_batch)
            self.eval_attribute = _eval_attribute(pl_module, self.eval_batch_arg_name)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Probe, then set the batch size (and accumulation) the run trains with."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        if trainer.fast_dev_run:
            rank_zero_warn("BatchFit: skipped, `fast_dev_run` is enabled")
            return
        batch = draw_batch(trainer)
        if batch is None:
            rank_zero_warn("BatchFit: skipped, the trainer has no train batches (`limit_train_batches=0`?)")
            return
        if self.checkpointing is not None:
            return self._fit(trainer, pl_module, batch)
        self.result = self._probe(trainer, pl_module, batch)
        size = self._apply(trainer, pl_module, self.result)
        if self.noise_scale:
            self.result = self._measure_noise(trainer, pl_module, self.result, size)
            # The noise scale adds caveats; a target's split is chosen on the trials and the safe batch alone.
            self.recommendation = self.result.recommend(target_batch=self.target_batch, world_size=trainer.world_size)
        if self.result.noise_scale is not None:
            log_noise(trainer, self.recommendation)

    # the work ----------------------------------------------------------------------------------
    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Result:
        """``find()`` on the strategy's model (DDP-wrapped where it is, so that batchfit defers its
        gradient all-reduce), stepping through ``strategy.training_step`` as the fit loop does."""
        kwargs = self._find_kwargs(trainer, pl_module)
        if self.find_kwargs.get("eval", self.eval_attribute is not None):  # the validation step too
            kwargs["eval"] = True
            if "eval_step" not in kwargs and (step := _validation_step(trainer, pl_module)) is not None:
                kwargs["eval_step"] = step
        with logging_muted(pl_module), metrics_kept(pl_module):
            return find(trainer.strategy.model, batch, **kwargs)

    def _fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """``fit()`` through ``training_step``; its policy applied for the run, its batch and accumulation set."""
        from lightning.pytorch.utilities.parsing import lightning_setattr
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        from batchfit.probe.checkpointing_blocks import keep_policy  # lazy: imports torch; this module must not

        if trainer.world_size > 1:
            raise ValueError("BatchFit(checkpointing=...) sizes one process; drop it under a distributed strategy")
        with logging_muted(pl_module), metrics_kept(pl_module):
            kwargs = {**self._find_kwargs(trainer, pl_module), "checkpointing": self.checkpointing}
            self.fit = fit(trainer.strategy.model, batch, target_batch=self.target_batch, **kwargs)
        self.recommendation = chosen = self.fit.recommendation
        applied = keep_policy(trainer.strategy.model, self.fit.policy)
        lightning_setattr(pl_module, self.batch_arg_name, chosen.batch_size)
        trainer.accumulate_grad_batches = chosen.accumulation
        reload_dataloaders(trainer)
        rank_zero_info(f"BatchFit: applied {applied}; {chosen.split()}: {chosen.reason}")
        if self.eval_attribute is not None:
            rank_zero_info(f"BatchFit: {self.eval_attribute} not sized: checkpointing sizes training only")

    def _find_kwargs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """``find()``'s keywords: the user's, the trainer's optimizer and precision, and the step."""
        kwargs = dict(self.find_kwargs)
        if "optimizer" not in kwargs:
            kwargs["optimizer"] = first_optimizer(trainer, pl_module)
        kwargs.setdefault("amp", _AMP.get(str(trainer.precision)))
        strategy = trainer.strategy

        def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            # ``model`` is strategy.model, the module find() was given: training_step reaches it
            # through the strategy, under the precision plugin's autocast, as in the fit loop.
            return loss_of(strategy.training_step(batch, 0))

        return {**kwargs, "step_fn": step}

    def _measure_noise(self, trainer: pl.Trainer, pl_module: pl.LightningModule, result: Result, size: int) -> Result:
        """``result`` with the noise scale of the fit loop's train dataloader, rebuilt at ``size``, on the
        device as the fit loop moves batches; dropped again after, with the random stream put back."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn
        from lightning.pytorch.utilities.seed import isolate_rng

        from batchfit.probe import measure_noise  # lazy: imports torch; this module must not

        options, loop = find_options("BatchFit", self._find_kwargs(trainer, pl_module)), trainer.fit_loop
        with isolate_rng(), logging_muted(pl_module), metrics_kept(pl_module):
            forget_train_loader(loop)
            loop.setup_data()
            try:
                batches = on_device(loop._combined_loader, trainer.strategy)
                noise = measure_noise(trainer.strategy.model, batches, options, micro_batch=size)
            except ValueError as exc:  # too few batches, say: advice is not worth failing the run for
                rank_zero_warn(f"BatchFit: no noise scale measured: {exc}")
                return result
            finally:
                forget_train_loader(loop)
        return dataclasses.replace(result, noise_scale=noise)

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, result: Result) -> int:
        """Set the batch size (and accumulation) where Lightning reads them, reload the data; the size set."""
        from lightning.pytorch.utilities.parsing import lightning_setattr
        from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

        # The split applied is the one reported: the recommendation for the trainer's ranks.
        self.recommendation = result.recommend(target_batch=self.target_batch, world_size=trainer.world_size)
        size = result.safe_batch
        if self.plan is not None:
            size = self.plan.batch_size
            trainer.accumulate_grad_batches = self.plan.accumulation
        lightning_setattr(pl_module, self.batch_arg_name, size)
        evaluation, where = result.evaluation, self.eval_attribute
        if evaluation is not None and where is not None:
            lightning_setattr(pl_module, where, evaluation.safe_batch)
        reload_dataloaders(trainer)
        rank_zero_info(_summary(self.batch_arg_name, size, result, self.plan, where))
        if not result.safe_verified:
            rank_zero_warn(f"BatchFit: the safe batch {result.safe_batch} was not verified; see result.notes")
        if evaluation is not None and where is None:
            rank_zero_warn(
                f"BatchFit: evaluation sized (eval safe batch {evaluation.safe_batch}) but not set: no attribute "
                f"{' or '.join(map(repr, EVAL_BATCH_ARG_NAMES))} for the validation loader; see result.evaluation"
            )
        elif evaluation is None and where is None and _validates(trainer, pl_module):
            rank_zero_info(
                f"BatchFit: the validation loader's batch is not sized: no attribute "
                f"{' or '.join(map(repr, EVAL_BATCH_ARG_NAMES))} (or eval_batch_arg_name) for it to read; it reads "
                f"what it read before (the {self.batch_arg_name!r} set here, if that is what it reads)"
            )
        elif evaluation is not None and not evaluation.safe_verified:
            rank_zero_warn(f"BatchFit: the eval safe batch {evaluation.safe_batch} was not verified")
        return size


# checks ------------------------------------------------------------------------------------------
def _checked_find_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``find()`` keywords, validated now (as [`Options`][batchfit.Options] does for
    ``find()``) so that a typo fails at construction, not after the trainer has set up."""
    for name in kwargs:
        if name in _FROM_TRAINER:
            raise TypeError(f"BatchFit sets {name!r} itself from the trainer and the LightningModule; do not pass it")
    find_options("BatchFit", kwargs)
    return kwargs


def _check_fit(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, target_batch: int | None) -> None:
    """What Lightning's ``BatchSizeFinder`` refuses, less distributed strategies (batchfit probes
    every rank together), plus what only a probe through ``training_step`` cannot do."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.utilities.parsing import lightning_hasattr

    if not trainer.fit_loop._data_source.is_module():
        raise MisconfigurationException(
            "BatchFit cannot change the batch size of dataloaders passed directly to `fit()`: return them from "
            "`train_dataloader()` of the LightningModule or a LightningDataModule, reading the batch size from an "
            "attribute"
        )
    if not lightning_hasattr(pl_module, name):
        raise MisconfigurationException(
            f"BatchFit: no attribute {name!r} on the model, its hparams, the datamodule or its hparams; "
            "set `batch_arg_name` to the attribute your dataloaders read the batch size from"
        )
    if not pl_module.automatic_optimization:
        raise MisconfigurationException(
            "BatchFit needs automatic optimization: with manual optimization `training_step` steps your "
            "optimizers itself, so a probe through it would train your model"
        )
    if target_batch is not None and any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise MisconfigurationException(
            "BatchFit(target_batch=...) sets `accumulate_grad_batches` itself; remove the GradientAccumulationScheduler"
        )


def _summary(name: str, size: int, result: Result, plan: Recommendation | None, eval_name: str | None = None) -> str:
    """One line for the log: what was set, and the measurement behind it."""
    ranks = f" per rank ({result.world_size} ranks)" if result.world_size > 1 else ""
    if plan is not None:
        name = f"{name}={size}, accumulate_grad_batches={plan.accumulation_steps} for the global batch " + (
            f"{plan.global_batch} (target {plan.target_batch})"
        )
    evaluation, evaluated = result.evaluation, ""
    if evaluation is not None:
        evaluated = f"; evaluation: largest batch {evaluation.max_batch}, safe batch {evaluation.safe_batch}"
        evaluated += f", set as {eval_name}={evaluation.safe_batch}" if eval_name is not None else ", not set"
    return (
        f"BatchFit: {name if plan is not None else f'{name}={size}'}; largest batch that trained {result.max_batch}, "
        f"safe batch {result.safe_batch} ({result.settings.headroom:.0%} headroom of "
        f"{format_bytes(result.budget_bytes)}){ranks}{evaluated}"
    )


# evaluation --------------------------------------------------------------------------------------
def _eval_attribute(pl_module: pl.LightningModule, name: str | None) -> str | None:
    """The attribute the validation loader reads its batch size from, found where ``batch_size`` is
    (``lightning_hasattr``): ``name`` when given (refused when missing, as ``batch_arg_name`` is),
    else the first of `EVAL_BATCH_ARG_NAMES` that exists, else ``None``."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.utilities.parsing import lightning_hasattr

    if name is None:
        return next((found for found in EVAL_BATCH_ARG_NAMES if lightning_hasattr(pl_module, found)), None)
    if not lightning_hasattr(pl_module, name):
        raise MisconfigurationException(
            f"BatchFit: no attribute {name!r} on the model, its hparams, the datamodule or its hparams; set "
            "`eval_batch_arg_name` to the attribute your validation dataloader reads the batch size from"
        )
    return name


def _validates(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the run validates at all: a ``validation_step`` and validation batches."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden("validation_step", pl_module) and trainer.limit_val_batches != 0


def _validation_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[Any, Any], Any] | None:
    """The eval probe's step: ``strategy.validation_step(batch, 0)`` as the validation loop calls it
    (under the precision plugin's autocast, through DDP's forward where it wraps the module), what it
    returns held until the step ends; ``None`` without a ``validation_step`` (``find()`` then runs
    the training step's forward and loss under ``torch.no_grad()``)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("validation_step", pl_module):
        return None
    strategy = trainer.strategy

    def step(model: torch.nn.Module, batch: Any) -> Any:
        return strategy.validation_step(batch, 0)

    return step

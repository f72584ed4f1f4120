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
([`batchfit.plan`][batchfit.plan]), and with ``checkpointing`` also the checkpointing policy
([`batchfit.fit`][batchfit.fit]). ``noise_scale=True`` also measures the gradient noise scale from the
run's train dataloader and logs it with the batch batchfit recommends (off by default: it costs passes).

What the probe must not change, it does not: ``self.log`` / ``self.log_dict`` are muted while it
runs (Lightning refuses a log call from ``on_fit_start``; the probe's losses are no metrics),
torchmetrics states ``training_step`` updates are put back, and the batch is drawn under
``isolate_rng``. Importing this module never needs Lightning; constructing
[`BatchFit`][batchfit.lightning.BatchFit] without it raises an ``ImportError`` saying what to install.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from batchfit.probe.options import find_options

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

    from batchfit.estimation import Plan
    from batchfit.probe.keywords import FindKeywords
    from batchfit.report import Fit, Recommendation, Result

__all__ = ["INSTALL_HINT", "BatchFit"]

INSTALL_HINT = "pip install 'batchfit[lightning]'"

#: ``find()`` keywords the callback fills in from the trainer: the batch comes from the train
#: dataloader, the step is the module's ``training_step``, the device is the strategy's.
_FROM_TRAINER = ("sample", "make_batch", "step_fn", "loss_fn", "criterion", "mode", "device")
#: Lightning's mixed-precision settings and the autocast batchfit runs its steps under.
_AMP = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


class BatchFit(_Callback):  # type: ignore[misc,valid-type]
    """Probe the largest batch that trains at the start of ``fit``, and train with its safe batch.

    Args:
        memory_limit: as [`batchfit.find`][batchfit.find] takes it; positionally too (`BatchFit("24GiB")`).
        batch_arg_name: the attribute the dataloaders read the batch size from, where Lightning's
            ``BatchSizeFinder`` looks: the module, its ``hparams``, the datamodule, its ``hparams``.
        target_batch: keep this global batch (over every rank and accumulation step): the batch size
            becomes the plan's micro-batch and ``trainer.accumulate_grad_batches`` its accumulation
            steps. ``None``: train with the safe batch, accumulation untouched.
        checkpointing: with ``target_batch``, one process: ``"auto"`` (or block names) runs `batchfit.fit`
            and applies the policy it recommends, with its micro-batch and accumulation (`fit`; logged).
        **find_kwargs: [`batchfit.find`][batchfit.find]'s other keywords
            ([`FindOptions`][batchfit.probe.keywords.FindOptions] and the hooks). ``optimizer`` and
            ``amp`` default to the trainer's (its first optimizer; ``"bf16-mixed"`` -> ``"bf16"``,
            ``"16-mixed"`` -> ``"fp16"``). ``noise_scale=True`` measures the gradient noise scale from the
            train dataloader at the size set, into `result`, and logs it to every logger (``batchfit/noise_scale``,
            ``_low``, ``_high``, ``batchfit/recommended_batch``, ``_global_batch``); too few batches: a warning.

    After ``fit`` has started, `result` holds the probe's [`Result`][batchfit.Result], `plan` the
    [`Plan`][batchfit.Plan] with ``target_batch``, and [`recommendation`][batchfit.report.result.Result.recommendation]
    the batch batchfit recommends ([`recommend`][batchfit.report.result.Result.recommend]).

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
        target_batch: int | None = None,
        checkpointing: str | Sequence[str] | None = None,
        **find_kwargs: Unpack[FindKeywords],
    ) -> None:
        if _MISSING is not None:
            raise ImportError(
                f"batchfit.lightning.BatchFit needs PyTorch Lightning (the 'lightning' package): {INSTALL_HINT}"
            ) from _MISSING
        super().__init__()
        if not isinstance(batch_arg_name, str) or not batch_arg_name.isidentifier():
            raise TypeError(f"batch_arg_name must be an attribute name, got {batch_arg_name!r}")
        if target_batch is not None:
            from batchfit.units import positive_int

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
        # Measured here, from the loader, not by find().
        self.noise_scale: bool = self.find_kwargs.pop("noise_scale", False)
        #: The probe's answer, once ``fit`` has started.
        self.result: Result | None = None
        #: How ``target_batch`` is reached, when one was given.
        self.plan: Plan | None = None
        #: The batch batchfit recommends, with the noise scale when measured.
        self.recommendation: Recommendation | None = None

    # Lightning hooks ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        """Refuse, before any work, what the callback cannot do (only ``fit`` is probed)."""
        if stage == "fit":
            _check_fit(trainer, pl_module, self.batch_arg_name, self.target_batch)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Probe, then set the batch size (and accumulation) the run trains with."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        if trainer.fast_dev_run:
            rank_zero_warn("BatchFit: skipped, `fast_dev_run` is enabled")
            return
        batch = _draw_batch(trainer)
        if batch is None:
            rank_zero_warn("BatchFit: skipped, the trainer has no train batches (`limit_train_batches=0`?)")
            return
        if self.checkpointing is not None:
            return self._fit(trainer, pl_module, batch)
        self.result = self._probe(trainer, pl_module, batch)
        size = self._apply(trainer, pl_module, self.result)
        if self.noise_scale:
            self.result = self._measure_noise(trainer, pl_module, self.result, size)
        self.recommendation = self.result.recommend(target_batch=self.target_batch)
        if self.result.noise_scale is not None:
            _log_noise(trainer, self.recommendation)

    # the work ----------------------------------------------------------------------------------
    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Result:
        """``find()`` on the strategy's model (DDP-wrapped where it is, so that batchfit defers its
        gradient all-reduce), stepping through ``strategy.training_step`` as the fit loop does."""
        import batchfit

        with _logging_muted(pl_module), _metrics_kept(pl_module):
            return batchfit.find(trainer.strategy.model, batch, **self._find_kwargs(trainer, pl_module))

    def _fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """``fit()`` through ``training_step``; its policy applied for the run, its batch and accumulation set."""
        from lightning.pytorch.utilities.parsing import lightning_setattr
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        from batchfit.api import fit
        from batchfit.probe.recompute import keep_policy

        if trainer.world_size > 1:
            raise ValueError("BatchFit(checkpointing=...) sizes one process; drop it under a distributed strategy")
        with _logging_muted(pl_module), _metrics_kept(pl_module):
            kwargs = {**self._find_kwargs(trainer, pl_module), "checkpointing": self.checkpointing}
            self.fit = fit(trainer.strategy.model, batch, target_batch=self.target_batch, **kwargs)
        self.recommendation = chosen = self.fit.recommendation
        applied = keep_policy(trainer.strategy.model, self.fit.policy)
        lightning_setattr(pl_module, self.batch_arg_name, chosen.batch_size)
        trainer.accumulate_grad_batches = chosen.accumulation
        _reload_dataloaders(trainer)
        rank_zero_info(f"BatchFit: applied {applied}; {chosen.split()}: {chosen.reason}")

    def _find_kwargs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """``find()``'s keywords: the user's, the trainer's optimizer and precision, and the step."""
        kwargs = dict(self.find_kwargs)
        if "optimizer" not in kwargs:
            kwargs["optimizer"] = _first_optimizer(trainer, pl_module)
        kwargs.setdefault("amp", _AMP.get(str(trainer.precision)))
        strategy = trainer.strategy

        def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            # ``model`` is strategy.model, the module find() was given: training_step reaches it
            # through the strategy, under the precision plugin's autocast, as in the fit loop.
            return _loss_of(strategy.training_step(batch, 0))

        return {**kwargs, "step_fn": step}

    def _measure_noise(self, trainer: pl.Trainer, pl_module: pl.LightningModule, result: Result, size: int) -> Result:
        """``result`` with the noise scale of the fit loop's train dataloader, rebuilt at ``size``, on the
        device as the fit loop moves batches; dropped again after, with the random stream put back."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn
        from lightning.pytorch.utilities.seed import isolate_rng

        from batchfit.probe import measure_noise

        options, loop = find_options("BatchFit", self._find_kwargs(trainer, pl_module)), trainer.fit_loop
        with isolate_rng(), _logging_muted(pl_module), _metrics_kept(pl_module):
            _forget_train_loader(loop)
            loop.setup_data()
            try:
                batches = _on_device(loop._combined_loader, trainer.strategy)
                noise = measure_noise(trainer.strategy.model, batches, options, micro_batch=size)
            except ValueError as exc:  # too few batches, say: advice is not worth failing the run for
                rank_zero_warn(f"BatchFit: no noise scale measured: {exc}")
                return result
            finally:
                _forget_train_loader(loop)
        return dataclasses.replace(result, noise_scale=noise)

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule, result: Result) -> int:
        """Set the batch size (and accumulation) where Lightning reads them, reload the data; the size set."""
        from lightning.pytorch.utilities.parsing import lightning_setattr
        from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

        size = result.safe_batch
        if self.target_batch is not None:
            import batchfit

            self.plan = batchfit.plan(result, target_batch=self.target_batch, world_size=trainer.world_size)
            size = self.plan.micro_batch
            trainer.accumulate_grad_batches = self.plan.accumulation_steps
        lightning_setattr(pl_module, self.batch_arg_name, size)
        _reload_dataloaders(trainer)
        rank_zero_info(_summary(self.batch_arg_name, size, result, self.plan))
        if not result.safe_verified:
            rank_zero_warn(f"BatchFit: the safe batch {result.safe_batch} was not verified; see result.notes")
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


# the pieces of a probe -----------------------------------------------------------------------------
def _draw_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the train dataloader the fit loop will use (distributed sampler
    included), on the model's device through the module's transfer hooks; ``None`` when there is
    none. Under ``isolate_rng``: a shuffled loader draws its seeds from the global generator, and
    the run must draw the same numbers it would have drawn without the callback."""
    from lightning.pytorch.utilities.seed import isolate_rng

    loop = trainer.fit_loop
    with isolate_rng():
        _forget_train_loader(loop)  # the user's dataloader as it is now, not one of a previous fit
        loop.setup_data()
        loader = loop._combined_loader
        if loader is None:
            return None
        try:
            batch, _, _ = next(iter(loader))
        except StopIteration:
            return None
        finally:
            # Shut its workers down, the loop as on_fit_start found it: the loaders are rebuilt after
            # the probe, and if it raises, Lightning's teardown must not meet an iterated loader.
            _forget_train_loader(loop)
        return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def _first_optimizer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The optimizer batchfit copies (class and hyperparameters; it never steps this one): the
    first of ``configure_optimizers()``, as the strategy already built it for the run. Without a
    real one (``configure_optimizers`` returned ``None``), plain SGD, which holds no state."""
    import torch
    from lightning.pytorch.core.optimizer import _MockOptimizer

    optimizers = list(trainer.optimizers) or _optimizers_in(pl_module.configure_optimizers())
    real = [o for o in optimizers if isinstance(o, torch.optim.Optimizer) and not isinstance(o, _MockOptimizer)]
    return real[0] if real else lambda params: torch.optim.SGD(params, lr=0.0)


def _optimizers_in(config: Any) -> list[Any]:
    """The optimizers in what ``configure_optimizers`` may return: one, a list or tuple of them,
    ``(optimizers, schedulers)``, a dict with ``"optimizer"``, or a list of such dicts."""
    import torch

    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, Mapping):
        return _optimizers_in(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        return [optimizer for item in config for optimizer in _optimizers_in(item)]
    return []


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``training_step`` returned: a tensor or a mapping with ``"loss"``."""
    import torch

    if isinstance(output, Mapping) and "loss" in output:
        output = output["loss"]
    if isinstance(output, torch.Tensor):
        return output
    if output is None:
        raise ValueError(
            "training_step returned None for the probe's batch (a skipped batch): BatchFit needs a loss to run "
            "backward and the optimizer step"
        )
    raise TypeError(f"training_step must return a loss tensor or a dict with 'loss', got {type(output).__name__}")


@contextlib.contextmanager
def _logging_muted(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` as no-ops while the probe runs ``training_step``.

    Unmuted, Lightning raises (``on_fit_start`` may not log); and a log with ``sync_dist=True``
    would start a collective inside the step, which a rank that ran out of memory never joins.
    The probe's losses at batch sizes the run never trains with are no metrics anyway."""
    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    pl_module.log = _ignore  # type: ignore[method-assign]
    pl_module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                setattr(pl_module, name, saved[name])
            else:
                delattr(pl_module, name)


def _ignore(*args: Any, **kwargs: Any) -> None:
    """What a muted ``self.log`` does."""


@contextlib.contextmanager
def _metrics_kept(pl_module: pl.LightningModule) -> Iterator[None]:
    """Put back the state of every torchmetrics ``Metric`` of the module after the probe: a
    ``training_step`` that updates one (``self.train_acc(preds, y)``) would otherwise count the
    probe's batches in the first epoch's value. batchfit restores registered tensors only, and
    metric states are plain attributes."""
    try:
        from torchmetrics import Metric
    except ImportError:
        yield
        return
    metrics = [m for m in pl_module.modules() if isinstance(m, Metric)]
    saved = [(m, copy.deepcopy(m.metric_state), m._update_count, m._computed) for m in metrics]
    try:
        yield
    finally:
        for metric, state, count, computed in saved:
            for name, value in state.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed = count, computed


def _forget_train_loader(loop: Any) -> None:
    """Shut down the fit loop's train loader and its fetcher (``setup_data`` made both) and drop
    them, so that the next ``setup_data`` builds them anew."""
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    if loop._combined_loader is not None:
        loop._combined_loader.reset()
        loop._combined_loader = None


def _reload_dataloaders(trainer: pl.Trainer) -> None:
    """Make the fit loop rebuild its dataloaders at the new batch size, as Lightning's tuner does
    (``tuner/batch_size_scaling.py``: ``_combined_loader = None``, for training and validation).

    The tuner then calls ``setup_data()`` at once because it runs loops itself; here the fit loop
    does it when it starts, where it would have without the callback, so the train loader's
    sampler and workers draw their seeds from the random stream at the same point as they would
    have (nothing between here and there reads the train loader: it is not built yet at
    ``on_fit_start`` in a run without the callback either)."""
    _forget_train_loader(trainer.fit_loop)
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def _summary(name: str, size: int, result: Result, plan: Plan | None) -> str:
    """One line for the log: what was set, and the measurement behind it."""
    from batchfit.units import format_bytes

    ranks = f" per rank ({result.world_size} ranks)" if result.world_size > 1 else ""
    if plan is not None:
        name = f"{name}={size}, accumulate_grad_batches={plan.accumulation_steps} for the global batch " + (
            f"{plan.global_batch} (target {plan.target_batch})"
        )
    return (
        f"BatchFit: {name if plan is not None else f'{name}={size}'}; largest batch that trained {result.max_batch}, "
        f"safe batch {result.safe_batch} ({result.settings.headroom:.0%} headroom of "
        f"{format_bytes(result.budget_bytes)}){ranks}"
    )


def _on_device(loader: Any, strategy: Any) -> Iterator[Any]:
    """The fit loop's train batches, moved to the device as the fit loop moves them (transfer hooks too)."""
    for batch, _, _ in loader:
        yield strategy.batch_to_device(batch, dataloader_idx=0)


def _log_noise(trainer: pl.Trainer, recommendation: Recommendation) -> None:
    """The noise scale and the recommended batch to every logger, the recommendation's reason to the log."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    for logger in trainer.loggers:  # rank zero's write
        logger.log_metrics(recommendation.metrics(), step=trainer.global_step)
    rank_zero_info(f"BatchFit: recommended {recommendation.split()}: {recommendation.reason}")

"""What [`BatchFit`][batchfit.lightning.BatchFit] reads of a Lightning ``Trainer`` and does to it around a probe.

The first train batch, the optimizer and the loss are read here; ``self.log`` is muted, metric
states are put back and the fit loop's dataloaders are dropped here. A room of its own so that
``batchfit.lightning`` keeps the one job of the callback (what to probe, what to set), and every
place this code reaches into Lightning's loops (``_combined_loader``, ``_data_fetcher``) is in one
file to check when Lightning changes them.

Import-safe as ``batchfit.lightning`` is: Lightning is imported only inside the functions.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

    from batchfit.report import Recommendation

__all__ = [
    "INSTALL_HINT",
    "draw_batch",
    "first_optimizer",
    "forget_train_loader",
    "log_noise",
    "logging_muted",
    "loss_of",
    "metrics_kept",
    "on_device",
    "optimizers_in",
    "reload_dataloaders",
]

#: What to install for the Lightning callbacks (``BatchFit``, ``BatchScheduler``).
INSTALL_HINT = "pip install 'batchfit[lightning]'"


def draw_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the train dataloader the fit loop will use (distributed sampler
    included), on the model's device through the module's transfer hooks; ``None`` when there is
    none. Under ``isolate_rng``: a shuffled loader draws its seeds from the global generator, and
    the run must draw the same numbers it would have drawn without the callback."""
    from lightning.pytorch.utilities.seed import isolate_rng

    loop = trainer.fit_loop
    with isolate_rng():
        forget_train_loader(loop)  # the user's dataloader as it is now, not one of a previous fit
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
            forget_train_loader(loop)
        return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def first_optimizer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The optimizer batchfit copies (class and hyperparameters; it never steps this one): the
    first of ``configure_optimizers()``, as the strategy already built it for the run. Without a
    real one (``configure_optimizers`` returned ``None``), plain SGD, which holds no state."""
    import torch
    from lightning.pytorch.core.optimizer import _MockOptimizer

    optimizers = list(trainer.optimizers) or optimizers_in(pl_module.configure_optimizers())
    real = [o for o in optimizers if isinstance(o, torch.optim.Optimizer) and not isinstance(o, _MockOptimizer)]
    return real[0] if real else lambda params: torch.optim.SGD(params, lr=0.0)


def optimizers_in(config: Any) -> list[Any]:
    """The optimizers in what ``configure_optimizers`` may return: one, a list or tuple of them,
    ``(optimizers, schedulers)``, a dict with ``"optimizer"``, or a list of such dicts."""
    import torch

    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, Mapping):
        return optimizers_in(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        return [optimizer for item in config for optimizer in optimizers_in(item)]
    return []


def loss_of(output: Any) -> torch.Tensor:
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
def logging_muted(pl_module: pl.LightningModule) -> Iterator[None]:
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
def metrics_kept(pl_module: pl.LightningModule) -> Iterator[None]:
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


def forget_train_loader(loop: Any) -> None:
    """Shut down the fit loop's train loader and its fetcher (``setup_data`` made both) and drop
    them, so that the next ``setup_data`` builds them anew."""
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    if loop._combined_loader is not None:
        loop._combined_loader.reset()
        loop._combined_loader = None


def reload_dataloaders(trainer: pl.Trainer) -> None:
    """Make the fit loop rebuild its dataloaders at the new batch size, as Lightning's tuner does
    (``tuner/batch_size_scaling.py``: ``_combined_loader = None``, for training and validation).

    The tuner then calls ``setup_data()`` at once because it runs loops itself; here the fit loop
    does it when it starts, where it would have without the callback, so the train loader's
    sampler and workers draw their seeds from the random stream at the same point as they would
    have (nothing between here and there reads the train loader: it is not built yet at
    ``on_fit_start`` in a run without the callback either)."""
    forget_train_loader(trainer.fit_loop)
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def on_device(loader: Any, strategy: Any) -> Iterator[Any]:
    """The fit loop's train batches, moved to the device as the fit loop moves them (transfer hooks too)."""
    for batch, _, _ in loader:
        yield strategy.batch_to_device(batch, dataloader_idx=0)


def log_noise(trainer: pl.Trainer, recommendation: Recommendation) -> None:
    """The noise scale and the recommended batch to every logger, the recommendation's reason to the log."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    for logger in trainer.loggers:  # rank zero's write
        logger.log_metrics(recommendation.metrics(), step=trainer.global_step)
    rank_zero_info(f"BatchFit: recommended {recommendation.split()}: {recommendation.reason}")

"""What [`autosize`][batchfit.transformers.autosize] reads of a Hugging Face ``Trainer`` and writes back to it.

Its first batch, its training and evaluation steps, its precision and data-parallel replicas are
read here; the batch sizes are written here, where the ``Trainer`` reads them. A room of its own
so that ``batchfit.transformers`` keeps the one job of deciding what to probe and what to set, and
so that every place this code touches a ``Trainer``'s internals (``_train_batch_size``, the
Accelerator's ``_dataloaders``) is in one file to check when transformers changes them.

Import-safe as ``batchfit.transformers`` is: neither torch nor transformers is imported at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import Trainer

__all__ = [
    "INSTALL_HINT",
    "checkpointing_pending",
    "data_parallel_size",
    "first_batch",
    "loader_kept",
    "require_transformers",
    "rng_kept",
    "set_batch",
    "trainer_amp",
    "trainer_eval_step",
    "trainer_step_fn",
]

INSTALL_HINT = "pip install 'batchfit[transformers]'"


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


def trainer_eval_step(trainer: Trainer) -> Callable[[nn.Module, Any], Any]:
    """The eval probe's step: ``trainer.prediction_step``, the very step ``trainer.evaluate()`` runs.

    The trainer's own evaluation step rather than a forward and a loss written here, so that what
    is sized is what evaluation runs: the loss through ``compute_loss`` under the trainer's
    autocast, the logits it keeps (all of the outputs but ``keys_to_ignore_at_inference``), and a
    subclass's override (``Seq2SeqTrainer`` with ``predict_with_generate`` generates there).
    ``prediction_loss_only`` is the arguments', as ``evaluate()`` passes it. What it returns (loss,
    logits, labels) is held until the step ends, as the evaluation loop holds it to gather it.
    The batch is a shallow copy: ``compute_loss`` may pop ``labels``.
    """

    def step(model: nn.Module, batch: Any) -> Any:
        return trainer.prediction_step(model, dict(batch), prediction_loss_only=trainer.args.prediction_loss_only)

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
    with loader_kept(trainer) as loader:
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
def loader_kept(trainer: Trainer) -> Iterator[Any]:
    """``trainer.get_train_dataloader()``, drawn from under `rng_kept`, then taken out of the
    Accelerator's list of prepared dataloaders again (``accelerator.prepare`` registers each one, and
    ``save_state`` walks that list)."""
    accelerator = getattr(trainer, "accelerator", None)
    registry = getattr(accelerator, "_dataloaders", None)
    registered = list(registry) if isinstance(registry, list) else None
    try:
        with rng_kept():
            yield trainer.get_train_dataloader()
    finally:
        if registered is not None and isinstance(getattr(accelerator, "_dataloaders", None), list):
            accelerator._dataloaders[:] = registered  # type: ignore[union-attr]


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put torch's CPU generator and the accelerator's generators (through its backend, as a probe
    does), ``random`` and numpy's global generator back afterwards."""
    import torch

    from batchfit.backends import backend_for, default_device  # lazy: the backends import torch; this module must not

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


def set_batch(trainer: Trainer, batch_size: int, accumulation_steps: int, eval_batch_size: int | None = None) -> None:
    """Set the batch where the ``Trainer`` reads it (and the eval batch, when one was sized).

    ``TrainingArguments`` is a mutable dataclass (transformers 4.35 froze it for one release;
    there ``dataclasses.replace`` is the way, and the trainer gets the new object). The
    ``Trainer`` copies ``args.train_batch_size`` into ``_train_batch_size`` at construction and
    builds its train dataloader from that copy, so it is set too, exactly as the ``Trainer``'s own
    ``auto_find_batch_size`` does. The eval dataloader reads ``args.eval_batch_size`` (from
    ``per_device_eval_batch_size``) each time it is built: no copy to set.
    """
    changes = {"per_device_train_batch_size": batch_size, "gradient_accumulation_steps": accumulation_steps}
    if eval_batch_size is not None:
        changes["per_device_eval_batch_size"] = eval_batch_size
    try:
        for name, value in changes.items():
            setattr(trainer.args, name, value)
    except dataclasses.FrozenInstanceError:
        trainer.args = dataclasses.replace(trainer.args, **changes)
    trainer._train_batch_size = trainer.args.train_batch_size


def checkpointing_pending(trainer: Trainer) -> bool:
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


def require_transformers() -> Any:
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

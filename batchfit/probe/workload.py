"""What one step of the user's work is: batch building, calling the model, the loss, the
optimizer, autocast. Everything here is about *what* runs; *measuring* it is trial.py's job.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from batchfit.errors import annotate
from batchfit.probe.batches import (
    META_BATCH,
    batch_size_of,
    check_has_values,
    spread,
    tensor_leaves,
    tile,
    to_device,
)
from batchfit.probe.compiled import mark_batch_dynamic
from batchfit.probe.generate_step import generate

if TYPE_CHECKING:
    from batchfit.probe.options import Options

Batch = Any
LossFn = Callable[[Any, Batch], torch.Tensor]
StepFn = Callable[[nn.Module, Batch], Any]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call the model the way the batch suggests: `model(x)`, `model(*x)` or `model(**x)`."""
    args, kwargs = spread(batch)
    return model(*args, **kwargs)


def split_pair(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch for ``criterion=``; a clear error for anything else."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"criterion= takes (inputs, targets) batches: a tuple or list of two, got {type(batch).__name__}"
        + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _explain_spread(exc: TypeError, batch: Any) -> None:
    """A hint on `exc` when a tuple sample was spread over too many arguments: `find(resnet, (x, y))`
    calls `resnet(x, y)`, which is the classic first mistake."""
    if isinstance(batch, (tuple, list)) and "positional argument" in str(exc):
        annotate(
            exc,
            f"batchfit: the sample is a {type(batch).__name__} of {len(batch)}, so the model was called as "
            f"model(*sample). For (inputs, targets) data pass criterion=, e.g. torch.nn.CrossEntropyLoss(): "
            "batchfit then calls model(inputs) and criterion(output, targets)",
        )


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss the model computed itself, ``None`` when it returned none: ``output.loss`` /
    ``output["loss"]`` when it is a tensor (Hugging Face models given labels), or a scalar first
    tensor (``return_dict=False``: ``(loss, logits, ...)``, or the loss alone)."""
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(iter(tensor_leaves(output, "output")), None)
    return first[1] if first is not None and first[1].dim() == 0 else None


def default_loss(output: Any) -> torch.Tensor:
    """A scalar to backpropagate from whatever the model returned.

    The model's `own_loss` when it has one, else the output itself, or its first tensor
    for tuples, lists and mappings (logits), reduced with ``mean()`` in float32 so that fp16
    outputs cannot overflow.
    """
    loss = own_loss(output)
    if loss is None:
        leaves = list(tensor_leaves(output, "output"))
        if not leaves:
            raise TypeError(
                f"cannot derive a loss from a model output of type {type(output).__name__}: "
                "pass loss_fn=(output, batch) -> loss or step_fn=(model, batch) -> loss"
            )
        loss = leaves[0][1]
    return loss if loss.dim() == 0 else loss.float().mean()


# Optimizer ------------------------------------------------------------------------------------
def optimizer_factory(
    optimizer: Any, parameter_of: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> OptimizerFactory:
    """Turn ``optimizer=`` into a factory of fresh optimizers for the probe's trials.

    ``None``: AdamW with torch's defaults (its two moments make it a realistic worst case).
    An optimizer instance: a fresh one of the same class with the same param-group
    hyperparameters over the same parameters; the user's own instance is never stepped. A
    callable: called with the list of trainable parameters. Every optimizer made must hold some of
    the parameters it is given, or it is refused by name (`_stepping_the_model`).

    ``parameter_of``: where the probe runs the model's parameters as other tensors (the estimate
    swaps fake ones into the model's slots), the tensor that stands in for each of the template's
    parameters. Without it the fresh optimizer would hold the originals, which never get a
    gradient there, and its step would allocate no state at all.
    """
    if optimizer is None:
        return lambda params: torch.optim.AdamW(params)
    if isinstance(optimizer, torch.optim.Optimizer):
        make = _cloner(optimizer, parameter_of)
    elif callable(optimizer):
        make = _from_factory(optimizer)
    else:
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer, or None, "
            f"not {type(optimizer).__name__}"
        )
    return lambda params: _stepping_the_model(make(params), params)


def _stepping_the_model(made: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``made``, unless it holds none of ``params`` (the model's trainable parameters): built over
    another model's, it would update nothing of this one and allocate no state in the probe's
    steps, and the batch found would be too large. A subset of the model's parameters (a frozen
    body, LoRA) is the model's; so is an extra tensor of the loss (a temperature) beside them."""
    held = [p for group in made.param_groups for p in group["params"]]
    trainable = {id(p) for p in params}
    if not held or not trainable or any(id(p) in trainable for p in held):
        return made
    raise ValueError(
        f"optimizer holds none of the model's {len(trainable)} trainable parameters (its {len(held)} are another "
        "model's): build it over this model's parameters, or pass a factory params -> optimizer "
        "(see docs/concepts/one-trial.md#one-trial)"
    )


def _from_factory(factory: Callable[..., Any]) -> OptimizerFactory:
    """``factory``, checked now for how it is called and at each call for what it returns."""
    _check_factory(factory)

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        made = factory(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory returned {type(made).__name__}, expected a torch.optim.Optimizer")
        return made

    return make


def _check_factory(factory: Callable[..., Any]) -> None:
    """Name a factory that cannot take the parameters now, not as a bare ``TypeError`` from the
    first trial (``optimizer=lambda: AdamW(model.parameters())`` is the classic slip)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: its call will say what it needs
        return
    try:
        signature.bind([])
    except TypeError as exc:
        name = getattr(factory, "__qualname__", type(factory).__name__)
        raise TypeError(
            f"optimizer= takes an optimizer, None, or a factory called with the list of trainable parameters "
            f"(params -> optimizer); {name}{signature} cannot be called that way: {exc}"
        ) from None


def _cloner(
    template: torch.optim.Optimizer, parameter_of: Callable[[torch.Tensor], torch.Tensor] | None
) -> OptimizerFactory:
    cls = type(template)
    groups = [{key: value for key, value in group.items() if key != "params"} for group in template.param_groups]
    params = [list(group["params"]) for group in template.param_groups]
    defaults = dict(template.defaults)

    def clone(_: list[nn.Parameter]) -> torch.optim.Optimizer:
        standing_in = params if parameter_of is None else [[parameter_of(p) for p in ps] for ps in params]
        fresh_groups = [dict(hyper, params=ps) for hyper, ps in zip(groups, standing_in)]
        try:
            return cls(fresh_groups)
        except TypeError:
            pass
        try:
            return cls(fresh_groups, **defaults)
        except TypeError as exc:
            raise TypeError(
                f"cannot create a fresh {cls.__name__} like the given optimizer ({exc}); "
                "pass optimizer=a factory params -> optimizer instead"
            ) from None

    return clone


# The workload -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Everything one step needs, resolved and validated."""

    model: nn.Module
    device: torch.device
    mode: str
    sample: Any
    sample_size: int | None
    make_batch: Callable[[int], Any] | None
    loss_fn: LossFn | None
    step_fn: StepFn | None
    new_optimizer: OptimizerFactory
    amp: str | None
    #: Mark dim 0 of every batch dynamic for ``torch.compile`` (``batchfit.probe.compiled``).
    dynamic_batch: bool = False
    #: ``(inputs, targets)`` data: the model gets the inputs, ``criterion(output, targets)`` is the loss.
    criterion: Callable[[Any, Any], Any] | None = None
    #: ``mode="generate"``: the tokens each row generates, and the loop that generates them (None: ``model.generate``).
    max_new_tokens: int | None = None
    generate_fn: Callable[[Any, Any, int], Any] | None = None
    #: ``mode="eval"``: the evaluation step, ``(model, batch) -> anything`` (None: forward and the loss).
    eval_step: Callable[[Any, Any], Any] | None = None

    @staticmethod
    def settings_of(options: Options) -> dict[str, Any]:
        """What a workload takes from the probe's `Options` as they are: every prober builds it so."""
        return {
            "mode": options.mode,
            "make_batch": options.batch_maker(),
            "loss_fn": options.loss_fn,
            "step_fn": options.step_fn,
            "criterion": options.criterion,
            "amp": options.amp,
            "max_new_tokens": options.max_new_tokens,
            "generate_fn": options.generate_fn,
            "eval_step": options.eval_step,
        }

    def build_batch(self, batch_size: int) -> Any:
        """A batch of ``batch_size`` on the probe's device."""
        if self.make_batch is None:
            assert self.sample_size is not None
            batch = tile(self.sample, batch_size, self.sample_size)
        else:
            built = self.make_batch(batch_size)
            try:
                batch = to_device(built, self.device)
            except NotImplementedError:  # torch's "Cannot copy out of meta tensor": say which, and what to do
                check_has_values(built, f"make_batch({batch_size})", META_BATCH)
                raise
            got = batch_size_of(batch, f"make_batch({batch_size})")
            if got != batch_size:
                raise ValueError(f"make_batch({batch_size}) returned a batch of size {got}")
        if self.dynamic_batch:
            mark_batch_dynamic(batch)
        return batch

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=AMP_DTYPES[self.amp])

    def grad_scaler(self, init_scale: float | None = None) -> torch.amp.GradScaler | None:
        """A ``GradScaler`` for fp16 (``None`` otherwise), starting at ``init_scale`` when given."""
        if self.amp != "fp16":
            return None
        if init_scale is None:
            return torch.amp.GradScaler(self.device.type)
        return torch.amp.GradScaler(self.device.type, init_scale=init_scale)

    def forward(self, batch: Any) -> tuple[Any, torch.Tensor | None]:
        """Run forward (and loss): returns ``(output, loss)``; loss is None in inference mode.

        In training ``output`` is what the step keeps alive through backward, as the loop it
        stands for does. The model's own loss (`own_loss`, with no ``loss_fn``) leaves
        ``None``: ``loss = model(**batch).loss``, Hugging Face's Trainer and Lightning free the
        output before backward. A ``loss_fn``, a ``criterion`` or the stand-in loss (the output's
        mean) took the output, and it is kept, as ``out = model(x); loss = criterion(out, y);
        loss.backward()`` keeps it. ``step_fn`` returns the loss alone: what it does not return is
        freed. The result's notes say which, after the first step (``checks.output_notes``).
        """
        with self.autocast():
            if self.mode == "generate":
                assert self.max_new_tokens is not None
                return generate(self.model, batch, self.max_new_tokens, self.generate_fn), None
            if self.mode == "eval" and self.eval_step is not None:
                return self.eval_step(self.model, batch), None
            if self.step_fn is not None:
                output = self.step_fn(self.model, batch)
                if self.mode == "inference":
                    return output, None
                if not isinstance(output, torch.Tensor):
                    raise TypeError(f"step_fn must return the loss tensor, got {type(output).__name__}")
                return None, output if output.dim() == 0 else output.float().mean()
            # The model is called here, not through `call_model`: one frame less between `find` and it.
            if self.criterion is not None:
                inputs, targets = split_pair(batch)
                args, kwargs = spread(inputs)
                output = self.model(*args, **kwargs)
                if self.mode == "inference":
                    return output, None
                loss = self.criterion(output, targets)
            else:
                args, kwargs = spread(batch)
                try:
                    output = self.model(*args, **kwargs)
                except TypeError as exc:
                    _explain_spread(exc, batch)
                    raise
                if self.mode == "inference":
                    return output, None
                own = own_loss(output) if self.loss_fn is None else None
                if self.mode == "eval":  # the evaluation loop keeps the output for its metrics
                    return output, own if own is not None else self._loss_of(output, batch)
                if own is not None:
                    loss, output = own, None  # freed before backward, as `loss = model(**batch).loss` frees it
                else:
                    loss = self._loss_of(output, batch)
        if self.mode == "eval":
            return output, loss
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
        if loss.dim() != 0:
            loss = loss.float().mean()
        if not loss.requires_grad:
            raise ValueError(
                "the loss does not require grad: no trainable parameter contributed to it "
                "(are all parameters frozen, or does the loss detach the output?)"
            )
        return output, loss

    def _loss_of(self, output: Any, batch: Any) -> torch.Tensor:
        """The loss of ``output`` when the model did not compute its own: ``loss_fn``'s, or the stand-in."""
        return self.loss_fn(output, batch) if self.loss_fn is not None else default_loss(output)

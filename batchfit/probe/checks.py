"""What every probe checks and knows about the user's model before (and beside) its trials.

The input checks shared by the real probe, the estimate and the gate, so that each entry point
refuses the same input with the same words; and the model facts the result's notes and memory
equation are built from (parameter bytes, the fixed memory advice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from batchfit.probe.batches import check_has_values
from batchfit.probe.generate_step import check_generation
from batchfit.probe.keywords import check_hooks
from batchfit.probe.options import Options
from batchfit.probe.positions import check_generation_length
from batchfit.probe.workload import split_pair
from batchfit.report import MemoryModel, Trial, Unit
from batchfit.units import format_bytes


def check_work(model: Any, sample: Any, options: Options) -> None:
    """What every probe (real or estimated) checks first: a module, and exactly one of a sample
    and ``make_batch``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if (sample is None) == (options.make_batch is None):
        raise TypeError(
            "pass exactly one of sample= (one batch; its first dimension is the batch) "
            "or make_batch= (a callable batch_size -> batch)"
            if sample is None
            else "pass either sample or make_batch, not both"
        )
    if options.criterion is not None and sample is not None:
        split_pair(sample)  # (inputs, targets) or a clear error now, not in a trial
    if options.mode == "generate":
        assert options.max_new_tokens is not None
        check_generation(model, options.generate_fn)
        check_generation_length(model, sample, options.seq_len, options.max_new_tokens)


def check_materialised(model: nn.Module, sample: Any) -> None:
    """Refuse, with the reason, what no trial could run: tensors without data (the ``meta``
    device) and lazy modules whose shapes are not known yet."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if is_lazy(tensor):
            raise ValueError(
                f"the model's {name} is an uninitialized lazy parameter (a torch.nn.Lazy* module): run one forward "
                "pass on a sample before probing, so that its shape is known"
            )
        if tensor.is_meta:
            raise ValueError(
                f"the model's {name} is on the meta device, which holds no data: materialise the model "
                "(model.to_empty(device=...), then initialise its weights) before probing"
            )
    if sample is not None:
        check_has_values(sample, "sample", "pass a sample with real values")


def check_callbacks(*callbacks: Any) -> None:
    """Name a callback that cannot be called before anything runs (`check_hooks`, positionally)."""
    check_hooks(dict(zip(("callback", "on_trial_start", "on_start"), callbacks)))


def loss_notes(model: nn.Module, sample: Any, options: Options) -> list[str]:
    """What the result says about the loss before any step: what a Hugging Face model given no
    labels leaves out (the output's fate is said after the first step: `output_notes`)."""
    return _unlabelled_notes(model, sample, options)


def output_notes(kept: bool, options: Options) -> list[str]:
    """Which loop the step stood for, where the user may have meant the other (``Workload.forward``,
    as its first training step did it): the model's own loss freed the output before backward, a
    ``loss_fn`` kept it. A ``criterion`` keeps it as everyone's ``criterion(model(x), y)`` loop
    does, ``step_fn`` is the user's own loop, and the stand-in loss has its own note: nothing said."""
    if options.step_fn is not None or options.criterion is not None:
        return []
    if kept and options.loss_fn is not None:
        return [
            "loss_fn takes the model's output, so the output was kept alive through backward, as "
            "`out = model(x); loss = loss_fn(out, batch); loss.backward()` keeps it; a loop that frees it first "
            "(`loss = model(**batch).loss`) fits more: step_fn=lambda model, batch: model(**batch).loss sizes that one"
        ]
    if not kept:
        return [
            "the loss is the model's own (output.loss), so its output was freed before backward, as "
            "`loss = model(**batch).loss`, Hugging Face's Trainer and Lightning free it; a loop that keeps the output "
            "through backward needs more: loss_fn=lambda output, batch: output.loss sizes that one"
        ]
    return []


def _unlabelled_notes(model: nn.Module, sample: Any, options: Options) -> list[str]:
    """A Hugging Face head model given no ``labels`` returns logits and no loss, and the default
    loss (``logits.mean()``) skips what the real loss holds. How much that is depends on the head:
    a language-model head (one with output embeddings) makes vocabulary-sized logits, and their
    cross-entropy is the biggest tensor of a small GPT-2's step: the batch found is then too large
    (measured: 7 without labels, 4 with). A classifier's logits are a few numbers per sample, and
    the answer does not move (a BERT classifier: 66 either way), so the note says so instead of
    calling it too large."""
    if options.mode != "train" or options.loss_fn or options.step_fn or options.criterion:
        return []
    hugging_face = any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)
    if not hugging_face or not isinstance(sample, Mapping) or "labels" in sample:
        return []
    said = "the sample has no 'labels', so the Hugging Face model returns logits and no loss, and batchfit used "
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if isinstance(head, nn.Module):
        classes = getattr(head, "out_features", None)
        over = f"the {classes:,}-word vocabulary" if isinstance(classes, int) else "the vocabulary"
        return [
            said + f"logits.mean() as the loss: the real loss (a cross-entropy over {over}) holds much more memory, "
            "so the batch sizes found are too large. Put labels in the sample (a causal LM takes labels = "
            "input_ids) or pass loss_fn="
        ]
    return [
        said + "logits.mean() as the loss: this model's head makes a few logits per sample, not vocabulary-sized "
        "ones, so a real loss adds little memory and the answer should hold; put labels in the sample (or pass "
        "loss_fn=) to measure the real loss"
    ]


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the model's parameters (each once: ``parameters()`` skips tied repeats), and of
    those that train (and so get gradients)."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights, sum(p.numel() * p.element_size() for p in params if p.requires_grad)


#: A reserved peak within this much of the budget pressed against the cap (see `fit_memory`):
#: the larger of a 20 MiB segment (the caching allocator's for mid-sized requests) and 2% of it.
PRESSED_SEGMENT_BYTES = 20 * 2**20
PRESSED_FRACTION = 0.02


def fit_memory(
    trials: list[Trial],
    weights: int,
    trainable: int,
    mode: str,
    optimizer_state: int,
    unit: Unit,
    budget_bytes: int | None = None,
) -> MemoryModel | None:
    """The memory equation of ``trials`` with its breakdown; gradients only when training.

    In reserved bytes, the trials whose peak pressed against the cap (within a segment of the
    budget) are left out when at least two sizes did not: a caching allocator gives its cached
    blocks back only when it reaches the cap, so near the boundary every size shows a reserved
    peak of about the cap while its need climbs, and a line through those points predicts too
    much memory lower down (and too small a safe batch).
    """
    if unit == "reserved" and budget_bytes is not None:
        pressed = budget_bytes - max(PRESSED_SEGMENT_BYTES, PRESSED_FRACTION * budget_bytes)
        free = [t for t in trials if t.fits and (t.peak_in(unit) or 0) < pressed]
        if len({t.batch_size for t in free}) >= 2:
            trials = free
    return MemoryModel.fit(trials, weights, trainable if mode == "train" else 0, optimizer_state, unit=unit)


def fixed_memory_advice(weights: int, trainable: int, mode: str, optimizer: Any, budget: int | None) -> str | None:
    """`Prober.fixed_advice` from the parameter bytes (shared with ``batchfit.estimation``)."""
    if mode != "train":
        parts, fixed = f"the weights alone need {format_bytes(weights)}", weights
    else:
        # AdamW (the default, and the Adam family) keeps two moments per trainable parameter.
        adam = optimizer is None or isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        state = 2 * trainable if adam else 0
        fixed = weights + trainable + state
        parts = (
            f"the weights ({format_bytes(weights)}), their gradients ({format_bytes(trainable)})"
            + (f" and AdamW's two moments ({format_bytes(state)})" if state else "")
            + f" alone need {format_bytes(fixed)}"
        )
    if budget is None or fixed <= budget:
        return None
    return (
        f"{parts[0].upper()}{parts[1:]}, more than the budget: lowering init_batch cannot help. Raise "
        "memory_limit, use a smaller model, or an optimizer with less state (SGD, or 8-bit/factored moments)."
    )

"""What a step holds and steps, and what a CPU probe may use (issue 32, items 5, 6 and 9).

Each answer is checked against an independent plain loop under the same live-tensor limit, or
against what the host has, never against batchfit's own numbers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchfit
from batchfit import examples
from tests.helpers import assert_same_state, state_of


# 5. The optimizer's parameters must be the model's ---------------------------------------------
def test_an_optimizer_over_another_models_parameters_is_refused() -> None:
    """Item 5: an AdamW built over another model's parameters stepped nothing of the probed
    model, allocated no state for it, and gave a larger answer (14 where the model's own AdamW
    gives 11). Refused before any trial, naming ``optimizer``, in find, in a factory that ignores
    the parameters it is given, and in the estimate; the model comes back as it was."""
    model, sample = examples.mlp()
    other, _ = examples.mlp(seed=1)
    before = state_of(model)
    started: list[int] = []
    with pytest.raises(ValueError, match=r"optimizer holds none of the model's .*trainable parameters"):
        batchfit.find(
            model,
            sample,
            memory_limit="16MiB",
            optimizer=torch.optim.AdamW(other.parameters()),
            on_trial_start=lambda b, k: started.append(b),
        )
    assert not started
    assert_same_state(before, state_of(model))
    with pytest.raises(ValueError, match="optimizer holds none of the model's"):
        batchfit.find(model, sample, memory_limit="16MiB", optimizer=lambda _: torch.optim.AdamW(other.parameters()))
    with pytest.raises(ValueError, match="optimizer holds none of the model's"):
        batchfit.estimate(model, sample, memory_limit="16MiB", optimizer=torch.optim.AdamW(other.parameters()))
    assert_same_state(before, state_of(model))


def test_an_optimizer_over_part_of_the_model_or_with_an_extra_tensor_is_the_models() -> None:
    """Item 5: a subset of the model's parameters (a frozen body, LoRA), the model's parameters
    with frozen ones among them, and the model's with an extra learnable tensor of the loss (a
    temperature) are all the model's optimizer: each probes as before."""
    model, sample = examples.mlp()
    body, head = list(model.parameters())[:-2], list(model.parameters())[-2:]
    for param in body:
        param.requires_grad_(False)
    temperature = nn.Parameter(torch.ones(()))
    for optimizer in (
        torch.optim.AdamW(head),
        torch.optim.AdamW(model.parameters()),
        torch.optim.AdamW([*head, temperature]),
    ):
        result = batchfit.find(
            model, sample, memory_limit="16MiB", optimizer=optimizer, max_batch=8, timed_steps=0, verify_steps=0
        )
        assert result.max_batch == 8


# 6. The output held through backward, or not ---------------------------------------------------
@dataclass
class LmOutput:
    """What a Hugging Face language model returns given labels: its own loss, and the logits."""

    loss: torch.Tensor
    logits: torch.Tensor


class WideHead(nn.Module):
    """A language model whose vocabulary-sized logits are a large share of a step's memory."""

    def __init__(self, vocab: int = 1024, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> LmOutput:
        logits = self.head(self.embed(input_ids))
        return LmOutput(F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits)


LIMIT = 3 * 2**20


def _plain_loop_trains(model: nn.Module, sample: dict[str, torch.Tensor], batch_size: int, keep_output: bool) -> bool:
    """Two steps of the loop users write, ``loss = model(**batch).loss; loss.backward();
    opt.step()`` (``keep_output``: ``out = model(**batch); out.loss.backward(); ...``, the output
    alive until the step ends), under the CPU meter's limit; whether they ran."""
    from batchfit.backends import LiveTensorMeter
    from batchfit.probe.batches import tile

    model = copy.deepcopy(model)
    held = [*model.parameters(), *model.buffers(), *sample.values()]
    meter = LiveTensorMeter(LIMIT, None, tensors=held)
    optimizer = torch.optim.AdamW(model.parameters())
    with meter.active(), meter.tracking():
        try:
            batch = tile(sample, batch_size, 2)
            for _ in range(2):
                out: Any = model(**batch)
                loss = out.loss
                if not keep_output:
                    del out
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
                out = None
        except torch.OutOfMemoryError:
            return False
    return True


def _plain_loop_max(model: nn.Module, sample: dict[str, torch.Tensor], keep_output: bool) -> int:
    """The plain loop's largest batch: doubling, then bisection (its memory grows with the batch)."""
    fits, fails = 1, 2
    while _plain_loop_trains(model, sample, fails, keep_output):
        fits, fails = fails, 2 * fails
    while fails - fits > 1:
        middle = (fits + fails) // 2
        fits, fails = (middle, fails) if _plain_loop_trains(model, sample, middle, keep_output) else (fits, middle)
    return fits


def test_the_models_own_loss_frees_its_output_before_backward_as_a_plain_loop_does() -> None:
    """Item 6: ``find()`` held the model's output through backward, while ``loss =
    model(**batch).loss`` (and Hugging Face's Trainer, and Lightning) frees it first: on a LoRA
    GPT-2, 26 trained where find() said 25. With the model's own loss (``output.loss``) the output
    is now freed before backward, and find's max is the plain loop's, exactly; a ``loss_fn`` that
    takes the output keeps it, as ``out = model(x); loss = crit(out, y)`` does, and its max is the
    holding loop's; ``step_fn`` frees what the function does not return. The result says which."""
    model = WideHead()
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids.clone()}
    freed, held = _plain_loop_max(model, sample, keep_output=False), _plain_loop_max(model, sample, keep_output=True)
    assert held < freed  # the scenario tells the two apart

    search_only = {"memory_limit": LIMIT, "timed_steps": 0, "verify_steps": 0}
    result = batchfit.find(model, sample, **search_only)
    assert result.max_batch == freed
    assert any("freed before backward" in note for note in result.notes), result.notes

    stepped = batchfit.find(model, sample, **search_only, step_fn=lambda m, batch: m(**batch).loss)
    assert stepped.max_batch == freed

    kept = batchfit.find(model, sample, **search_only, loss_fn=lambda out, batch: out.loss)
    assert kept.max_batch == held
    assert any("kept alive through backward" in note and "step_fn" in note for note in kept.notes), kept.notes


class OwnLossOnTensors(nn.Module):
    """A model that computes its own loss from a plain tensor (no ``labels`` key to guess by)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.linear(x)
        return {"loss": out.pow(2).mean(), "out": out}


def test_the_note_says_what_the_step_did_not_what_the_sample_suggests() -> None:
    """The note on the output comes from the first training step itself: a model that returns its
    own loss from a plain tensor (no ``labels`` to guess by) is said to have its output freed; the
    stand-in loss (the output's mean) keeps the output and is not said to free it."""
    search_only = {"memory_limit": "1MiB", "timed_steps": 0, "verify_steps": 0, "max_batch": 8}
    own = batchfit.find(OwnLossOnTensors(), torch.randn(2, 8), **search_only)
    assert any("freed before backward" in note for note in own.notes), own.notes
    stand_in = batchfit.find(nn.Linear(8, 8), torch.randn(2, 8), **search_only)
    assert not any("before backward" in note or "through backward" in note for note in stand_in.notes)


# 9. A CPU limit the host cannot spare ------------------------------------------------------------
def test_a_cpu_memory_limit_above_what_the_host_can_spare_is_clipped_with_a_note() -> None:
    """Item 9: the README's ``memory_limit="24GiB"`` on a 23.5 GiB machine was taken at its word
    and grew to 7.4 GB resident and climbing. A CPU limit above 3/4 of the host memory available
    is clipped to that, and the result says so; nothing near it is allocated here (max_batch=8)."""
    from batchfit.backends.host import total_host_bytes

    total = total_host_bytes()
    assert total is not None
    model, sample = examples.mlp()
    limit = 4 * total
    result = batchfit.find(model, sample, memory_limit=limit, max_batch=8, timed_steps=0, verify_steps=0)
    assert result.max_batch == 8
    assert result.budget_bytes is not None and result.budget_bytes <= 0.75 * total
    assert any("75% of the host memory available when the probe starts" in note for note in result.notes), result.notes

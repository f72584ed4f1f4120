"""Bad input gets one clear error each, before anything runs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import batchfit
from batchfit import examples


@pytest.fixture
def mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    return examples.mlp(in_features=8)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": "not a model"}, TypeError, "model must be a torch.nn.Module, got str"),
        (
            {"sample": {"x": torch.zeros(4, 8), "y": torch.zeros(3)}},
            ValueError,
            r"disagree on the batch size.*\['x'\].*4",
        ),
        ({"sample": torch.zeros(0, 8)}, ValueError, "is empty"),
        ({"sample": {"mask": None, "ids": []}}, ValueError, "holds no tensor"),
        ({"sample": torch.tensor(3.0)}, ValueError, "0-dim tensor"),
        ({"sample": None}, TypeError, "pass exactly one of sample="),
        ({"make_batch": lambda b: torch.zeros(b, 8)}, TypeError, "either sample or make_batch"),
        ({"memory_limit": -5}, ValueError, "positive number of bytes"),
        ({"memory_limit": "lots"}, ValueError, "'lots' is not a size"),
        ({"memory_limit": "3 parsecs"}, ValueError, "unknown unit"),
        ({"memory_limit": 1.5}, ValueError, r"fraction 1.5 must be in \(0, 1\]"),
        ({"memory_limit": [1]}, TypeError, "memory_limit must be bytes"),
        ({"init_batch": 64, "max_batch": 32}, ValueError, "max_batch=32 is smaller than init_batch=64"),
        ({"init_batch": 0}, ValueError, "init_batch must be >= 1"),
        ({"max_batch": 2.5}, TypeError, "max_batch must be an int"),
        ({"multiple_of": 8, "init_batch": 12}, ValueError, "init_batch=12 must be a multiple of multiple_of=8"),
        ({"mode": "serve"}, ValueError, "mode must be one of 'train', 'inference', 'eval', 'generate'"),
        ({"amp": "fp8"}, ValueError, "amp must be one of None, 'bf16', 'fp16'"),
        ({"headroom": 1.0}, ValueError, "headroom must be a fraction"),
        ({"steps_per_trial": 0}, ValueError, "steps_per_trial must be >= 1"),
        ({"optimizer": "adam"}, TypeError, "optimizer must be a torch.optim.Optimizer"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable"),
        (
            {"loss_fn": lambda o, b: o.sum(), "step_fn": lambda m, b: m(b).sum()},
            ValueError,
            "pass one of loss_fn, step_fn and criterion, not loss_fn and step_fn",
        ),
        ({"device": "tpu"}, ValueError, "'tpu' is not a device torch knows"),
        ({"device": "cuda:0"}, ValueError, "CUDA is not available"),
        ({"strategy": "guess"}, ValueError, "unknown search strategy 'guess'"),
        ({"callback": "print"}, TypeError, "callback must be callable"),
        ({"time_budget": -1}, ValueError, "time_budget must be a positive, finite number"),
        ({"memory_limit": "1."}, ValueError, "memory_limit '1.' is ambiguous"),
    ],
)
def test_bad_input_is_named(
    mlp: tuple[torch.nn.Module, torch.Tensor], kwargs: dict[str, Any], error: type, match: str
) -> None:
    if kwargs.get("device") == "cuda:0" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model, sample = mlp
    arguments: dict[str, Any] = {"model": model, "sample": sample, "memory_limit": "64MiB"}
    arguments.update(kwargs)
    if "make_batch" in kwargs and "sample" not in kwargs:
        arguments["sample"] = sample
    with pytest.raises(error, match=match):
        batchfit.find(arguments.pop("model"), arguments.pop("sample"), **arguments)


def test_loss_that_does_not_require_grad_is_named(mlp: tuple[torch.nn.Module, torch.Tensor]) -> None:
    model, sample = mlp
    with pytest.raises(ValueError, match="the loss does not require grad") as info:
        batchfit.find(model, sample, loss_fn=lambda out, batch: out.detach().sum(), memory_limit="64MiB")
    assert any("batch size 2" in note for note in info.value.__notes__)


def test_output_without_tensors_is_named() -> None:
    with pytest.raises(TypeError, match="cannot derive a loss from a model output of type str"):
        batchfit.find(_Stringly(), torch.zeros(2, 3), memory_limit="64MiB")


class _Stringly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> str:
        return "logits"


def test_make_batch_of_the_wrong_size_is_named(mlp: tuple[torch.nn.Module, torch.Tensor]) -> None:
    model, _ = mlp
    with pytest.raises(ValueError, match=r"make_batch\(2\) returned a batch of size 3"):
        batchfit.find(model, make_batch=lambda b: torch.zeros(b + 1, 8), memory_limit="64MiB")


def test_unsupported_device_is_named() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'cpu', 'cuda', 'xpu' devices; 'mps' is not supported"):
        batchfit.find(model, torch.zeros(2, 2), device="mps")


def test_a_model_or_sample_without_data_is_named() -> None:
    with pytest.raises(ValueError, match=r"model's weight is on the meta device.*to_empty"):
        batchfit.find(torch.nn.Linear(2, 2).to("meta"), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"sample\[1\] is on the meta device"):
        batchfit.find(torch.nn.Linear(2, 2), (torch.zeros(2, 2), torch.zeros(2, 2, device="meta")))


def test_lazy_modules_are_named_before_any_trial() -> None:
    with pytest.raises(ValueError, match=r"weight is an uninitialized lazy parameter.*run one forward"):
        batchfit.find(torch.nn.LazyLinear(4), torch.zeros(2, 8))


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_find_trains_even_when_called_with_gradients_off(mlp: tuple[torch.nn.Module, torch.Tensor], context) -> None:
    model, sample = mlp
    with context():
        result = batchfit.find(model, sample, memory_limit="64MiB", max_batch=16, verify_steps=0)
    assert result.max_batch == 16 and result.memory is not None and result.memory.optimizer_state_bytes > 0


def test_a_sample_that_requires_grad_is_detached_and_untouched() -> None:
    model = torch.nn.Linear(8, 2)
    sample = torch.randn(2, 8, requires_grad=True)
    original = sample.detach().clone()
    result = batchfit.find(model, sample, memory_limit="8MiB", max_batch=8, verify_steps=0)
    assert result.max_batch == 8
    assert sample.grad is None and torch.equal(sample.detach(), original)


def test_an_optimizer_factory_returning_none_is_named_before_any_trial(
    mlp: tuple[torch.nn.Module, torch.Tensor],
) -> None:
    model, sample = mlp
    started: list[int] = []
    with pytest.raises(TypeError, match="optimizer factory returned NoneType") as info:
        batchfit.find(model, sample, optimizer=lambda params: None, on_trial_start=lambda b, k: started.append(b))
    assert not started and not getattr(info.value, "__notes__", None)


def test_a_nothing_fits_error_from_a_callback_is_not_rewritten(mlp: tuple[torch.nn.Module, torch.Tensor]) -> None:
    model, sample = mlp
    mine = batchfit.NothingFitsError(12345, cause="raised by my callback")

    def callback(trial: batchfit.Trial) -> None:
        raise mine

    with pytest.raises(batchfit.NothingFitsError) as info:
        batchfit.find(model, sample, memory_limit="64MiB", callback=callback)
    assert info.value is mine


def test_nothing_fits_says_when_the_fixed_memory_alone_is_over_the_budget() -> None:
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: with grads and AdamW, 16 MiB before any batch
    with pytest.raises(batchfit.NothingFitsError, match="lowering init_batch cannot help") as info:
        batchfit.find(model, torch.zeros(2, 1024), memory_limit="10MiB")
    assert "Lower init_batch" not in str(info.value)


def test_frozen_model_cannot_train(mlp: tuple[torch.nn.Module, torch.Tensor]) -> None:
    model, sample = mlp
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        batchfit.find(model, sample, memory_limit="64MiB")
    assert batchfit.find(model, sample, memory_limit="64MiB", mode="inference", max_batch=8).max_batch == 8


# Integral numbers that are not Python ints (issue 32, item 11) --------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        pytest.param(np.int64, id="numpy int64"),
        pytest.param(lambda n: np.arange(n, n + 1)[0], id="an element of np.arange"),
        pytest.param(torch.tensor, id="0-d int tensor"),
    ],
)
def test_an_integral_number_is_taken_as_the_int_it_holds(value: Any) -> None:
    options = batchfit.Options(max_batch=value(8), multiple_of=value(2), seq_len=value(16), verify_steps=value(0))

    assert (options.max_batch, options.multiple_of, options.seq_len, options.verify_steps) == (8, 2, 16, 0)
    assert {type(options.max_batch), type(options.multiple_of), type(options.seq_len)} == {int}


def test_find_takes_numpy_sizes_and_answers_in_ints() -> None:
    model = torch.nn.Linear(8, 2)

    result = batchfit.find(
        model, torch.zeros(2, 8), memory_limit="8MiB", init_batch=np.int64(2), max_batch=np.int64(8), verify_steps=0
    )

    assert result.max_batch == 8
    assert type(result.settings.init_batch) is int and type(result.settings.max_batch) is int
    assert batchfit.Result.from_json(result.to_json()) == result


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "bool True"),
        (np.bool_(True), "True"),
        (torch.tensor(True), "tensor(True)"),
        (torch.tensor([8]), "tensor([8])"),
        (torch.tensor(8.0), "tensor(8.)"),
        (torch.tensor(8, device="meta"), "meta"),
        (8.0, "float 8.0"),
    ],
)
def test_a_bool_or_a_non_integral_number_is_not_an_int(value: Any, shown: str) -> None:
    with pytest.raises(TypeError, match="max_batch must be an int") as raised:
        batchfit.Options(max_batch=value)
    assert shown in str(raised.value)


def test_a_make_batch_of_meta_tensors_is_named_by_find() -> None:
    """``find(make_batch=...)`` building meta tensors: the batch and what to do, not torch's raw
    "Cannot copy out of meta tensor" (issue 32)."""
    model = torch.nn.Linear(8, 2)
    with pytest.raises(ValueError, match=r"make_batch\(2\) is on the meta device.*build the batches on the CPU"):
        batchfit.find(model, make_batch=lambda b: torch.randn(b, 8, device="meta"), memory_limit="1MiB", device="cpu")

"""estimate(): find()'s answer traced on fake tensors, checked against find() on real models."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import ItemGate, hf_sample, tiny_llama
from torch import nn

import batchfit
from batchfit import examples

MiB = 2**20


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Real steps (find(), the fallback) on one thread: memory does not depend on it, and on a
    2-core machine shared with other jobs two spinning threads per step are many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Models ------------------------------------------------------------------------------------------
def _tiny_gpt2() -> tuple[nn.Module, Any]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    return transformers.GPT2LMHeadModel(config), hf_sample()


def _tiny_bert() -> tuple[nn.Module, Any]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=128,
        num_labels=2,
    )
    ids = hf_sample()["input_ids"]
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}
    return transformers.BertForSequenceClassification(config), sample


def _tiny_bert_padded() -> tuple[nn.Module, Any]:
    # A padded position: transformers keeps the attention mask on real tensors too (with an all-ones
    # mask it drops it after checking the values, which a fake trace cannot do; see below).
    model, sample = _tiny_bert()
    sample["attention_mask"][:, -1] = 0
    return model, sample


# name: (factory, memory). The HF models are built from a config: nothing is downloaded.
EXACT: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], str]] = {
    "mlp": (examples.mlp, "32MiB"),
    "cnn": (examples.cnn, "64MiB"),
    "gpt": (examples.gpt, "64MiB"),
    "hf-gpt2": (_tiny_gpt2, "128MiB"),
    "hf-llama": (tiny_llama, "128MiB"),
    "hf-bert-padded": (_tiny_bert_padded, "64MiB"),
}


@functools.cache
def _find_and_estimate(name: str) -> tuple[batchfit.Result, batchfit.Result]:
    """find() and estimate() of one model at one memory size (cached: several tests read them)."""
    factory, memory = {**EXACT, "hf-bert": (_tiny_bert, "64MiB")}[name]
    model, sample = factory()
    found = batchfit.find(model, sample, memory_limit=memory)
    model, sample = factory()
    return found, batchfit.estimate(model, sample, memory_limit=memory)


def _memory_record(trial: batchfit.Trial) -> tuple[Any, ...]:
    """Everything a trial says about memory and outcome (not its timing)."""
    return (
        trial.batch_size,
        trial.kind,
        trial.fits,
        trial.phase,
        trial.steps,
        trial.peak_bytes,
        trial.phase_peaks,
        trial.reserved_peak_bytes,
        trial.phase_reserved_peaks,
        trial.leaked_bytes,
    )


class MaskSelect(nn.Module):
    """Selects the positive activations (``x[x > 0]``): an output shape that depends on values."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(256, 512)
        self.out = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h).sum() + h[h > 0].sum()


DATA_DEPENDENT = {
    "item": (ItemGate, "DataDependentOutputException"),
    "nonzero": (MaskSelect, "DynamicOutputShapeException"),
}


# 1. On the CPU the estimate is find()'s measurement, byte for byte ---------------------------------
def _probed(result: batchfit.Result) -> list[batchfit.Trial]:
    """The trials an estimate runs too, as it runs them: find() also times sizes warm ("time"
    trials, ``batchfit.probe.timing``) and, on the CPU, runs the safe batch's verification
    `timed_steps` steps longer, timed without the meter, which fake tensors cannot (the memory is
    its first `verify_steps` steps')."""
    verify = result.settings.verify_steps
    return [
        replace(t, steps=verify) if t.kind == "verify" and t.steps > verify else t
        for t in result.trials
        if t.kind != "time"
    ]


# Seconds each: the MLP stays in the fast set, the rest run with the slow tests.
@pytest.mark.parametrize("name", [n if n == "mlp" else pytest.param(n, marks=pytest.mark.slow) for n in EXACT])
def test_cpu_estimate_equals_find_byte_for_byte(name: str) -> None:
    found, estimated = _find_and_estimate(name)
    assert found.boundary_reached and found.max_batch > 4, f"{name}: pick a memory size with a real boundary"

    assert estimated.max_batch == found.max_batch
    assert estimated.safe_batch == found.safe_batch
    assert estimated.budget_bytes == found.budget_bytes
    assert estimated.boundary_reached and estimated.stop_reason == found.stop_reason
    assert [_memory_record(t) for t in estimated.trials] == [_memory_record(t) for t in _probed(found)]
    assert estimated.memory == found.memory


@pytest.mark.slow
def test_a_model_left_in_eval_mode_is_estimated_as_it_trains() -> None:
    """find() trains with train() on (dropout and all); so does the estimate, and the flags come back."""
    model, sample = examples.gpt()
    model.eval()
    estimate = batchfit.estimate(model, sample, memory_limit="64MiB")
    assert not model.training and not any(m.training for m in model.modules())
    real = batchfit.find(model, sample, memory_limit="64MiB")
    assert [(t.batch_size, t.peak_bytes) for t in estimate.trials] == [
        (t.batch_size, t.peak_bytes) for t in _probed(real)
    ]


@pytest.mark.slow
def test_bert_estimate_is_within_one_percent_of_find() -> None:
    # With an all-ones attention mask the real step drops the mask after looking at its values;
    # the fake trace cannot look and keeps it (a bool batch x 128 x 128: 16 KiB a sample), so the
    # estimate is a little above find() (+0.57% at the boundary), on the safe side.
    found, estimated = _find_and_estimate("hf-bert")
    assert found.boundary_reached
    assert estimated.max_batch == found.max_batch
    assert [(t.batch_size, t.kind, t.fits) for t in estimated.trials] == [
        (t.batch_size, t.kind, t.fits) for t in _probed(found)
    ]
    for real, fake in zip(_probed(found), estimated.trials):
        assert real.peak_bytes is not None and fake.peak_bytes is not None
        assert real.peak_bytes <= fake.peak_bytes <= 1.01 * real.peak_bytes, (real.batch_size, real.kind)


# 2. The result says it is an estimate -------------------------------------------------------------
@pytest.mark.slow
def test_the_result_says_it_is_an_estimate() -> None:
    found, estimated = _find_and_estimate("gpt")
    assert estimated.estimated is True and found.estimated is False
    assert estimated.assumptions and not found.assumptions
    assert "ESTIMATE" in str(estimated).splitlines()[0]
    assert "ESTIMATE" not in str(found)
    assert all(f"assumes: {line}" in str(estimated) for line in estimated.assumptions)
    assert all(t.samples_per_s is None and t.step_time_s is None and t.step_times_s == () for t in estimated.trials)
    assert estimated.throughput is None and found.throughput is not None
    assert estimated.device.name == "estimate for cpu"
    assert estimated.device.total_bytes == 64 * MiB

    again = batchfit.Result.from_json(estimated.to_json())
    assert again.estimated is True and again.assumptions == estimated.assumptions


# 3. The model is left as it was -------------------------------------------------------------------
def _prepared(name: str) -> tuple[nn.Module, Any]:
    if name == "fallback":  # real CPU steps (the fallback): dropout draws random numbers
        torch.manual_seed(0)
        model: nn.Module = ItemGate()
        sample: Any = torch.randn(4, 256)
    else:
        model, sample = {"gpt": examples.gpt, "cnn": examples.cnn}[name]()
    # Gradients from an earlier step, a frozen parameter and mixed train/eval flags: all must stay.
    first = next(model.parameters())
    first.requires_grad_(False)
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.randn_like(param)
    model.train()
    list(model.children())[-1].eval()
    return model, sample


@pytest.mark.parametrize("name", ["gpt", "cnn", "fallback"])
def test_the_model_is_left_untouched(name: str) -> None:
    model, sample = _prepared(name)
    slots = dict(model.state_dict(keep_vars=True))
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    flags = {n: m.training for n, m in model.named_modules()}
    requires = {n: p.requires_grad for n, p in model.named_parameters()}
    values = copy.deepcopy(model)
    torch.manual_seed(1234)
    rng = torch.random.get_rng_state()

    result = batchfit.estimate(model, sample, memory_limit="16MiB", max_batch=256)

    assert result.max_batch >= 2
    assert any("ran real CPU steps" in line for line in result.assumptions) == (name == "fallback")
    assert torch.equal(torch.random.get_rng_state(), rng), "the CPU RNG state changed"
    after = dict(model.state_dict(keep_vars=True))
    assert after.keys() == slots.keys()
    for key, tensor in slots.items():
        assert after[key] is tensor, f"{key} was replaced"
    for key, tensor in values.state_dict(keep_vars=True).items():
        assert torch.equal(after[key], tensor), f"{key} changed"
        assert after[key].device == tensor.device and after[key].dtype == tensor.dtype
    for param_name, param in model.named_parameters():
        if name != "fallback":  # real steps (find's Prober) put back a copy of each gradient
            assert param.grad is grads[param_name], f"the gradient of {param_name} was replaced"
        assert (param.grad is None) == (grads[param_name] is None)
        if param.grad is not None:
            assert torch.equal(param.grad, grad_values[param_name]), f"the gradient of {param_name} changed"
    assert {n: p.requires_grad for n, p in model.named_parameters()} == requires
    assert {n: m.training for n, m in model.named_modules()} == flags
    if name == "gpt":
        assert model.head.weight is model.token.weight, "the tied weight came apart"


# 4. A model on the meta device --------------------------------------------------------------------
@pytest.mark.slow
def test_a_meta_model_estimates_as_its_real_twin() -> None:
    real, sample = examples.gpt()
    with torch.device("meta"):
        meta = examples.GPT(vocab_size=512, seq_len=64, d_model=128, n_layers=2, n_heads=4)
    on_meta = batchfit.estimate(meta, sample, memory_limit="64MiB")
    with_weights = batchfit.estimate(real, sample, memory_limit="64MiB")

    assert on_meta.max_batch == with_weights.max_batch == _find_and_estimate("gpt")[0].max_batch
    assert on_meta.safe_batch == with_weights.safe_batch
    assert [_memory_record(t) for t in on_meta.trials] == [_memory_record(t) for t in with_weights.trials]
    assert all(t.device.type == "meta" for t in [*meta.parameters(), *meta.buffers()])
    assert meta.head.weight is meta.token.weight


@pytest.mark.slow
def test_a_large_meta_model_is_estimated_without_its_weights() -> None:
    with torch.device("meta"):
        model = examples.GPT(vocab_size=32000, seq_len=256, d_model=1024, n_layers=8, n_heads=16)
    params = sum(p.numel() for p in model.parameters())  # the tied embedding and head counted once
    assert params > 100_000_000
    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(0))

    result = batchfit.estimate(model, {"input_ids": ids, "labels": ids.clone()}, memory_limit="64GiB")

    assert result.max_batch >= 1 and result.boundary_reached
    assert result.memory is not None
    assert result.memory.weights_bytes == 4 * params
    assert result.memory.gradient_bytes == 4 * params
    # Weights, gradients and AdamW's two moments are in every peak; the boundary's peak fits.
    assert all(t.peak_bytes >= 4 * 4 * params for t in result.trials if t.fits and t.kind == "search")
    assert result.trial(result.max_batch).peak_bytes <= 64 * 2**30 < result.trial(result.max_batch + 1).peak_bytes
    assert all(t.device.type == "meta" for t in model.parameters())


# 5. Data-dependent models fall back to real steps, and say so -------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DATA_DEPENDENT))
def test_a_data_dependent_model_under_the_fallback_cap_gets_finds_own_answer(kind: str) -> None:
    cls, error = DATA_DEPENDENT[kind]
    torch.manual_seed(0)
    model, sample = cls(), torch.randn(4, 256)
    result = batchfit.estimate(model, sample, memory_limit="32MiB")
    real = batchfit.find(model, sample, memory_limit="32MiB")

    assert result.estimated is True
    said = [line for line in result.assumptions if "ran real CPU steps" in line]
    assert len(said) == 1 and error in said[0] and error + ": " + error not in said[0]
    assert (result.max_batch, result.safe_batch) == (real.max_batch, real.safe_batch)
    assert all(t.step_time_s is None for t in result.trials) and result.throughput is None


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DATA_DEPENDENT))
def test_a_data_dependent_model_above_the_cap_is_extrapolated_from_real_steps(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real steps up to the cap, the memory line read off them, and said so: checked against a
    real probe at the full budget."""
    import batchfit.estimation.estimator

    cls, error = DATA_DEPENDENT[kind]
    torch.manual_seed(0)
    model, sample = cls(), torch.randn(4, 256)
    monkeypatch.setattr(batchfit.estimation.estimator, "FALLBACK_CAP", 12 * MiB)
    result = batchfit.estimate(model, sample, memory_limit="48MiB")
    real = batchfit.find(model, sample, memory_limit="48MiB")

    said = [line for line in result.assumptions if "extrapolated" in line]
    assert len(said) == 1 and error in said[0]
    assert not result.boundary_reached and not result.safe_verified
    assert max(t.peak_bytes or 0 for t in result.trials if t.fits) <= 12 * MiB  # no real step above the cap
    memory, budget = result.memory, result.budget_bytes
    assert memory is not None and budget == 48 * MiB
    assert memory.predict(result.max_batch) <= budget < memory.predict(result.max_batch + 1)
    assert result.safe_batch <= result.max_batch
    # Read off sizes that show the per-sample bytes, the line lands near the real boundary.
    assert abs(result.max_batch - real.max_batch) <= 0.05 * real.max_batch


@pytest.mark.parametrize("kind", list(DATA_DEPENDENT))
def test_a_data_dependent_model_on_meta_is_refused(kind: str) -> None:
    cls, _ = DATA_DEPENDENT[kind]
    with torch.device("meta"):
        model = cls()
    with pytest.raises(ValueError, match="meta"):
        batchfit.estimate(model, torch.randn(4, 256), memory_limit="32MiB")


# 6. Estimates for CUDA: the caching allocator, modelled --------------------------------------------
def _check_reserved_trials(result: batchfit.Result) -> None:
    budget = result.budget_bytes
    assert budget is not None
    assert result.budget_counts == "reserved"
    assert result.memory is not None and result.memory.unit == "reserved"
    fitted = [t for t in result.trials if t.fits]
    assert fitted and any(not t.fits for t in result.trials)
    for trial in fitted:
        assert trial.reserved_peak_bytes is not None and trial.peak_bytes is not None
        assert trial.peak_bytes <= trial.reserved_peak_bytes <= budget
        # Segments are whole multiples of 2 MiB; the two cuBLAS workspaces (2 x 33 MiB) are held.
        assert trial.reserved_peak_bytes % (2 * MiB) == 0
        assert trial.peak_bytes >= 66 * MiB + result.memory.weights_bytes
    assert all(t.reserved_peak_bytes > (t.cap_bytes or budget) for t in result.trials if not t.fits)
    assert any("cuBLAS" in line for line in result.assumptions)


@pytest.mark.slow
def test_a_cuda_estimate_counts_reserved_bytes_beside_the_context() -> None:
    model, sample = examples.gpt()
    result = batchfit.estimate(model, sample, memory_limit="1280MiB", for_device="cuda")
    # The context is assumed at the top of CUDA 12's 0.5-1 GiB, and the line says the range.
    assert result.budget_bytes == 1280 * MiB - 1024 * MiB
    context = [line for line in result.assumptions if "outside the allocator" in line]
    assert len(context) == 1 and "1.00 GiB of the 1.25 GiB" in context[0]
    assert "512.00 MiB to 1.00 GiB under CUDA 12" in context[0] and "reserve=" in context[0]
    assert result.device.name == "estimate for cuda" and result.device.total_bytes == 1280 * MiB
    assert result.boundary_reached
    _check_reserved_trials(result)


@pytest.mark.slow
def test_a_cuda_estimate_fits_no_more_than_the_cpu_one() -> None:
    model, sample = examples.gpt()
    cuda = batchfit.estimate(model, sample, memory_limit="256MiB", for_device="cuda", reserve=0)
    cpu = batchfit.estimate(model, sample, memory_limit="256MiB")
    assert cuda.budget_bytes == 256 * MiB
    assert not any("outside the allocator" in line for line in cuda.assumptions)
    _check_reserved_trials(cuda)
    assert cpu.budget_counts == "allocated" and cpu.boundary_reached
    assert 1 <= cuda.max_batch <= cpu.max_batch


def _weighty_gpt() -> tuple[nn.Module, Any]:
    """A GPT whose weights outweigh one short sequence's activations: the step's own blocks then
    reach past what the backward leaves cached, and show in reserved bytes."""
    return examples.gpt(vocab_size=1024, d_model=256, n_layers=4, seq_len=16)


@functools.cache
def _first_step(optimizer: str, device: str = "cuda") -> tuple[tuple[str, ...], int, int]:
    """The assumptions and the step phase's (allocated, reserved) peaks of the first trial at batch 1."""
    model, sample = _weighty_gpt()
    chosen = {
        "default": None,
        "object": torch.optim.AdamW(model.parameters(), lr=1e-3),  # rebuilt over the fakes by the estimate
        "factory": lambda params: torch.optim.AdamW(params, lr=1e-3),
        "foreach": lambda params: torch.optim.AdamW(params, foreach=True),
        "loop": lambda params: torch.optim.AdamW(params, foreach=False),
    }[optimizer]
    result = batchfit.estimate(
        model, sample, memory_limit="4GiB", for_device=device, reserve=0, optimizer=chosen, init_batch=1, max_batch=1
    )
    trial = result.trials[0]
    assert trial.batch_size == 1 and trial.fits and trial.phase_reserved_peaks is not None
    return result.assumptions, dict(trial.phase_peaks)["step"], dict(trial.phase_reserved_peaks)["step"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["default", "object", "factory"])
def test_a_cuda_estimate_steps_an_optimizer_that_leaves_foreach_to_torch_as_cuda_does(optimizer: str) -> None:
    """On CUDA torch resolves foreach=None to the foreach implementation, whose step keeps AdamW's
    sqrt(exp_avg_sq) of every parameter live at once; the CPU's for-loop keeps one parameter's."""
    model, _ = _weighty_gpt()
    trainable = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    intermediates = sum(-(-size // 512) * 512 for size in trainable)  # one block each, 512-byte rounding
    # Where the loop peaks it holds two of the largest parameter's temporaries (its sqrt, the quotient).
    expected_gain = intermediates - 2 * max(trainable)
    assumed, allocated, reserved = _first_step(optimizer)
    _, loop_allocated, loop_reserved = _first_step("loop")
    assert allocated - loop_allocated == pytest.approx(expected_gain, abs=64 * 1024)
    assert expected_gain - 2 * MiB <= reserved - loop_reserved <= intermediates + 2 * MiB  # 2 MiB segments
    assert (allocated, reserved) == _first_step("foreach")[1:]
    assert any(line.startswith("foreach optimizer as on CUDA: AdamW") for line in assumed)


@pytest.mark.slow
def test_an_optimizer_that_chose_foreach_or_a_cpu_estimate_assumes_nothing_about_it() -> None:
    for chosen, device in [("loop", "cuda"), ("foreach", "cuda"), ("default", "cpu")]:
        assumed, _, _ = _first_step(chosen, device)
        assert not any("foreach" in line for line in assumed), (chosen, device)
    # The CPU steps the loop, as torch does there.
    assert _first_step("default", "cpu")[1] < _first_step("foreach", "cpu")[1]


@pytest.mark.slow
def test_a_rocm_estimate_holds_hipblas_workspaces_on_a_cuda_device() -> None:
    """ROCm is torch's cuda device with hipBLAS (128 MiB on MI300/MI350) and hipBLASLt (76 MiB)
    workspaces per handle in place of cuBLAS's 32 MiB and cuBLASLt's 1 MiB."""
    model, sample = examples.gpt()
    sizes = {"init_batch": 8, "max_batch": 8}  # the same trials on both, to compare them one by one
    cuda = batchfit.estimate(model, sample, memory_limit="2GiB", for_device="cuda", reserve=0, **sizes)
    rocm = batchfit.estimate(model, sample, memory_limit="2GiB", for_device="rocm", reserve=0, **sizes)
    # Each workspace over 10 MiB is a segment of its own; cuBLASLt's two 1 MiB blocks share one of 2 MiB.
    extra = 2 * (128 + 76) * MiB - (2 * 32 + 2) * MiB
    assert [(t.batch_size, t.kind) for t in rocm.trials] == [(t.batch_size, t.kind) for t in cuda.trials]
    for on_rocm, on_cuda in zip(rocm.trials, cuda.trials):
        assert on_rocm.reserved_peak_bytes - on_cuda.reserved_peak_bytes == extra  # type: ignore[operator]
        assert on_rocm.peak_bytes - on_cuda.peak_bytes == 2 * (128 + 76 - 33) * MiB  # type: ignore[operator]
    assert any("hipBLASLt" in line and "76.00 MiB" in line for line in rocm.assumptions)
    assert not any("cuBLAS workspaces" in line for line in rocm.assumptions)
    assert any(line.startswith("foreach optimizer as on CUDA") for line in rocm.assumptions)
    assert (rocm.device.type, rocm.device.name) == ("cuda", "estimate for rocm")
    assert batchfit.Result.from_json(rocm.to_json()).device.type == "cuda"
    # The context outside the allocator is CUDA's, assumed, and said to be so.
    default = batchfit.estimate(model, sample, memory_limit="2GiB", for_device="rocm", **sizes)
    assert default.budget_bytes == 1024 * MiB
    assert any("not measured under ROCm" in line for line in default.assumptions)


# 7. Bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"memory_limit": "1GiB", "device": "tpu"}, ValueError, "device", id="device-tpu"),
        pytest.param({"memory_limit": 0.5}, TypeError, "memory", id="memory-float"),
        pytest.param({"memory_limit": True}, TypeError, "memory", id="memory-bool"),
        pytest.param({"memory_limit": "-1GiB"}, ValueError, "not a size", id="memory-negative"),
        pytest.param({"memory_limit": "lots"}, ValueError, "not a size", id="memory-garbage"),
        pytest.param({"memory_limit": "8 parsecs"}, ValueError, "unknown unit", id="memory-unit"),
        pytest.param({"memory_limit": 0}, ValueError, "positive", id="memory-zero"),
        pytest.param({"memory_limit": "1GiB", "reserve": "auto"}, ValueError, "auto", id="reserve-auto"),
        pytest.param({"memory_limit": "1GiB", "reserve": "lots"}, ValueError, "reserve", id="reserve-garbage"),
        pytest.param({"memory_limit": "1GiB", "device": "cuda"}, ValueError, "leaves nothing", id="context-too-big"),
        pytest.param({"memory_limit": "1GiB", "sample": None}, TypeError, "sample", id="no-sample"),
        pytest.param(
            {"memory_limit": "1GiB", "make_batch": lambda size: torch.randn(size, 256)}, TypeError, "sample", id="both"
        ),
        pytest.param({"memory_limit": "1GiB", "model": "not a model"}, TypeError, "Module", id="not-a-module"),
    ],
)
def test_bad_input_is_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    model, sample = examples.mlp()
    arguments: dict[str, Any] = {"model": model, "sample": sample, **kwargs}
    with pytest.raises(error, match=match):
        batchfit.estimate(arguments.pop("model"), arguments.pop("sample"), **arguments)


# 8. Nothing fits ----------------------------------------------------------------------------------
def test_nothing_fits_below_the_weights_with_finds_advice() -> None:
    model, sample = examples.mlp()
    with pytest.raises(batchfit.NothingFitsError) as real:
        batchfit.find(model, sample, memory_limit="1MiB")
    with pytest.raises(batchfit.NothingFitsError, match="weights") as fake:
        batchfit.estimate(model, sample, memory_limit="1MiB")
    assert fake.value.advice is not None and "weights" in fake.value.advice
    assert fake.value.advice == real.value.advice
    assert str(fake.value) == str(real.value)
    assert (fake.value.batch_size, fake.value.budget_bytes, fake.value.needed_bytes) == (
        real.value.batch_size,
        1 * MiB,
        real.value.needed_bytes,
    )

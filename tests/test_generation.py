"""Generation as a probe (issue 36): `find(mode="generate")`, its frontier and estimate, and bad input.

The truths are independent of the probe: the KV cache's bytes per token are the model's own
arithmetic (2 x layers x KV heads x head size x element size); a plain `model.generate` of every
new token, run under the same live-tensor meter outside any probe, peaks where the probe's trial at
that size does; and the boundary is the one trial-by-trial sizes show.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit.backends.cpu import LiveTensorMeter
from tests.helpers import assert_same_state, state_of

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Any:
    """transformers' warnings about the tiny configs, silenced for these tests only (set at import,
    the verbosity would silence the other tests' loggers under ``transformers`` too)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)

NEW_TOKENS = 12


def _gpt2(positions: int = 128) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=positions, bos_token_id=0, eos_token_id=1
    )
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    return transformers.LlamaForCausalLM(config)


def _prompts(length: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 100, (1, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _plain_generate_peak(model: nn.Module, prompts: dict[str, torch.Tensor], rows: int, new_tokens: int) -> int:
    """The peak live bytes of a plain greedy `generate` of every new token for ``rows`` copies of
    ``prompts``, outside any probe (the prompts held too, as the probe holds its sample)."""
    model.eval()
    batch = {key: value.repeat(rows, 1) for key, value in prompts.items()}
    held = [*model.parameters(), *model.buffers(), *prompts.values(), *batch.values()]
    meter = LiveTensorMeter(None, None, tensors=held)
    with meter.tracking(), torch.inference_mode():
        meter.begin_trial()
        with meter.phase("forward"):
            out = model.generate(
                **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            assert out.shape[-1] == batch["input_ids"].shape[-1] + new_tokens
            del out
    return max(meter.phase_peaks().values())


@pytest.mark.parametrize("build", [_gpt2, pytest.param(_llama, marks=pytest.mark.slow)], ids=["gpt2", "llama"])
def test_generation_sizes_a_real_generate_of_every_token(build: Any) -> None:
    model = build()
    model.config.use_cache = False  # the model's own setting: generation is sized with its cache, then this comes back
    before = state_of(model)
    config_before = model.generation_config.to_dict()
    prompts = _prompts()
    result = batchfit.find(
        model, prompts, mode="generate", max_new_tokens=NEW_TOKENS, memory_limit="2MiB", timed_steps=0
    )
    assert_same_state(before, state_of(model))  # weights, flags, RNG: nothing lost
    assert model.generation_config.to_dict() == config_before and model.config.use_cache is False
    assert result.boundary_reached and result.settings.mode == "generate"
    generation = result.generation
    assert generation is not None
    assert (generation.prompt_tokens, generation.new_tokens, generation.context_tokens) == (8, NEW_TOKENS, 20)
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_size = config.hidden_size // config.num_attention_heads
    assert generation.kv_bytes_per_token == 2 * config.num_hidden_layers * heads * head_size * 4
    # The trial at the boundary is a plain generate, byte for byte; one more row does not fit.
    at_max = result.trial(result.max_batch)
    assert at_max is not None and at_max.fits
    assert _plain_generate_peak(model, prompts, result.max_batch, NEW_TOKENS) == at_max.peak_bytes
    above = result.trial(result.max_batch + 1)
    assert above is not None and not above.fits
    # The equation in (batch, context) gives the boundary's peak back, and grows by the KV cache per token.
    predicted = generation.predict_bytes(result.max_batch)
    assert predicted is not None and abs(predicted - at_max.peak_bytes) <= 0.02 * at_max.peak_bytes
    longer = generation.predict_bytes(result.max_batch, 40)
    assert longer is not None
    assert longer - predicted == pytest.approx(result.max_batch * 20 * generation.kv_bytes_per_token)
    assert "generation" in str(result) and "KV cache" in str(result)


def test_stopping_is_disabled_so_an_early_end_of_sequence_cannot_make_a_size_look_safe() -> None:
    model, prompts = _gpt2(), _prompts()
    first = model.generate(**prompts, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1]
    model.generation_config.eos_token_id = int(first)  # greedy's first new token now ends the sequence
    stopping = model.generate(**prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert stopping.shape[-1] < 8 + NEW_TOKENS  # a plain generate stops early here
    result = batchfit.find(
        model, prompts, mode="generate", max_new_tokens=NEW_TOKENS, memory_limit="2MiB", timed_steps=0
    )
    at_max = result.trial(result.max_batch)
    assert at_max is not None
    assert _plain_generate_peak(model, prompts, result.max_batch, NEW_TOKENS) == at_max.peak_bytes


def _greedy(model: nn.Module, batch: dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
    """A fixed-length greedy loop with the model's KV cache: it reads no token value to decide anything."""
    out = model(input_ids=batch["input_ids"], use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    made = [token]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        made.append(token)
    return torch.cat([batch["input_ids"], *made], dim=1)


@pytest.mark.slow
def test_a_generate_fn_is_sized_and_estimated_alike_on_fake_tensors() -> None:
    model = _gpt2()
    prompts = {"input_ids": _prompts()["input_ids"]}
    keywords: dict[str, Any] = {"mode": "generate", "max_new_tokens": NEW_TOKENS, "generate_fn": _greedy}
    found = batchfit.find(model, prompts, memory_limit="2MiB", timed_steps=0, **keywords)
    estimated = batchfit.estimate(model, prompts, memory_limit="2MiB", **keywords)
    assert estimated.estimated and found.boundary_reached
    assert estimated.max_batch == found.max_batch
    assert estimated.generation is not None and estimated.generation.new_tokens == NEW_TOKENS


@pytest.mark.slow
def test_hugging_face_generate_is_estimated_by_real_cpu_steps_and_says_why() -> None:
    """`generate` reads token values to decide when to stop, which fake tensors cannot: the estimate
    runs real CPU steps instead and says so (its answer is the real probe's)."""
    model, prompts = _gpt2(), _prompts()
    estimated = batchfit.estimate(model, prompts, mode="generate", max_new_tokens=4, memory_limit="3MiB")
    found = batchfit.find(model, prompts, mode="generate", max_new_tokens=4, memory_limit="3MiB", timed_steps=0)
    assert any("data-dependent" in line for line in estimated.assumptions)
    assert estimated.max_batch == found.max_batch


@pytest.mark.slow
def test_the_generation_frontier_counts_the_context_and_new_tokens() -> None:
    model = _gpt2()

    def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(2, 100, (batch_size, seq_len), generator=torch.Generator().manual_seed(1))}

    frontier = batchfit.frontier(
        model,
        make_batch,
        seq_lens=[8, 32],
        mode="generate",
        max_new_tokens=NEW_TOKENS,
        memory_limit="2MiB",
        longest_at_batch_1=False,
    )
    assert frontier.new_tokens == NEW_TOKENS
    short, long = frontier.point(8), frontier.point(32)
    assert short.max_batch > long.max_batch
    for point in (short, long):
        assert point.context_tokens == point.seq_len + NEW_TOKENS
        assert point.tokens == point.max_batch * point.context_tokens
        found = batchfit.find(
            model,
            make_batch=make_batch,
            seq_len=point.seq_len,
            mode="generate",
            max_new_tokens=NEW_TOKENS,
            memory_limit="2MiB",
            timed_steps=0,
        )
        assert found.max_batch == point.max_batch  # each point is exact
    assert frontier.token_budget == min(short.tokens, long.tokens)
    assert "KV cache" in str(frontier)


def test_a_context_beyond_the_positions_is_refused_by_the_frontier_before_any_trial() -> None:
    calls: list[int] = []
    with pytest.raises(ValueError, match="max_new_tokens=12"):
        batchfit.frontier(
            _gpt2(positions=40),
            lambda b, s: {"input_ids": torch.zeros(b, s, dtype=torch.long)},
            seq_lens=[8, 32],
            mode="generate",
            max_new_tokens=NEW_TOKENS,
            memory_limit="2MiB",
            callback=lambda trial: calls.append(trial.batch_size),
        )
    assert calls == []


# Bad input: a clear error before any trial, nothing lost ---------------------------------------------
class _NoGenerate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize(
    ("model", "keywords", "error", "words"),
    [
        (_NoGenerate(), {"max_new_tokens": 4}, TypeError, "has none: pass generate_fn"),
        (None, {}, ValueError, "needs max_new_tokens"),
        (None, {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        (None, {"max_new_tokens": "4"}, TypeError, "max_new_tokens"),
        (None, {"max_new_tokens": 4, "optimizer": torch.optim.SGD}, ValueError, "trains nothing: optimizer"),
        (None, {"max_new_tokens": 4, "generate_fn": 3}, TypeError, "generate_fn must be callable"),
        (None, {"max_new_tokens": 200}, ValueError, "longer than the model's position embeddings"),
    ],
)
def test_bad_generation_input_is_named_before_any_trial(
    model: nn.Module | None, keywords: dict[str, Any], error: type[Exception], words: str
) -> None:
    model = _gpt2() if model is None else model
    sample = torch.randn(2, 4) if isinstance(model, _NoGenerate) else _prompts()
    before = state_of(model)
    calls: list[int] = []
    with pytest.raises(error, match=words):
        batchfit.find(
            model,
            sample,
            mode="generate",
            memory_limit="2MiB",
            callback=lambda t: calls.append(t.batch_size),
            **keywords,
        )
    assert calls == []
    assert_same_state(before, state_of(model))


def test_generation_options_outside_generation_are_refused() -> None:
    with pytest.raises(ValueError, match="applies to mode='generate' only"):
        batchfit.Options(max_new_tokens=4)
    with pytest.raises(ValueError, match="applies to mode='generate' only"):
        batchfit.Options(mode="inference", generate_fn=_greedy)


def test_a_generate_fn_that_returns_nothing_is_named_and_nothing_is_lost() -> None:
    model = _gpt2()
    before = state_of(model)
    with pytest.raises(TypeError, match="generate_fn returned None"):
        batchfit.find(
            model, _prompts(), mode="generate", max_new_tokens=4, generate_fn=lambda m, b, n: None, memory_limit="2MiB"
        )
    assert_same_state(before, state_of(model))


def test_the_command_line_sizes_generation(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from batchfit.cli import main

    target = tmp_path / "target.py"
    target.write_text(
        "from tests.test_generation import _gpt2, _prompts\n\n\ndef build():\n    return _gpt2(), _prompts()\n"
    )
    out = tmp_path / "result.json"
    code = main(
        ["probe", f"{target}:build", "--memory-limit", "2MiB", "--mode", "generate", "--max-new-tokens", "4",
         "--timed-steps", "0", "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = batchfit.Result.from_json(out.read_text())
    assert result.generation is not None and result.generation.new_tokens == 4
    assert "KV cache" in printed.out + printed.err and "recommended" not in printed.out + printed.err

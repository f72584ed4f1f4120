"""``batchfit.frontier``: the largest batch per sequence length, exact at every point.

Real Hugging Face GPT-2 models built from configs (no download), real steps on the CPU under
the live-tensor limit: each point must equal what a one-dimensional ``find()`` at that length
answers; the longest length at batch 1 must fit while one more token does not; the surface's
``s^2`` term must be there for eager attention and not for SDPA's flash kernel; lengths the
model cannot take are refused before any trial.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import batchfit
from batchfit.report.frontier import Frontier

transformers = pytest.importorskip("transformers")

LIMIT = "24MiB"
VOCAB = 128


def gpt2(attention: str, positions: int = 4096) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_positions=positions,
        vocab_size=VOCAB,
        attn_pdrop=0.0,  # SDPA's CPU flash kernel takes no dropout: with it SDPA runs the math kernel
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attention,
    )
    return transformers.GPT2LMHeadModel(config)


def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def eager() -> tuple[torch.nn.Module, Frontier]:
    model = gpt2("eager")
    return model, batchfit.frontier(model, make_batch, seq_lens=[32, 64, 128], memory_limit=LIMIT)


@pytest.mark.slow
def test_each_point_is_the_exact_answer_of_find_at_that_length(eager):
    model, frontier = eager
    assert [p.seq_len for p in frontier.points] == [32, 64, 128]
    for point in frontier.points:
        alone = batchfit.find(model, make_batch=lambda b, s=point.seq_len: make_batch(b, s), memory_limit=LIMIT)
        assert point.result.boundary_reached and alone.boundary_reached
        assert point.max_batch == alone.max_batch, point.seq_len
        assert point.result.safe_verified and point.safe_batch <= point.max_batch
        assert point.tokens == point.max_batch * point.seq_len
        assert point.tokens_per_s and point.tokens_per_s > 0
    # Memory grows with the length, so the largest batch falls with it.
    batches = [p.max_batch for p in frontier.points]
    assert batches == sorted(batches, reverse=True)
    assert frontier.token_budget == min(p.max_batch * p.seq_len for p in frontier.points)


def fits_at_batch_1(model: torch.nn.Module, seq_len: int) -> bool:
    with batchfit.Prober(model, make_batch=lambda b: make_batch(b, seq_len), memory_limit=LIMIT) as prober:
        return prober.trial(1).fits


def test_the_longest_length_at_batch_1_is_exact(eager):
    model, frontier = eager
    longest = frontier.longest_at_batch_1
    assert frontier.longest_limited_by == "memory" and longest is not None
    assert longest > 128 and frontier.longest_trials > 0
    assert fits_at_batch_1(model, longest)
    assert not fits_at_batch_1(model, longest + 1)


def test_the_quadratic_term_is_there_for_eager_attention_and_not_for_sdpa(eager):
    _, eager_frontier = eager
    surface = eager_frontier.surface
    assert surface is not None and surface.quadratic
    assert surface.per_token_squared_bytes > 0.05 * surface.per_token_bytes / 128
    assert "s x s scores" in surface.meaning()

    sdpa = batchfit.frontier(gpt2("sdpa"), make_batch, seq_lens=[32, 128], memory_limit=LIMIT, longest_at_batch_1=False)
    flat = sdpa.surface
    assert flat is not None and not flat.quadratic
    assert flat.quadratic_share < 0.01
    assert sdpa.longest_at_batch_1 is None and sdpa.longest_trials == 0
    assert "linearly" in flat.meaning()


def test_the_longest_length_stops_at_the_models_positions_without_a_trial():
    model = gpt2("sdpa", positions=64)
    trials: list[Any] = []
    frontier = batchfit.frontier(model, make_batch, seq_lens=[16, 64], memory_limit=LIMIT, callback=trials.append)
    assert (frontier.longest_at_batch_1, frontier.longest_limited_by, frontier.longest_trials) == (64, "positions", 0)
    assert len(trials) == frontier.trials
    assert any("config.n_positions" in note for note in frontier.notes)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"seq_lens": [32, 512]}, ValueError, "512 exceed what the model takes: its position embeddings hold 256"),
        ({"seq_lens": [32], "max_seq_len": 1024}, ValueError, "max_seq_len=1024 exceeds what the model takes"),
        ({"seq_lens": [64], "max_seq_len": 32}, ValueError, "max_seq_len=32 is below the longest of seq_lens"),
        ({"seq_lens": []}, ValueError, "seq_lens is empty"),
        ({"seq_lens": [32, 32]}, ValueError, "seq_lens has 32 more than once"),
        ({"seq_lens": "128"}, TypeError, "seq_lens must be a list of ints"),
        ({"seq_lens": [32, 0]}, ValueError, "seq_lens[1] must be >= 1"),
        ({"seq_lens": [32.0]}, TypeError, "seq_lens[0] must be an int"),
        (
            {"seq_lens": [32], "make_batch": lambda b: make_batch(b, 32)},
            TypeError,
            "make_batch must take (batch_size, seq_len)",
        ),
        ({"seq_lens": [32], "make_batch": None}, TypeError, "frontier() needs make_batch"),
        ({"seq_lens": [32], "on_point": 3}, TypeError, "on_point must be callable"),
        # integral numbers are ints, bools are not (issue 32, item 11)
        ({"seq_lens": [True]}, TypeError, "seq_lens[0] must be an int"),
        ({"seq_lens": [32, torch.tensor(True)]}, TypeError, "seq_lens[1] must be an int"),
        ({"seq_lens": [32], "max_seq_len": True}, TypeError, "max_seq_len must be an int"),
        ({"seq_lens": np.array([32, 32])}, ValueError, "seq_lens has 32 more than once"),
        ({"seq_lens": {32: "a"}}, TypeError, "seq_lens must be a list of ints"),
        # make_batch is not believed: each length's batch is checked before any trial (items 3, 11)
        (
            {"seq_lens": [8, 16], "make_batch": lambda b, s: make_batch(b, 16)},
            ValueError,
            "make_batch(1, 8) built a batch of length 16, not 8",
        ),
        (
            {"seq_lens": [32, 64], "make_batch": lambda b, s: make_batch(b, 48)},
            ValueError,
            "make_batch(1, 32) built a batch of length 48, not 32",
        ),
        (
            {"seq_lens": [32], "make_batch": lambda b, s: {k: t.to("meta") for k, t in make_batch(b, s).items()}},
            ValueError,
            "make_batch(1, 32)['input_ids'] is on the meta device, which holds no data",
        ),
    ],
)
def test_bad_input_is_refused_before_any_trial(kwargs, error, words):
    model = gpt2("eager", positions=256)
    before = weights(model)
    trials: list[Any] = []
    kwargs = {"make_batch": make_batch, **kwargs}
    with pytest.raises(error) as raised:
        batchfit.frontier(model, kwargs.pop("make_batch"), memory_limit=LIMIT, callback=trials.append, **kwargs)
    assert words in str(raised.value)
    assert trials == []
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.slow
def test_estimate_with_a_length_axis_gives_the_same_frontier_from_fake_tensors(eager):
    model, measured = eager
    before = weights(model)
    estimated = batchfit.estimate(model, make_batch=make_batch, seq_lens=[32, 64, 128], memory_limit=LIMIT)
    assert isinstance(estimated, Frontier) and estimated.estimated
    # On the CPU the live-tensor meter counts fake storages as real ones: the same exact points.
    assert [(p.seq_len, p.max_batch) for p in estimated.points] == [(p.seq_len, p.max_batch) for p in measured.points]
    assert estimated.longest_at_batch_1 == measured.longest_at_batch_1
    assert all(p.result.estimated and p.tokens_per_s is None for p in estimated.points)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_estimate_with_a_length_axis_refuses_a_sample():
    model = gpt2("eager", positions=256)
    with pytest.raises(TypeError, match="seq_lens= builds each length's batches with make_batch"):
        batchfit.estimate(model, make_batch(2, 32), seq_lens=[32], memory_limit=LIMIT)


def on_the_global_generator(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids}


def test_seq_lens_may_be_any_integral_numbers_and_the_random_state_is_kept():
    model = gpt2("sdpa", positions=64)
    torch.manual_seed(7)
    rng = torch.get_rng_state()

    frontier = batchfit.frontier(
        model,
        on_the_global_generator,
        seq_lens=np.arange(16, 65, 48),
        max_seq_len=torch.tensor(64),
        memory_limit="4MiB",
        verify_steps=1,
    )

    assert [p.seq_len for p in frontier.points] == [16, 64] and {type(p.seq_len) for p in frontier.points} == {int}
    assert frontier.longest_at_batch_1 == 64 and type(frontier.longest_at_batch_1) is int
    assert Frontier.from_json(frontier.to_json()) == frontier
    assert torch.equal(torch.get_rng_state(), rng)  # the batches checked before the trials drew nothing for good


def test_a_refused_make_batch_leaves_the_random_state():
    model = gpt2("sdpa", positions=64)
    rng = torch.get_rng_state()

    with pytest.raises(ValueError, match="built a batch of length 16, not 32"):
        batchfit.frontier(model, lambda b, s: on_the_global_generator(b, 16), seq_lens=[16, 32], memory_limit=LIMIT)

    assert torch.equal(torch.get_rng_state(), rng)


def test_a_make_batch_that_stops_short_on_the_length_axis_is_named():
    """The length axis builds lengths no one listed: a make_batch that truncates (a tokenizer's
    max_length) is caught at the first batch it cuts, not taken for the longest length."""
    model = gpt2("sdpa", positions=256)

    def truncated(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        return make_batch(batch_size, min(seq_len, 100))

    with pytest.raises(ValueError, match=r"make_batch\(1, \d+\) built a batch of length 100, not \d+"):
        batchfit.frontier(model, truncated, seq_lens=[64], memory_limit="4MiB", verify_steps=0)


@pytest.mark.slow
def test_an_estimate_takes_a_make_batch_of_meta_tensors():
    """An estimate runs no step: meta tensors are what it traces, so only a real frontier refuses them."""
    model = gpt2("sdpa", positions=256)

    def on_meta(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (batch_size, seq_len), device="meta")
        return {"input_ids": ids, "labels": ids}

    estimated = batchfit.estimate(model, make_batch=on_meta, seq_lens=[32, 64], memory_limit=LIMIT)

    assert [p.seq_len for p in estimated.points] == [32, 64] and all(p.max_batch > 1 for p in estimated.points)

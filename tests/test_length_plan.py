"""``batchfit.buckets`` and ``batchfit.soak`` on a real model: every answer held to real steps.

A Hugging Face GPT-2 from a config (no download), eager attention (an ``s^2`` term, so short and
long rows bind differently), long-tailed lengths, real steps on the CPU under the live-tensor
limit. Each bucket's batch must be what a plain ``find`` answers at its longest length; every
batch the token budget admits must fit, replayed over a whole epoch of the samplers by the soak
(0 out of memory), while an oversized batch does not; bad input is refused before any trial and
the model comes back as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import batchfit
from batchfit import examples
from batchfit.report.bucketing import histogram_of
from batchfit.samplers import BucketBatchSampler, TokenBudgetBatchSampler

transformers = pytest.importorskip("transformers")

LIMIT = "24MiB"
VOCAB = 128


def gpt2(positions: int = 1024) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_positions=positions,
        vocab_size=VOCAB,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(config)


def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "labels": ids}


def long_tail(rows: int = 600, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(rows, generator=generator) * 0.6 + 3.6)  # median ~37, max ~8x that
    return drawn.clamp(4, 320).long().tolist()


@pytest.fixture(scope="module")
def planned():
    model = gpt2(positions=512)  # the packed row's search at batch 1 goes up to the positions
    lengths = long_tail()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = batchfit.buckets(model, make_batch, lengths=lengths, memory_limit=LIMIT, pack_length=max(lengths))
    return model, lengths, before, plan


@pytest.mark.slow
def test_each_bucket_is_the_exact_answer_of_find_at_its_longest_length(planned):
    model, lengths, _, plan = planned
    assert plan.longest == max(lengths) and plan.rows == len(lengths)
    assert sum(b.rows for b in plan.buckets) == len(lengths)
    assert plan.boundaries[-1] == max(lengths)
    for bucket in plan.buckets[-2:]:  # the longest two: the search is cheapest there
        alone = batchfit.find(model, make_batch=lambda b, s=bucket.longest: make_batch(b, s), memory_limit=LIMIT)
        assert (bucket.max_batch, bucket.batch_size) == (alone.max_batch, alone.safe_batch)
    assert [b.batch_size for b in plan.buckets] == sorted((b.batch_size for b in plan.buckets), reverse=True)


@pytest.mark.slow
def test_the_token_budget_is_verified_at_its_worst_compositions(planned):
    _, lengths, _, plan = planned
    budget = plan.token_budget
    assert budget is not None and budget.max_tokens >= max(lengths)
    kinds = {c.kind for c in budget.compositions}
    assert {"longest", "binding"} <= kinds
    assert all(c.fits and c.rows * c.seq_len <= budget.max_tokens for c in budget.compositions)
    # one token more admits a batch the binding length's measured batch does not hold
    point = {p.seq_len: p.safe_batch for p in plan.frontier.points}.get(budget.binding_length)
    if point is not None:
        assert (budget.max_tokens + 1) // budget.binding_length > point


@pytest.mark.slow
def test_a_whole_epoch_of_each_sampler_fits_and_an_oversized_batch_does_not(planned):
    model, lengths, before, plan = planned
    buckets = BucketBatchSampler(lengths, plan.boundaries, plan.batch_sizes, seed=0)
    budget = TokenBudgetBatchSampler(lengths, plan.token_budget.max_tokens, seed=0)
    for name, sampler in (("buckets", buckets), ("token budget", budget)):
        soak = batchfit.soak(model, make_batch, sampler, name=name, memory_limit=LIMIT)
        assert soak.steps == len(sampler) and soak.oom == 0, soak
        assert 0 < soak.peak_bytes <= soak.budget_bytes
        assert soak.peak_shape == sampler.steps()[soak.peak_step - 1]
        assert soak.retries_per_100 is None  # the CPU keeps no cache
    longest = plan.buckets[-1]
    oversized = [(4, 16), (longest.max_batch + 1, longest.longest), (4, 16)]
    soak = batchfit.soak(model, make_batch, oversized, name="oversized", memory_limit=LIMIT)
    assert (soak.steps, soak.oom) == (3, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_packing_is_sized_by_its_packed_length_and_compared(planned):
    _, lengths, _, plan = planned
    packing = plan.packing
    assert packing is not None and packing.pack_length == max(lengths)
    assert 0 < packing.fill <= 1 and packing.batch_size <= packing.max_batch
    assert packing.longest_packed_row is not None and packing.longest_packed_row >= max(lengths)
    assert plan.best_layout in ("buckets", "packing")
    assert plan.knobs["verl"]["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == packing.longest_packed_row


@pytest.mark.slow
def test_the_plan_round_trips_through_json_and_reads_as_text(planned):
    model, _, before, plan = planned
    again = batchfit.LengthPlan.from_json(plan.to_json())
    assert again == plan
    text = str(plan)
    assert "token budget: max_tokens=" in text and "knobs:" in text
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training


class Rows(Dataset):
    """Rows of token ids of the declared lengths (a collate pads each batch to its longest)."""

    def __init__(self, lengths: list[int], pad: int = 0) -> None:
        self.lengths = lengths
        self._pad = pad

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.arange(self.lengths[index] + self._pad) % VOCAB


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return {"input_ids": ids, "labels": ids}


def test_bad_input_is_refused_before_any_trial():
    model = gpt2(positions=64)
    trials: list[object] = []
    told = {"callback": trials.append, "memory_limit": LIMIT}
    with pytest.raises(ValueError, match="exceed what the model takes"):
        batchfit.buckets(model, make_batch, lengths=[8, 80], **told)
    with pytest.raises(ValueError, match="below the longest row"):
        batchfit.buckets(model, make_batch, lengths=[8, 40], boundaries=[16, 32], **told)
    with pytest.raises(ValueError, match="packing needs a model whose forward takes position_ids"):
        batchfit.buckets(examples.gpt()[0], make_batch, lengths=[8, 40], pack_length=40, **told)
    with pytest.raises(ValueError, match="shorter than the longest row"):
        batchfit.buckets(model, make_batch, lengths=[8, 40], pack_length=32, **told)
    with pytest.raises(TypeError, match=r"lengths\[1\] must be an integer"):
        batchfit.buckets(model, make_batch, lengths=[8, 4.5], **told)
    with pytest.raises(ValueError, match="max_buckets must be an int >= 1"):
        batchfit.buckets(model, make_batch, lengths=[8, 40], max_buckets=0, **told)
    with pytest.raises(ValueError, match="verify must be None or 'epoch'"):
        batchfit.buckets(model, make_batch, lengths=[8, 40], verify="forever", **told)
    lying = DataLoader(Rows([8, 12, 20], pad=3), batch_size=2, collate_fn=collate)
    with pytest.raises(ValueError, match="lengths disagree with the batches the loader yields: item 2"):
        batchfit.buckets(model, lying, **told)
    assert not trials


@pytest.mark.slow
def test_a_loader_that_declares_its_lengths_is_planned_from_its_own_rows():
    model = gpt2(positions=256)
    lengths = long_tail(rows=200, seed=1)
    loader = DataLoader(Rows(lengths), batch_size=8, collate_fn=collate)
    plan = batchfit.buckets(model, loader, memory_limit=LIMIT, token_budget=False, max_buckets=3)
    assert plan.rows == len(lengths) and plan.longest == max(lengths)
    assert len(plan.buckets) <= 3 and plan.token_budget is None
    assert histogram_of(lengths) == {**histogram_of(lengths)}


def gpt2_generating() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=128, bos_token_id=0, eos_token_id=1
    )
    return transformers.GPT2LMHeadModel(config)


def prompts(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 100, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.slow
def test_generation_shaped_lengths_size_each_bucket_at_its_longest_prompt_and_response():
    model = gpt2_generating()
    pairs = [(4, 3), (10, 12), (16, 5), (20, 2), (40, 6), (48, 4)]
    plan = batchfit.buckets(model, prompts, lengths=pairs, boundaries=[16, 48], memory_limit="3MiB")
    assert [(b.shortest, b.longest, b.new_tokens) for b in plan.buckets] == [(4, 16, 12), (20, 48, 12)]
    assert plan.token_budget is None and plan.packing is None
    assert [b.tokens for b in plan.buckets] == [3 + 12 + 5, 2 + 6 + 4]  # the real new tokens
    longest = plan.buckets[-1]
    alone = batchfit.find(
        model,
        make_batch=lambda b: prompts(b, 48),
        mode="generate",
        max_new_tokens=12,
        memory_limit="3MiB",
        timed_steps=0,
    )
    assert longest.max_batch == alone.max_batch
    assert set(plan.knobs) == {"batchfit"} and plan.knobs["batchfit"]["max_new_tokens"] == [12, 12]


def test_generation_shaped_lengths_refuse_what_is_for_training():
    model = gpt2_generating()
    pairs = [(4, 3), (10, 12)]
    with pytest.raises(ValueError, match="sized with mode='generate', not 'train'"):
        batchfit.buckets(model, prompts, lengths=pairs, mode="train", memory_limit="3MiB")
    with pytest.raises(ValueError, match="pack_length= and verify= are for training"):
        batchfit.buckets(model, prompts, lengths=pairs, pack_length=64, memory_limit="3MiB")
    with pytest.raises(ValueError, match="set max_new_tokens per bucket"):
        batchfit.buckets(model, prompts, lengths=pairs, max_new_tokens=4, memory_limit="3MiB")
    with pytest.raises(TypeError, match=r"lengths\[1\] must be a \(prompt, response\) pair"):
        batchfit.buckets(model, prompts, lengths=[(4, 3), 10], memory_limit="3MiB")

"""The worst case of real data (issue 21, item 1): a loader is sized on the batch that drives
memory, not on its first batch; ``seq_len=`` sizes on a length the user knows better.

The data is ordered so that a loader's first batches hold its shortest sequences, as a loader
sorted or bucketed by length does: the first-batch answer then runs out of memory in a real pass
over the data, and the worst-batch answer does not. "Trains" means real steps under batchfit's
own CPU meter with the same limit (a step over it is a real ``torch.OutOfMemoryError``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_state, state_of
from torch import nn
from torch.utils.data import DataLoader, Dataset

import batchfit
from batchfit import examples
from batchfit.probe import position_limit
from batchfit.probe.batches import batch_size_of
from batchfit.probe.real_data import worst_batch

transformers = pytest.importorskip("transformers")

#: 24 sequences growing from 4 to 64 tokens; 6 batches of 4 in order: the first holds the shortest.
LENGTHS = [4 + (60 * i) // 23 for i in range(24)]
LOADER_BATCH = 4
POSITIONS = 256
#: Live tensor bytes a step may use: batch ~15 at 64 tokens, ~100 at the first batch's 9.
LIMIT = "32MiB"
#: No verification, no timing: a probe that only searches.
QUICK: dict[str, Any] = {"verify_steps": 0, "timed_steps": 0}


class Sequences(Dataset):
    """Token sequences of the given lengths; no ``lengths`` attribute: only a scan finds the worst."""

    def __init__(self, lengths: list[int]) -> None:
        generator = torch.Generator().manual_seed(1)
        self.items = [torch.randint(0, 500, (n,), generator=generator) for n in lengths]
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loaded.append(index)
        return self.items[index]


class WithLengths(Sequences):
    """The same, declaring its lengths as bucketing datasets do."""

    def __init__(self, lengths: list[int]) -> None:
        super().__init__(lengths)
        self.lengths = list(lengths)


def pad(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest: input_ids, attention_mask, and labels with -100 at the pads."""
    longest = max(len(item) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, item in enumerate(items):
        ids[row, : len(item)], mask[row, : len(item)], labels[row, : len(item)] = item, 1, item
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loader_of(dataset: Dataset, batch_size: int = LOADER_BATCH) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, collate_fn=pad)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, n_positions=POSITIONS, vocab_size=500, bos_token_id=0, eos_token_id=0
    )
    config._attn_implementation = "eager"  # its s x s scores: memory that grows with the length
    return transformers.GPT2LMHeadModel(config)


def full_pass(model: nn.Module, dataset: Dataset, batch_size: int) -> list[bool]:
    """Train one pass over ``dataset`` re-batched at ``batch_size`` (the same collate function),
    every step a real trial under :data:`LIMIT`, the optimizer kept from step to step as training
    keeps it; whether each batch fitted, up to the first that did not."""
    current: dict[str, Any] = {}
    fitted = []
    with batchfit.Prober(model, make_batch=lambda _: current["batch"], memory_limit=LIMIT, verify_steps=0) as prober:
        for batch in loader_of(dataset, batch_size):
            current["batch"] = batch
            fitted.append(prober.trial(batch_size_of(batch)).fits)
            if not fitted[-1]:
                break
    return fitted


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return gpt2()


@pytest.fixture(scope="module")
def answers(model: nn.Module) -> dict[str, batchfit.Result]:
    loader = loader_of(Sequences(LENGTHS))
    return {
        "worst": batchfit.find(model, loader, memory_limit=LIMIT, verify_steps=0),
        "first": batchfit.find(model, next(iter(loader)), memory_limit=LIMIT, verify_steps=0),
    }


# The worst batch ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_worst_batch_answer_trains_a_full_pass_where_the_first_batch_answer_runs_out(
    model: nn.Module, answers: dict[str, batchfit.Result]
) -> None:
    worst, first = answers["worst"], answers["first"]
    assert 8 <= worst.max_batch <= 40, worst.max_batch  # the limit puts the boundary where it means something
    assert first.max_batch > 2 * worst.max_batch
    dataset = Sequences(LENGTHS)
    assert all(full_pass(model, dataset, worst.safe_batch))
    assert len(full_pass(model, dataset, worst.max_batch)) == math.ceil(len(LENGTHS) / worst.max_batch)
    assert not all(full_pass(model, dataset, first.safe_batch))


def test_the_max_batch_at_the_worst_case_is_exact(model: nn.Module, answers: dict[str, batchfit.Result]) -> None:
    largest = answers["worst"].max_batch
    batch, _, _ = worst_batch(loader_of(Sequences(LENGTHS)))
    assert batch["input_ids"].shape == (LOADER_BATCH, max(LENGTHS))
    with batchfit.Prober(model, batch, memory_limit=LIMIT) as prober:
        assert prober.trial(largest).fits
        assert not prober.trial(largest + 1).fits


def test_the_answer_says_what_it_sized_on_and_how_much_it_scanned(answers: dict[str, batchfit.Result]) -> None:
    worst = answers["worst"]
    batches = len(LENGTHS) // LOADER_BATCH
    assert worst.sized_on == batchfit.report.SizedOn(
        source="loader scan",
        batches_scanned=batches,
        total_batches=batches,
        leaf="sample['input_ids']",
        dim=1,
        length=max(LENGTHS),
        first_length=LENGTHS[LOADER_BATCH - 1],
        batch_number=batches,
    )
    note = next(n for n in worst.notes if n.startswith("sample: "))
    assert f"the worst of {batches} batches scanned (of {batches}) of the DataLoader" in note
    assert f"sequence length {max(LENGTHS)} (dim 1 of sample['input_ids'])" in note
    assert f"the first batch had length {LENGTHS[LOADER_BATCH - 1]}" in note and "repeated along dim 0" in note
    assert f"sized on           length {max(LENGTHS)}" in str(worst)
    assert batchfit.Result.from_json(worst.to_json()) == worst
    assert answers["first"].sized_on is None


def test_scanning_one_batch_reproduces_the_first_batch_answer(
    model: nn.Module, answers: dict[str, batchfit.Result]
) -> None:
    first = answers["first"].max_batch
    # Searched right at the first-batch answer's boundary: it fits there and one more does not.
    around = {"init_batch": first, "max_batch": first + 1, "verify_steps": 0}
    with pytest.warns(UserWarning, match="the scan read 1 of the DataLoader's 6 batches"):
        one = batchfit.find(model, loader_of(Sequences(LENGTHS)), memory_limit=LIMIT, scan_batches=1, **around)
    assert one.max_batch == first and one.boundary_reached
    assert one.sized_on is not None and one.sized_on.batches_scanned == 1 and one.sized_on.leaf is None
    assert any("the first batch of the DataLoader (batch size 4)" in n and "1 batch scanned" in n for n in one.notes)


@pytest.mark.slow
def test_the_estimate_sizes_on_the_same_worst_batch(model: nn.Module, answers: dict[str, batchfit.Result]) -> None:
    estimated = batchfit.estimate(model, loader_of(Sequences(LENGTHS)), memory_limit=LIMIT, device="cpu")
    assert estimated.sized_on == answers["worst"].sized_on
    assert estimated.max_batch == answers["worst"].max_batch


def test_a_dataset_that_declares_its_lengths_gives_its_longest_item_and_nothing_else_is_loaded() -> None:
    dataset = WithLengths(LENGTHS)
    batch, note, sized_on = worst_batch(loader_of(dataset))
    assert dataset.loaded == [len(LENGTHS) - 1]  # only the longest item was read
    assert batch["input_ids"].shape == (1, max(LENGTHS))
    assert torch.equal(batch["input_ids"][0], dataset.items[-1])
    assert sized_on is not None and sized_on.source == "dataset lengths"
    assert (sized_on.length, sized_on.dataset_size, sized_on.batches_scanned) == (max(LENGTHS), len(LENGTHS), 0)
    assert note is not None and f"the longest of the {len(LENGTHS)} samples by the dataset's lengths" in note


def test_hugging_faces_length_grouped_sampler_gives_its_lengths() -> None:
    from transformers.trainer_pt_utils import LengthGroupedSampler

    dataset = Sequences(LENGTHS)
    sampler = LengthGroupedSampler(LOADER_BATCH, lengths=LENGTHS, generator=torch.Generator().manual_seed(0))
    batch, _, sized_on = worst_batch(DataLoader(dataset, batch_size=LOADER_BATCH, sampler=sampler, collate_fn=pad))
    assert dataset.loaded == [len(LENGTHS) - 1]
    assert sized_on is not None and (sized_on.source, sized_on.length) == ("dataset lengths", max(LENGTHS))


def test_the_scan_keeps_every_generator_and_stops_at_scan_batches() -> None:
    dataset = Sequences(LENGTHS)
    loader = DataLoader(dataset, batch_size=LOADER_BATCH, collate_fn=pad, shuffle=True)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match="the scan read 2 of the DataLoader's 6 batches"):
        _, _, sized_on = worst_batch(loader, scan_batches=2)
    assert torch.equal(torch.get_rng_state(), before)
    assert sized_on is not None and (sized_on.batches_scanned, sized_on.total_batches) == (2, 6)
    assert len(dataset.loaded) == 2 * LOADER_BATCH


# seq_len ----------------------------------------------------------------------------------------------
def test_seq_len_cuts_or_extends_the_worst_rows_with_their_own_tokens() -> None:
    loader = loader_of(Sequences(LENGTHS))
    worst, _, _ = worst_batch(loader)
    cut, note, sized_on = worst_batch(loader, seq_len=40)
    assert {key: tuple(t.shape) for key, t in cut.items()} == dict.fromkeys(worst, (LOADER_BATCH, 40))
    assert all(torch.equal(cut[key], worst[key][:, :40]) for key in worst)
    assert sized_on is not None and (sized_on.source, sized_on.length, sized_on.leaf) == (
        "seq_len",
        40,
        "sample['input_ids']",
    )
    assert note is not None and "seq_len=40" in note and "cut to it" in note

    longer, note, _ = worst_batch(loader, seq_len=150)
    index = torch.arange(150) % max(LENGTHS)
    assert all(torch.equal(longer[key], worst[key][:, index]) for key in worst)
    assert note is not None and "repeated along the sequence" in note


def test_seq_len_reaches_the_probe_from_a_loader(model: nn.Module) -> None:
    result = batchfit.find(
        model, loader_of(Sequences(LENGTHS)), memory_limit=LIMIT, seq_len=96, max_batch=2, verify_steps=0
    )
    assert result.sized_on is not None and (result.sized_on.source, result.sized_on.length) == ("seq_len", 96)
    assert "seq_len=96" in str(result)


@pytest.mark.slow
def test_seq_len_with_make_batch_calls_it_with_the_length(model: nn.Module) -> None:
    calls: list[tuple[int, int]] = []

    def make(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        calls.append((batch_size, seq_len))
        ids = torch.randint(0, 500, (batch_size, seq_len))
        return {"input_ids": ids, "labels": ids}

    with batchfit.Prober(model, make_batch=make, seq_len=48, memory_limit=LIMIT) as prober:
        assert prober.trial(2).fits
        assert prober.sized_on == batchfit.report.SizedOn(source="seq_len", length=48)
    assert calls and all(call == (2, 48) for call in calls)
    estimated = batchfit.estimate(model, make_batch=make, seq_len=48, memory_limit="8MiB", device="cpu", max_batch=4)
    assert estimated.sized_on is not None and estimated.sized_on.length == 48
    assert {length for _, length in calls} == {48}
    with pytest.raises(TypeError, match=r"make_batch\(batch_size, seq_len\)"):
        batchfit.find(model, make_batch=lambda b: make(b, 8), seq_len=8)


# Bad input: refused before any trial, nothing lost ----------------------------------------------------
def test_an_empty_loader_is_named() -> None:
    with pytest.raises(ValueError, match="the sample DataLoader yielded no batch: it is empty"):
        batchfit.find(gpt2(), loader_of(Sequences([])), memory_limit=LIMIT)


def test_seq_len_beyond_the_position_embeddings_is_refused_before_any_trial(model: nn.Module) -> None:
    assert position_limit(model) == (POSITIONS, "config.n_positions")
    before = state_of(model)
    ran: list[Any] = []
    for call in (batchfit.find, batchfit.estimate):
        with pytest.raises(ValueError, match=r"seq_len=257 is longer than .* \(256, its config.n_positions\)"):
            call(model, loader_of(Sequences(LENGTHS)), memory_limit=LIMIT, seq_len=257, callback=ran.append)
    assert ran == []
    assert_same_state(before, state_of(model))


def test_a_single_batch_without_a_sequence_dimension_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    with pytest.raises(ValueError, match=r"seq_len=16: cannot tell .* \(sample \(2, 3, 8, 8\)\)"):
        batchfit.find(model, torch.randn(2, 3, 8, 8), seq_len=16, memory_limit=LIMIT)
    with pytest.raises(ValueError, match=r"seq_len=16: no tensor of the sample has a dimension beyond the batch"):
        batchfit.find(nn.Linear(1, 1), torch.randn(2, 1).squeeze(1), seq_len=16, memory_limit=LIMIT)
    same = DataLoader([torch.randn(3, 8, 8)] * 4, batch_size=2)
    with pytest.raises(ValueError, match=r"seq_len=16: no dimension varies in the 2 batches scanned \(of 2\)"):
        batchfit.find(model, same, seq_len=16, memory_limit=LIMIT)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be >= 1"),
        ({"seq_len": 2.5}, TypeError, "seq_len must be an int"),
        ({"scan_batches": 0}, ValueError, "scan_batches must be >= 1"),
    ],
)
def test_the_new_options_are_checked_by_name(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        batchfit.find(nn.Linear(2, 2), torch.randn(2, 2), **kwargs)


def test_position_limit_reads_an_embedding_of_positions_by_its_name() -> None:
    model, _ = examples.gpt(seq_len=32)
    assert position_limit(model) == (32, "position.num_embeddings")
    assert position_limit(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))) is None


# The command line ---------------------------------------------------------------------------------------
_TARGET = """
import torch
from torch.utils.data import DataLoader

import batchfit
from batchfit import examples


def build():
    model, _ = batchfit.examples.gpt(seq_len=64)
    rows = [torch.randint(0, 256, (n,)) for n in (8, 8, 16, 16, 32, 32)]
    collate = lambda items: {"input_ids": torch.stack(items), "labels": torch.stack(items)}
    return model, DataLoader(rows, batch_size=2, collate_fn=collate)
"""


@pytest.mark.slow
def test_the_command_line_takes_seq_len_and_scan_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchfit import cli

    path = tmp_path / "loader.py"
    path.write_text(_TARGET)
    out = tmp_path / "probe.json"
    common = ["--memory-limit", "16MiB", "--device", "cpu", "--max-batch", "2"]
    assert cli.main(["probe", f"{path}:build", *common, "--verify-steps", "0", "--json", str(out)]) == 0
    assert batchfit.Result.from_json(out.read_text()).sized_on.length == 32  # type: ignore[union-attr]
    args = ["--scan-batches", "1", "--seq-len", "24", "--json", str(out)]
    assert cli.main(["estimate", f"{path}:build", *common, *args]) == 0
    sized_on = batchfit.Result.from_json(out.read_text()).sized_on
    assert sized_on is not None and (sized_on.length, sized_on.first_length, sized_on.batches_scanned) == (24, 8, 1)
    assert cli.main(["probe", f"{path}:build", *common, "--seq-len", "65"]) == 2
    assert "seq_len=65 is longer than" in capsys.readouterr().err
    # --scan-batches all is the Python API's scan_batches=None: every batch read, nothing left unread.
    assert cli.main(["estimate", f"{path}:build", *common, "--scan-batches", "all", "--json", str(out)]) == 0
    every = batchfit.Result.from_json(out.read_text()).sized_on
    assert every is not None and every.batches_scanned == every.total_batches == 3, every


# A loader sorted by length (issue 32, item 1) -----------------------------------------------------------
#: The issue's eval loader, scaled down: 600 rows growing from 8 to 100 tokens, in order, in batches of 8:
#: 75 batches, more than the scan's default 64. The 64th batch (the last the old scan read) holds length 86.
SORTED = [8 + (92 * i) // 599 for i in range(600)]
SORTED_BATCH = 8
#: Live tensor bytes a step may use: the tiny BERT trains ~12 rows of 100 tokens, ~16 of 86.
SORTED_LIMIT = "12MiB"


def sorted_rows() -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(1, 500, (n,), generator=generator), i % 2) for i, n in enumerate(SORTED)]


def classify(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """A classifier's batch: ids and mask padded to the batch's longest, one label per row."""
    ids = pad([item for item, _ in items])["input_ids"]
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([y for _, y in items])}


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.BertForSequenceClassification(config)


def in_order(rows: list[tuple[torch.Tensor, int]]) -> Iterator[dict[str, torch.Tensor]]:
    """The same batches from a generator: no sampler, no len()."""
    for start in range(0, len(rows), SORTED_BATCH):
        yield classify(rows[start : start + SORTED_BATCH])


@pytest.mark.slow
def test_a_loader_sorted_by_length_is_sized_on_its_longest_batch_not_its_head() -> None:
    model, rows = tiny_bert(), sorted_rows()
    loader = DataLoader(rows, batch_size=SORTED_BATCH, collate_fn=classify)
    assert len(loader) == 75
    head = classify(rows[63 * SORTED_BATCH : 64 * SORTED_BATCH])  # the worst of the first 64: what the old scan used
    assert head["input_ids"].shape[1] == 86
    settings: dict[str, Any] = {"memory_limit": SORTED_LIMIT, "verify_steps": 0, "timed_steps": 0}
    with pytest.warns(UserWarning, match=r"64 of the DataLoader's 75 batches") as caught:
        sized = batchfit.find(model, loader, **settings)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert sized.sized_on is not None
    assert (sized.sized_on.length, sized.sized_on.batch_number) == (max(SORTED), 75)
    assert (sized.sized_on.batches_scanned, sized.sized_on.total_batches) == (64, 75)
    assert any("spread across the epoch" in note and "scan_batches=None" in note for note in sized.notes)
    on_the_head = batchfit.find(model, head, **settings)
    assert on_the_head.safe_batch > sized.max_batch
    # A pass over the data at batch b ends on its b longest rows: the head's answer runs out of memory there.
    with batchfit.Prober(model, make_batch=lambda b: classify(rows[-b:]), memory_limit=SORTED_LIMIT) as prober:
        assert prober.trial(sized.safe_batch).fits and prober.trial(sized.max_batch).fits
        assert not prober.trial(on_the_head.safe_batch).fits


def test_scan_batches_none_reads_the_whole_epoch_and_says_nothing_is_left() -> None:
    rows = sorted_rows()
    dataset = Sequences([len(item) for item, _ in rows])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, note, sized_on = worst_batch(loader_of(dataset, SORTED_BATCH), scan_batches=None)
    assert sized_on is not None and (sized_on.batches_scanned, sized_on.total_batches, sized_on.length) == (75, 75, 100)
    assert note is not None and "scan_batches=None" not in note
    assert sorted(dataset.loaded) == list(range(600))  # every item once, read by index: no worker, no second pass


def test_a_spread_scan_reads_only_the_batches_it_picks_its_ends_included() -> None:
    dataset = Sequences(SORTED)
    with pytest.warns(UserWarning, match="71 not read"):
        _, _, sized_on = worst_batch(loader_of(dataset, SORTED_BATCH), scan_batches=4)
    picked = sorted({index // SORTED_BATCH for index in dataset.loaded})
    assert picked[0] == 0 and picked[-1] == 74 and len(picked) == 4
    assert sized_on is not None and (sized_on.batch_number, sized_on.length) == (75, max(SORTED))


def test_a_plain_iterable_is_read_on_while_its_worst_batch_is_at_the_scan_s_edge() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it reached the end: nothing to warn about
        _, note, sized_on = worst_batch(in_order(sorted_rows()), scan_batches=20)
    assert sized_on is not None and (sized_on.batches_scanned, sized_on.length) == (75, max(SORTED))
    assert note is not None and "batch 75 of the generator" in note


def test_a_plain_iterable_the_scan_cannot_cover_warns_what_to_pass() -> None:
    with pytest.warns(UserWarning) as caught:
        _, note, sized_on = worst_batch(in_order(sorted_rows()), scan_batches=4)
    said = str(caught[0].message)
    assert "16 batches of the generator" in said and "still growing" in said
    for remedy in ("scan_batches=None", "seq_len=", "lengths"):
        assert remedy in said
    assert note is not None and said.removeprefix("batchfit: ") in note
    assert sized_on is not None and sized_on.batches_scanned == 16  # 4 x scan_batches at most, then it stops
    model = nn.Embedding(500, 4)

    def ids() -> Iterator[torch.Tensor]:
        return (batch["input_ids"] for batch in in_order(sorted_rows()))

    with pytest.warns(UserWarning, match="scan_batches=None") as caught:
        batchfit.find(model, ids(), scan_batches=4, max_batch=2, **QUICK)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = batchfit.find(model, ids(), scan_batches=None, max_batch=2, **QUICK)
    assert whole.sized_on is not None and (whole.sized_on.batches_scanned, whole.sized_on.length) == (75, 100)


# Batches of another structure (issue 32, item 4) ----------------------------------------------------------
def test_a_scan_refuses_batches_whose_structure_changes_naming_the_first() -> None:
    ids = torch.randint(0, 500, (4, 16))
    batches = [{"input_ids": ids, "labels": ids}, {"input_ids": ids, "labels": ids}, (ids,), {"input_ids": ids}]
    model = gpt2()
    before = state_of(model)
    with pytest.raises(ValueError, match=r"batch 3 of the sample list_iterator differs in structure from its first"):
        batchfit.find(model, iter(batches), memory_limit=LIMIT)
    assert_same_state(before, state_of(model))
    without_labels = [batches[0], batches[3]]
    with pytest.raises(ValueError, match=r"batch 2 .*\(no batch\['labels'\]\)"):
        worst_batch(iter(without_labels))
    reordered = [batches[0], {"labels": ids, "input_ids": ids}]  # the order of a dict's keys is no structure
    assert worst_batch(iter(reordered))[2] is not None
    with pytest.raises(ValueError, match=r"batch 2 .*\(batch\[0\] of 3 dims, not 2\)"):
        worst_batch(iter([(ids,), (ids[:, :, None],)]))


def test_a_generator_of_nones_is_named_as_such() -> None:
    with pytest.raises(ValueError, match=r"batch 1 of the sample generator is None"):
        batchfit.find(nn.Linear(2, 2), (None for _ in range(4)))


def test_a_loader_of_one_shape_is_noted_not_warned_about() -> None:
    """Text packed into blocks (every batch one shape): batches left unread are said in the note,
    but a warning on every such loader would teach users to ignore the one that matters."""
    rows = torch.utils.data.TensorDataset(torch.zeros(400, 12, dtype=torch.long))
    loader = DataLoader(rows, batch_size=4, collate_fn=lambda items: torch.stack([item[0] for item in items]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch, note, sized_on = worst_batch(loader, scan_batches=20)
    assert sized_on is not None and (sized_on.batches_scanned, sized_on.total_batches) == (20, 100)
    assert note is not None and "80 not read" in note and tuple(batch.shape) == (4, 12)

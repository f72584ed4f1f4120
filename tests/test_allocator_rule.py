"""What fits on CUDA, one rule per allocator (issue 47, items 1-3), driven on a CPU.

The prober, meter, trial runner, search and safe batch are batchfit's own and run a real model through
real steps on CPU tensors; only the device module under the accelerator backend is a stand-in: a card
whose allocator flushes its cache (``num_alloc_retries``) or runs out of memory at scripted batch sizes,
and whose cuBLAS workspaces are made at the first step that finds none (as cuBLAS makes them), so that
a replay of a fresh process meets the card as a fresh process does.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit.backends.accelerator import AcceleratorBackend
from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.backends.allocator_rule import AllocatorWatch, facts_notes
from batchfit.cli import main
from batchfit.cli.allocators import child_argv
from batchfit.probe import prober as prober_module
from batchfit.report.records import AllocatorFacts
from batchfit.view.cells import trial_cells

MiB, GiB = 2**20, 2**30
WORKSPACES = 64 * MiB


class Card:
    """The ``torch.cuda`` calls the accelerator backend makes, for a card whose allocator is scripted by
    batch size: from ``retry_at`` on a step flushes the cache once; from ``oom_at`` (``fresh_oom_at`` in a
    trial that had to make its workspaces, i.e. one that met the card as a fresh process) it runs out."""

    def __init__(
        self, oom_at: int, fresh_oom_at: int | None = None, retry_at: int | None = None, block: str = "20.00 MiB"
    ) -> None:
        self.oom_at, self.fresh_oom_at, self.retry_at = oom_at, fresh_oom_at or oom_at, retry_at
        self.block = block  # what an out-of-memory message says the allocator tried to allocate
        self.workspaces = 0
        self.retries = 0
        self.fresh = False
        #: The workspace bytes each step found when it started, in order.
        self.seen: list[int] = []
        self.fraction = 1.0

    # what the model's step does on this card
    def step(self, batch: int) -> None:
        self.seen.append(self.workspaces)
        if not self.workspaces:  # cuBLAS makes its workspaces at the first matmul that finds none
            self.workspaces, self.fresh = WORKSPACES, True
        if batch >= (self.fresh_oom_at if self.fresh else self.oom_at):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {self.block}")
        if self.retry_at is not None and batch >= self.retry_at:
            self.retries += 1

    # torch.cuda
    def is_available(self) -> bool:
        return True

    def get_device_properties(self, device: Any) -> Any:
        return SimpleNamespace(name="a stand-in card", total_memory=80 * GiB)

    def get_per_process_memory_fraction(self, device: Any) -> float:
        return self.fraction

    def set_per_process_memory_fraction(self, fraction: float, device: Any) -> None:
        self.fraction = fraction

    def memory_allocated(self, device: Any = None) -> int:
        return self.workspaces

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {"num_alloc_retries": self.retries, "segment.all.current": 2 if self.workspaces else 0}

    def memory_snapshot(self) -> list[dict[str, Any]]:
        return [{"address": 0, "total_size": self.workspaces, "blocks": []}] if self.workspaces else []

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return 80 * GiB - self.workspaces, 80 * GiB

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def is_initialized(self) -> bool:
        return False


class CardBackend(AcceleratorBackend):
    """batchfit's accelerator backend over a `Card`, serving the CPU's tensors."""

    def __init__(self, card: Card, conf: str = "") -> None:
        super().__init__("cuda")
        self.card, self.settings = card, AllocatorConfig.parse(conf)

    @property
    def module(self) -> Any:
        return self.card

    @property
    def memory(self) -> Any:
        return self.card

    def validate(self, device: torch.device) -> torch.device:
        return device

    def allocator_settings(self) -> AllocatorConfig:
        return self.settings

    def warm_up(self, device: torch.device, amp_dtype: torch.dtype | None) -> None:
        self.card.workspaces, self.card.fresh = WORKSPACES, False

    def clear_workspaces(self, device: torch.device) -> None:
        self.card.workspaces = 0


class OnTheCard(nn.Module):
    """A small real model whose forward is a step on the card."""

    def __init__(self, card: Card) -> None:
        super().__init__()
        self.card = card
        self.layer = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.card.step(x.shape[0])
        return self.layer(x)


@pytest.fixture
def on_card(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``find`` on the card: the prober is handed the card's backend; the tensors stay on the CPU."""

    def run(card: Card, conf: str = "", sample: Any = None, **kwargs: Any) -> batchfit.Result:
        monkeypatch.setattr(prober_module, "backend_for", lambda device: CardBackend(card, conf))
        options = {"memory_limit": "1GiB", "max_batch": 64, "timed_steps": 0} | kwargs
        sample = torch.randn(1, 8) if sample is None else sample
        return batchfit.find(OnTheCard(card), sample, device="cpu", **options)

    return run


@pytest.mark.slow
def test_a_step_that_needed_a_retry_does_not_fit_on_the_native_allocator(on_card: Any) -> None:
    card = Card(oom_at=9, retry_at=6)
    result = on_card(card)
    assert result.max_batch == 5
    flushed = [t for t in result.trials if t.batch_size >= 6 and t.batch_size < 9]
    assert flushed and not any(t.fits for t in flushed)
    assert all("allocator retry" in (t.message or "") and t.allocator.retries >= 1 for t in flushed)
    assert all(t.allocator.retries == 0 for t in result.trials if t.fits)
    assert all(t.refused_for_retry and trial_cells(0, t, None).outcome.startswith("retry in") for t in flushed)


@pytest.mark.slow
def test_expandable_segments_report_retries_and_judge_on_out_of_memory_alone(on_card: Any) -> None:
    card = Card(oom_at=9, retry_at=6)
    result = on_card(card, conf="expandable_segments:True")
    assert result.max_batch == 8
    at_max = [t for t in result.trials if t.batch_size == 8 and t.fits]
    assert at_max and at_max[-1].allocator.retries >= 1
    assert trial_cells(0, at_max[-1], None).outcome == f"fits, {at_max[-1].allocator.retries} retries"
    assert any("flushed its cache" in note and "expandable" in note for note in result.notes)


@pytest.mark.slow
def test_the_boundary_from_scratch_moves_up_when_max_plus_one_fits_there(on_card: Any) -> None:
    """Warm trials run out at 9, a fresh process only at 12: the answer is 11, seen from scratch on both sides."""
    card = Card(oom_at=9, fresh_oom_at=12)
    result = on_card(card)
    assert (result.max_batch, result.boundary_reached) == (11, True)
    searched = [t for t in result.trials if t.kind == "search"]
    assert [t.fits for t in searched if t.batch_size == 9] == [False, True]  # warm, then from scratch
    assert {11: True, 12: False}.items() <= {t.batch_size: t.fits for t in searched}.items()
    assert any("fitted from scratch" in note for note in result.notes)
    assert not result.non_monotone  # the warm failure at 9 was overruled by the trial from scratch


def test_a_replay_clears_the_workspaces_makes_them_in_its_steps_and_leaves_no_leak(on_card: Any) -> None:
    card = Card(oom_at=20)
    result = on_card(card)
    assert result.max_batch == 19
    replays = [t for t in result.trials if t.steps >= 3]
    assert replays, "no replay of a fresh process ran"
    assert 0 in card.seen, "no step met the card without its workspaces"
    assert all(t.leaked_bytes == 0 for t in result.trials)
    assert card.workspaces == WORKSPACES  # made again for the probe's other trials, then left as they were
    assert not any("allocated after release" in note for note in result.notes)


@pytest.mark.slow
def test_the_safe_batch_keeps_room_for_one_more_of_the_largest_block_at_the_boundary(on_card: Any) -> None:
    """A 300 MiB block at the boundary is more than a 10% headroom of 1 GiB: the verification's cap is
    the budget less that block, and a note says why; a small block leaves the headroom as it was."""
    big = on_card(Card(oom_at=9, block="300.00 MiB"))
    verified = [t for t in big.trials if t.kind == "verify"]
    assert verified and verified[-1].cap_bytes == GiB - 300 * MiB
    assert any("one more of the step's largest allocation (300.00 MiB)" in note for note in big.notes)
    small = on_card(Card(oom_at=9))
    assert [t.cap_bytes for t in small.trials if t.kind == "verify"][-1] == int(GiB * 0.9)
    assert not any("largest allocation" in note for note in small.notes)


def test_the_watch_counts_retries_per_phase_and_reads_the_largest_request() -> None:
    watch = AllocatorWatch("native")
    watch.begin({"num_alloc_retries": 5})
    watch.phase_ended("forward", {"num_alloc_retries": 5, "inactive_split_bytes.all.peak": 3 * MiB}, 10, 20)
    watch.phase_ended("backward", {"num_alloc_retries": 7, "inactive_split_bytes.all.peak": 9 * MiB}, 10, 20)
    watch.failed(40 * MiB)
    facts = watch.facts(30 * MiB, [{"total_size": 50 * MiB}, {"total_size": 2 * MiB}])
    assert facts == AllocatorFacts(2, 9 * MiB, 40 * MiB, 50 * MiB, None, rule="native")
    phase, reason = watch.refusal() or ("", "")
    assert phase == "backward" and "2 time(s)" in reason
    assert AllocatorWatch("expandable").refusal() is None


def test_the_async_pool_overhead_is_kept_and_its_retries_never_refuse() -> None:
    watch = AllocatorWatch("async")
    watch.begin({})
    watch.phase_ended("forward", {}, 10 * GiB, 10 * GiB + 600 * MiB)
    assert watch.facts(None, None).pool_overhead_bytes == 600 * MiB
    assert watch.refusal() is None


def test_split_free_bytes_over_the_headroom_advise_expandable_segments() -> None:
    facts = AllocatorFacts(inactive_split_peak_bytes=5 * GiB, rule="native")
    said = facts_notes(facts, headroom_bytes=2 * GiB)
    assert len(said) == 1 and "expandable_segments:True" in said[0]
    assert facts_notes(facts, headroom_bytes=6 * GiB) == []
    assert facts_notes(replace(facts, rule="expandable"), headroom_bytes=2 * GiB) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("conf", "said"),
    [
        ("max_split_size_mb:128", "max_split_size_mb"),
        ("expandable_segments:True,frobnicate:1", "keys batchfit does not know (frobnicate)"),
    ],
)
def test_a_setting_the_rule_cannot_read_is_said(conf: str, said: str, on_card: Any) -> None:
    result = on_card(Card(oom_at=9), conf=conf)
    assert any(said in note for note in result.notes), result.notes


def test_a_pluggable_allocator_is_said(on_card: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AllocatorConfig, "parse", lambda text: replace(AllocatorConfig(), backend="pluggable"))
    result = on_card(Card(oom_at=9, retry_at=6))
    assert result.max_batch == 8  # retries are not read from it: out-of-memory alone decides
    assert any("pluggable allocator" in note for note in result.notes)



@pytest.mark.slow
def test_data_whose_lengths_vary_advise_expandable_segments_on_the_native_allocator(on_card: Any) -> None:
    """A loader's rows change length from batch to batch: the native allocator fragments over an epoch."""
    loader = torch.utils.data.DataLoader([torch.randn(2, length, 8) for length in (3, 6, 4)], batch_size=None)
    result = on_card(Card(oom_at=9), sample=loader)
    assert result.sized_on is not None and result.sized_on.leaf is not None
    assert any("lengths vary" in note and "expandable_segments:True" in note for note in result.notes)
    steady = on_card(Card(oom_at=9))
    assert not any("lengths vary" in note for note in steady.notes)


def test_the_child_command_drops_what_the_child_writes_itself() -> None:
    argv = ["probe", "t:f", "--json", "out.json", "-q", "--memory-limit", "1GiB", "--json=x", "--compare-expandable"]
    assert child_argv(argv) == ["probe", "t:f", "--memory-limit", "1GiB"]


@pytest.mark.slow
def test_the_command_line_gives_the_answer_under_expandable_segments_from_a_child(tmp_path: Any) -> None:
    """A real child process probes the same target again (on the CPU the setting changes nothing: equal answers)."""
    out = tmp_path / "result.json"
    argv = ["probe", "batchfit.examples:mlp", "--memory-limit", "16MiB", "--timed-steps", "0", "-q"]
    assert main([*argv, "--compare-expandable", "--json", str(out)]) == 0
    result = batchfit.Result.from_json(out.read_text())
    said = [note for note in result.notes if "measured in a child process" in note]
    assert len(said) == 1 and f"max {result.max_batch} (+0%), safe {result.safe_batch}" in said[0], result.notes

"""The result cache (``find(cache=DIR)``, ``batchfit probe --cache DIR``): a hit runs no trial and
gives the stored answer; what changes the answer changes the key; an entry that cannot be trusted
is ignored and rewritten; writers at once never leave a torn file; ranks decide together.

Real probes of a small MLP on the CPU under a 1 MiB limit (a second each); nothing asserts a time.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from cache_writer import write_many
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import batchfit
from batchfit import Result, examples
from batchfit.cli import main
from batchfit.probe import Options, Prober
from batchfit.probe.cache import open_cache
from batchfit.probe.cache_files import CACHE_SCHEMA, ENTRY_CAP_BYTES, check_entry, entry_document
from batchfit.probe.keys import cache_key, probe_key
from batchfit.probe.safe_batch import safe_cap
from batchfit.units import format_bytes

#: A probe that takes about a second: a boundary near 130 samples, no extra timing.
FAST: dict[str, Any] = {"memory_limit": "160KiB", "timed_steps": 0}


def small(hidden: int = 64) -> tuple[nn.Module, torch.Tensor]:
    return examples.mlp(in_features=32, hidden=hidden, depth=1)


class Counted:
    """Counts the trial callbacks and the model's forward calls of a probe."""

    def __init__(self, model: nn.Module) -> None:
        self.trials = self.started = self.forwards = 0
        model.register_forward_hook(lambda *_: self._forward())

    def _forward(self) -> None:
        self.forwards += 1

    def kwargs(self) -> dict[str, Any]:
        def on_trial(_: Any) -> None:
            self.trials += 1

        def on_trial_start(*_: Any) -> None:
            self.started += 1

        return {"callback": on_trial, "on_trial_start": on_trial_start}


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


# A hit -------------------------------------------------------------------------------------------
def test_a_hit_runs_no_trial_and_gives_the_answer_the_miss_stored(tmp_path: Path) -> None:
    model, sample = small()
    counted = Counted(model)
    missed = batchfit.find(model, sample, memory_limit="1MiB", cache=tmp_path, **counted.kwargs())
    assert missed.from_cache is None and counted.trials == len(missed.trials) > 0
    (path,) = entries(tmp_path)
    entry = json.loads(path.read_text())
    assert entry["schema"] == CACHE_SCHEMA and entry["key"] == path.stem
    assert entry["key_fields"]["model"]["parameters"][0][:2] == ["net.0.weight", [64, 32]]  # readable
    assert Result.from_dict(entry["result"]) == missed  # the answer as measured

    counted.trials = counted.started = counted.forwards = 0
    hit = batchfit.find(model, sample, memory_limit="1MiB", cache=tmp_path, **counted.kwargs())

    assert (counted.trials, counted.started) == (0, 0)  # no trial of a search: no callback
    # The stored safe batch checked once, with the 2 steps that show its peak, then the max with 1.
    assert counted.forwards == 3
    for name in ("max_batch", "safe_batch", "best_throughput_batch", "trials", "memory", "throughput"):
        assert getattr(hit, name) == getattr(missed, name), name
    assert (hit.budget_bytes, hit.settings, hit.device) == (missed.budget_bytes, missed.settings, missed.device)
    assert hit.throughput is not None  # the timed sizes too
    assert hit.from_cache is not None
    assert hit.from_cache.path == str(path) and hit.from_cache.key == path.stem
    assert hit.from_cache.elapsed_s == missed.elapsed_s and hit.from_cache.world_size == 1
    written = datetime.datetime.strptime(hit.from_cache.written_at, "%Y-%m-%dT%H:%M:%SZ")
    assert abs(datetime.datetime.utcnow() - written) < datetime.timedelta(hours=1)
    assert hit.notes[: len(missed.notes)] == missed.notes
    cap = f"{format_bytes(safe_cap(missed.budget_bytes or 0, 0.10))}"
    said = f"no search ran; safe batch {missed.safe_batch} checked with 2 steps under {cap}: it fits"
    said += f"; max batch {missed.max_batch} with 1 step under {format_bytes(missed.budget_bytes or 0)}: it fits"
    assert f"from the cache: {path}, written {hit.from_cache.written_at}; {said}" in hit.notes
    shown = [line for line in str(hit).splitlines() if line.startswith("from the cache")]
    assert len(shown) == 1 and str(path) in shown[0] and hit.from_cache.written_at in shown[0]
    assert Result.from_json(hit.to_json()) == hit  # the record reads back
    assert len(entries(tmp_path)) == 1  # a hit writes nothing


def test_without_verification_a_hit_never_runs_the_model(tmp_path: Path) -> None:
    """``verify_steps=0`` verifies nothing, the hit's check included."""
    model, sample = small()
    batchfit.find(model, sample, cache=tmp_path, verify_steps=0, **FAST)
    counted = Counted(model)
    hit = batchfit.find(model, sample, cache=tmp_path, verify_steps=0, **FAST, **counted.kwargs())
    assert hit.from_cache is not None and (counted.trials, counted.started, counted.forwards) == (0, 0, 0)
    assert hit.notes[-1].endswith("; no trial ran")


def test_weights_alone_changing_is_a_hit(tmp_path: Path) -> None:
    """A model after training keys as before: the key holds the structure, not the values."""
    model, sample = small()
    first = batchfit.find(model, sample, cache=tmp_path, **FAST)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(sample).pow(2).mean().backward()
    optimizer.step()
    again = batchfit.find(model, sample, cache=tmp_path, **FAST)
    assert again.from_cache is not None and again.max_batch == first.max_batch


def test_a_learning_rate_change_alone_is_a_hit_and_another_optimizer_a_miss(tmp_path: Path) -> None:
    """The learning rate, weight decay, betas and eps change the numbers, not the tensors a step
    allocates: they are not in the key. The optimizer's type is."""
    model, sample = small()
    first = batchfit.find(
        model, sample, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), cache=tmp_path, **FAST
    )
    tuned = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, betas=(0.8, 0.95), eps=1e-6)
    again = batchfit.find(model, sample, optimizer=tuned, cache=tmp_path, **FAST)
    assert first.from_cache is None and again.from_cache is not None and again.max_batch == first.max_batch
    counted = Counted(model)
    other = batchfit.find(
        model, sample, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), cache=tmp_path, **FAST,
        **counted.kwargs(),
    )  # fmt: skip
    assert other.from_cache is None and counted.trials > 0
    assert len(entries(tmp_path)) == 2


# The key -----------------------------------------------------------------------------------------
class Wrapper(nn.Module):
    """Stands for DDP or FSDP: a wrapper is a module class like any other."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _with(model: nn.Module, change: Any) -> nn.Module:
    change()
    return model


def _adamw(model: nn.Module, **settings: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **settings)


#: name -> (model, sample, options) -> what the probe is given instead.
CHANGES: dict[str, Any] = {
    "amp": lambda m, s, o: (m, s, replace(o, amp="bf16")),
    "optimizer class": lambda m, s, o: (m, s, replace(o, optimizer=torch.optim.SGD(m.parameters(), lr=1e-3))),
    "optimizer amsgrad": lambda m, s, o: (m, s, replace(o, optimizer=_adamw(m, amsgrad=True))),
    "optimizer foreach": lambda m, s, o: (m, s, replace(o, optimizer=_adamw(m, foreach=False))),
    "a zero weight decay": lambda m, s, o: (m, s, replace(o, optimizer=_adamw(m, weight_decay=0.0))),
    "default optimizer": lambda m, s, o: (m, s, replace(o, optimizer=None)),
    "mode": lambda m, s, o: (m, s, replace(o, mode="inference")),
    "a frozen layer": lambda m, s, o: (_with(m, lambda: m.net[0].weight.requires_grad_(False)), s, o),
    "a wider layer": lambda m, s, o: (small(hidden=65)[0], s, o),
    "a module in eval": lambda m, s, o: (_with(m, lambda: m.net[1].eval()), s, o),
    "gradient checkpointing": lambda m, s, o: (_with(m, lambda: setattr(m.net, "gradient_checkpointing", True)), s, o),
    "a wrapper": lambda m, s, o: (Wrapper(m), s, o),
    "a buffer": lambda m, s, o: (_with(m, lambda: m.register_buffer("extra", torch.zeros(3))), s, o),
    "the sample's shape": lambda m, s, o: (m, torch.randn(8, 32), o),
    "the sample's dtype": lambda m, s, o: (m, s.double(), o),
    "the sample's tree": lambda m, s, o: (m, (s,), o),
    "loss_fn": lambda m, s, o: (m, s, replace(o, loss_fn=lambda out, batch: out.sum())),
    "criterion": lambda m, s, o: (m, (s, torch.zeros(4).long()), replace(o, criterion=nn.CrossEntropyLoss())),
    "memory_limit": lambda m, s, o: (m, s, replace(o, memory_limit="2MiB")),
    "reserve": lambda m, s, o: (m, s, replace(o, reserve="64KiB")),
    "headroom": lambda m, s, o: (m, s, replace(o, headroom=0.2)),
    "init_batch": lambda m, s, o: (m, s, replace(o, init_batch=4)),
    "max_batch": lambda m, s, o: (m, s, replace(o, max_batch=512)),
    "multiple_of": lambda m, s, o: (m, s, replace(o, multiple_of=8)),
    "steps_per_trial": lambda m, s, o: (m, s, replace(o, steps_per_trial=3)),
    "verify_steps": lambda m, s, o: (m, s, replace(o, verify_steps=3)),
    "strategy": lambda m, s, o: (m, s, replace(o, strategy="binary")),
    "time_budget": lambda m, s, o: (m, s, replace(o, time_budget=60.0)),
    "timed_steps": lambda m, s, o: (m, s, replace(o, timed_steps=3)),
    "scan_batches": lambda m, s, o: (m, s, replace(o, scan_batches=8)),
}


def _key(model: nn.Module, sample: Any, options: Options, **versions: str) -> str:
    return probe_key(Prober(model, sample, options=options), options, **versions).hex


def _base() -> tuple[nn.Module, torch.Tensor, Options]:
    model, sample = small()
    return model, sample, Options(memory_limit="1MiB", optimizer=_adamw(model))


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_part_of_the_key_changing_is_a_miss(change: str) -> None:
    model, sample, options = _base()
    before = _key(model, sample, options)
    assert _key(*_base()) == before  # the same probe again: the same key
    assert _key(*CHANGES[change](model, sample, options)) != before


def _sgd(model: nn.Module, **settings: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), **settings)


#: (first optimizer, second optimizer, same key?): what changes memory keys apart, values do not.
OPTIMIZER_SETTINGS: dict[str, Any] = {
    "AdamW lr": (lambda m: _adamw(m), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), True),
    "AdamW betas, eps, decay": (
        lambda m: _adamw(m),
        lambda m: _adamw(m, betas=(0.5, 0.9), eps=1e-5, weight_decay=0.3),
        True,
    ),
    "SGD momentum value": (lambda m: _sgd(m, lr=0.1, momentum=0.9), lambda m: _sgd(m, lr=0.2, momentum=0.5), True),
    "SGD momentum on": (lambda m: _sgd(m, lr=0.1), lambda m: _sgd(m, lr=0.1, momentum=0.9), False),
    "SGD nesterov": (
        lambda m: _sgd(m, lr=0.1, momentum=0.9),
        lambda m: _sgd(m, lr=0.1, momentum=0.9, nesterov=True),
        False,
    ),
    "AdamW to Adam": (lambda m: _adamw(m), lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), False),
    "AdamW fused": (lambda m: _adamw(m), lambda m: _adamw(m, fused=True), False),
    "L-BFGS history": (
        lambda m: torch.optim.LBFGS(m.parameters(), history_size=10),
        lambda m: torch.optim.LBFGS(m.parameters(), history_size=20),
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZER_SETTINGS))
def test_only_the_optimizer_settings_that_change_memory_are_in_the_key(name: str) -> None:
    first, second, same = OPTIMIZER_SETTINGS[name]
    model, sample = small()
    keys = [_key(model, sample, Options(memory_limit="1MiB", optimizer=make(model))) for make in (first, second)]
    assert (keys[0] == keys[1]) is same


@pytest.mark.parametrize("version", ["torch_version", "batchfit_version"])
def test_another_version_is_another_key(version: str) -> None:
    model, sample, options = _base()
    assert _key(model, sample, options, **{version: "0.0.1"}) != _key(model, sample, options)


@pytest.mark.parametrize("change", ["name", "total_bytes", "config"])
def test_another_device_is_another_key(change: str) -> None:
    model, sample, options = _base()
    device = Prober(model, sample, options=options).device_info
    other = {"name": device.name + " v2", "total_bytes": (device.total_bytes or 0) + 2**30, "config": ()}[change]
    args = (model, sample, options)
    same = cache_key(*args, device, 2**20, 0, torch_version="2", batchfit_version="1")
    assert same == cache_key(*args, device, 2**20, 0, torch_version="2", batchfit_version="1")
    changed = replace(device, **{change: other})
    assert cache_key(*args, changed, 2**20, 0, torch_version="2", batchfit_version="1").hex != same.hex


def test_the_weights_the_index_and_the_world_size_are_not_in_the_key() -> None:
    model, sample, options = _base()
    before = _key(model, sample, options)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3).add_(1)
    assert _key(model, sample, options) == before
    assert _key(model, sample, replace(options, distributed=False, rank_timeout=5.0, restore_rng=False)) == before
    assert _key(model, sample, replace(options, noise_scale=True, noise_passes=16)) == before


def test_a_hugging_face_model_s_activation_checkpointing_is_in_the_key_without_a_deprecation_warning() -> None:
    """Checkpointing trades memory for compute: the same model with it on is another answer."""
    transformers = pytest.importorskip("transformers")
    import warnings

    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (1, 16))
    options = Options(memory_limit="64MiB")  # in bytes: the CPU's default limit moves with free memory
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5 deprecates is_gradient_checkpointing
        plain = _key(model, {"input_ids": ids, "labels": ids}, options)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        assert _key(model, {"input_ids": ids, "labels": ids}, options) != plain


def test_make_batch_keys_on_what_it_builds_and_leaves_the_random_generator_alone() -> None:
    model, _ = small()

    def build(batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 32)

    def build_wide(batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 33)

    options = Options(memory_limit="1MiB", make_batch=build)
    state = torch.get_rng_state()
    key = probe_key(Prober(model, None, options=options), options)
    assert torch.equal(torch.get_rng_state(), state)
    assert key.fields["batch"]["leaves"] == [["batch", [2, 32], "torch.float32"]]
    wide = replace(options, make_batch=build_wide)
    assert probe_key(Prober(model, None, options=wide), wide).hex != key.hex


def test_seq_len_keys_on_the_batch_cut_to_it() -> None:
    model, sample = examples.gpt()
    keys = {
        seq_len: probe_key(Prober(model, sample, options=o), o).fields["batch"]["leaves"]
        for seq_len in (None, 16)
        for o in [Options(memory_limit="64MiB", seq_len=seq_len)]
    }
    assert keys[None] != keys[16] and [16] == [leaf[1][1] for leaf in keys[16]][:1]


# Entries that cannot be trusted ----------------------------------------------------------------
def _edited(field: str, value: Any) -> Any:
    def edit(text: str) -> str:
        entry = json.loads(text)
        where = entry
        *path, last = field.split(".")
        for name in path:
            where = where[int(name) if isinstance(where, list) else name]
        where[int(last) if isinstance(where, list) else last] = value
        return json.dumps(entry)

    return edit


BROKEN = {
    "not JSON": (lambda text: "{not json", "not valid JSON"),
    "truncated": (lambda text: text[: len(text) // 2], "not valid JSON"),
    "empty": (lambda text: "", "it is empty"),
    "not an object": (lambda text: "[1, 2]", "not a JSON object"),
    "another schema": (_edited("schema", "batchfit.cache/0"), "its schema is 'batchfit.cache/0'"),
    "a mismatched key": (_edited("key", "0" * 64), "the key inside it is not its file's"),
    "edited key fields": (_edited("key_fields.search.headroom", "float 0.5"), "its key fields do not hash"),
    "no time": (_edited("written_at", None), "it says not when it was written"),
    "a refused result": (_edited("result.max_batch", "big"), "its result is refused (not a batchfit result"),
    "a time with an escape": (_edited("written_at", "\x1b[2J"), "it says not when it was written"),
    # The tampering: an answer its own trials contradict.
    "a max no trial fitted": (
        lambda text: _edited("result.safe_batch", 3600)(_edited("result.max_batch", 4000)(text)),
        "its answer contradicts its own trials: max_batch 4000 fitted no trial under the budget",
    ),
    "a max above a failed size": (
        _edited("result.trials.0.fits", False),
        lambda text: (
            f"its answer contradicts its own trials: max_batch {json.loads(text)['result']['max_batch']} is "
            "at or above batch 2, which ran out of memory in its trials"
        ),
    ),
    "a verified safe batch never verified": (
        _edited("result.safe_batch", 1),
        "its answer contradicts its own trials: safe_batch 1 is said to be verified, and no verification",
    ),
    "a throughput batch that never ran": (
        _edited("result.best_throughput_batch", 4000),
        "its answer contradicts its own trials: best_throughput_batch 4000 fitted no trial",
    ),
    "memory said not monotone": (
        _edited("result.non_monotone", True),
        "its answer contradicts its own trials: it says memory was not monotone, and its trials say otherwise",
    ),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A good entry's file name and text, from one real probe."""
    directory = tmp_path_factory.mktemp("stored")
    model, sample = small()
    batchfit.find(model, sample, cache=directory, **FAST)
    (path,) = entries(directory)
    return path.name, path.read_text()


#: The damage a real probe meets in the test below; every other kind is checked on the entry alone.
PROBED = (
    "not JSON", "truncated", "empty", "another schema", "a mismatched key", "a refused result", "a max no trial fitted",
)  # fmt: skip


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_every_kind_of_damage_is_named(broken: str, stored: tuple[str, str]) -> None:
    name, text = stored
    damage, why = BROKEN[broken]
    why = why(text) if callable(why) else why
    assert check_entry(text.encode(), Path(name).stem) is None
    said = check_entry(damage(text).encode(), Path(name).stem)
    assert said is not None and said.startswith(why), said


@pytest.mark.slow
@pytest.mark.parametrize("broken", PROBED)
def test_an_entry_that_cannot_be_trusted_is_a_miss_with_a_note_then_rewritten(
    broken: str, stored: tuple[str, str], tmp_path: Path
) -> None:
    name, text = stored
    damage, why = BROKEN[broken]
    path = tmp_path / name
    path.write_text(damage(text))
    model, sample = small()
    counted = Counted(model)

    result = batchfit.find(model, sample, cache=tmp_path, **FAST, **counted.kwargs())

    assert result.from_cache is None and counted.trials > 0
    (note,) = [n for n in result.notes if "cache entry" in n]
    assert note.startswith(f"the cache entry {path} was ignored: {why}") and note.endswith("; probed again")
    assert check_entry(path.read_bytes(), path.stem) is None  # rewritten by the fresh answer
    again = batchfit.find(model, sample, cache=tmp_path, **FAST)
    assert again.from_cache is not None and again.max_batch == result.max_batch
    assert not any("cache entry" in n for n in again.notes)  # the stored answer carries no cache note


def test_an_entry_from_another_world_size_keeps_per_rank_sizes_and_says_so(
    stored: tuple[str, str], tmp_path: Path
) -> None:
    """The key leaves the world size out (an elastic restart reuses the answer): an entry a job
    of 4 ranks wrote holds its per-rank sizes here, and the note says whose rates they are."""
    name, text = stored
    (tmp_path / name).write_text(_edited("result.world_size", 4)(text))
    model, sample = small()
    hit = batchfit.find(model, sample, cache=tmp_path, **FAST)
    assert hit.from_cache is not None and hit.from_cache.world_size == 4 and hit.world_size == 1
    assert hit.max_batch == Result.from_json(json.dumps(json.loads(text)["result"])).max_batch
    assert any("measured on 4 ranks, now 1" in n and "samples/s are those of the 4" in n for n in hit.notes)


#: Text a terminal acts on: clear the screen, set the window title, ring, reverse the line's direction.
RAW = ("\x1b[2J", "\x1b]0;", "\x07", "\u202e")


def _rigged(text: str) -> str:
    """The entry ``text`` with terminal escapes (and rich markup) in every kind of text it shows."""
    entry = json.loads(text)
    result = entry["result"]
    result["notes"] = ["\x1b[2Jcleared", "[/] [link=file:///etc]\u202ereversed[/link]"]
    result["device"]["name"] = "\x1b]0;a title\x07CPU"
    result["settings"]["limit_source"] = "memory_limit\x1b[31m"
    return json.dumps(entry)


def test_an_entry_s_text_reaches_no_terminal_raw(stored: tuple[str, str], tmp_path: Path) -> None:
    """A shared cache is written by others: what a hit shows is escaped once, as it is read, so that
    ``str(result)``, the notes, the JSON and the rich view show the escapes as text."""
    from io import StringIO

    from batchfit.view.live import LiveView

    name, text = stored
    (tmp_path / name).write_text(_rigged(text))
    model, sample = small()
    hit = batchfit.find(model, sample, cache=tmp_path, **FAST)
    assert hit.from_cache is not None
    assert hit.notes[:2] == ("\\x1b[2Jcleared", "[/] [link=file:///etc]\\u202ereversed[/link]")
    assert hit.device.name == "\\x1b]0;a title\\x07CPU"
    live = StringIO()
    LiveView(live).summary(hit)  # rich: markup in a note is text too ("[/]" would raise, a link would be one)
    for shown in (str(hit), hit.to_json(), live.getvalue()):
        assert not any(raw in shown for raw in RAW), shown
    assert "\\x1b[2Jcleared" in live.getvalue() and "[link=file:///etc]" in live.getvalue()


def test_a_hit_whose_safe_batch_no_longer_fits_is_probed_again(tmp_path: Path) -> None:
    """The key cannot see everything that changes memory (the model's code, what else holds the
    device): a hit runs its safe batch once, under the budget less its headroom, before it is
    trusted. Here the entry holds a true answer, for a larger budget: self-consistent, and wrong."""
    model, sample = small()
    roomy = batchfit.find(model, sample, memory_limit="1MiB", timed_steps=0)
    options = Options(**FAST)
    key = probe_key(Prober(model, sample, options=options), options)
    path = tmp_path / f"{key.hex}.json"
    path.write_text(json.dumps(entry_document(key.hex, key.fields, roomy)))
    assert check_entry(path.read_bytes(), key.hex) is None  # nothing in it contradicts itself
    counted = Counted(model)

    result = batchfit.find(model, sample, cache=tmp_path, **FAST, **counted.kwargs())

    assert result.from_cache is None and counted.trials > 0 and result.safe_batch < roomy.safe_batch
    cap = format_bytes(safe_cap(result.budget_bytes or 0, 0.10))
    said = f"its safe batch {roomy.safe_batch} ran out of memory when checked under {cap}"
    assert f"the cache entry {path} was ignored: {said}; probed again" in result.notes
    assert Result.from_dict(json.loads(path.read_text())["result"]).safe_batch == result.safe_batch  # rewritten
    assert sum("budget" in note for note in result.notes) == sum("budget" in note for note in roomy.notes)


def _max_moved_up(text: str) -> str:
    """The issue's forgery, consistent with itself: the boundary's failing trial (``max_batch + 1``)
    now a copy of the max's fitting one, and ``max_batch`` moved onto it."""
    entry = json.loads(text)
    result = entry["result"]
    top = result["max_batch"]
    (fitted,) = [t for t in result["trials"] if t["batch_size"] == top and t["kind"] == "search"]
    result["trials"] = [
        {**fitted, "batch_size": top + 1} if t["batch_size"] == top + 1 and not t["fits"] else t
        for t in result["trials"]
    ]
    result["max_batch"] = top + 1
    return json.dumps(entry)


def test_a_hit_whose_max_batch_does_not_fit_is_not_trusted(stored: tuple[str, str], tmp_path: Path) -> None:
    """An entry that agrees with itself, its max one above the truth (a shared directory is written
    by anyone who reaches it): the hit's check runs the stored max once, under the budget, and it
    runs out of memory. The look-up alone: what follows a refused entry is an ordinary probe."""
    name, text = stored
    forged = _max_moved_up(text)
    top = json.loads(forged)["result"]["max_batch"]
    assert check_entry(forged.encode(), Path(name).stem) is None  # nothing in it contradicts itself
    (tmp_path / name).write_text(forged)
    model, sample = small()
    options = Options(cache=tmp_path, **FAST)
    prober = Prober(model, sample, options=options)
    cache = open_cache(prober, options)
    assert cache.path.name == name

    assert cache.look_up(time.monotonic()) is None  # a miss: the probe runs

    budget = format_bytes(Result.from_json(json.dumps(json.loads(text)["result"])).budget_bytes or 0)
    said = f"its max batch {top} ran out of memory when checked under {budget}"
    assert cache.notes == [f"the cache entry {tmp_path / name} was ignored: {said}; probed again"]


def test_a_file_larger_than_any_entry_is_not_read(stored: tuple[str, str], tmp_path: Path) -> None:
    name, _ = stored
    path = tmp_path / name
    with open(path, "wb") as file:
        file.truncate(ENTRY_CAP_BYTES + 1)  # sparse: no disk
    model, sample = small()
    result = batchfit.find(model, sample, cache=tmp_path, **FAST)
    assert f"the cache entry {path} was ignored: it is larger than 64.00 MiB, more than any entry; probed again" in (
        result.notes
    )


#: A child that probes with a cache holding, at the entry's path, what ``argv`` names; its data
#: segment is capped, so that a read of ``/dev/zero`` fails fast instead of filling the machine.
_SPECIAL_ENTRY_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, 3 * 2**30))
import batchfit
from batchfit import examples
said = {}
for cache in sys.argv[1:]:
    model, sample = examples.mlp(in_features=32, hidden=64, depth=1)
    result = batchfit.find(model, sample, cache=cache, memory_limit="160KiB", timed_steps=0)
    said[cache] = [note for note in result.notes if "cache entry" in note]
print(json.dumps(said))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/zero are POSIX")
def test_a_fifo_or_a_device_at_an_entry_s_path_is_not_read(stored: tuple[str, str], tmp_path: Path) -> None:
    """A FIFO would block the read before any trial, ``/dev/zero`` and ``/dev/urandom`` would be
    read until memory runs out: only a regular file is opened. In a child with a deadline, so that
    a regression fails here instead of hanging the suite."""
    name, _ = stored
    made = {"fifo": os.mkfifo, "/dev/zero": Path.symlink_to, "/dev/urandom": Path.symlink_to}
    paths = {}
    for kind in made:
        path = tmp_path / kind.replace("/", "_") / name
        path.parent.mkdir()
        os.mkfifo(path) if kind == "fifo" else path.symlink_to(kind)
        paths[kind] = path
    dirs = [str(path.parent) for path in paths.values()]
    child = subprocess.run(
        [sys.executable, "-c", _SPECIAL_ENTRY_CHILD, *dirs], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    said = json.loads(child.stdout.splitlines()[-1])
    for kind, path in paths.items():
        assert said[str(path.parent)] == [
            f"the cache entry {path} was ignored: it is not a regular file; probed again"
        ], kind
        assert path.is_file() and not path.is_symlink() and check_entry(path.read_bytes(), path.stem) is None


# Writers at once ----------------------------------------------------------------------------------
def test_writers_at_once_never_leave_a_torn_entry(stored: tuple[str, str], tmp_path: Path) -> None:
    name, text = stored
    path = tmp_path / "shared" / name  # the directory is made by whichever writer comes first
    spawn = multiprocessing.get_context("spawn")
    writers = [spawn.Process(target=write_many, args=(str(path), text, w, 25)) for w in range(3)]
    for process in writers:
        process.start()
    seen = 0
    while any(process.is_alive() for process in writers) or not seen:
        try:
            read = path.read_bytes()
        except FileNotFoundError:
            continue
        assert check_entry(read, path.stem) is None, read[-80:]  # complete, or not there at all
        seen += 1
    for process in writers:
        process.join(60)
        assert process.exitcode == 0
    assert check_entry(path.read_bytes(), path.stem) is None
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temporary file left behind


# A directory that cannot be written, and bad input ----------------------------------------------
def test_a_directory_that_cannot_be_written_is_a_note_not_a_lost_probe(tmp_path: Path) -> None:
    in_the_way = tmp_path / "a file"
    in_the_way.write_text("not a directory")
    model, sample = small()
    result = batchfit.find(model, sample, cache=in_the_way, **FAST)
    assert result.max_batch > 1 and result.from_cache is None
    (note,) = [n for n in result.notes if "cache" in n]
    assert f"could not be stored in the cache {in_the_way}" in note and "nothing was cached" in note


@pytest.mark.parametrize("bad", [123, b"dir", ["dir"]])
def test_a_cache_of_the_wrong_type_is_a_type_error_naming_it(bad: Any) -> None:
    model, sample = small()
    with pytest.raises(TypeError, match=r"^cache must be a directory \(a str or os.PathLike\) or None, got "):
        batchfit.find(model, sample, cache=bad, **FAST)
    with pytest.raises(ValueError, match="cache must name a directory"):
        Options(cache="")


# The noise scale ---------------------------------------------------------------------------------
def test_the_noise_scale_is_measured_again_on_a_hit_and_never_stored(tmp_path: Path) -> None:
    """It depends on the weights, which the key leaves out."""
    model, _ = small()
    data = TensorDataset(torch.randn(256, 32, generator=torch.Generator().manual_seed(0)))
    loader = DataLoader(data, batch_size=8, collate_fn=lambda rows: torch.stack([r[0] for r in rows]))
    missed = batchfit.find(model, loader, noise_scale=True, noise_passes=8, cache=tmp_path, **FAST)
    (path,) = entries(tmp_path)
    assert missed.noise_scale is not None and json.loads(path.read_text())["result"]["noise_scale"] is None
    counted = Counted(model)
    hit = batchfit.find(model, loader, noise_scale=True, noise_passes=8, cache=tmp_path, **FAST, **counted.kwargs())
    assert hit.from_cache is not None and hit.noise_scale is not None
    assert counted.trials == counted.started == 0 and counted.forwards > 0  # passes of the noise scale, no trial


# The command line --------------------------------------------------------------------------------
def test_probe_with_cache_twice_answers_the_second_time_from_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """And shows the entry's text as text: escapes in it (another writer's) do not reach the terminal."""
    cache, first, second = tmp_path / "cache", tmp_path / "first.json", tmp_path / "second.json"
    command = ["probe", "batchfit.examples:gpt", "--device", "cpu", "--memory-limit", "64MiB", "--max-batch", "16"]
    command += ["--timed-steps", "0", "--cache", str(cache)]
    assert main([*command, "--json", str(first)]) == 0
    (path,) = entries(cache)
    path.write_text(_rigged(path.read_text()))
    capsys.readouterr()
    assert main([*command, "--json", str(second)]) == 0
    captured = capsys.readouterr()
    before, after = Result.from_json(first.read_text()), Result.from_json(second.read_text())
    assert before.from_cache is None and after.from_cache is not None
    assert (after.max_batch, after.safe_batch, after.trials) == (before.max_batch, before.safe_batch, before.trials)
    assert after.from_cache.path == str(path)
    said = r"no search ran; safe batch \d+ checked with 2 steps under [\d.]+ MiB: it fits"
    assert re.search(rf"from the cache: .*written \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ; {said}", captured.out)
    assert "\\x1b[2Jcleared" in captured.out and not any(raw in captured.out + captured.err for raw in RAW)


@pytest.mark.parametrize("extra", [["--require-batch", "4"], ["--nproc-per-trial", "2"]])
def test_probe_refuses_cache_where_there_is_no_probe_to_keep(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["probe", "batchfit.examples:mlp", "--device", "cpu", "--cache", str(tmp_path), *extra])
    assert code == 2 and "--cache" in capsys.readouterr().err
    assert not entries(tmp_path)


# Ranks ---------------------------------------------------------------------------------------------
def _rank(rank: int, store: str, cache: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model, sample = small()
        said = []
        for headroom in (0.10, 0.2, 0.2):  # the stored entry; another setting; that setting again
            result = batchfit.find(
                model, sample, cache=cache, distributed=True, rank_timeout=60.0, headroom=headroom, **FAST
            )
            said.append([result.from_cache is not None, result.max_batch, result.world_size, list(result.notes)])
        Path(out).write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.skipif(sys.platform == "win32", reason="gloo over a file store")
def test_ranks_take_rank_0s_decision_together_and_only_rank_0_writes(stored: tuple[str, str], tmp_path: Path) -> None:
    """Two ranks: an entry one process wrote is a hit on both (with the world-size note); a
    changed setting misses on both, and one entry is written."""
    name, text = stored
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / name).write_text(text)
    spawn = multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(target=_rank, args=(r, str(tmp_path / "store"), str(cache), str(tmp_path / f"{r}.json")))
        for r in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(240)
        assert process.exitcode == 0
    said = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert said[0] == said[1]  # the same decision and the same answer on every rank
    (stored_hit, missed, hit) = said[0]
    assert stored_hit[:3] == [True, Result.from_dict(json.loads(text)["result"]).max_batch, 2]
    assert any("measured on 1 rank, now 2" in note for note in stored_hit[3])
    assert missed[0] is False and missed[2] == 2
    assert hit[:3] == [True, missed[1], 2] and not any("measured on" in note for note in hit[3])
    assert len(entries(cache)) == 2 and not [p for p in cache.iterdir() if p.suffix != ".json"]

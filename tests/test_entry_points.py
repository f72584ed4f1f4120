"""`find` and `estimate` take a model or a target plus a rank count (`world_size`), one word for it.

A target ("module:factory") with `world_size` is the job search (`find`) or the sharded estimate
(`estimate`); `find_sharded` and `estimate_sharded` are the same calls under the names they shipped
with, and the old spellings (`find_sharded(nproc=)`, `estimate(device=)`, `what_if(device=)`,
Accelerate's `headroom=`) still work, with a `DeprecationWarning`, giving the same answer. What
belongs to one kind is refused with the other, by name, before anything runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit.accelerate import find_executable_batch_size

ROOT = Path(__file__).resolve().parents[1]
FSDP = f"{Path(__file__).resolve().parent / 'fsdp_target.py'}:build"
GPT = f"{ROOT / 'benchmarks' / 'sharded_targets.py'}:gpt"
#: The job search's settings of tests/test_sharded.py: the FSDP2 MLP's boundary at 95 per rank.
JOBS = {"memory_limit": "16MiB", "device": "cpu", "rank_timeout": 30.0, "trial_timeout": 60.0}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


# A model with a target's keywords, a target with a model's -------------------------------------------
@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"world_size": 2}, "the ranks of a model are the ones launched"),
        ({"trial_log": "trials.jsonl"}, r"trial_log=: a job search's own"),
        ({"trial_timeout": 60.0, "guess": 4}, r"trial_timeout=, guess=: a job search's own"),
        ({"estimate": False}, r"estimate=: a job search's own"),
    ],
)
def test_find_of_a_model_refuses_a_targets_keywords_by_name(given: dict[str, Any], said: str) -> None:
    with pytest.raises(TypeError, match=said):
        batchfit.find(_model(), torch.randn(2, 32), **given)


def test_find_of_a_target_needs_world_size_and_takes_no_sample() -> None:
    with pytest.raises(TypeError, match=r"needs world_size=: the ranks of every job"):
        batchfit.find(FSDP, **JOBS)
    with pytest.raises(TypeError, match="a target's factory returns the sample"):
        batchfit.find(FSDP, torch.randn(2, 32), world_size=2, **JOBS)


@pytest.mark.parametrize(
    ("given", "error", "said"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive int"),
        ({"world_size": 2.0}, TypeError, "world_size must be a positive int"),
        ({"world_size": 2, "headroom": 2}, ValueError, "headroom must be a fraction"),
        ({"world_size": 2, "loss_fn": lambda out, batch: out.sum()}, ValueError, "loss_fn cannot reach the ranks"),
    ],
)
def test_find_of_a_target_checks_as_find_sharded_does_before_any_job(
    given: dict[str, Any], error: type, said: str
) -> None:
    for call in (batchfit.find, batchfit.find_sharded):
        with pytest.raises(error, match=said):
            call(FSDP, estimate=False, **{**JOBS, **given})


def test_find_sharded_nproc_warns_and_names_the_keyword_it_was_given() -> None:
    with pytest.warns(DeprecationWarning, match=r"find_sharded\(nproc=...\) is now find_sharded\(world_size=...\)"):
        with pytest.raises(ValueError, match="nproc must be a positive int"):
            batchfit.find_sharded(FSDP, nproc=0, estimate=False, **JOBS)
    with pytest.raises(TypeError, match="got both nproc= and world_size="):
        batchfit.find_sharded(FSDP, 2, nproc=2, **JOBS)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"world_size": 2}, "the ranks of a model are the ones launched"),
        ({"timeout_s": 5.0}, "timeout_s=: it bounds a target's process"),
    ],
)
def test_estimate_of_a_model_refuses_a_targets_keywords_by_name(given: dict[str, Any], said: str) -> None:
    with pytest.raises(TypeError, match=said):
        batchfit.estimate(_model(), torch.randn(2, 32), memory_limit="64MiB", **given)


def test_estimate_of_a_target_needs_world_size_and_refuses_what_its_process_cannot_take() -> None:
    with pytest.raises(TypeError, match=r"needs world_size=: the ranks of the job"):
        batchfit.estimate(GPT, memory_limit="32MiB")
    with pytest.raises(TypeError, match=r"got sample=, seq_lens=: a target's factory returns its sample"):
        batchfit.estimate(GPT, torch.zeros(2, 8), world_size=2, memory_limit="32MiB", seq_lens=[8])
    with pytest.raises(TypeError, match="needs memory_limit="):  # estimate_sharded's own check, reached
        batchfit.estimate(GPT, world_size=2)


# The old spellings: the same answer, with a warning ----------------------------------------------------
@pytest.mark.slow  # two estimates, about 1 s each on a loaded machine
def test_estimate_device_is_for_device_with_a_warning() -> None:
    model, sample = _model(), torch.randn(2, 32)
    new = batchfit.estimate(model, sample, memory_limit="64MiB", for_device="cpu", max_batch=64)
    with pytest.warns(DeprecationWarning, match=r"estimate\(device=...\) is now estimate\(for_device=...\)"):
        old = batchfit.estimate(model, sample, memory_limit="64MiB", device="cpu", max_batch=64)
    assert (old.max_batch, old.safe_batch, old.device.name) == (new.max_batch, new.safe_batch, "estimate for cpu")
    # The old name reaches the card's check as the new one does (a card no backend models, before any trace).
    with pytest.raises(ValueError) as refused:
        batchfit.estimate(model, sample, memory_limit="64MiB", for_device="tpu")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=str(refused.value)[:40]):
        batchfit.estimate(model, sample, memory_limit="64MiB", device="tpu")
    with pytest.raises(TypeError, match="got both device= and for_device="):
        batchfit.estimate(model, sample, memory_limit="64MiB", device="cuda", for_device="cuda")


@pytest.mark.slow
def test_what_if_device_is_for_device_with_a_warning() -> None:
    model, sample = _model(), torch.randn(2, 32)
    new = batchfit.what_if(model, sample, memory_limit="16MiB", for_device="cpu", max_batch=64, options=[])
    with pytest.warns(DeprecationWarning, match=r"what_if\(device=...\) is now what_if\(for_device=...\)"):
        old = batchfit.what_if(model, sample, memory_limit="16MiB", device="cpu", max_batch=64, options=[])
    assert old == new and new.device == "cpu"


def test_accelerate_headroom_is_margin_with_a_warning() -> None:
    def train(batch_size: int) -> None:
        pass

    assert find_executable_batch_size(train, margin=0.25).margin == 0.25
    with pytest.warns(DeprecationWarning, match=r"\(headroom=...\) is now .*\(margin=...\), a fraction of samples"):
        assert find_executable_batch_size(train, headroom=0.25).margin == 0.25
    with pytest.warns(DeprecationWarning):
        assert find_executable_batch_size(headroom=0.25)(train).margin == 0.25  # as a decorator factory
    with pytest.raises(ValueError, match=r"margin must be a fraction in \[0, 1\)"):
        find_executable_batch_size(train, margin=1.0)


# The same answer through every name (processes: slow) -------------------------------------------------
@pytest.mark.distributed
def test_find_of_a_target_and_its_aliases_give_the_same_answer(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    found = batchfit.find(FSDP, world_size=2, trial_log=log, estimate=False, **JOBS)
    # The same key: the aliases read every verdict back from the log, so they run no job.
    alias = batchfit.find_sharded(FSDP, 2, trial_log=log, estimate=False, **JOBS)
    with pytest.warns(DeprecationWarning):
        old = batchfit.find_sharded(FSDP, nproc=2, trial_log=log, estimate=False, **JOBS)
    for other in (alias, old):
        assert (other.max_batch, other.safe_batch, other.world_size) == (found.max_batch, found.safe_batch, 2)
        assert [t.batch_size for t in other.trials] == [t.batch_size for t in found.trials]
    assert found.max_batch == 95


@pytest.mark.slow
def test_estimate_of_a_target_is_estimate_sharded() -> None:
    routed = batchfit.estimate(GPT, world_size=2, memory_limit="32MiB", for_device="cpu")
    sharded = batchfit.estimate_sharded(GPT, 2, memory_limit="32MiB", device="cpu")
    assert (routed.max_batch, routed.safe_batch, routed.world_size) == (sharded.max_batch, sharded.safe_batch, 2)
    assert routed.estimated and math.isclose(routed.budget_bytes, sharded.budget_bytes)

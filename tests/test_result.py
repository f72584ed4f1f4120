"""Result: JSON round trip, readable text, and the memory equation."""

from __future__ import annotations

import json

import pytest

import batchfit
from batchfit import examples
from batchfit.result import SCHEMA, MemoryModel, Trial


@pytest.fixture(scope="module")
def result() -> batchfit.Result:
    model, sample = examples.mlp(in_features=4096, hidden=32, depth=1)
    return batchfit.find(model, sample, memory_limit="3.9MB", steps_per_trial=2)


def test_json_round_trip_is_exact(result: batchfit.Result) -> None:
    text = result.to_json()
    data = json.loads(text)
    assert data["schema"] == SCHEMA
    assert data["max_batch"] == result.max_batch
    assert batchfit.Result.from_json(text) == result


def test_from_json_rejects_other_documents() -> None:
    with pytest.raises(ValueError, match="not a batchfit result"):
        batchfit.Result.from_json('{"schema": "something/else"}')


def test_text_summary_names_the_answers(result: batchfit.Result) -> None:
    text = str(result)
    assert f"max batch          {result.max_batch}" in text
    assert f"safe batch         {result.safe_batch}" in text
    assert "memory equation" in text
    assert text.count("\n") >= len(result.trials) + 6
    assert "OOM (" in text


def test_result_is_frozen(result: batchfit.Result) -> None:
    with pytest.raises(AttributeError):
        result.max_batch = 1  # type: ignore[misc]


def _trial(size: int, peaks: dict[str, int]) -> Trial:
    return Trial(batch_size=size, fits=True, peak_bytes=max(peaks.values()), phase_peaks=tuple(peaks.items()))


def test_memory_model_takes_the_max_of_phase_lines() -> None:
    # The optimizer step is flat at 1000 bytes; backward grows 100 bytes per sample from 200.
    trials = [_trial(b, {"backward": 200 + 100 * b, "step": 1000}) for b in (1, 2, 4, 8, 16)]
    model = MemoryModel.fit(trials)
    assert model is not None
    assert model.phase == "backward"
    assert model.fixed_bytes == 200 and model.per_sample_bytes == pytest.approx(100)
    assert model.predict(2) == 1000  # the flat step phase is the peak at small batches
    assert model.predict(30) == 3200
    assert model.largest_batch_within(3200, ceiling=1000) == 30
    assert model.largest_batch_within(999, ceiling=1000) == 0
    assert model.largest_batch_within(10**9, ceiling=64) == 64


def test_memory_model_needs_two_sizes() -> None:
    assert MemoryModel.fit([_trial(4, {"forward": 10})]) is None
    assert MemoryModel.fit([Trial(batch_size=4, fits=False, phase="forward")]) is None

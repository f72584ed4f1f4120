"""Replayed fake trials (`batchfit.estimation.replay`): the answer every traced trial gives, or no replay at all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import tiny_llama
from torch import nn

import batchfit
from batchfit import examples
from batchfit.estimation import fake_trials, replay
from batchfit.estimation.fake_trials import FakeProbe

MiB = 2**20


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trial traced, as before replays existed."""
    monkeypatch.setattr(FakeProbe, "_record", lambda self: "replay switched off by the test")


def _reasons(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What each probe's recording decided: a `Replay`, or why there is none."""
    seen: list[Any] = []
    recorded = FakeProbe._record

    def spying(self: FakeProbe) -> Any:
        seen.append(recorded(self))
        return seen[-1]

    monkeypatch.setattr(FakeProbe, "_record", spying)
    return seen


def _same(replayed: batchfit.Result, traced: batchfit.Result) -> None:
    assert replayed.trials == traced.trials  # every size, kind, outcome, step count, peak and message
    assert (replayed.max_batch, replayed.safe_batch) == (traced.max_batch, traced.safe_batch)
    assert replayed.memory == traced.memory
    assert replayed.notes == traced.notes and replayed.assumptions == traced.assumptions


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], dict[str, Any], str | None]] = {
    "gpt cuda": (examples.gpt, {"memory_limit": "160MiB", "device": "cuda", "reserve": 0}, None),
    "cnn cuda (scratch note)": (examples.cnn, {"memory_limit": "96MiB", "device": "cuda", "reserve": 0}, None),
    "gpt rocm expandable": (
        examples.gpt,
        {"memory_limit": "480MiB", "device": "rocm", "reserve": 0},
        "expandable_segments:True",
    ),
    "llama cuda bf16": (tiny_llama, {"memory_limit": "192MiB", "device": "cuda", "reserve": 0, "amp": "bf16"}, None),
}


#: The fast set compares one case; the others are slow (each estimate runs twice, once traced throughout).
FAST = "cnn cuda (scratch note)"


@pytest.mark.parametrize(
    "name", [name if name == FAST else pytest.param(name, marks=pytest.mark.slow) for name in CASES]
)
def test_replayed_trials_are_the_traced_ones(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build, kwargs, alloc_conf = CASES[name]
    if alloc_conf is not None:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)
    model, sample = build()
    reasons = _reasons(monkeypatch)
    replayed = batchfit.estimate(model, sample, **kwargs)
    assert len(reasons) == 1 and isinstance(reasons[0], replay.Replay), reasons
    assert replayed.boundary_reached and any(not t.fits for t in replayed.trials)
    _traced(monkeypatch)
    _same(replayed, batchfit.estimate(model, sample, **kwargs))


def test_a_replayed_estimate_traces_only_the_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    traced: list[int] = []
    replayed: list[int] = []
    run_trial, trial = fake_trials.run_trial, replay.Replay.trial
    monkeypatch.setattr(
        fake_trials,
        "run_trial",
        lambda workload, meter, size, *a: traced.append(size) or run_trial(workload, meter, size, *a),
    )
    monkeypatch.setattr(
        replay.Replay,
        "trial",
        lambda self, meter, state, size, *a: replayed.append(size) or trial(self, meter, state, size, *a),
    )
    model, sample = examples.gpt()
    result = batchfit.estimate(model, sample, memory_limit="160MiB", device="cuda", reserve=0)
    assert traced == [] and replayed == [t.batch_size for t in result.trials]
    # The largest fit was confirmed from scratch, and the safe batch verified, by replays too.
    assert {t.kind for t in result.trials} == {"search", "verify"}


def test_a_cpu_estimate_is_traced_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    reasons = _reasons(monkeypatch)
    model, sample = examples.mlp()
    result = batchfit.estimate(model, sample, memory_limit="32MiB")
    assert len(reasons) == 1 and isinstance(reasons[0], str) and "modelled allocator" in reasons[0]
    assert result.trials


class _Branchy(nn.Module):
    """Takes another path from batch 5 on: a stream no two small sizes can predict."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if x.shape[0] >= 5:
            y = self.inner(y.relu())
        return y


class _Caching(nn.Module):
    """Keeps a tensor from its first call, as a lazily built cache does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(256, 256)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(4 * MiB // 4)
        return self.inner(x) + self.cache[:256]


class _Padded(nn.Module):
    """Pads the batch to a multiple of 8: its bytes are not affine in the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, -x.shape[0] % 8))
        return self.inner(padded)[: x.shape[0]]


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (_Branchy, "the forward at batch 9 was not what the steps at 2 and 3 predict"),
        pytest.param(
            _Caching, "a storage other than the optimizer's state outlived the first step", marks=pytest.mark.slow
        ),
        pytest.param(
            _Padded, "the forward at batch 9 was not what the steps at 2 and 3 predict", marks=pytest.mark.slow
        ),
    ],
)
def test_what_a_replay_cannot_predict_is_traced(
    module: type[nn.Module], why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reasons = _reasons(monkeypatch)
    torch.manual_seed(0)
    sample = torch.randn(2, 64, 256)
    kwargs = {"memory_limit": "128MiB", "device": "cuda", "reserve": 0, "max_batch": 4096}
    result = batchfit.estimate(module(), sample, **kwargs)
    assert reasons == [why]
    monkeypatch.undo()
    _traced(monkeypatch)
    traced = batchfit.estimate(module(), sample, **kwargs)
    if module is _Caching:
        # The recording made the cache, not the first trial: it is counted from the start, where the
        # traced first trial counted it as a leak (and the search's next size follows from that).
        assert (result.max_batch, result.safe_batch) == (traced.max_batch, traced.safe_batch)
        assert result.trials[0].leaked_bytes == 0 and traced.trials[0].leaked_bytes == 4 * MiB
        assert result.trials[0].peak_bytes == traced.trials[0].peak_bytes
    else:
        _same(result, traced)


def test_affine_templates_are_exact_or_refused() -> None:
    events = lambda n: [(replay.ENTER, "forward"), (replay.MALLOC, 0, n), (replay.FREE, 0)]  # noqa: E731
    template = replay._affine([events(2 * 512 + 64), events(3 * 512 + 64)], [2, 3])
    assert template is not None and template[1] == (replay.MALLOC, 0, 64, 512)
    assert replay._at(template, 100) == events(100 * 512 + 64)
    assert replay._affine([events(2 * 512), events(4 * 512 + 1)], [2, 4]) is None  # half a byte per sample
    assert replay._affine([events(8), events(8), events(16)], [2, 3, 9]) is None  # the third size disagrees

"""find() on real models under a CPU memory limit, against an exhaustive scan."""

from __future__ import annotations

import pytest
import torch
from helpers import exhaustive_boundary

import batchfit
from batchfit import examples
from batchfit.probe.safe_batch import ATTEMPTS

# (factory, kwargs, cap): caps chosen so that the true boundary is a few dozen samples, which
# keeps the exhaustive scan (the truth) cheap on a 2-core CPU.
CASES = {
    "mlp": (examples.mlp, {"in_features": 4096, "hidden": 32, "depth": 1}, "3.9MB"),
    "cnn": (examples.cnn, {"image_size": 32, "width": 16}, "6MiB"),
    "gpt": (examples.gpt, {}, "24MiB"),
}
STEPS = 2


# The exhaustive scans of the CNN and the GPT take tens of seconds: the MLP's stays in the fast set.
@pytest.mark.parametrize("name", [n if n == "mlp" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CASES)])
def test_find_returns_the_exhaustive_boundary(name: str) -> None:
    factory, kwargs, cap = CASES[name]
    model, sample = factory(**kwargs)
    truth = exhaustive_boundary(model, sample, cap, STEPS)
    assert 4 < truth < 80, f"cap {cap} gives an unhelpful boundary {truth} for {name}"

    for strategy in ("interpolate", "binary"):
        result = batchfit.find(model, sample, memory_limit=cap, steps_per_trial=STEPS, strategy=strategy)
        assert result.settings.strategy == strategy

        assert result.max_batch == truth
        assert result.boundary_reached and result.stop_reason == "boundary"
        assert not result.non_monotone
        search = result.search_trials
        assert len(search) <= 2 * (result.settings.max_batch - 1).bit_length() + 2
        assert result.trial(truth).fits and not result.trial(truth + 1).fits
        assert result.safe_verified and result.safe_batch <= result.max_batch
        verification = [t for t in result.trials if t.kind == "verify"][-1]
        assert verification.batch_size == result.safe_batch
        assert verification.peak_bytes <= 0.9 * result.budget_bytes
        assert result.best_throughput_batch in {t.batch_size for t in result.trials if t.fits}
        assert all(t.leaked_bytes == 0 for t in result.trials)
        fitted = [t for t in result.trials if t.fits]
        assert all(t.peak_bytes <= result.budget_bytes for t in fitted)
        assert all(t.samples_per_s and t.samples_per_s > 0 for t in fitted)
        failed = [t for t in result.trials if not t.fits]
        assert failed and all(t.phase in {"batch", "forward", "backward", "step"} for t in failed)
        assert all(t.peak_bytes > result.budget_bytes for t in failed)


def test_memory_equation_predicts_the_measured_peaks() -> None:
    model, sample = examples.gpt()
    result = batchfit.find(model, sample, memory_limit="24MiB", steps_per_trial=2)
    memory = result.memory
    assert memory is not None
    assert memory.per_sample_bytes > 0
    assert memory.weights_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert memory.gradient_bytes == memory.weights_bytes
    assert memory.optimizer_state_bytes >= 2 * memory.weights_bytes  # AdamW: two moments (+ steps)
    for trial in result.trials:
        if trial.fits and trial.batch_size >= 4:
            assert abs(memory.predict(trial.batch_size) - trial.peak_bytes) <= 0.05 * trial.peak_bytes


def test_reaching_max_batch_says_the_boundary_was_not_reached() -> None:
    model, sample = examples.mlp()
    for strategy in ("binary", "interpolate"):
        result = batchfit.find(
            model, sample, memory_limit="1GiB", max_batch=24, steps_per_trial=1, verify_steps=1, strategy=strategy
        )
        assert result.max_batch == 24
        assert not result.boundary_reached and result.stop_reason == "max_batch"
        assert any("may be larger" in note for note in result.notes)
        sizes = [t.batch_size for t in result.search_trials]
        if strategy == "binary":
            assert sizes == [2, 4, 8, 16, 24]
        else:  # the measured memory says 24 is far below the budget: it goes straight there
            assert sizes[-1] == 24 and len(sizes) < 5


def test_multiple_of_keeps_every_size_on_the_grid() -> None:
    model, sample = examples.gpt()
    result = batchfit.find(model, sample, memory_limit="24MiB", multiple_of=8, steps_per_trial=2)
    assert all(t.batch_size % 8 == 0 for t in result.trials)
    assert result.max_batch % 8 == 0
    assert result.trial(result.max_batch + 8) is not None
    assert not result.trial(result.max_batch + 8).fits


def test_nothing_fits_names_the_size_and_the_memory() -> None:
    model, sample = examples.gpt()
    with pytest.raises(batchfit.NothingFitsError, match=r"batch size 2 does not fit.*needing at least") as info:
        batchfit.find(model, sample, memory_limit="4MiB")
    assert info.value.batch_size == 2
    assert info.value.needed_bytes > 4 * 2**20
    assert info.value.budget_bytes == 4 * 2**20


def test_callbacks_see_every_trial_in_order() -> None:
    model, sample = examples.gpt()
    started: list[tuple[int, str]] = []
    finished: list[batchfit.Trial] = []
    probe: list[tuple[batchfit.DeviceInfo, int | None, int]] = []
    result = batchfit.find(
        model,
        sample,
        memory_limit="24MiB",
        steps_per_trial=1,
        callback=finished.append,
        on_trial_start=lambda size, kind: started.append((size, kind)),
        on_start=lambda device, budget: probe.append((device, budget, len(started))),
    )
    assert probe == [(result.device, 24 * 2**20, 0)]
    assert tuple(finished) == result.trials
    assert started == [(t.batch_size, t.kind) for t in result.trials]


def test_time_budget_stops_the_search_early() -> None:
    model, sample = examples.gpt()
    result = batchfit.find(model, sample, memory_limit="24MiB", time_budget=1e-9, steps_per_trial=1)
    assert len(result.search_trials) == 1
    assert result.stop_reason == "stopped" and not result.boundary_reached


def test_inference_mode_fits_larger_batches_than_training() -> None:
    model, sample = examples.gpt()
    train = batchfit.find(model, sample, memory_limit="24MiB", steps_per_trial=1, verify_steps=0)
    infer = batchfit.find(model, sample, memory_limit="24MiB", steps_per_trial=1, mode="inference", verify_steps=0)
    assert infer.max_batch > train.max_batch
    assert all(t.phase in (None, "batch", "forward") for t in infer.trials)
    assert infer.memory is not None and infer.memory.optimizer_state_bytes == 0


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_autocast_runs_real_steps(amp: str) -> None:
    model, sample = examples.mlp()
    result = batchfit.find(
        model, sample, amp=amp, memory_limit="64MiB", max_batch=64, steps_per_trial=2, verify_steps=0
    )
    assert result.settings.amp == amp
    assert result.max_batch == 64


def test_make_batch_loss_fn_and_optimizer_factory() -> None:
    import torch

    model, _ = examples.mlp(in_features=32)
    calls: list[int] = []

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(size)
        return torch.randn(size, 32), torch.randint(0, 10, (size,))

    def step_fn(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x), y)

    result = batchfit.find(
        model,
        make_batch=make_batch,
        step_fn=step_fn,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        memory_limit="8MiB",
        steps_per_trial=1,
        verify_steps=1,
    )
    assert calls == [t.batch_size for t in result.trials]
    assert result.memory is not None and result.memory.optimizer_state_bytes == 0  # plain SGD has no state
    assert result.boundary_reached


def test_loss_fn_receives_output_and_batch() -> None:

    model, sample = examples.mlp(in_features=16)
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def loss_fn(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(output.shape), tuple(batch.shape)))
        return output.pow(2).mean()

    batchfit.find(
        model,
        sample,
        loss_fn=loss_fn,
        max_batch=4,
        steps_per_trial=1,
        verify_steps=0,
        memory_limit="64MiB",
        timed_steps=0,
    )
    assert seen[0] == ((2, 10), (2, 16))
    assert seen[-1] == ((4, 10), (4, 16))


def test_memory_a_trial_keeps_is_reported_as_leaked() -> None:
    import torch

    class Hoarder(torch.nn.Module):
        """Keeps every output alive, as a model that caches activations by mistake would."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)
            self.kept: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.linear(x)
            self.kept.append(out.detach())
            return out

    model = Hoarder()
    result = batchfit.find(
        model,
        torch.randn(2, 64),
        memory_limit="8MiB",
        max_batch=8,
        steps_per_trial=1,
        verify_steps=0,
        strategy="binary",
        timed_steps=0,
    )
    assert [t.leaked_bytes for t in result.trials] == [2 * 64 * 4, 4 * 64 * 4, 8 * 64 * 4]
    assert any("left 512 B allocated" in note for note in result.notes)


class HungryLater(torch.nn.Module):
    """Fits during the search; once ``hungry`` (set when verification starts), every step also
    asks for 4 MiB per row, more than the budget at any size: the "found batch runs out of memory
    later" trap, where nothing the search saw fitting verifies."""

    def __init__(self, row_floats: int = 1 << 20) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.hungry = False
        self.row_floats = row_floats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        if self.hungry:
            out = out + torch.zeros(x.shape[0], self.row_floats).sum(1, keepdim=True) * 0
        return out


@pytest.mark.slow
def test_when_no_safe_batch_verifies_only_a_size_that_ran_is_returned_and_said_loudly() -> None:
    model = HungryLater()

    def on_trial_start(batch_size: int, kind: str) -> None:
        model.hungry = kind == "verify"

    result = batchfit.find(
        model, torch.randn(2, 64), memory_limit="4MiB", max_batch=1024, on_trial_start=on_trial_start
    )
    verifies = [t for t in result.trials if t.kind == "verify"]
    # ATTEMPTS step-downs, then the size handed back (the largest that fitted below them) once more
    assert len(verifies) == ATTEMPTS + 1 and not any(t.fits for t in verifies)
    assert not result.safe_verified
    assert result.safe_batch == verifies[-1].batch_size < min(t.batch_size for t in verifies[:-1])
    assert result.safe_batch in {t.batch_size for t in result.trials if t.fits}
    assert any("NO SAFE BATCH WAS VERIFIED" in note for note in result.notes)


def test_when_the_step_downs_fail_the_largest_smaller_size_that_ran_is_verified() -> None:
    """A wall below the step-downs (here 16 KiB more per row once verifying; on a real allocator,
    fragmentation or an address-space limit): the size handed back is verified, not guessed."""
    model = HungryLater(row_floats=4096)

    def on_trial_start(batch_size: int, kind: str) -> None:
        model.hungry = kind == "verify"

    result = batchfit.find(
        model, torch.randn(2, 64), memory_limit="4MiB", max_batch=1024, on_trial_start=on_trial_start
    )
    verifies = [t for t in result.trials if t.kind == "verify"]
    assert len(verifies) == ATTEMPTS + 1
    assert not any(t.fits for t in verifies[:-1]) and verifies[-1].fits
    assert result.safe_verified and result.safe_batch == verifies[-1].batch_size
    assert result.safe_batch < min(t.batch_size for t in verifies[:-1])
    assert result.safe_batch in {t.batch_size for t in result.trials if t.fits and t.kind != "verify"}
    assert any("is the largest size below the failed candidates that fitted a trial" in n for n in result.notes)
    assert not any("NO SAFE BATCH WAS VERIFIED" in note for note in result.notes)


def _mobile_block(cin: int, cout: int, stride: int) -> torch.nn.Module:
    """A MobileNetV3-style inverted residual: expand, depthwise conv, squeeze-excite, project."""
    mid = cin * 4

    class SqueezeExcite(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down, self.up = torch.nn.Conv2d(mid, mid // 4, 1), torch.nn.Conv2d(mid // 4, mid, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = torch.nn.functional.adaptive_avg_pool2d(x, 1)
            return x * torch.nn.functional.hardsigmoid(self.up(torch.relu(self.down(scale))))

    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.Hardswish(),
        nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.Hardswish(),
        SqueezeExcite(), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
    )  # fmt: skip


@pytest.mark.slow
def test_out_of_memory_in_backward_under_autocast_leaves_nothing_behind() -> None:
    """An OOM raised inside backward under CPU autocast can leave the failed graph alive until the
    next backward (pytorch #82218); the trial runs a tiny backward after such an OOM, and any
    leak would show in ``leaked_bytes`` and make the verification fail."""
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish(),
        _mobile_block(16, 24, 2), _mobile_block(24, 40, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(40, 10),
    )  # fmt: skip
    result = batchfit.find(model, torch.randn(2, 3, 32, 32), amp="bf16", memory_limit="9MiB")
    assert any(t.phase == "backward" for t in result.trials if not t.fits)
    assert all(t.leaked_bytes == 0 for t in result.trials)
    assert result.safe_verified


@pytest.mark.slow
def test_a_kept_optimizer_gives_the_peak_a_fresh_one_shows_in_its_second_step() -> None:
    """The search keeps the optimizer between trials and runs one step: its peak must be the
    steady peak that a fresh optimizer only reaches in step 2 (step 1 allocates the state)."""
    model, sample = examples.gpt()
    with batchfit.Prober(model, sample, memory_limit="256MiB") as prober:
        first = prober.trial(4)  # fresh optimizer: two steps
        warm = prober.trial(24)  # kept optimizer: one step
        fresh = prober.trial(24, steps=2, fresh_optimizer=True)
        fresh_one = prober.trial(24, steps=1, fresh_optimizer=True)
    assert (first.steps, warm.steps, fresh.steps) == (2, 1, 2)
    assert warm.peak_bytes == fresh.peak_bytes
    assert fresh_one.peak_bytes is not None and warm.peak_bytes is not None
    assert fresh_one.peak_bytes < warm.peak_bytes  # one fresh step misses the state: what the kept one avoids
    assert all(t.leaked_bytes == 0 for t in (first, warm, fresh, fresh_one))

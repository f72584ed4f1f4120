"""`batchfit.schedule` in a plain loop: the meter reads what the step computes and changes nothing,
the batch grows by the rule with the learning rate, bad input is refused by name, and a resumed run
continues the schedule or says why it cannot."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit.examples import gpt, text_loader
from batchfit.probe.layernorm_meter import LayerNormMeter
from batchfit.probe.noise_meter import NoiseMeter
from batchfit.report.schedule import ScheduleState

SEQ = 16


def _gpt(seed: int = 0) -> nn.Module:
    model, _ = gpt(vocab_size=256, seq_len=SEQ, d_model=32, n_layers=1, n_heads=2, seed=seed)
    return model


def _train(model: nn.Module, schedule: Any, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    batches = iter(text_loader(seq_len=SEQ, batch_size=schedule.rule.micro_batch, seed=seed))
    for _ in range(steps):
        with schedule.step():
            for batch in schedule.micro_batches(batches):
                (model(**batch)["loss"] / schedule.accumulation).backward()
            optimizer.step()
            optimizer.zero_grad()


def test_metering_every_step_leaves_the_training_exactly_as_without_it() -> None:
    trained = []
    for policy in ("noise", "constant"):
        torch.manual_seed(0)
        model = _gpt()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        schedule = batchfit.schedule(model, optimizer, micro_batch=4, accumulation=3, policy=policy, every=1)
        _train(model, schedule, optimizer, steps=6)
        trained.append([p.detach().clone() for p in model.parameters()])
        if policy == "noise":
            assert len(schedule.state.noise) == 6 and schedule.state.windows == 6
    for metered, plain in zip(*trained):
        torch.testing.assert_close(metered, plain, rtol=0, atol=0)


def test_the_window_is_the_micro_batches_norms_and_their_means() -> None:
    model = _gpt()
    batches = iter(text_loader(seq_len=SEQ, batch_size=4, seed=1))
    micro = [next(batches) for _ in range(3)]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(model(**b)["loss"], params) for b in micro]
    flat = [torch.cat([g.reshape(-1) for g in gs]).double() for gs in grads]
    small = sum(float(f @ f) for f in flat) / 3
    mean = sum(flat) / 3
    big = float(mean @ mean)

    meter = NoiseMeter(model, micro_batch=4)
    meter.start()
    for batch in micro:
        (model(**batch)["loss"] / 3).backward()
    window = meter.stop(accumulation=3)
    assert window is not None and (window.small_batch, window.big_batch) == (4, 12)
    assert window.small == pytest.approx(small, rel=1e-4) and window.big == pytest.approx(big, rel=1e-4)
    assert not meter.active
    # the meter's hooks are gone: another backward adds nothing to what it measured
    model(**micro[0])["loss"].backward()
    assert meter.stop(accumulation=3) is not None and meter._small == []


def test_the_batch_grows_by_the_rule_and_the_learning_rate_with_it() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = batchfit.schedule(
        model, optimizer, micro_batch=4, accumulation=2, policy="ramp", thresholds=(16, 48), min_steps=1
    )
    _train(model, schedule, optimizer, steps=8)
    changes = schedule.changes
    assert [c.global_batch for c in changes] == [16, 32] and schedule.accumulation == 8
    assert [c.samples for c in changes] == [16, 48]  # the first step whose samples passed each threshold
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 2)  # sqrt(4) over two doublings, AdamW
    state = schedule.state
    assert state.samples == sum(batch for batch in _batches_taken(state))
    assert state.megatron() == "0:8 16:16 48:32"


def _batches_taken(state: ScheduleState) -> list[int]:
    starts = [(c.step, c.global_batch) for c in state.changes]
    batch, taken = state.rule.global_batch(state.rule.accumulation), []
    for step in range(state.step):
        batch = next((b for s, b in reversed(starts) if s <= step), batch)
        taken.append(batch)
    return taken


def test_the_noise_policy_changes_the_batch_when_the_measured_noise_scale_passes_it() -> None:
    model = _gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    schedule = batchfit.schedule(
        model, optimizer, micro_batch=2, accumulation=2, every=1, min_steps=1, settle=1, decay=0.0
    )
    _train(model, schedule, optimizer, steps=12)
    for change in schedule.changes:
        assert change.noise_scale is not None and change.noise_scale >= change.global_batch
    for point in schedule.state.noise:
        assert point.b_simple is None or math.isfinite(point.b_simple)
    if schedule.changes:
        growth = schedule.changes[-1].global_batch / 4
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * growth)  # linear for SGD


def test_a_resumed_run_continues_the_schedule_and_refuses_another_world_size() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = batchfit.schedule(
        model, optimizer, micro_batch=4, accumulation=2, policy="ramp", thresholds=(8,), min_steps=1
    )
    _train(model, schedule, optimizer, steps=3)
    saved = schedule.state_dict()

    again = batchfit.schedule(
        model, optimizer, micro_batch=4, accumulation=2, policy="ramp", thresholds=(8,), min_steps=1
    )
    again.load_state_dict(saved)
    assert again.state == schedule.state and again.accumulation == schedule.accumulation
    with pytest.raises(ValueError, match="ran on 1 ranks and this run has 2"):
        batchfit.schedule(model, optimizer, micro_batch=4, world_size=2, policy="constant").load_state_dict(saved)
    with pytest.raises(ValueError, match="micro-batches of 4 and this run asks for 8"):
        batchfit.schedule(model, optimizer, micro_batch=8, policy="ramp", thresholds=(8,)).load_state_dict(saved)
    with pytest.raises(ValueError, match="not a batchfit batch schedule"):
        again.load_state_dict({"rule": "?"})


class _Unknown(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Any = None) -> None:
        return None


class _MyAdam(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"accumulation": 1}, ValueError, "accumulation >= 2, train data-parallel .* or meter=.layernorm."),
        ({"meter": "layernorm", "micro_batch": 1}, ValueError, "a micro-batch of 1 has one size only"),
        ({"meter": "weights"}, ValueError, "meter must be one of"),
        ({"policy": "cosine"}, ValueError, "policy must be one of"),
        ({"lr_rule": "cube"}, ValueError, "lr_rule must be one of"),
        ({"micro_batch": 0}, ValueError, "micro_batch must be >= 1"),
        ({"micro_batch": "4"}, TypeError, "micro_batch"),
        ({"max_accumulation": 1}, ValueError, "max_accumulation"),
        ({"policy": "ramp"}, ValueError, "pass thresholds="),
        ({"policy": "ramp", "thresholds": (50, 10)}, ValueError, "thresholds must be increasing"),
        ({"decay": 1.0}, ValueError, "decay must be in"),
        ({"thresholds": "10"}, TypeError, "thresholds must be a sequence"),
    ],
)
def test_bad_input_is_refused_by_name(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    arguments = {"micro_batch": 4, "accumulation": 2, **kwargs}
    with pytest.raises(error, match=message):
        batchfit.schedule(model, optimizer, **arguments)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.param_groups[0]["lr"] == 1e-3


def test_an_optimizer_of_unknown_family_and_an_unpassed_lr_scheduler_are_named() -> None:
    model = _gpt()
    with pytest.raises(ValueError, match="_Unknown should follow the batch: pass lr_rule="):
        batchfit.schedule(model, _Unknown(model.parameters()), micro_batch=4)
    assert batchfit.schedule(model, _Unknown(model.parameters()), micro_batch=4, lr_rule="none").rule.lr_rule == "none"
    assert batchfit.schedule(model, _MyAdam(model.parameters()), micro_batch=4).rule.lr_rule == "sqrt"  # its lineage
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(ValueError, match="pass it as lr_scheduler="):
        batchfit.schedule(model, optimizer, micro_batch=4)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        batchfit.schedule(model, "adam", micro_batch=4)  # type: ignore[arg-type]
    schedule = batchfit.schedule(
        model, optimizer, micro_batch=4, policy="ramp", thresholds=(8,), min_steps=1, lr_scheduler=scheduler
    )
    _train(model, schedule, optimizer, steps=2)
    scheduler.step()
    assert scheduler.base_lrs == [pytest.approx(1e-3 * math.sqrt(2))]  # the scheduler keeps the scaled rate
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * math.sqrt(2))


def test_an_interrupted_step_leaves_no_hook_behind() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = batchfit.schedule(model, optimizer, micro_batch=4, every=1)
    with pytest.raises(KeyboardInterrupt), schedule.step():
        raise KeyboardInterrupt
    assert schedule.meter is not None and not schedule.meter.active and schedule.state.step == 0


def test_the_layernorm_meter_reads_each_examples_gradient_of_the_layernorms() -> None:
    model = _gpt()
    batches = iter(text_loader(seq_len=SEQ, batch_size=4, seed=1))
    micro = [next(batches) for _ in range(2)]
    norms = [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    per_example, per_batch = [], []
    for batch in micro:
        rows = []
        for n in range(4):
            grads = torch.autograd.grad(model(**{k: v[n : n + 1] for k, v in batch.items()})["loss"], norms)
            rows.append(torch.cat([g.reshape(-1) for g in grads]).double())
        per_example += [float(r @ r) for r in rows]
        mean = sum(rows) / 4
        per_batch.append(float(mean @ mean))

    meter = LayerNormMeter(model, micro_batch=4)
    meter.start()
    for batch in micro:
        (model(**batch)["loss"] / 2).backward()
    window = meter.stop(accumulation=2)
    assert window is not None and (window.small_batch, window.big_batch) == (1, 4)
    assert window.small == pytest.approx(sum(per_example) / 8, rel=1e-5)
    assert window.big == pytest.approx(sum(per_batch) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="has none: use meter='micro-batches'"):
        LayerNormMeter(nn.Linear(2, 2), micro_batch=4)


def test_the_layernorm_meter_needs_no_accumulation_and_changes_nothing() -> None:
    trained = []
    for policy in ("noise", "constant"):
        model = _gpt()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        schedule = batchfit.schedule(
            model, optimizer, micro_batch=4, accumulation=1, max_accumulation=1, policy=policy, meter="layernorm",
            every=1,
        )  # fmt: skip
        _train(model, schedule, optimizer, steps=5)
        trained.append([p.detach().clone() for p in model.parameters()])
        if policy == "noise":
            assert schedule.state.windows == 5 and all(p.b_simple is not None for p in schedule.state.noise)
    for metered, plain in zip(*trained):
        torch.testing.assert_close(metered, plain, rtol=0, atol=0)


def test_a_step_the_data_cut_short_counts_its_rows_only() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = batchfit.schedule(model, optimizer, micro_batch=4, accumulation=3, every=1)
    batches = iter([next(iter(text_loader(seq_len=SEQ, batch_size=4)))] * 4)  # 4 micro-batches: a step and 1
    for _ in range(2):
        with schedule.step():
            for batch in schedule.micro_batches(batches):
                (model(**batch)["loss"] / schedule.accumulation).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert schedule.state.step == 2 and schedule.state.samples == 4 * 4
    assert schedule.state.windows == 1  # the short step's norms are not a window of 3 micro-batches


def test_ctrl_c_right_after_the_hooks_are_registered_removes_them() -> None:
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = batchfit.schedule(model, optimizer, micro_batch=4, every=1)
    meter = schedule.meter
    assert isinstance(meter, NoiseMeter)
    registered = meter.start

    def start_then_interrupted(loss_scale: float = 1.0) -> None:
        registered(loss_scale)  # the hooks are on the parameters now: the signal lands on the next line
        assert meter.active
        raise KeyboardInterrupt

    meter.start = start_then_interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt), schedule.step():
        pass
    assert not meter.active and schedule.state.step == 0

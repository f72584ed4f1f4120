"""The batch schedule's pure rule (`batchfit.report.schedule`), exhaustively: the rule's checks, the
learning-rate rule by optimizer, the smoothed noise scale against a direct computation, every change
of the closed loop and of the open-loop baselines against a brute-force simulation over many random
rules, the state's JSON, the resume check, the Megatron and OLMo-core exports, and the text."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from batchfit.report.noise import window_estimates
from batchfit.report.schedule import ScheduleChange, ScheduleState, Window
from batchfit.report.schedule_rule import ScheduleRule, lr_rule_for, ramp_thresholds, seesaw_thresholds
from batchfit.report.schedule_text import schedule_text

EXPONENT = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def rule(**overrides: object) -> ScheduleRule:
    settings: dict[str, object] = {"micro_batch": 4, "accumulation": 2, "max_accumulation": 16}
    return ScheduleRule(**{**settings, **overrides})  # type: ignore[arg-type]


def window(
    state: ScheduleState, b_noise: float, g: float = 1.0, jitter: float = 0.0, rng: random.Random | None = None
) -> Window:
    """The squared norms of a step at ``state``'s batch whose gradient has ``|G|^2 = g`` and noise
    scale ``b_noise`` (``E|g_b|^2 = |G|^2 + tr(Sigma)/b``), each off by up to ``jitter``."""
    rng = rng or random.Random(0)
    small_batch, big_batch = state.rule.micro_batch, state.global_batch
    trace = b_noise * g
    small = (g + trace / small_batch) * (1 + rng.uniform(-jitter, jitter))
    big = (g + trace / big_batch) * (1 + rng.uniform(-jitter, jitter))
    return Window(small=small, big=big, small_batch=small_batch, big_batch=big_batch)


# The rule's checks: each bad argument refused by name, before anything runs.


@pytest.mark.parametrize(
    ("overrides", "error", "named"),
    [
        ({"accumulation": 1}, ValueError, "accumulation >= 2"),
        ({"accumulation": 1}, ValueError, "DDP, world_size >= 2"),
        ({"max_accumulation": 1}, ValueError, "max_accumulation (1) is below the starting accumulation (2)"),
        ({"policy": "ramp", "thresholds": (50, 10)}, ValueError, "thresholds must be increasing"),
        ({"policy": "ramp", "thresholds": (10, 10)}, ValueError, "thresholds must be increasing"),
        ({"policy": "ramp", "thresholds": (0, 10)}, ValueError, "thresholds must be increasing sample counts above 0"),
        ({"policy": "ramp", "thresholds": (1.5,)}, TypeError, "thresholds must be whole sample counts"),
        ({"policy": "ramp", "thresholds": "10"}, TypeError, "thresholds must be a sequence"),
        ({"policy": "ramp"}, ValueError, "pass thresholds="),
        ({"policy": "seesaw"}, ValueError, "pass thresholds="),
        ({"decay": 1.0}, ValueError, "decay must be in [0, 1), got 1.0"),
        ({"decay": -0.1}, ValueError, "decay must be in [0, 1)"),
        ({"decay": math.nan}, ValueError, "decay must be in [0, 1)"),
        ({"decay": True}, TypeError, "decay must be a number"),
        ({"decay": "0.9"}, TypeError, "decay must be a number"),
        ({"policy": "cyclic"}, ValueError, "policy must be one of noise, constant, ramp, seesaw, got 'cyclic'"),
        ({"lr_rule": "cube"}, ValueError, "lr_rule must be one of sqrt, linear, none, got 'cube'"),
        ({"micro_batch": 0}, ValueError, "micro_batch must be positive"),
        ({"every": 2.0}, TypeError, "every must be an int"),
        ({"min_steps": 0}, ValueError, "min_steps must be positive"),
        ({"settle": 0}, ValueError, "settle must be positive"),
        ({"world_size": 0}, ValueError, "world_size must be positive"),
    ],
)
def test_each_bad_argument_is_refused_by_name(overrides: dict, error: type, named: str) -> None:
    with pytest.raises(error) as raised:
        rule(**overrides)
    assert named in str(raised.value)


def test_a_second_batch_size_from_accumulation_or_ranks_makes_a_noise_rule() -> None:
    assert rule(accumulation=1, world_size=2).global_batch(1) == 8  # DDP: one micro-batch a rank
    assert rule(accumulation=1, policy="constant").accumulation == 1  # no noise measured, none needed
    assert rule(decay=0).decay == 0 and rule(decay=0.999).decay == 0.999


def test_thresholds_given_as_a_list_are_held_as_a_tuple() -> None:
    listed = rule(policy="ramp", thresholds=[10, 20])
    assert listed.thresholds == (10, 20) and listed == rule(policy="ramp", thresholds=(10, 20))
    assert hash(listed) == hash(rule(policy="ramp", thresholds=(10, 20)))


@pytest.mark.parametrize(
    ("name", "given", "expected"),
    [
        ("Adam", None, "sqrt"),
        ("AdamW", None, "sqrt"),
        ("RMSprop", None, "sqrt"),
        ("SGD", None, "linear"),
        ("SGD", "sqrt", "sqrt"),
        ("AdamW", "linear", "linear"),
        ("AdamW", "none", "none"),
        ("Shampoo", "none", "none"),
    ],
)
def test_the_learning_rate_rule_follows_the_optimizer_unless_given(name: str, given: str | None, expected: str) -> None:
    assert lr_rule_for(name, given) == expected


def test_an_optimizer_of_no_known_family_without_a_rule_is_named() -> None:
    with pytest.raises(ValueError, match="learning rate of Shampoo should follow the batch: pass lr_rule="):
        lr_rule_for("Shampoo", None)
    with pytest.raises(ValueError, match="lr_rule must be one of sqrt, linear, none, got 'cube'"):
        lr_rule_for("Adam", "cube")


# The smoothed noise scale.


def test_the_moving_averages_match_a_direct_computation() -> None:
    rng = random.Random(3)
    r = rule(every=1, min_steps=10**6, decay=0.8)  # no change: the batch stays, only the averages move
    state = ScheduleState.start(r)
    gradient_sq = trace_sigma = None
    for _ in range(30):
        w = window(state, b_noise=rng.uniform(5, 50), g=rng.uniform(0.5, 2), jitter=0.2, rng=rng)
        g, t = window_estimates(w.small, w.big, w.small_batch, w.big_batch)
        if gradient_sq is None or trace_sigma is None:
            gradient_sq, trace_sigma = g, t
        else:
            gradient_sq, trace_sigma = 0.8 * gradient_sq + 0.2 * g, 0.8 * trace_sigma + 0.2 * t
        state = state.after_step(w)
        assert state.gradient_sq == pytest.approx(gradient_sq, rel=1e-12)
        assert state.trace_sigma == pytest.approx(trace_sigma, rel=1e-12)
        assert state.b_simple == pytest.approx(max(0.0, trace_sigma) / gradient_sq, rel=1e-12)
        assert state.noise[-1].b_simple == state.b_simple
    assert state.windows == 30 and len(state.noise) == 30 and not state.changes
    assert [p.step for p in state.noise] == list(range(1, 31))
    assert [p.samples for p in state.noise] == [8 * k for k in range(1, 31)]


def test_a_noise_scale_without_signal_is_none_and_a_negative_trace_is_zero() -> None:
    start = ScheduleState.start(rule())
    assert start.b_simple is None and not start.meters(1) and start.meters()
    assert replace(start, gradient_sq=0.0, trace_sigma=3.0).b_simple is None
    assert replace(start, gradient_sq=-1.0, trace_sigma=3.0).b_simple is None
    assert replace(start, gradient_sq=2.0, trace_sigma=-3.0).b_simple == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        Window(math.nan, 1.0, 4, 8),
        Window(1.0, math.inf, 4, 8),
        Window(-math.inf, 1.0, 4, 8),
        Window(2.0, 1.0, 8, 8),  # no second batch size
        Window(2.0, 1.0, 8, 4),
    ],
)
def test_a_window_that_is_not_finite_is_dropped(bad: Window) -> None:
    before = ScheduleState.start(rule(every=1)).after_step(Window(2.0, 1.5, 4, 8))
    after = before.after_step(bad)
    assert after == replace(before, step=before.step + 1, samples=before.samples + before.global_batch)


# The closed loop against a brute-force simulation.


def simulate_noise(r: ScheduleRule, draws: list[tuple[float, float, bool]]) -> tuple[list[tuple], float, float]:
    """The rule, step by step, written out: the changes ``(step, samples, accumulation, lr_factor,
    b_simple)`` and the final averages. ``draws``: per step, a noise scale, a jitter seed, whether
    the window is spoilt (not finite)."""
    acc, samples, settled, last, lr = r.accumulation, 0, 0, 0, 1.0
    g_avg = t_avg = None
    changes = []
    for step, (b_noise, seed, spoilt) in enumerate(draws):
        batch = r.micro_batch * acc * r.world_size
        metered = step % r.every == 0
        samples += batch
        done = step + 1
        if metered and not spoilt:
            rng = random.Random(seed)
            small = (1 + b_noise / r.micro_batch) * (1 + rng.uniform(-0.3, 0.3))
            big = (1 + b_noise / batch) * (1 + rng.uniform(-0.3, 0.3))
            b, big_b = r.micro_batch, batch
            g = (big_b * big - b * small) / (big_b - b)
            t = (small - big) / (1 / b - 1 / big_b)
            if g_avg is None or t_avg is None:
                g_avg, t_avg = g, t
            else:
                g_avg, t_avg = r.decay * g_avg + (1 - r.decay) * g, r.decay * t_avg + (1 - r.decay) * t
            settled += 1
        b_simple = None if g_avg is None or t_avg is None or g_avg <= 0 else max(0.0, t_avg) / g_avg
        drowned = g_avg is not None and t_avg is not None and g_avg <= 0 and t_avg > 0  # the signal below the noise
        doubled = acc * 2
        if (
            doubled <= r.max_accumulation
            and done - last >= r.min_steps
            and settled >= r.settle
            and (drowned or (b_simple is not None and r.fraction * b_simple >= r.micro_batch * doubled * r.world_size))
        ):
            acc, settled, last = doubled, 0, done
            lr *= 2 ** EXPONENT[r.lr_rule]
            changes.append((done, samples, acc, lr, b_simple))
    return changes, g_avg, t_avg


def run_noise(r: ScheduleRule, draws: list[tuple[float, float, bool]]) -> ScheduleState:
    state = ScheduleState.start(r)
    for b_noise, seed, spoilt in draws:
        w = None
        if state.meters():
            rng = random.Random(seed)
            batch = state.global_batch
            small = (1 + b_noise / r.micro_batch) * (1 + rng.uniform(-0.3, 0.3))
            big = math.nan if spoilt else (1 + b_noise / batch) * (1 + rng.uniform(-0.3, 0.3))
            w = Window(small, big, r.micro_batch, batch)
        state = state.after_step(w)
    return state


@pytest.mark.parametrize("seed", range(40))
def test_the_closed_loop_changes_as_a_brute_force_simulation_of_its_rule(seed: int) -> None:
    rng = random.Random(seed)
    acc = rng.randint(1, 4)
    r = ScheduleRule(
        micro_batch=rng.randint(1, 8),
        accumulation=acc,
        max_accumulation=acc * 2 ** rng.randint(0, 5) + rng.randint(0, acc),
        world_size=rng.choice([1, 2, 3]) if acc > 1 else rng.choice([2, 4]),
        lr_rule=rng.choice(["sqrt", "linear", "none"]),
        every=rng.randint(1, 4),
        min_steps=rng.randint(1, 30),
        settle=rng.randint(1, 4),
        decay=rng.choice([0.0, 0.5, 0.9]),
    )
    growth = rng.uniform(0.5, 4)
    draws = [(1 + growth * k, rng.random(), rng.random() < 0.1) for k in range(150)]
    state = run_noise(r, draws)
    expected, g_avg, t_avg = simulate_noise(r, draws)
    got = [(c.step, c.samples, c.accumulation, c.lr_factor, c.noise_scale) for c in state.changes]
    assert len(got) == len(expected), (got, expected)
    for have, want in zip(got, expected):
        assert have[:3] == want[:3]
        assert have[3] == pytest.approx(want[3], rel=1e-12)
        assert have[4] == (None if want[4] is None else pytest.approx(want[4], rel=1e-12))
    if g_avg is not None:
        assert state.gradient_sq == pytest.approx(g_avg, rel=1e-9)
        assert state.trace_sigma == pytest.approx(t_avg, rel=1e-9)
    # What the rule promises, change by change.
    previous, last, lr = r.accumulation, 0, 1.0
    for change in state.changes:
        assert change.accumulation == 2 * previous <= r.max_accumulation  # one doubling, never above the most
        assert change.global_batch == r.global_batch(change.accumulation)
        if change.noise_scale is None:  # the signal drowned in the noise: B_simple beyond what was measured
            assert f"did not show above the noise: B_simple beyond the batches measured, >= {change.global_batch}" in (
                change.reason
            )
        else:
            assert r.fraction * change.noise_scale >= change.global_batch
            assert f"x {r.fraction:g} >= the doubled batch {change.global_batch}" in change.reason
        assert change.step - last >= r.min_steps
        assert change.lr_factor == pytest.approx(lr * 2 ** EXPONENT[r.lr_rule])
        previous, last, lr = change.accumulation, change.step, change.lr_factor
    assert state.accumulation == previous and state.lr_factor == lr
    assert state.samples == sum(r.global_batch(a) for a in _accumulations(state))


def _accumulations(state: ScheduleState) -> list[int]:
    """The accumulation each step trained with, from the changes."""
    taken, acc, changes = [], state.rule.accumulation, list(state.changes)
    for step in range(state.step):
        while changes and changes[0].step <= step:
            acc = changes.pop(0).accumulation
        taken.append(acc)
    return taken


def test_the_loop_waits_for_settle_windows_and_min_steps() -> None:
    r = rule(every=1, min_steps=5, settle=3, max_accumulation=8)
    state = ScheduleState.start(r)
    for step in range(1, 5):  # a huge noise scale from the first window: only min_steps holds it back
        state = state.after_step(window(state, b_noise=1e6))
        assert not state.changes, step
    state = state.after_step(window(state, b_noise=1e6))
    assert [c.step for c in state.changes] == [5] and state.settled == 0
    for _ in range(2):  # re-measured at the new batch: settle windows, then min_steps again (5 after 5)
        state = state.after_step(window(state, b_noise=1e6))
    assert len(state.changes) == 1
    for _ in range(3):
        state = state.after_step(None)  # unmetered steps: settle still short
    assert len(state.changes) == 1
    state = state.after_step(window(state, b_noise=1e6))
    assert [c.step for c in state.changes] == [5, 11] and state.accumulation == 8
    for _ in range(50):
        state = state.after_step(window(state, b_noise=1e6))
    assert state.accumulation == 8 and len(state.changes) == 2  # at the most: no further change


def test_the_batch_never_passes_the_noise_scale() -> None:
    r = rule(every=1, min_steps=1, settle=1, decay=0.0, max_accumulation=1024)
    state = ScheduleState.start(r)
    for _ in range(40):
        state = state.after_step(window(state, b_noise=100.0))
    assert state.global_batch == 32  # 4 x 8: the power of two at or below half of 100 (64 is above)
    assert [c.global_batch for c in state.changes] == [16, 32]
    everything = ScheduleState.start(replace(r, fraction=1.0))
    for _ in range(40):
        everything = everything.after_step(window(everything, b_noise=100.0))
    assert everything.global_batch == 64  # fraction=1: the power of two at or below 100 itself


def test_a_constant_schedule_never_changes() -> None:
    r = rule(policy="constant", every=1, min_steps=1, settle=1, decay=0.0)
    state = ScheduleState.start(r)
    for _ in range(60):
        assert not state.meters()
        state = state.after_step(window(state, b_noise=1e6))
    assert not state.changes and state.accumulation == 2 and state.lr_factor == 1.0 and state.samples == 60 * 8


# The open-loop baselines against a brute-force simulation.


def simulate_thresholds(r: ScheduleRule, steps: int) -> list[tuple[int, int, int, float]]:
    """Ramp and Seesaw written out: after each step, the batch doubles once for each threshold its
    samples passed, while the most allows; ``(step, samples, accumulation, lr_factor)`` per change."""
    acc, samples, lr, consumed, changes = r.accumulation, 0, 1.0, 0, []
    per_doubling = 2 ** EXPONENT[r.lr_rule]  # Seesaw too: the rule on top of the run's own decay
    for step in range(1, steps + 1):
        samples += r.global_batch(acc)
        before = acc
        while consumed < len(r.thresholds) and r.thresholds[consumed] <= samples:
            consumed += 1
            if acc * 2 <= r.max_accumulation:
                acc *= 2
                lr *= per_doubling
        if acc != before:
            changes.append((step, samples, acc, lr))
    return changes


@pytest.mark.parametrize("seed", range(60))
def test_ramp_and_seesaw_change_at_the_step_that_passes_each_threshold(seed: int) -> None:
    rng = random.Random(1000 + seed)
    acc = rng.randint(1, 4)
    policy = rng.choice(["ramp", "seesaw"])
    micro, ranks = rng.randint(1, 8), rng.randint(1, 3)
    steps = 80
    reach = micro * ranks * acc * rng.choice([3, 20, steps * 4])  # dense thresholds: several passed in a step
    r = ScheduleRule(
        micro_batch=micro,
        accumulation=acc,
        max_accumulation=acc * 2 ** rng.randint(0, 6) + rng.randint(0, acc),
        world_size=ranks,
        policy=policy,  # type: ignore[arg-type]
        lr_rule=rng.choice(["sqrt", "linear", "none"]),
        min_steps=rng.randint(1, 100),  # the closed loop's guards: an open loop does not wait for them
        settle=rng.randint(1, 5),
        thresholds=tuple(sorted(rng.sample(range(1, reach), min(reach - 1, rng.randint(1, 10))))),
    )
    state = ScheduleState.start(r)
    for _ in range(steps):
        before = state
        state = state.after_step()
        assert state.samples == before.samples + before.global_batch
        if len(state.changes) > len(before.changes):  # exactly at the step whose samples passed a threshold
            applied = [t for t in r.thresholds if before.samples < t <= state.samples]
            assert applied and str(applied[0]) in state.changes[-1].reason
    got = [(c.step, c.samples, c.accumulation, c.lr_factor) for c in state.changes]
    expected = simulate_thresholds(r, steps)
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    assert [g[3] for g in got] == pytest.approx([e[3] for e in expected], rel=1e-12)
    assert all(c.noise_scale is None and c.reason.startswith(f"{policy}: ") for c in state.changes)
    assert state.accumulation <= r.max_accumulation and not state.noise


def test_two_thresholds_passed_in_one_step_double_twice_at_once() -> None:
    r = rule(policy="seesaw", thresholds=(10, 12, 40))
    state = ScheduleState.start(r)
    state = state.after_step().after_step()  # 16 samples: past 10 and 12
    (change,) = state.changes
    assert (change.step, change.samples, change.accumulation, change.global_batch) == (2, 16, 8, 32)
    assert change.lr_factor == pytest.approx(2.0)  # sqrt(4) on top of the run's own decay, halved twice by then
    assert change.reason == "seesaw: 16 samples passed the thresholds 10, 12"
    state = state.after_step()  # 48: past 40
    assert [c.accumulation for c in state.changes] == [8, 16]


# The state's JSON, the resume check, the exports.


def noisy_state() -> ScheduleState:
    r = rule(every=2, min_steps=3, settle=1, decay=0.5, max_accumulation=64)
    state = ScheduleState.start(r)
    rng = random.Random(5)
    for k in range(40):
        w = window(state, b_noise=2.0 + 4 * k, jitter=0.2, rng=rng) if state.meters() else None
        state = state.after_step(w)
    return state


def test_a_state_with_changes_survives_its_json() -> None:
    state = noisy_state()
    assert len(state.changes) >= 2 and state.noise
    state = replace(state, noise=(*state.noise, replace(state.noise[-1], b_simple=None)))
    assert ScheduleState.from_json(state.to_json()) == state
    assert ScheduleState.from_dict(state.to_dict()) == state
    ramp = ScheduleState.start(rule(policy="ramp", thresholds=(8, 40)))
    for _ in range(10):
        ramp = ramp.after_step()
    assert ScheduleState.from_json(ramp.to_json(indent=None)) == ramp


def test_a_resumed_run_must_have_the_saved_world_size_and_micro_batch() -> None:
    state = ScheduleState.start(rule(world_size=2))
    state.check_resumable(2, 4)
    state.check_resumable(2)
    with pytest.raises(ValueError, match="ran on 2 ranks and this run has 3: its global batch \\(16\\)"):
        state.check_resumable(3)
    with pytest.raises(ValueError, match="micro-batches of 4 and this run asks for 8: resume with micro_batch=4"):
        state.check_resumable(2, 8)


def exported(samples: list[int], batches: list[int], micro: int = 384) -> ScheduleState:
    state = ScheduleState.start(rule(micro_batch=micro, accumulation=2, max_accumulation=64, policy="constant"))
    changes = tuple(
        ScheduleChange(step=i + 1, samples=s, accumulation=b // micro, global_batch=b, lr_factor=1.0, noise_scale=None,
                       reason="given")
        for i, (s, b) in enumerate(zip(samples, batches))
    )  # fmt: skip
    return replace(state, changes=changes, accumulation=changes[-1].accumulation)


def test_the_realised_schedule_exports_as_megatron_and_olmo_core_read_it() -> None:
    state = exported([250_000_000, 1_500_000, 1234], [1536, 3072, 6144])
    assert state.steps() == ((0, 0, 768), (1, 250_000_000, 1536), (2, 1_500_000, 3072), (3, 1234, 6144))
    assert state.megatron() == "0:768 250M:1536 1500K:3072 1234:6144"  # suffixes only where exact
    assert state.megatron(seq_length=1000) == "0:768 250B:1536 1500M:3072 1234K:6144"
    assert state.megatron(seq_length=4000) == "0:768 1T:1536 6B:3072 4936K:6144"
    assert state.olmo_core() == {"batch_sizes": [768, 1536, 3072, 6144], "schedule": [0, 250_000_000, 1_500_000, 1234]}
    assert state.olmo_core(seq_length=2048) == {
        "batch_sizes": [768 * 2048, 1536 * 2048, 3072 * 2048, 6144 * 2048],
        "schedule": [0, 250_000_000 * 2048, 1_500_000 * 2048, 1234 * 2048],
    }
    assert ScheduleState.start(rule()).megatron() == "0:8"


def test_seesaw_thresholds_are_where_a_cosine_over_the_budget_halves() -> None:
    budget = 10**7
    points = seesaw_thresholds(budget, 4)
    assert len(points) == 4 and points[0] == budget // 2
    for k, t in enumerate(points, start=1):
        cosine = 0.5 * (1 + math.cos(math.pi * t / budget))
        assert cosine == pytest.approx(0.5**k, abs=math.pi / (4 * budget) * 1.01)  # within half a sample's rounding
        assert 0.5 * (1 + math.cos(math.pi * (t - 1) / budget)) > 0.5**k - 1e-12
    assert list(points) == sorted(set(points))
    assert seesaw_thresholds(1, 3) == (1,)  # two points rounding to one sample: one threshold, above 0
    ScheduleState.start(rule(policy="seesaw", thresholds=seesaw_thresholds(1000, 5)))
    with pytest.raises(ValueError, match="halvings must be positive"):
        seesaw_thresholds(1000, 0)
    with pytest.raises(TypeError, match="budget must be an int"):
        seesaw_thresholds(1000.0, 2)  # type: ignore[arg-type]


def test_ramp_thresholds_are_fractions_of_the_budget() -> None:
    assert ramp_thresholds(1000, [0.5, 0.1, 0.25, 0.1]) == (100, 250, 500)
    assert ramp_thresholds(3, [0.01]) == (1,)
    with pytest.raises(ValueError, match="fractions must be numbers in \\(0, 1\\]"):
        ramp_thresholds(1000, [0.5, 1.5])
    with pytest.raises(ValueError, match="budget must be positive"):
        ramp_thresholds(0, [0.5])


# The text.


def test_the_text_says_the_rule_each_change_the_noise_scale_and_the_megatron_string() -> None:
    state = noisy_state()
    text = schedule_text(state)
    assert str(state) == state.summary() == text
    lines = text.splitlines()
    assert lines[0].startswith("batch schedule (noise): micro-batch 4 x 2 accumulation = global batch 8 at the start")
    assert "at most 256 (accumulation 64)" in lines[0] and "learning rate x sqrt(batch ratio) (sqrt)" in lines[0]
    assert lines[1] == (
        f"now: step 40, {state.samples:,} samples, global batch {state.global_batch:,} "
        f"(accumulation {state.accumulation}), learning rate x{state.lr_factor:.3g} of the start"
    )
    batch = 8
    for line, change in zip(lines[2:], state.changes):
        assert line == (
            f"  step {change.step} ({change.samples:,} samples): batch {batch} -> {change.global_batch}, "
            f"lr x1.41: {change.reason}"
        )
        batch = change.global_batch
    recent = state.noise_scale()
    assert recent is not None
    assert lines[-2] == (
        f"B_simple (smoothed over {state.windows} metered steps): ~{state.b_simple:,.0f} samples; "
        f"the last {recent.windows} windows alone: {recent.interval_text()}"
    )
    assert lines[-1] == f'Megatron-LM: --step-batch-size-schedule "{state.megatron()}"'


def test_the_text_of_a_baseline_and_of_a_run_not_yet_measured() -> None:
    seesaw = ScheduleState.start(rule(policy="seesaw", world_size=2, thresholds=(16,)))
    seesaw = seesaw.after_step()
    assert str(seesaw).splitlines() == [
        "batch schedule (seesaw): micro-batch 4 x 2 accumulation x 2 ranks = global batch 16 at the start, at most "
        "128 (accumulation 16); learning rate x sqrt(batch ratio) (sqrt)",
        "now: step 1, 16 samples, global batch 32 (accumulation 4), learning rate x1.41 of the start",
        "  step 1 (16 samples): batch 16 -> 32, lr x1.41: seesaw: 16 samples passed the threshold 16",
        'Megatron-LM: --step-batch-size-schedule "0:16 16:32"',
    ]
    fresh = str(ScheduleState.start(rule(lr_rule="linear"))).splitlines()
    assert "learning rate x batch ratio (linear), metered every 10 steps" in fresh[0]
    assert fresh[2:] == [
        "  no change yet",
        "B_simple (smoothed over 0 metered steps): not measured yet",
        'Megatron-LM: --step-batch-size-schedule "0:8"',
    ]


def test_a_signal_drowned_in_its_noise_grows_the_batch_and_records_no_number() -> None:
    # |G|^2 = (8 x 0.4 - 4 x 1) / 4 < 0 and tr(Sigma) > 0: the noise scale is beyond what batches of 8 resolve.
    r = ScheduleRule(micro_batch=4, accumulation=2, max_accumulation=4, every=1, min_steps=1, settle=1)
    state = ScheduleState.start(r).after_step(Window(1.0, 0.4, 4, 8))
    assert state.b_simple is None and state.noise[-1].b_simple is None
    [change] = state.changes
    assert change.accumulation == 4 and change.noise_scale is None and "did not show above the noise" in change.reason
    # A window with no noise either way (small == big: tr(Sigma) = 0) grows nothing.
    flat = ScheduleState.start(r).after_step(Window(1.0, 1.0, 4, 8))
    assert flat.changes == () and flat.b_simple == 0.0


def test_the_recent_windows_give_the_noise_scale_with_its_interval() -> None:
    from batchfit.report.noise import NoiseScale
    from batchfit.report.schedule import RECENT

    r = rule(every=1, min_steps=1, settle=3, decay=0.9, max_accumulation=4)
    state = ScheduleState.start(r)
    assert state.noise_scale() is None
    draws = random.Random(3)
    fed = []
    for _ in range(RECENT + 10):
        w = Window(1.8 * (1 + draws.uniform(-0.2, 0.2)), 1.0 * (1 + draws.uniform(-0.2, 0.2)), 4, state.global_batch)
        state = state.after_step(w)
        fed.append(w)
    # The batch only grows: the windows at the current sizes are those since the last change.
    kept = [w for w in fed if w.big_batch == state.global_batch][-RECENT:]
    assert [tuple(x) for x in state.recent] == [(w.small, w.big, w.small_batch, w.big_batch) for w in kept]
    expected = NoiseScale.from_windows(
        [(w.small, w.big) for w in kept], 4, kept[-1].big_batch, passes=0, samples=len(kept) * kept[-1].big_batch,
        elapsed_s=0.0,
    )  # fmt: skip
    got = state.noise_scale()
    assert got is not None and (got.b_simple, got.low, got.high) == (expected.b_simple, expected.low, expected.high)
    assert len(state.recent) <= RECENT and all(x[2:] == state.recent[-1][2:] for x in state.recent)
    assert ScheduleState.from_json(state.to_json()) == state
    (change,) = state.changes
    assert "(the last" in change.reason and "windows alone: 90%" in change.reason

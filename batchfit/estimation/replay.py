"""Replayed fake trials: a step traced at two batch sizes, replayed through the allocator model at any other.

Why: a fake step of a 1.5B model is 20 000 operators through ``FakeTensorMode`` (1.5 s on 2 cores),
and an estimate for CUDA runs 15 of them (the search, the largest fit again from scratch, the safe
batch's verification), each dispatching the same operators with sizes that grow with the batch;
only the allocator model's answer differs. So `record` traces one step with a fresh optimizer at
``init`` and one with it kept at ``init + m`` (``m``: ``multiple_of``) under a `RecordingMeter`,
which logs each storage's creation with its bytes, each death, phase and operator, in order. The
two streams must be the same event for event (the fresh one less its optimizer state), every size
exactly affine in the batch size, and a forward traced at ``init + 7m`` what they predict; else
nothing is replayed (`Replay.build` says why) and every trial is traced as before. A trial is then
the batch's storages, the first step (making the optimizer's state where it is fresh), the steady
steps, the batch's release, fed to the target's meter through the calls a traced trial makes
(`Replay.trial`): the same peaks, out-of-memory point and message, in milliseconds.

Refused: a storage resized in place, one that outlives its step other than the optimizer's state
(a cache a model keeps from its first call, then counted from the start), a stream that differs
between sizes, bytes not affine in the size. A size law that holds at the three sizes and not
beyond (padding to a multiple above ``7m``) is not seen; backward and the optimizer step are
checked at two sizes only.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from batchfit.backends import LiveTensorMeter
from batchfit.backends.base import data_storages
from batchfit.errors import first_line
from batchfit.interrupts import InterruptGuard
from batchfit.probe.trial import run_trial
from batchfit.probe.workload import Workload
from batchfit.report import Trial, TrialKind

__all__ = ["RecordingMeter", "Replay", "ReplayState", "record"]

# Event kinds, raw (keys are storage ``_cdata``) and in a template (keys are indices within a segment).
MALLOC, STATE, FREE, FREE_BATCH, CHECK, ENTER, EXIT = range(7)


class RecordingMeter(LiveTensorMeter):
    """The live-tensor meter with no limit, logging every storage made and freed, every phase and
    every operator that added bytes, in order, while `events` is a list."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.events: list[tuple[Any, ...]] | None = None
        #: Why the stream cannot be replayed, once something said so.
        self.odd: str | None = None
        super().__init__(None, None, tensors=tensors)

    def _add(self, key: int, nbytes: int) -> None:
        if self.events is not None:
            if key in self._live:
                self.odd = "a storage was resized in place"
            self.events.append((MALLOC, key, nbytes))
        super()._add(key, nbytes)

    def _release(self, key: int) -> None:
        if self.events is not None and key in self._live:
            self.events.append((FREE, key))
        super()._release(key)

    def _over_limit(self, func: Any, added: int, anywhere: bool = False) -> torch.OutOfMemoryError | None:
        if self.events is not None and added > 0 and not anywhere:
            self.events.append((CHECK, func))
        return None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.events is not None:
            self.events.append((ENTER, name))
        with super().phase(name):
            yield
        if self.events is not None:
            self.events.append((EXIT, name))


@dataclass
class _Split:
    """A recorded trial cut in segments: the batch, each step, the batch's release; each event's
    reference an index within its segment (``STATE``: the optimizer's, numbered on their own)."""

    batch: list[tuple[Any, ...]]
    steps: list[list[tuple[Any, ...]]]
    end: list[tuple[Any, ...]]


def _split(events: list[tuple[Any, ...]], state_events: set[int], complete: bool = True) -> _Split | str:
    """``events`` in segments (`_Split`), or why they cannot be; ``state_events``: the positions of
    the ``MALLOC`` events that made the optimizer's state (a key is an address, reused once freed);
    ``complete``: the events are a whole trial's, every storage freed by its end."""
    batch: list[tuple[Any, ...]] = []
    steps: list[list[tuple[Any, ...]]] = []
    end: list[tuple[Any, ...]] = []
    # Each storage is numbered by its creation within its segment (an address is reused once freed).
    batch_refs: dict[int, int] = {}
    step_refs: dict[int, int] = {}
    made = states = 0
    current = batch
    for position, event in enumerate(events):
        kind = event[0]
        if kind == ENTER and event[1] == "forward":
            if step_refs:
                return "a storage made in one step lived into the next"
            current, made = [], 0
            steps.append(current)
        if kind == MALLOC:
            key, nbytes = event[1], event[2]
            if current is end:
                return "a storage was made after the last step"
            if position in state_events:
                current.append((STATE, states, nbytes))
                states += 1
                continue
            refs = batch_refs if current is batch else step_refs
            refs[key] = made
            made += 1
            current.append((MALLOC, refs[key], nbytes))
        elif kind == FREE:
            key = event[1]
            if current is not batch and key in step_refs:
                if current is end:
                    return "a step's storage was freed after the batch's"
                current.append((FREE, step_refs.pop(key)))
            elif key in batch_refs and current is not batch:
                current = end
                end.append((FREE_BATCH, batch_refs.pop(key)))
            elif key in batch_refs:
                batch.append((FREE_BATCH, batch_refs.pop(key)))
            else:
                return "a storage made before the trial was freed in it"
        elif kind in (CHECK, ENTER, EXIT):
            if current is end:
                return "an operator ran after the batch was released"
            current.append(event)
    if complete and (batch_refs or step_refs):
        return "a storage outlived the trial"  # a leak, or a cache the model builds on its first call
    return _Split(batch, steps, end)


def _affine(segments: list[list[tuple[Any, ...]]], sizes: list[int]) -> list[tuple[Any, ...]] | None:
    """One template of ``segments`` (the same events, recorded at ``sizes``), each event's bytes
    ``(at_zero, per_sample)``, exact at the first two sizes and checked at the others; ``None``
    when the streams differ or the bytes are not affine in the batch size."""
    first, second = segments[0], segments[1]
    if any(len(segment) != len(first) for segment in segments):
        return None
    template: list[tuple[Any, ...]] = []
    span = sizes[1] - sizes[0]
    for index, event in enumerate(first):
        others = [segment[index] for segment in segments]
        if event[0] not in (MALLOC, STATE):
            if any(other != event for other in others):
                return None
            template.append(event)
            continue
        if any(other[:2] != event[:2] for other in others):
            return None
        grown = second[index][2] - event[2]
        if grown % span:
            return None
        slope = grown // span
        at_zero = event[2] - slope * sizes[0]
        if any(at_zero + slope * size != other[2] for size, other in zip(sizes, others)):
            return None
        template.append((event[0], event[1], at_zero, slope))
    return template


def _steady_positions(fresh: list[tuple[Any, ...]]) -> list[int]:
    """The positions of a fresh optimizer's first step that a steady step has too: all but the
    state's creation and the check of each operator that made only state."""
    kept: list[int] = []
    state = other = False  # what the operator being checked made
    for position, event in enumerate(fresh):
        if event[0] == STATE:
            state = True
            continue
        if event[0] == MALLOC:
            other = True
        if event[0] == CHECK:
            only_state, state, other = state and not other, False, False
            if only_state:
                continue
        kept.append(position)
    return kept


def _at(template: list[tuple[Any, ...]], size: int) -> list[tuple[Any, ...]]:
    """``template``'s events with their bytes at ``size``, as `_split` writes a recorded one."""
    return [(e[0], e[1], e[2] + e[3] * size) if e[0] in (MALLOC, STATE) else e for e in template]


@dataclass
class ReplayState:
    """What a replayed probe keeps between trials: the optimizer's state in the meter (its keys), if kept."""

    warm: bool = False
    state_keys: tuple[int, ...] = ()
    next_key: int = -1


@dataclass(frozen=True)
class Replay:
    """The templates of one model's trials (module docs): `trial` replays one."""

    batch: list[tuple[Any, ...]]
    fresh_step: list[tuple[Any, ...]]
    steady_step: list[tuple[Any, ...]]
    end: list[tuple[Any, ...]]
    #: The scratch-allocating operators the steps ran (`LiveTensorMeter.scratch_ops`: the traced trials' note).
    scratch_ops: frozenset[Any] = frozenset()

    @classmethod
    def build(cls, sizes: tuple[int, int, int], splits: list[_Split | str], fresh_state: bool) -> Replay | str:
        """The templates from ``splits``, recorded at ``sizes``: a fresh optimizer's step, a kept
        one's, and a forward at the third size that checks them; or why there are none.
        ``fresh_state``: the fresh step's lasting storages were exactly its optimizer's state."""
        if not fresh_state:
            return "a storage other than the optimizer's state outlived the first step"
        for split in splits:
            if isinstance(split, str):
                return split
        first, kept, check = (split for split in splits if isinstance(split, _Split))
        if len(first.steps) != 1 or len(kept.steps) != 1 or len(check.steps) != 1:
            return "a recorded trial did not run one step"
        fresh = first.steps[0]
        steady_part = _steady_positions(fresh)
        pair = list(sizes[:2])
        steady = _affine([[fresh[p] for p in steady_part], kept.steps[0]], pair)
        batch = _affine([first.batch, kept.batch], pair)
        end = _affine([first.end, kept.end], pair)
        if steady is None or batch is None or end is None:
            return "the recorded steps were not the same at both batch sizes, nor affine in it"
        forward = check.steps[0]
        if _at(batch, sizes[2]) != check.batch or _at(steady[: len(forward)], sizes[2]) != forward:
            return f"the forward at batch {sizes[2]} was not what the steps at {sizes[0]} and {sizes[1]} predict"
        laws = dict(zip(steady_part, steady))
        fresh_step = [laws.get(p, (*e, 0) if e[0] == STATE else e) for p, e in enumerate(fresh)]
        return cls(batch, fresh_step, steady, end)

    def trial(
        self,
        meter: Any,
        state: ReplayState,
        batch_size: int,
        steps: int,
        kind: TrialKind,
    ) -> tuple[Trial, int]:
        """One trial at ``batch_size`` through ``meter`` (a `SimulatedCudaMeter`) as `run_trial`
        would run it traced, and the bytes of the optimizer's state it counted; ``state`` is updated."""
        before = meter.allocated_bytes()
        meter.begin_trial()
        warm = state.warm
        plan = [(self.batch, "b"), (self.steady_step if warm else self.fresh_step, "s")]
        plan += [(self.steady_step, "s")] * (steps - 1) + [(self.end, "e")]
        batch_keys: dict[int, int] = {}
        step_keys: dict[int, int] = {}
        made_state: list[int] = []
        key = state.next_key
        done = 0
        phase = "batch"
        failure: tuple[str, tuple[int | None, int | None]] | None = None
        added = 0
        for events, part in plan:
            if part == "s":
                step_keys = {}
            for event in events:
                kind_ = event[0]
                if kind_ == MALLOC or kind_ == STATE:
                    nbytes = event[2] + event[3] * batch_size
                    if kind_ == STATE:
                        made_state.append(key)
                    elif part == "b":
                        batch_keys[event[1]] = key
                    else:
                        step_keys[event[1]] = key
                    meter._add(key, nbytes)
                    added += nbytes
                    key -= 1
                elif kind_ == FREE:
                    meter._release(step_keys.pop(event[1]))
                elif kind_ == FREE_BATCH:
                    meter._release(batch_keys.pop(event[1]))
                elif kind_ == CHECK:
                    error = meter._over_limit(event[1], added) if added > 0 else None
                    added = 0
                    if error is not None:
                        failure = (first_line(error), meter.failure_bytes(str(error)))
                        break
                elif kind_ == ENTER:
                    phase = name = event[1]
                    meter._phase_reserved[name] = max(meter._phase_reserved.get(name, 0), meter.reserved_bytes())
                    meter._phase = name
                    meter._phase_peaks[name] = max(meter._phase_peaks.get(name, 0), meter._current)
                else:  # EXIT: the phase's end, where memory no operator reported fails the step
                    error = meter._over_limit(f"the {event[1]} phase", 0, anywhere=True)
                    meter._phase = None
                    if error is not None:
                        failure = (first_line(error), meter.failure_bytes(str(error)))
                        break
            if failure is not None:
                meter._phase = None
                break
            if part == "s":
                done += 1
        ready = warm or done > 0
        if failure is not None:
            for leftover in [*step_keys.values(), *batch_keys.values(), *([] if ready else made_state)]:
                meter._release(leftover)
        if made_state and ready:
            state.state_keys = tuple(made_state)
        state.warm = ready
        state.next_key = key
        state_bytes = sum(meter.allocator.block_bytes(meter._handles[k]) for k in state.state_keys) if ready else 0
        kept_bytes = state_bytes if ready and not warm else 0
        meter.release(target_bytes=before + kept_bytes)
        leaked = max(0, meter.allocated_bytes() - before - kept_bytes)
        return _trial(meter, batch_size, kind, done, leaked, phase, failure), state_bytes if done else 0

    @staticmethod
    def drop_state(meter: Any, state: ReplayState) -> None:
        """A fresh optimizer: the kept one's state freed (as the traced probe drops its optimizer)."""
        for key in state.state_keys:
            meter._release(key)
        state.state_keys, state.warm = (), False


def _trial(
    meter: Any,
    batch_size: int,
    kind: TrialKind,
    steps: int,
    leaked: int,
    phase: str,
    failure: tuple[str, tuple[int | None, int | None]] | None,
) -> Trial:
    """The `Trial` `run_trial` builds from the meter's peaks (fake trials: never timed)."""
    order = ("batch", "forward", "backward", "step")
    peaks, reserved = meter.phase_peaks(), meter.phase_reserved_peaks()
    phase_peaks = tuple((name, peaks[name]) for name in order if name in peaks)
    phase_reserved = tuple((name, reserved[name]) for name in order if name in reserved)
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "kind": kind,
        "phase_peaks": phase_peaks,
        "phase_reserved_peaks": phase_reserved,
        "steps": steps,
        "skipped_steps": 0,
        "leaked_bytes": leaked,
        "allocator": meter.trial_facts(),
    }
    if failure is not None:
        message, (needed, needed_reserved) = failure
        return Trial(
            fits=False, phase=phase, peak_bytes=needed, reserved_peak_bytes=needed_reserved, message=message, **common
        )
    return Trial(
        fits=True,
        peak_bytes=max((b for _, b in phase_peaks), default=None),
        reserved_peak_bytes=max((b for _, b in phase_reserved), default=None),
        step_time_s=None,
        samples_per_s=None,
        step_times_s=(),
        **common,
    )


def record(
    workload: Workload, held: list[torch.Tensor], sizes: tuple[int, int, int], interrupts: InterruptGuard | None = None
) -> tuple[Replay | str, list[torch.UntypedStorage]]:
    """Trace one step at each of the first two ``sizes`` (a fresh optimizer, then kept) and a
    forward at the third under a `RecordingMeter` that sees ``held`` (the model's tensors and the
    sample) as there before, and build the `Replay`; the reason instead when the steps cannot be
    replayed, with the storages the steps left behind (a cache the model keeps from its first call),
    which the probe's meter must count as the traced trials would have. Every other storage of these
    steps, the optimizer's too, is gone when it returns: the probe's own meter saw none of them.
    ``interrupts``: the probe's guard, where a deferred Ctrl-C surfaces between two operators."""
    meter = RecordingMeter(held)
    meter.interrupts = interrupts
    before = set(meter._storages)
    splits: list[_Split | str] = []
    fresh_state = False
    reason: str | None = None
    with meter.active():
        optimizer: torch.optim.Optimizer | None = None
        try:
            meter.events = []
            run: Any = run_trial(workload, meter, sizes[0], 1, "search", None, None)
            events, meter.events = meter.events, None
            optimizer = run.optimizer
            if optimizer is None:
                raise RuntimeError("the recorded step did not complete")
            state_keys = {
                storage._cdata
                for entries in optimizer.state.values()
                for value in entries.values()
                if isinstance(value, torch.Tensor)
                for storage in data_storages(value)
                if storage._cdata in meter._live
            }
            last = {event[1]: position for position, event in enumerate(events) if event[0] == MALLOC}
            fresh_state = {key for key in last if key in meter._live} == state_keys
            splits.append(meter.odd or _split(events, {last[key] for key in state_keys if key in last}))
            meter.events = []
            run = run_trial(workload, meter, sizes[1], 1, "search", None, optimizer)
            events, meter.events = meter.events, None
            splits.append(meter.odd or _split(events, set()))
            run = optimizer = None
            splits.append(meter.odd or _forward(workload, meter, sizes[2]))
        except Exception as exc:  # the traced trials meet it again, and say it in their own words
            reason = f"a recorded step raised {type(exc).__name__}: {first_line(exc)}"
        finally:
            meter.events = optimizer = run = None
            for param in workload.model.parameters():
                param.grad = None
        replay = reason or Replay.build(sizes, splits, fresh_state)
        if not isinstance(replay, str):
            return replace(replay, scratch_ops=frozenset(meter.scratch_ops)), []
        gc.collect()  # what a reference cycle kept is not left behind
        left = [ref() for key, ref in meter._storages.items() if key not in before]
        return replay, [storage for storage in left if storage is not None]


def _forward(workload: Workload, meter: RecordingMeter, size: int) -> _Split | str:
    """The batch and the forward of a training step at ``size``, recorded as `run_trial` runs them."""
    meter.begin_trial()
    meter.events = []
    with meter.tracking(), torch.inference_mode(False), torch.enable_grad():
        with meter.phase("batch"):
            batch = workload.build_batch(size)
        with meter.phase("forward"):
            output, loss = workload.forward(batch)
        events, meter.events = meter.events, None
        del output, loss, batch
    return _split(events, set(), complete=False)

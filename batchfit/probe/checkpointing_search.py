"""The checkpointing policy that trains a target batch fastest, found by real steps (`fit_with`).

`fit_with` reads top to bottom as what [`batchfit.fit`][batchfit.fit] does:

1. check the target, the blocks and the options before any trial; blocks of several groups are
   ordered by the bytes each saves for backward, measured in one step at batch 1 (`saving`);
2. probe the model as it is (policy *none*): `find()`'s memory answer (its search, its verified
   safe batch), nothing timed;
3. when the target does not fit there: one trial with the first N - 1 blocks checkpointed, at the
   largest batch that fits without (it fits with, on less memory), gives that policy's bytes per
   sample (the fixed bytes do not change);
4. the two lines predict every k between, per block (checkpointing the first k blocks lowers the
   peak by the same bytes per sample for each block: identical blocks, whose activations live from
   forward to their backward). The fewest blocks whose predicted safe batch holds the target is
   probed from its predicted line (`FromLine`: the safe batch's verification, the boundary, one
   more: three trials when the prediction holds); a miss moves up, a verified fit whose refitted
   line says fewer blocks would do moves down, until a measured miss and a measured fit are
   neighbours or the lines say no k between fits. When no k fits the target at once by the lines,
   all blocks are probed exactly instead (for its micro-batch with accumulation);
5. time the candidates that reach the target in one `Prober`: no checkpointing at the
   micro-batch its safe batch allows with accumulation; the fewest blocks at the target; all
   blocks with accumulation when no policy fits the target at once. Each is a fresh optimizer,
   one untimed step, then warm plain steps, at a micro-batch within its policy's verified safe batch;
6. recommend the candidate with the most samples/s, in `Result.recommendation`'s form.

A ``torch.compile``'d model on a device whose probe runs compiled code (a GPU) gets the compile
partitioner's activation memory budget instead of blocks, in steps of 0.1 from 1.0 down to 0.0,
searched the same way (k steps below 1.0 for k blocks): each budget a fresh compile of the model's
module under that setting, the user's compiled code untouched.

Every probe applies its policy around itself (`batchfit.probe.checkpointing_blocks.applied`) and the prober
restores everything else, so the model comes back as it was whatever happens, Ctrl-C included.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from batchfit.backends import backend_for, resolve_device
from batchfit.probe.checkpointing_blocks import (
    BUDGET_SOURCE,
    BUDGET_STEPS,
    Blocks,
    applied,
    budget_policy,
    by_saving,
    find_blocks,
    policy_for,
    saving,
)
from batchfit.probe.compiled import compiled_info
from batchfit.probe.finder import search_with
from batchfit.probe.keywords import ProbeStartCallback, StartCallback, TrialCallback
from batchfit.probe.options import Options
from batchfit.probe.prober import Prober
from batchfit.probe.probing import FromLine
from batchfit.probe.runner import TrialRequest, opened
from batchfit.probe.safe_batch import safe_cap
from batchfit.probe.timing import UNTIMED_STEPS, warm_steps
from batchfit.report import Fit, Placement, Policy, PolicyRow, Result, Trial
from batchfit.report.checkpointing import fit_recommendation
from batchfit.report.global_split import split_global
from batchfit.search.near import HEDGE
from batchfit.units import format_bytes, positive_int

__all__ = ["MIN_TIMED_STEPS", "fit_with"]

#: Warm timed steps per candidate at least: the candidates' rates decide, and one step is noisy.
MIN_TIMED_STEPS = 2
#: Probes of a checkpointed k at most: each costs about three trials.
MAX_PROBES = 4


def fit_with(
    model: nn.Module,
    sample: Any,
    target_batch: int,
    options: Options,
    *,
    checkpointing: str | Sequence[str] = "auto",
    placement: Placement = "first",
    accumulate: bool = True,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
) -> Fit:
    """[`fit`][batchfit.fit] for callers that hold an [`Options`][batchfit.Options] (see the module)."""
    started = time.monotonic()
    target = positive_int("target_batch", target_batch)
    quiet = options.untimed()
    trials: list[Trial] = []

    def told(trial: Trial) -> None:
        trials.append(trial)
        if callback is not None:
            callback(trial)

    measure = functools.partial(_saved_bytes, model, sample, quiet, told, on_trial_start)
    policies = _policies(model, checkpointing, placement, accumulate, options, measure)
    choose, n, chosen_from, found_in, notes, already = policies
    results: dict[int, Result] = {}

    def probe(k: int, line: tuple[float, float] | None) -> Result:
        plan = None if line is None else FromLine(*line, options.headroom, HEDGE, bool(options.verify_steps), [])
        with applied(model, choose(k)) as runnable:
            results[k] = search_with(
                Prober(runnable, sample, options=quiet),
                quiet,
                time.monotonic(),
                callback=told,
                on_trial_start=on_trial_start,
                on_start=on_start if not results else None,
                plan=plan,
            )
        return results[k]

    # 2. The model as it is.
    none = probe(0, None)
    budget, unit = none.budget_bytes, none.budget_counts
    lines = {0: _line(none, None)}
    chosen_k: int | None = 0 if target <= none.safe_batch else None
    if chosen_k is None and n:
        # 3. All blocks but the last checkpointed, one trial at the largest batch that fits without: its line.
        far = max(1, n - 1)
        lines[far] = _far_line(model, sample, quiet, choose(far), none, lines[0][0], told, on_trial_start)
        # 4. The fewest blocks that hold the target, each probed from the line the measured ones predict.
        low, high = 0, n
        if not _holds(_line_at(lines, n), target, budget, options.headroom):
            low = n - 1  # no k fits at once by the lines: all blocks, exactly, for the accumulation
        for _ in range(MAX_PROBES):
            k = _fewest(lines, low, high, target, budget, options.headroom)
            if k in results:
                break
            lines[k] = _line(probe(k, _aim(_line_at(lines, k), budget)), lines[0][0])
            low, high = (low, k) if results[k].safe_batch >= target else (k, high)
            if low == n or (high - low == 1 and high in results):
                break
        fitting = [k for k, r in results.items() if r.safe_batch >= target]
        chosen_k = min(fitting) if fitting else None

    # 5. The candidates that reach the target, timed alike.
    candidates = _candidates(results, chosen_k, n, target, accumulate, options)
    if not candidates:
        raise ValueError(_unreachable(results, n, target, lines))
    rates = _time(model, sample, quiet, choose, candidates, told, on_trial_start)

    # 6. The answer.
    ways = {k: (micro, accumulation) for k, micro, accumulation in candidates}
    rows = tuple(_row(choose(k), results[k], *ways.get(k, (None, None)), rates.get(k)) for k in sorted(results))
    timed = [row for row in rows if row.samples_per_s is not None]
    if not timed:
        raise RuntimeError("no candidate trained under the safe cap when timed: see the trials passed to callback")
    best = max(timed, key=lambda row: row.samples_per_s or 0.0)
    known = range(n + 1) if len(lines) > 1 else sorted(lines)  # one line predicts no other k
    predicted = tuple((k, _largest(_line_at(lines, k), budget, results, k)) for k in known)
    return Fit(
        target_batch=target,
        blocks=chosen_from,
        blocks_from=found_in,
        rows=rows,
        chosen=rows.index(best),
        recommendation=fit_recommendation(best, timed, rows, target, n, already),
        predicted=predicted,
        budget_bytes=budget,
        budget_counts=unit,
        device=none.device,
        trials=len(trials),
        elapsed_s=time.monotonic() - started,
        notes=tuple(notes),
    )


def _policies(
    model: nn.Module,
    checkpointing: Any,
    placement: Any,
    accumulate: Any,
    options: Options,
    measure: Callable[[Blocks], dict[str, int]],
) -> tuple[Callable[[int], Policy], int, tuple[str, ...], str, list[str], int]:
    """Every argument `fit` adds to `find`'s, checked before any trial; then the policies: ``k ->
    policy`` for k from 0 to N, N, the blocks they choose from, where those were found, notes, and
    how many blocks you had checkpointed already.

    A ``torch.compile``'d model on a device whose probe runs compiled code gets the compile
    partitioner's activation memory budget in `BUDGET_STEPS` steps (with ``checkpointing="auto"``);
    elsewhere (the CPU runs it eagerly) its blocks, and a note says so. Blocks found in several
    groups (a ResNet's stages, T5's encoder and decoder) are ordered by the bytes each saves for
    backward, measured in one step (``measure``): the first k save most."""
    if placement not in ("first", "evenly"):
        raise ValueError(f"placement must be 'first' or 'evenly', got {placement!r}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be True or False, got {accumulate!r}")
    if options.mode != "train":
        raise ValueError(
            f"fit() sizes training: checkpointing saves memory for backward, and mode={options.mode!r} runs none"
        )
    if options.cache is not None or options.noise_scale or options.eval:
        raise ValueError("fit() takes neither cache, noise_scale nor eval: call find() for those")
    if options.distributed:
        raise ValueError("fit() sizes one process: distributed=True is not supported yet; run it on one rank")
    if isinstance(checkpointing, str) and checkpointing != "auto":
        raise ValueError(f"checkpointing must be 'auto' or a list of module names, got {checkpointing!r}")
    compiled = compiled_info(model) is not None
    device = resolve_device(options.device, model)
    if compiled and checkpointing == "auto" and backend_for(device).runs_compiled:
        return functools.partial(budget_policy, steps=BUDGET_STEPS), BUDGET_STEPS, (), BUDGET_SOURCE, [], 0
    blocks = find_blocks(model, None if checkpointing == "auto" else checkpointing)
    notes = _notes(blocks)
    if compiled:
        notes.append(
            f"the model is torch.compile'd, but on {device.type} the probe runs it eagerly: its blocks were "
            f"checkpointed instead of searching {BUDGET_SOURCE} (searched where compiled code runs, a GPU)"
        )
    if len(blocks.groups) > 1 and blocks.free:
        blocks, note = by_saving(blocks, measure(blocks))
        notes.append(note)
    free = blocks.free
    choose = functools.partial(policy_for, free, placement=placement)
    return choose, len(free), free, blocks.found_in, notes, len(blocks.already)


def _saved_bytes(
    model: nn.Module,
    sample: Any,
    options: Options,
    told: TrialCallback,
    on_trial_start: StartCallback | None,
    blocks: Blocks,
) -> dict[str, int]:
    """The bytes each free block saves for backward in one step at batch 1 (`saving`), in a probe:
    everything that step changes is put back."""
    if on_trial_start is not None:
        on_trial_start(1, "search")
    with opened(runner := Prober(model, sample, options=options)), saving(model, blocks.free) as saved:
        trial = runner.run(TrialRequest(1, steps=1))
    told(trial)
    return saved if trial.fits else {}


def _notes(blocks: Blocks) -> list[str]:
    if not blocks.already:
        return []
    shown = ", ".join(blocks.already[:3]) + (", ..." if len(blocks.already) > 3 else "")
    rest = (
        f"the policies choose among the other {len(blocks.free)}"
        if blocks.free
        else "no block is left to checkpoint, so only the model as it is (with yours) was measured"
    )
    return [
        f"{len(blocks.already)} of the {len(blocks.names)} blocks were checkpointed already ({shown}): measured "
        f"from there, as you run it; {rest}"
    ]


def _line(result: Result, fixed: float | None) -> tuple[float, float]:
    """``(fixed bytes, bytes per sample)`` of a policy: its fitted equation; through its largest fit
    with ``fixed`` (policy none's) where it fitted none (one fitting size)."""
    if result.memory is not None and result.memory.per_sample_bytes > 0:
        return float(result.memory.fixed_bytes), float(result.memory.per_sample_bytes)
    trial = result.trial(result.max_batch)
    peak = trial.peak_in(result.budget_counts) if trial is not None else None
    base = fixed or 0.0
    return base, max(1.0, ((peak or 0) - base) / result.max_batch)


def _aim(line: tuple[float, float], budget: int | None) -> tuple[float, float] | None:
    return None if budget is None else line


def _line_at(lines: dict[int, tuple[float, float]], k: int) -> tuple[float, float]:
    """The line at ``k``: measured, or linear in k between the measured ks around it. Above the
    highest measured (all N blocks, from N - 1) the highest's: the last block's recompute runs at
    the start of backward, with the others' inputs held, so it saves little (a third of a block on
    a GPT-2); never a saving that was not measured."""
    if k in lines:
        return lines[k]
    below, above = max(j for j in lines if j < k), min((j for j in lines if j > k), default=None)
    if above is None:
        return lines[below]
    share = (k - below) / (above - below)
    (f0, p0), (f1, p1) = lines[below], lines[above]
    return f0 + share * (f1 - f0), p0 + share * (p1 - p0)


def _fewest(
    lines: dict[int, tuple[float, float]], low: int, high: int, target: int, budget: int | None, headroom: float
) -> int:
    """The fewest blocks above ``low`` whose safe batch the lines predict holds ``target``; ``high``
    (known or predicted to hold it) when none below it does."""
    for k in range(low + 1, high):
        if _holds(_line_at(lines, k), target, budget, headroom):
            return k
    return high


def _holds(line: tuple[float, float], target: int, budget: int | None, headroom: float) -> bool:
    """Whether the safe batch ``line`` predicts holds ``target``."""
    fixed, per_sample = line
    return budget is None or per_sample <= 0 or (safe_cap(budget, headroom) - fixed) / per_sample >= target


def _far_line(
    model: nn.Module,
    sample: Any,
    options: Options,
    most: Policy,
    none: Result,
    fixed: float,
    told: TrialCallback,
    on_trial_start: StartCallback | None,
) -> tuple[float, float]:
    """A policy that recomputes nearly all (every block but the last, or budget 0.1): its line through
    one trial at the largest batch that fits without (which fits with, on less memory), with policy
    none's fixed bytes: the saving per block (or budget step) for every k. Not all blocks: the last
    block's recompute runs at the start of backward, with every other block's input still held, so
    all N save one block's activations less than N times one block's saving."""
    size = none.max_batch
    if on_trial_start is not None:
        on_trial_start(size, "search")
    with applied(model, most) as runnable, opened(runner := Prober(runnable, sample, options=options)):
        trial = runner.run(TrialRequest(size))
    told(trial)
    peak = trial.peak_in(none.budget_counts)
    if not trial.fits or peak is None:
        return fixed, _line(none, None)[1]
    return fixed, max(1.0, (peak - fixed) / size)


def _largest(line: tuple[float, float], budget: int | None, results: dict[int, Result], k: int) -> int:
    """Policy k's largest batch: measured where it was probed, else where its line meets the budget."""
    if k in results:
        return results[k].max_batch
    fixed, per_sample = line
    if budget is None or per_sample <= 0:
        return 0
    return max(0, math.floor((budget - fixed) / per_sample))


def _candidates(
    results: dict[int, Result], chosen: int | None, n: int, target: int, accumulate: bool, options: Options
) -> list[tuple[int, int, int]]:
    """``(k, micro-batch, accumulation)`` of each way to the target worth timing."""
    if chosen == 0:
        return [(0, target, 1)]
    out: list[tuple[int, int, int]] = []
    if accumulate:
        out.append((0, *split_global(target, results[0].safe_batch, 1, options.multiple_of)))
    if chosen is not None:
        out.append((chosen, target, 1))
    elif accumulate and n in results and results[n].safe_batch > results[0].safe_batch:
        out.append((n, *split_global(target, results[n].safe_batch, 1, options.multiple_of)))
    return out


def _time(
    model: nn.Module,
    sample: Any,
    options: Options,
    choose: Callable[[int], Policy],
    candidates: list[tuple[int, int, int]],
    told: TrialCallback,
    on_trial_start: StartCallback | None,
) -> dict[int, float]:
    """Each candidate's samples/s at its micro-batch: a fresh optimizer, one untimed step, then warm
    plain steps. Each micro-batch is within its policy's safe batch, which that policy's probe
    verified. Policies of blocks share one prober (switched between trials); a budget runs its own
    compiled module, in a prober of its own."""
    steps = UNTIMED_STEPS + max(MIN_TIMED_STEPS, warm_steps(options))
    rates: dict[int, float] = {}

    def timed(runner: Prober, k: int, micro: int) -> None:
        if on_trial_start is not None:
            on_trial_start(micro, "time")
        trial = runner.run(TrialRequest(micro, steps, "time", fresh_optimizer=True))
        told(trial)
        if trial.fits and trial.samples_per_s:
            rates[k] = trial.samples_per_s

    if any(choose(k).budget is not None for k, _, _ in candidates):
        for k, micro, _ in candidates:
            with applied(model, choose(k)) as runnable, opened(runner := Prober(runnable, sample, options=options)):
                timed(runner, k, micro)
        return rates
    with opened(runner := Prober(model, sample, options=options)):
        for k, micro, _ in candidates:
            with applied(model, choose(k)):
                timed(runner, k, micro)
    return rates


def _row(
    policy: Policy,
    result: Result,
    micro: int | None = None,
    accumulation: int | None = None,
    rate: float | None = None,
) -> PolicyRow:
    memory = result.memory
    return PolicyRow(
        policy=policy,
        max_batch=result.max_batch,
        safe_batch=result.safe_batch,
        safe_verified=result.safe_verified,
        boundary_reached=result.boundary_reached,
        fixed_bytes=None if memory is None else memory.fixed_bytes,
        per_sample_bytes=None if memory is None else memory.per_sample_bytes,
        trials=len(result.trials),
        micro_batch=micro,
        accumulation=accumulation,
        samples_per_s=rate,
    )


def _unreachable(results: dict[int, Result], n: int, target: int, lines: dict[int, tuple[float, float]]) -> str:
    """Why no policy reaches the target without accumulation, the closest, and what it would take."""
    k = n if n in results else 0
    closest = results[k]
    label = "with all blocks checkpointed" if k else "as it is"
    short = (target - closest.safe_batch) * lines[k][1]
    return (
        f"no policy fits target_batch {target} in one step: the closest, {label}, has a safe batch of "
        f"{closest.safe_batch}; it would take about {format_bytes(short)} more memory, or accumulate=True"
    )

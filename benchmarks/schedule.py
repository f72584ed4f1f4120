"""``batchfit.schedule``: a batch grown by the noise scale measured during training, against a
constant batch and two open-loop schedules, on a small GPT trained here on real text.

Run from the repository root::

    python benchmarks/schedule.py            # 3 seeds x 4 policies, about 12 minutes on 2 idle cores
    python benchmarks/schedule.py --quick    # a smoke run: 1 seed, a tenth of the budget

The text is ``batchfit.examples.text_ids()`` (the source of four standard-library modules, as byte
ids). Training rows are ``--seq-len`` windows at offsets drawn by a generator seeded per seed from the
first 90% of the text (every policy of a seed sees the same rows in the same order, grouped into its
own steps); validation is the last 10% cut into windows. The model is
``batchfit.examples.gpt`` (vocabulary 256, ``--width``, ``--layers``), seeded per seed. The micro-batch
is at most the **verified safe batch**: ``batchfit.find`` under ``--memory-limit`` first, the micro-batch
``min(--micro, safe batch)``, and every policy
trains micro-batches of exactly that many rows (the largest counted at each training forward), so none
is above it; a step out of memory would end its run (counted as ``oom``).

Every policy starts at ``micro x --accumulation`` samples per step and trains ``--budget`` samples, then
on to ``1.05 x`` the budget at the floor rate (so that reaching the target within 1.05x the samples
can be seen). AdamW (betas 0.9, 0.95), the learning rate a function of samples seen: a linear warm-up
over 5% of the budget, then a cosine to ``--floor`` of the peak at the budget, times the schedule's
``lr_factor`` (the sqrt rule: x sqrt(2) a doubling):

* ``constant``: the batch never changes;
* ``ramp`` (Merrill et al. 2025's batch warm-up): doubles at 10%, 25%, 50% of the budget;
* ``seesaw`` (arXiv 2510.14717): doubles where the cosine reaches 1/2, 1/4, 1/8 of the peak, the
  rate x sqrt(2) on top of the cosine's halving: Seesaw's net 1/sqrt(2);
* ``noise`` (batchfit's closed loop): metered every ``--every`` steps; doubles when half the smoothed
  ``B_simple`` reaches the doubled batch (``fraction=0.5``), after ``--settle`` metered steps at a
  batch and at most every ``--min-steps`` steps.

The validation loss is measured at every ``--eval-every`` of the budget and smoothed as the mean of
``--smooth`` evaluations centred on each (one evaluation moves by its last steps' noise, which would
decide a first crossing). The target is the constant batch's smoothed loss at the budget (its seed's); a
policy's steps-to-target are its optimizer steps at the first evaluation whose smoothed loss is at or
below it (and its samples then). The meter's overhead: the median step
time of the noise policy metered every step over the same steps unmetered, interleaved
(``--overhead-rounds``), divided by ``--every`` for the rate the run meters at. Benchmarks are not
tests: nothing asserts. Output: a table, JSON under ``benchmarks/results/schedule-cpu-*.json`` and the
realised schedules of the first seed against its measured noise scale in ``schedule-cpu-*.png``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)

import batchfit  # noqa: E402
from batchfit.examples import gpt, text_ids  # noqa: E402
from batchfit.report.schedule_plot import plot_schedule  # noqa: E402
from batchfit.report.schedule_rule import ramp_thresholds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("constant", "ramp", "seesaw", "noise")
RAMP_AT = (0.10, 0.25, 0.50)
#: Each run trains on past the budget to this multiple of it, at the floor rate.
EXTEND = 1.05
SEESAW_HALVINGS = 3


def text(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training text (the first 90%) and the rest cut into validation windows."""
    ids = text_ids()
    cut = len(ids) * 9 // 10
    return ids[:cut], ids[cut : cut + (len(ids) - cut) // seq_len * seq_len].view(-1, seq_len)


def batches(ids: torch.Tensor, micro: int, seq_len: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of ``seq_len`` windows at offsets drawn by a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(1000 + seed)
    span = torch.arange(seq_len)
    while True:
        starts = torch.randint(0, len(ids) - seq_len, (micro,), generator=generator)
        rows = ids[starts[:, None] + span]
        yield {"input_ids": rows, "labels": rows}


def model_for(args: argparse.Namespace, seed: int) -> nn.Module:
    model, _ = gpt(vocab_size=256, seq_len=args.seq_len, d_model=args.width, n_layers=args.layers, n_heads=4, seed=seed)
    return model


@torch.no_grad()
def validation_loss(model: nn.Module, rows: torch.Tensor) -> float:
    model.eval()
    chunks = [rows[i : i + 64] for i in range(0, len(rows), 64)]
    losses = [float(model(input_ids=chunk, labels=chunk)["loss"]) for chunk in chunks]
    model.train()
    return statistics.fmean(losses)


def learning_rate(args: argparse.Namespace, samples: int) -> float:
    """The base rate at ``samples``: a linear warm-up over 5% of the budget, a cosine to the floor."""
    warmup = 0.05 * args.budget
    if samples < warmup:
        return args.lr * (samples + 1) / warmup
    t = min(1.0, (samples - warmup) / (args.budget - warmup))
    return args.lr * (args.floor + (1 - args.floor) * 0.5 * (1 + math.cos(math.pi * t)))


def cosine_halvings(args: argparse.Namespace, halvings: int) -> tuple[int, ...]:
    """The samples where `learning_rate` first reaches 1/2, 1/4, ... of the peak (Seesaw's points)."""
    points, level = [], 0.5
    for samples in range(int(0.05 * args.budget), args.budget + 1, max(1, args.budget // 20_000)):
        if len(points) < halvings and learning_rate(args, samples) <= level * args.lr:
            points.append(samples)
            level /= 2
    return tuple(points)


Data = tuple[torch.Tensor, torch.Tensor]


def train(args: argparse.Namespace, policy: str, seed: int, micro: int, data: Data) -> dict[str, Any]:
    train_ids, val_rows = data
    model = model_for(args, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    thresholds = {
        "ramp": ramp_thresholds(args.budget, RAMP_AT),
        "seesaw": cosine_halvings(args, SEESAW_HALVINGS),
    }.get(policy, ())
    schedule = batchfit.schedule(
        model, optimizer, micro_batch=micro, accumulation=args.accumulation,
        max_accumulation=args.accumulation * args.growth, policy=policy, every=args.every, lr_rule=args.lr_rule,
        min_steps=args.min_steps, settle=args.settle, decay=args.decay, fraction=args.fraction,
        thresholds=thresholds,
    )  # fmt: skip
    largest = 0

    def count_rows(module: nn.Module, inputs: Any, kwargs: dict[str, Any]) -> None:
        nonlocal largest
        if module.training:  # training micro-batches; validation runs in eval mode
            largest = max(largest, len(kwargs["input_ids"]))

    model.register_forward_pre_hook(count_rows, with_kwargs=True)
    stream = batches(train_ids, micro, args.seq_len, seed)
    evaluations = [(0, 0, validation_loss(model, val_rows))]
    next_eval = args.eval_every * args.budget
    oom, started, at_budget = 0, time.perf_counter(), None
    try:
        while schedule.state.samples < EXTEND * args.budget:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, schedule.state.samples) * schedule.state.lr_factor
            with schedule.step():
                for batch in schedule.micro_batches(stream):
                    (model(**batch)["loss"] / schedule.accumulation).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if schedule.state.samples >= next_eval:
                evaluations.append((schedule.state.step, schedule.state.samples, validation_loss(model, val_rows)))
                next_eval += args.eval_every * args.budget
            if at_budget is None and schedule.state.samples >= args.budget:
                at_budget = evaluations[-1] if evaluations[-1][1] == schedule.state.samples else None
                if at_budget is None:
                    at_budget = (schedule.state.step, schedule.state.samples, validation_loss(model, val_rows))
                    evaluations.append(at_budget)
    except torch.OutOfMemoryError:
        oom += 1
    return {
        "policy": policy,
        "seed": seed,
        "evaluations": evaluations,
        "steps": schedule.state.step,
        "samples": schedule.state.samples,
        "budget_loss": at_budget[2] if at_budget else None,
        "budget_steps": at_budget[0] if at_budget else None,
        "final_loss": evaluations[-1][2],
        "largest_micro_batch": largest,
        "oom": oom,
        "wall_s": time.perf_counter() - started,
        "state": schedule.state,
    }


def smoothed(evaluations: list[tuple[int, int, float]], width: int) -> list[tuple[int, int, float]]:
    """Each evaluation's loss as the mean of the ``width`` evaluations centred on it (fewer at the ends):
    one evaluation's loss moves by the last few steps' noise, which would decide a first crossing."""
    half = width // 2
    losses = [loss for _, _, loss in evaluations]
    return [
        (step, samples, statistics.fmean(losses[max(0, i - half) : i + half + 1]))
        for i, (step, samples, _) in enumerate(evaluations)
    ]


def loss_at_budget(run: dict[str, Any], budget: int, width: int) -> float:
    """The smoothed loss of the first evaluation at or past the budget."""
    return next(loss for _, samples, loss in smoothed(run["evaluations"], width) if samples >= budget)


def to_target(run: dict[str, Any], target: float, width: int) -> tuple[int | None, int | None]:
    """Steps and samples at the first evaluation whose smoothed loss is at or below ``target``."""
    for step, samples, loss in smoothed(run["evaluations"], width):
        if loss <= target:
            return step, samples
    return None, None


def overhead(args: argparse.Namespace, micro: int, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Median step time metered every step over unmetered, the same steps interleaved."""
    model = model_for(args, 0)
    times: dict[str, list[float]] = {"noise": [], "constant": []}
    for _ in range(args.overhead_rounds):
        for policy in ("noise", "constant"):
            copy_ = copy.deepcopy(model)
            optimizer = torch.optim.AdamW(copy_.parameters(), lr=args.lr)
            schedule = batchfit.schedule(
                copy_, optimizer, micro_batch=micro, accumulation=args.accumulation, policy=policy, every=1,
                min_steps=10**9,
            )  # fmt: skip
            stream = batches(data[0], micro, args.seq_len, 0)
            for index in range(args.overhead_steps + 2):
                begun = time.perf_counter()
                with schedule.step():
                    for batch in schedule.micro_batches(stream):
                        (copy_(**batch)["loss"] / schedule.accumulation).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if index >= 2:
                    times[policy].append(time.perf_counter() - begun)
    ratio = statistics.median(times["noise"]) / statistics.median(times["constant"])
    return {
        "step_s": statistics.median(times["constant"]),
        "metered_every_step": ratio - 1,
        "at_every": (ratio - 1) / args.every,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, a tenth of the budget")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=24_000, help="training samples per run")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--memory-limit", default="7MiB", help="the budget the micro-batch is verified under")
    parser.add_argument("--micro", type=int, default=2, help="the micro-batch, if the safe batch is not below it")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--growth", type=int, default=16, help="max_accumulation = accumulation x growth")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--floor", type=float, default=0.1, help="the cosine's end, a fraction of the peak")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--min-steps", type=int, default=20)
    parser.add_argument("--settle", type=int, default=5)
    parser.add_argument("--decay", type=float, default=0.9)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--lr-rule", default="sqrt", choices=["sqrt", "linear", "none"])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="with constant")
    parser.add_argument("--eval-every", type=float, default=0.025, help="fraction of the budget")
    parser.add_argument("--smooth", type=int, default=3, help="evaluations a smoothed loss is the mean of")
    parser.add_argument("--overhead-rounds", type=int, default=3)
    parser.add_argument("--overhead-steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file and the picture")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    if "constant" not in args.policies:
        parser.error("--policies must include constant: its loss at the budget is the target")
    if args.quick:
        args.seeds, args.budget, args.overhead_rounds = 1, args.budget // 10, 1
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    data = text(args.seq_len)
    probe_model = model_for(args, 0)
    sample = {"input_ids": data[1][:2], "labels": data[1][:2]}
    found = batchfit.find(probe_model, sample, memory_limit=args.memory_limit, device="cpu")
    micro = min(args.micro, found.safe_batch)
    print(
        f"batchfit.schedule benchmark: micro-batch {micro} (--micro {args.micro}; the safe batch under "
        f"{args.memory_limit} is {found.safe_batch}, max {found.max_batch})"
    )
    runs = []
    for seed in range(args.seeds):
        for policy in args.policies:
            run = train(args, policy, seed, micro, data)
            runs.append(run)
            print(f"  seed {seed} {policy:8s} {run['steps']:5d} steps {run['samples']:7d} samples "
                  f"loss at the budget {run['budget_loss']:.4f} ({run['wall_s']:.0f} s)")  # fmt: skip
    cost = overhead(args, micro, data)
    rows = []
    for seed in [*range(args.seeds), "mean"]:
        if seed == "mean":
            mine = {p: seed_mean([r for r in runs if r["policy"] == p]) for p in args.policies}
        else:
            mine = {r["policy"]: r for r in runs if r["seed"] == seed}
        rows += target_rows(seed, mine, args)
    header = f"{'seed':>4} {'policy':8} {'steps->target':>13} {'fewer':>7} {'samples x':>9} {'loss@budget':>11}"
    print("(losses smoothed; 'mean': the seeds' mean curves; the target: constant's loss at the budget)")
    print(f"\n{header} {'micro':>5}")
    for row in rows:
        fewer = "-" if row["steps_fewer"] is None else f"{row['steps_fewer']:.0%}"
        ratio = "-" if row["samples_ratio"] is None else f"{row['samples_ratio']:.2f}"
        steps = "never" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}"
        print(f"{row['seed']:>4} {row['policy']:8} {steps:>13} {fewer:>7} {ratio:>9} {row['target_loss']:11.4f} "
              f"{row['largest_micro_batch']:>5}")  # fmt: skip
    goals = goals_of(rows, cost, micro)
    print(f"\nmeter overhead: {cost['metered_every_step']:.1%} metered every step, {cost['at_every']:.2%} at every "
          f"{args.every} (step {cost['step_s'] * 1e3:.0f} ms)")  # fmt: skip
    for name, verdict in goals.items():
        print(f"  {name}: {verdict}")
    meta = {**compare.stamp(argv), "machine": compare.machine(), "settings": {**vars(args), "out": str(args.out)}}
    meta["total_wall_s"] = time.perf_counter() - started
    document = {
        "schema": "batchfit.schedule-benchmark/1", **meta, "micro_batch": micro, "max_batch": found.max_batch,
        "safe_batch": found.safe_batch, "rows": rows, "overhead": cost, "goals": goals,
        "runs": [{k: (v.to_dict() if k == "state" else v) for k, v in run.items()} for run in runs],
    }  # fmt: skip
    if not args.no_json:
        path = compare.write_results(document, args.out, "schedule-cpu")
        states = {r["policy"]: r["state"] for r in runs if r["seed"] == 0}
        print(f"wrote {plot_schedule(states, path.with_suffix('.png'))}")
    print(f"total {meta['total_wall_s']:.0f} s")
    return document


def seed_mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's runs as one: at each evaluation (the same sample grid in every run) the mean loss,
    steps and samples over the seeds."""
    count = min(len(r["evaluations"]) for r in runs)
    evaluations = [
        tuple(statistics.fmean(r["evaluations"][i][k] for r in runs) for k in range(3)) for i in range(count)
    ]
    return {
        "evaluations": evaluations,
        "largest_micro_batch": max(r["largest_micro_batch"] for r in runs),
        "oom": sum(r["oom"] for r in runs),
    }


def target_rows(seed: int | str, mine: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each policy's steps and samples to the constant batch's smoothed loss at the budget."""
    target = loss_at_budget(mine["constant"], args.budget, args.smooth)
    constant_steps, constant_samples = to_target(mine["constant"], target, args.smooth)
    rows = []
    for policy, run in mine.items():
        steps, samples = to_target(run, target, args.smooth)
        rows.append({
            "seed": seed, "policy": policy, "target": target, "steps_to_target": steps,
            "samples_to_target": samples, "target_loss": loss_at_budget(run, args.budget, args.smooth),
            "steps_fewer": None if steps is None else 1 - steps / constant_steps,
            "samples_ratio": None if samples is None else samples / constant_samples,
            "largest_micro_batch": run["largest_micro_batch"], "oom": run["oom"],
        })  # fmt: skip
    return rows


def goals_of(rows: list[dict[str, Any]], cost: dict[str, float], micro: int) -> dict[str, str]:
    """The issue's goals on the seeds' mean curves, each seed's numbers beside."""
    everyone = rows
    rows = [r for r in everyone if r["seed"] == "mean"]
    per_seed = {
        name: [r[name] for r in everyone if r["policy"] == "noise" and r["seed"] != "mean"]
        for name in ("steps_fewer", "samples_ratio")
    }
    noise = [r for r in rows if r["policy"] == "noise"]
    fewer = [r["steps_fewer"] for r in noise]
    ratios = [r["samples_ratio"] for r in noise]
    reached = all(f is not None for f in fewer)
    best_open = []
    for row in noise:
        open_loop = [
            r["steps_to_target"] for r in rows
            if r["seed"] == row["seed"] and r["policy"] in ("ramp", "seesaw") and r["steps_to_target"] is not None
        ]  # fmt: skip
        best_open.append((_whole(row["steps_to_target"]), _whole(min(open_loop)) if open_loop else None))
    as_good = [s is not None and (b is None or s <= b) for s, b in best_open]
    return {
        ">=30% fewer steps at <=1.05x samples": (
            f"{'held' if reached and min(fewer) >= 0.30 and max(ratios) <= 1.05 else 'not held'} on the seeds' mean: "
            f"fewer {_rounded(fewer)}, samples x {_rounded(ratios)}; each seed: fewer "
            f"{_rounded(per_seed['steps_fewer'])}, samples x {_rounded(per_seed['samples_ratio'])}"
        ),
        "as good as the best open-loop baseline": (
            f"{'held' if all(as_good) else 'not held'} on the seeds' mean: (noise, best open loop) steps {best_open}"
        ),
        "meter overhead <= 2%": f"{'held' if cost['at_every'] <= 0.02 else 'not held'}: {cost['at_every']:.2%}",
        "no micro-batch above the safe batch, 0 OOM": (
            f"{'held' if all(r['largest_micro_batch'] <= micro and r['oom'] == 0 for r in everyone) else 'not held'}: "
            f"largest {max(r['largest_micro_batch'] for r in everyone)} of {micro}, OOM {sum(r['oom'] for r in rows)}"
        ),
    }


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def _rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 3) for v in values]


if __name__ == "__main__":
    main()

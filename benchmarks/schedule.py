"""``batchfit.schedule``: a batch grown by the noise scale measured during training, against a
constant batch and two open-loop schedules, on a small GPT trained here on real text.

Run from the repository root::

    python benchmarks/schedule.py            # 3 seeds x 4 policies, about 8 minutes on 2 idle cores
    python benchmarks/schedule.py --quick    # a smoke run: 1 seed, a tenth of the budget

The text is ``batchfit.examples.text_ids()`` (the source of four standard-library modules, as byte
ids), cut into ``--seq-len`` windows; the last 10% of the windows are held out for validation, the
rest shuffled per seed and cycled. The model is ``batchfit.examples.gpt`` (vocabulary 256), seeded
the same for every policy of a seed. The micro-batch is the **verified safe batch**:
``batchfit.find`` under ``--memory-limit`` first, and every policy trains micro-batches of exactly
that many rows (counted at each forward), so none is above it; an out-of-memory step would end the
run with its error (counted as ``oom``).

Policies, all from ``micro x --accumulation`` samples per step over the same ``--budget`` of samples,
AdamW, the learning rate a function of samples seen (a linear warm-up over ``--warmup`` samples, then
constant), times the schedule's ``lr_factor``:

* ``constant``: the batch never changes;
* ``ramp`` (Merrill et al. 2025's batch warm-up): doubles at 10%, 25%, 50% of the budget, sqrt rule;
* ``seesaw`` (arXiv 2510.14717): doubles where a cosine over the budget would reach 1/2, 1/4, 1/8
  of its peak, the rate x 1/sqrt(2) at each;
* ``noise`` (batchfit's closed loop): metered every ``--every`` steps; doubles when the smoothed
  ``B_simple`` reaches the doubled batch, at most every ``--min-steps`` steps, sqrt rule.

The validation loss is measured whenever a policy's samples pass a multiple of ``--eval-every`` of the
budget. The target is the constant batch's final validation loss (of its seed); a policy's
steps-to-target is its optimizer steps at the first evaluation at or below it (and its samples then).
The meter's overhead: the median step time of the noise policy metered every step over that of the
same steps unmetered, interleaved (``--overhead-rounds``), divided by ``--every`` for the rate the
run meters at. Benchmarks are not tests: nothing asserts. Output: a table, JSON under
``benchmarks/results/schedule-cpu-*.json`` and the realised schedules against the measured noise
scale in ``schedule-cpu-*.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
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
from batchfit.report.schedule import ramp_thresholds, seesaw_thresholds  # noqa: E402
from batchfit.report.schedule_plot import plot_schedule  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("constant", "ramp", "seesaw", "noise")
RAMP_AT = (0.10, 0.25, 0.50)
SEESAW_HALVINGS = 3


def windows(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The text as ``seq_len`` windows: training rows, validation rows (the last 10%)."""
    ids = text_ids()
    rows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    held = max(1, len(rows) // 10)
    return rows[:-held], rows[-held:]


def batches(rows: torch.Tensor, micro: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of ``rows``, reshuffled each epoch by a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(rows), generator=generator)
        for start in range(0, len(order) - micro + 1, micro):
            chosen = rows[order[start : start + micro]]
            yield {"input_ids": chosen, "labels": chosen}


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
    return args.lr * min(1.0, (samples + 1) / args.warmup)


Data = tuple[torch.Tensor, torch.Tensor]


def train(args: argparse.Namespace, policy: str, seed: int, micro: int, data: Data) -> dict[str, Any]:
    train_rows, val_rows = data
    model = model_for(args, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    thresholds = {
        "ramp": ramp_thresholds(args.budget, RAMP_AT),
        "seesaw": seesaw_thresholds(args.budget, SEESAW_HALVINGS),
    }.get(policy, ())
    schedule = batchfit.schedule(
        model, optimizer, micro_batch=micro, accumulation=args.accumulation,
        max_accumulation=args.accumulation * args.growth, policy=policy, every=args.every,
        min_steps=args.min_steps, settle=args.settle, decay=args.decay, thresholds=thresholds,
    )  # fmt: skip
    largest = 0

    def count_rows(module: nn.Module, inputs: Any, kwargs: dict[str, Any]) -> None:
        nonlocal largest
        if module.training:  # training micro-batches; validation runs in eval mode
            largest = max(largest, len(kwargs["input_ids"]))

    model.register_forward_pre_hook(count_rows, with_kwargs=True)
    stream = batches(train_rows, micro, seed)
    evaluations = [(0, 0, validation_loss(model, val_rows))]
    next_eval = args.eval_every * args.budget
    oom, started = 0, time.perf_counter()
    try:
        while schedule.state.samples < args.budget:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, schedule.state.samples) * schedule.state.lr_factor
            with schedule.step():
                for batch in schedule.micro_batches(stream):
                    (model(**batch)["loss"] / schedule.accumulation).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if schedule.state.samples >= next_eval or schedule.state.samples >= args.budget:
                evaluations.append((schedule.state.step, schedule.state.samples, validation_loss(model, val_rows)))
                next_eval += args.eval_every * args.budget
    except torch.OutOfMemoryError:
        oom += 1
    return {
        "policy": policy,
        "seed": seed,
        "evaluations": evaluations,
        "steps": schedule.state.step,
        "samples": schedule.state.samples,
        "final_loss": evaluations[-1][2],
        "largest_micro_batch": largest,
        "oom": oom,
        "wall_s": time.perf_counter() - started,
        "state": schedule.state,
    }


def to_target(run: dict[str, Any], target: float) -> tuple[int | None, int | None]:
    """Steps and samples at the first evaluation at or below ``target``."""
    for step, samples, loss in run["evaluations"]:
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
            stream = batches(data[0], micro, 0)
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
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--memory-limit", default="48MiB", help="the budget the micro-batch is verified under")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--growth", type=int, default=16, help="max_accumulation = accumulation x growth")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=2_000, help="samples of linear warm-up")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--min-steps", type=int, default=20)
    parser.add_argument("--settle", type=int, default=3)
    parser.add_argument("--decay", type=float, default=0.9)
    parser.add_argument("--eval-every", type=float, default=0.025, help="fraction of the budget")
    parser.add_argument("--overhead-rounds", type=int, default=3)
    parser.add_argument("--overhead-steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file and the picture")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.budget, args.warmup, args.overhead_rounds = 1, args.budget // 10, args.warmup // 10, 1
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    data = windows(args.seq_len)
    probe_model = model_for(args, 0)
    sample = {"input_ids": data[0][:2], "labels": data[0][:2]}
    found = batchfit.find(probe_model, sample, memory_limit=args.memory_limit, device="cpu")
    micro = found.safe_batch
    print(f"batchfit.schedule benchmark: micro-batch {micro} (safe under {args.memory_limit}, max {found.max_batch})")
    runs = []
    for seed in range(args.seeds):
        for policy in POLICIES:
            run = train(args, policy, seed, micro, data)
            runs.append(run)
            print(f"  seed {seed} {policy:8s} {run['steps']:5d} steps {run['samples']:7d} samples "
                  f"loss {run['final_loss']:.4f} ({run['wall_s']:.0f} s)")  # fmt: skip
    cost = overhead(args, micro, data)
    rows = []
    for seed in range(args.seeds):
        mine = {r["policy"]: r for r in runs if r["seed"] == seed}
        target = mine["constant"]["final_loss"]
        constant_steps, constant_samples = to_target(mine["constant"], target)
        for policy in POLICIES:
            steps, samples = to_target(mine[policy], target)
            rows.append({
                "seed": seed, "policy": policy, "target": target, "steps_to_target": steps,
                "samples_to_target": samples, "final_loss": mine[policy]["final_loss"],
                "steps_fewer": None if steps is None else 1 - steps / constant_steps,
                "samples_ratio": None if samples is None else samples / constant_samples,
                "largest_micro_batch": mine[policy]["largest_micro_batch"], "oom": mine[policy]["oom"],
            })  # fmt: skip
    print(f"\n{'seed':>4} {'policy':8} {'steps->target':>13} {'fewer':>7} {'samples x':>9} {'final':>7} {'micro':>5}")
    for row in rows:
        fewer = "-" if row["steps_fewer"] is None else f"{row['steps_fewer']:.0%}"
        ratio = "-" if row["samples_ratio"] is None else f"{row['samples_ratio']:.2f}"
        steps = "never" if row["steps_to_target"] is None else str(row["steps_to_target"])
        print(f"{row['seed']:>4} {row['policy']:8} {steps:>13} {fewer:>7} {ratio:>9} {row['final_loss']:7.4f} "
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
        "rows": rows, "overhead": cost, "goals": goals,
        "runs": [{k: (v.to_dict() if k == "state" else v) for k, v in run.items()} for run in runs],
    }  # fmt: skip
    if not args.no_json:
        path = compare.write_results(document, args.out, "schedule-cpu")
        states = {r["policy"]: r["state"] for r in runs if r["seed"] == 0}
        print(f"wrote {plot_schedule(states, path.with_suffix('.png'))}")
    print(f"total {meta['total_wall_s']:.0f} s")
    return document


def goals_of(rows: list[dict[str, Any]], cost: dict[str, float], micro: int) -> dict[str, str]:
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
        best_open.append((row["steps_to_target"], min(open_loop) if open_loop else None))
    as_good = [s is not None and (b is None or s <= b) for s, b in best_open]
    return {
        ">=30% fewer steps at <=1.05x samples": (
            f"{'held' if reached and min(fewer) >= 0.30 and max(ratios) <= 1.05 else 'not held'}: fewer "
            f"{_rounded(fewer)}, samples x {_rounded(ratios)}"
        ),
        "as good as the best open-loop baseline": (
            f"{'held' if all(as_good) else 'not held'}: (noise, best open loop) {best_open}"
        ),
        "meter overhead <= 2%": f"{'held' if cost['at_every'] <= 0.02 else 'not held'}: {cost['at_every']:.2%}",
        "no micro-batch above the safe batch, 0 OOM": (
            f"{'held' if all(r['largest_micro_batch'] <= micro and r['oom'] == 0 for r in rows) else 'not held'}: "
            f"largest {max(r['largest_micro_batch'] for r in rows)} of safe {micro}, OOM {sum(r['oom'] for r in rows)}"
        ),
    }


def _rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 3) for v in values]


if __name__ == "__main__":
    main()

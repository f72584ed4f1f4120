"""Are the samples/s batchfit reports the ones training gets? Each reported rate beside warm plain steps.

Run from the repository root::

    python benchmarks/throughput.py                # gpt @ 650 MiB and hf_gpt2 @ 700 MiB, ~4 min on 2 cores
    python benchmarks/throughput.py --case gpt     # one case
    python benchmarks/throughput.py --quick        # the built-in GPT at 256 MiB (the issue's case), ~1 min

Per case (``compute.py``'s models and caps: boundaries in the hundreds, steps of real compute),
in one process, one after another:

* **batchfit** ``find()`` with its defaults: after the search it times the sizes around the knee,
  then the safe batch by its verification, warm and alike (``batchfit.probe.timing``); its
  ``Throughput.rates`` are what it reports.
* **before**: the same probe with ``timed_steps=0``, its rates read as batchfit read them before
  (each size's trial with the most timed steps: the search's single cold steps beside the
  safe batch's warm ones, ``batchfit.report.best_timed``).
* **plain**: at every size either reported, a user's loop with no meter (fresh AdamW, one
  untimed step, then ``--plain-steps`` timed ones, median): what training at that size gets.

Printed per size: each rate and its ratio to plain; per finder the best batch and the knee, and
the time the warm timing took. Benchmarks are not tests: nothing asserts a timing. Output: the
table and JSON under ``benchmarks/results/throughput-cpu-*.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)
import compute  # noqa: E402

import batchfit  # noqa: E402
from batchfit import examples  # noqa: E402
from batchfit.probe.batches import batch_size_of, tile  # noqa: E402
from batchfit.probe.workload import call_model, default_loss  # noqa: E402
from batchfit.report.throughput import best_timed, knee_of  # noqa: E402
from batchfit.units import format_bytes, parse_memory_limit  # noqa: E402

QUICK = compute.ComputeCase("gpt_small", parse_memory_limit("256MiB", None))
compute.MODELS.setdefault("gpt_small", (lambda: examples.gpt(), None))
CASES = (compute.CASES[0], compute.CASES[1])


def plain_rate(case: compute.ComputeCase, batch_size: int, steps: int) -> tuple[float, list[float]]:
    """Samples/s of warm plain training steps at ``batch_size``: median of ``steps`` timed steps
    after one untimed step, as a user's loop runs them."""
    model, sample = case.build()
    model.train()
    batch = tile(sample, batch_size, batch_size_of(sample))
    optimizer = torch.optim.AdamW(model.parameters())
    times: list[float] = []
    for index in range(steps + 1):
        started = time.perf_counter()
        loss = default_loss(call_model(model, batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        if index:
            times.append(time.perf_counter() - started)
    del model, optimizer, batch
    compare.release(torch.device("cpu"))
    return batch_size / statistics.median(times), times


def best_and_knee(rates: dict[int, float]) -> tuple[int, int]:
    return max(rates, key=lambda size: rates[size]), knee_of(rates)


def run_case(case: compute.ComputeCase, plain_steps: int) -> dict[str, Any]:
    print(f"\n== {case.label} ==")
    model, sample = case.build()
    started = time.perf_counter()
    result = batchfit.find(model, sample, memory_limit=case.cap_bytes)
    wall = time.perf_counter() - started
    assert result.throughput is not None
    now = dict(result.throughput.rates)
    model, sample = case.build()
    started = time.perf_counter()
    before_result = batchfit.find(model, sample, memory_limit=case.cap_bytes, timed_steps=0)
    before_wall = time.perf_counter() - started
    before = {size: trial.samples_per_s or 0.0 for size, trial in best_timed(list(before_result.trials)).items()}
    del model, sample
    sizes = sorted(set(now) | set(before))
    plain = {size: plain_rate(case, size, plain_steps) for size in sizes if size > 2}
    print(
        f"batchfit: max {result.max_batch}, safe {result.safe_batch}, {wall:.1f} s "
        f"(warm timing {result.throughput.timing_s or 0:.1f} s); before: {before_wall:.1f} s"
    )
    print(f"{'batch':>7} {'plain':>9} {'batchfit':>9} {'/plain':>7} {'before':>9} {'/plain':>7}")
    rows = []
    for size in sizes:
        reference = plain.get(size, (None, []))[0]
        cells = [f"{size:>7}", f"{reference:>9.1f}" if reference else f"{'-':>9}"]
        for rates in (now, before):
            rate = rates.get(size)
            cells.append(f"{rate:>9.1f}" if rate else f"{'-':>9}")
            cells.append(f"{rate / reference:>7.2f}" if rate and reference else f"{'-':>7}")
        print(" ".join(cells))
        rows.append(
            {
                "batch": size,
                "plain": reference,
                "plain_step_times_s": plain.get(size, (None, []))[1],
                "batchfit": now.get(size),
                "before": before.get(size),
            }
        )
    plain_rates = {size: rate for size, (rate, _) in plain.items()}
    answers = {"batchfit": best_and_knee(now), "before": best_and_knee(before), "plain": best_and_knee(plain_rates)}
    for name, (best, knee) in answers.items():
        print(f"{name:>9}: best {best}, knee {knee}")
    return {
        "case": case.label,
        "cap_bytes": case.cap_bytes,
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "wall_s": wall,
        "before_wall_s": before_wall,
        "timing_s": result.throughput.timing_s,
        "trials": [t.kind for t in result.trials],
        "spread": result.throughput.spread,
        "rows": rows,
        "best_and_knee": {name: {"best": best, "knee": knee} for name, (best, knee) in answers.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=["gpt", "hf_gpt2"], help="only this model")
    parser.add_argument("--quick", action="store_true", help="the built-in GPT at 256 MiB only")
    parser.add_argument("--plain-steps", type=int, default=4, help="timed plain steps per size")
    parser.add_argument("--out", type=Path, default=compare.RESULTS)
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    cases = [QUICK] if args.quick else [c for c in CASES if args.case in (None, c.model)]
    compute.warm_up_imports()
    started = time.perf_counter()
    meta = {
        **compare.stamp(argv),
        "machine": compare.machine(),
        "versions": compare.versions(),
    }
    print(f"batchfit throughput benchmark: {meta['machine']['cpu']}, {meta['machine']['cores']} cores")
    results = [run_case(case, args.plain_steps) for case in cases if not case.missing]
    meta["total_wall_s"] = time.perf_counter() - started
    document = {"schema": "batchfit.throughput-benchmark/1", **meta, "cases": results}
    print(f"\ntotal {meta['total_wall_s']:.0f} s; caps {', '.join(format_bytes(c.cap_bytes) for c in cases)}")
    if not args.no_json:
        compare.write_results(document, args.out, "throughput-cpu")
    return document


if __name__ == "__main__":
    main()

"""A probe done once: ``find(cache=DIR)``'s probe (a miss) against its hit, on compute-dominated cases.

Run from the repository root (transformers is optional: a case whose package is missing says so)::

    python benchmarks/cache.py                   # gpt @ 650 MiB and hf_gpt2 @ 700 MiB, about 2 minutes on 2 cores
    python benchmarks/cache.py --case gpt

Per case (``compute.py``'s models and caps: boundaries in the hundreds, a step of 0.5 s or more
at the boundary on two cores), one after another in this process, each on a freshly built
(seeded, identical) model under the same live-tensor cap, with an empty cache directory:

* **miss**: ``find(model, sample, memory_limit=CAP, cache=DIR)``: the whole probe, then the entry
  written;
* **hit**: the same call again on a fresh copy of the model, as a restart, another node or a CI
  run of the same model would make it: no trial, the answer read back;
* **hit after training**: the same, after 20 AdamW steps changed the weights (the key leaves
  the weights out: the memory and the speed do not depend on them);
* **fresh process**: ``batchfit probe`` of the same case from the command line with ``--cache``
  pointing at the same entry is not timed here (a process start and ``import torch`` dominate it).

Per row: wall time, trials run, whether the answer (max, safe, trials) is identical to the miss's,
and the hit's time as a fraction of the miss's. Nothing here asserts a timing. Output: a table on
stdout and JSON under ``benchmarks/results/cache-cpu-*.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)
import compute  # noqa: E402

import batchfit  # noqa: E402

#: compute.py's first two cases: the built-in GPT and a Hugging Face GPT-2 from its config.
CASES = compute.CASES[:2]


def _timed(case: compute.ComputeCase, cache: Path, train_steps: int = 0) -> tuple[batchfit.Result, float, int]:
    """``find(cache=...)`` on a freshly built model (after ``train_steps`` AdamW steps); the
    result, its wall time and the trials it ran (counted by its callback)."""
    model, sample = case.build()
    if train_steps:  # both cases' samples are {"input_ids", "labels"} and their models return a loss
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(train_steps):
            model(**sample)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
    trials: list[Any] = []
    started = time.perf_counter()
    result = batchfit.find(
        model, sample, memory_limit=case.cap_bytes, device="cpu", cache=cache, callback=trials.append
    )
    wall = time.perf_counter() - started
    compare.release(torch.device("cpu"))
    return result, wall, len(trials)


def _answer(result: batchfit.Result) -> tuple[Any, ...]:
    return (result.max_batch, result.safe_batch, result.trials, result.memory, result.throughput)


def run_case(case: compute.ComputeCase) -> dict[str, Any]:
    if case.missing:
        print(f"== {case.label} == skipped: {case.missing} is not installed")
        return {"case": case.label, "skipped": f"{case.missing} is not installed"}
    with tempfile.TemporaryDirectory(prefix="batchfit-cache-") as folder:
        cache = Path(folder)
        miss, miss_s, miss_trials = _timed(case, cache)
        rows = [{"row": "miss (the probe)", "wall_s": miss_s, "trials": miss_trials, "identical": True}]
        for label, steps in (("hit", 0), ("hit after 20 training steps", 20)):
            hit, hit_s, hit_trials = _timed(case, cache, train_steps=steps)
            rows.append(
                {
                    "row": label,
                    "wall_s": hit_s,
                    "trials": hit_trials,
                    "identical": _answer(hit) == _answer(miss),
                    "from_cache": hit.from_cache is not None,
                    "of_miss": hit_s / miss_s,
                }
            )
    print(f"== {case.label} ==  (max {miss.max_batch}, safe {miss.safe_batch}, knee "
          f"{miss.throughput.knee_batch if miss.throughput else '-'})")  # fmt: skip
    print(f"  {'':30} {'wall s':>8} {'trials':>7} {'same answer':>12} {'x miss':>8}")
    for row in rows:
        fraction = f"{row['of_miss']:.4f}" if "of_miss" in row else "1"
        print(f"  {row['row']:30} {row['wall_s']:8.3f} {row['trials']:7d} {str(row['identical']):>12} {fraction:>8}")
    return {"case": case.label, "max_batch": miss.max_batch, "safe_batch": miss.safe_batch, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted({case.model for case in CASES}), help="only this model's case")
    parser.add_argument("--out", type=Path, default=compare.RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    document: dict[str, Any] = {
        **compare.stamp(argv),
        "machine": compare.machine(),
        "torch": torch.__version__,
        "cases": [run_case(case) for case in CASES if args.case in (None, case.model)],
    }
    compare.write_results(document, args.out, "cache-cpu")
    return document


if __name__ == "__main__":
    main()

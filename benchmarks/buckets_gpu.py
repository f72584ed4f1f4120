"""The soak on a caching allocator (issue 50, item 6): does an epoch at the plan's sizes drift?

On the CPU a soak can show only that no step ran out of memory; on CUDA the allocator's cache
fragments as shapes change, which is what makes runs fail hours in (pytorch#130330, verl #2159).
This script is the device check for that, one call on the GPU box::

    python3 benchmarks/buckets_gpu.py --out "$OUT"        # CUDA: GPT-2-small shaped, 24 GiB cap (~3-4 min)
    python3 benchmarks/buckets_gpu.py --out DIR           # anywhere else: a small GPT on the CPU (~1 min)

1. ``batchfit.buckets`` plans buckets and a token budget for long-tailed lengths (lognormal, median
   128, the longest 1024) on the built-in GPT (GPT-2-small sized on CUDA, a small one on the CPU);
2. each sampler's epoch (its first ``--soak-steps``) is replayed in a FRESH process
   (``batchfit.soak("benchmarks/buckets_gpu.py:target", None, sampler)``), as a training run starts;
3. it writes ``buckets_gpu.json`` and prints, per sampler: steps, out-of-memory steps, the peak and
   its step, and on CUDA the allocator's retries and reserved drift per 100 steps.

Verdict: 0 out-of-memory steps at the plan's sizes is the goal; retries or a growing reserve are
the fragmentation to report (and, if they grow, the headroom to raise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import batchfit  # noqa: E402
from batchfit.examples import gpt  # noqa: E402
from batchfit.samplers import BucketBatchSampler, TokenBudgetBatchSampler  # noqa: E402

LONGEST = 1024
VOCAB = 50257


def on_cuda() -> bool:
    return torch.cuda.is_available()


def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """``batch_size`` rows of ``seq_len`` random token ids, on the model's device."""
    vocab = VOCAB if on_cuda() else 512
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    ids = ids.to("cuda" if on_cuda() else "cpu")
    return {"input_ids": ids, "labels": ids}


def target() -> dict[str, Any]:
    """The model and its batches: GPT-2-small sized on CUDA, a small GPT on the CPU (the fresh
    process of the soak builds it again from here)."""
    if on_cuda():
        model, _ = gpt(vocab_size=VOCAB, seq_len=LONGEST, d_model=768, n_layers=12, n_heads=12)
        model = model.to("cuda")
    else:
        model, _ = gpt(vocab_size=512, seq_len=LONGEST, d_model=64, n_layers=2, n_heads=4)
    return {"model": model, "make_batch": make_batch}


def long_tail(rows: int, median: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(rows, generator=generator) * 0.8 + float(torch.log(torch.tensor(median))))
    return drawn.clamp(8, LONGEST).long().tolist()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--memory-limit", default=None, help="default: 24GiB on CUDA, 96MiB on the CPU")
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--median", type=int, default=128)
    parser.add_argument("--soak-steps", type=int, default=300)
    args = parser.parse_args(argv)
    limit = args.memory_limit or ("24GiB" if on_cuda() else "96MiB")
    lengths = long_tail(args.rows, args.median)
    built = target()
    started = time.monotonic()
    plan = batchfit.buckets(built["model"], make_batch, lengths=lengths, memory_limit=limit, max_buckets=6)
    planned_s = time.monotonic() - started
    del built
    print(plan)
    spec = f"{Path(__file__).resolve()}:target"
    samplers: list[tuple[str, Any]] = [("buckets", BucketBatchSampler(lengths, plan.boundaries, plan.batch_sizes))]
    if plan.token_budget is not None:
        samplers.append(("token budget", TokenBudgetBatchSampler(lengths, plan.token_budget.max_tokens)))
    soaks = []
    for name, sampler in samplers:
        soak = batchfit.soak(spec, None, sampler, name=name, max_steps=args.soak_steps, memory_limit=limit)
        soaks.append(soak)
    header = ("sampler", "steps", "oom", "peak", "at step", "retries/100", "drift/100")
    print("\n{:<14} {:>6} {:>4} {:>12} {:>8} {:>12} {:>12}".format(*header))
    for soak in soaks:
        retries = "-" if soak.retries_per_100 is None else f"{soak.retries_per_100:.2f}"
        drift = "-" if soak.reserved_drift_per_100 is None else f"{soak.reserved_drift_per_100 / 2**20:.1f} MiB"
        print(
            f"{soak.sampler:<14} {soak.steps:>6} {soak.oom:>4} {soak.peak_bytes / 2**20:>9.1f} MiB "
            f"{soak.peak_step:>8} {retries:>12} {drift:>12}"
        )
    verdict = "PASS" if all(soak.oom == 0 for soak in soaks) else "FAIL"
    print(f"\nverdict: {verdict} (0 out-of-memory steps at the plan's sizes, in fresh processes)")
    document = {
        "benchmark": "buckets_gpu",
        "device": plan.frontier.device.name,
        "memory_limit": limit,
        "plan_seconds": planned_s,
        "verdict": verdict,
        "plan": json.loads(plan.to_json()),
        "soaks": [json.loads(soak.to_json()) for soak in soaks],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "buckets_gpu.json").write_text(json.dumps(document, indent=2, sort_keys=True))
    return document


if __name__ == "__main__":
    main()

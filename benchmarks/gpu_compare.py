"""The comparison of ``compare.py`` on one CUDA GPU, with the cap applied by the CUDA allocator.

Run from the repository root on a machine with a GPU (Lightning and Accelerate installed next
to batchfit, without replacing its torch)::

    python benchmarks/gpu_compare.py                 # all cases, about 6-7 minutes on one H100 (estimate)
    python benchmarks/gpu_compare.py --deadline 300  # skip the cases that would start after 300 s

This compares finders with an exhaustive scan made the same way under the same cap, so an error
they share (a cap that is not what a fresh process meets, say) goes unseen here. What proves or
disproves the CUDA path itself is ``python benchmarks/gpu.py``: run that first.

What differs from the CPU run:

* The cap is ``torch.cuda.set_per_process_memory_fraction(cap / total)`` (batchfit's
  ``memory_limit`` on CUDA), so the real caching allocator raises ``torch.OutOfMemoryError`` at
  the cap, for every finder alike. It counts *reserved* memory, so fragmentation is part of the
  picture, as on a real smaller GPU.
* Models are sized for a GPU, and a GPT-2-small-sized model (124M parameters, sequence 1024)
  runs in bf16 autocast (Lightning: ``precision="bf16-mixed"``).
* Caps are calibrated at the start: two uncapped trials measure each model's *reserved* peak
  (``Trial.reserved_peak_bytes``, the allocator's segments: what the cap counts) at two batch
  sizes, and the cap is set where the fitted line reaches the case's target size. The
  exhaustive scan then finds the true boundary under that cap. Reserved memory grows in
  segment-sized steps (2 MiB, 20 MiB) rather than on a line, so the boundary lands near the
  target, not on it; calibrating on allocated bytes would put every cap too low by the
  allocator's rounding and cache, and the boundary below the target.

A deadline keeps the run unattended-safe: a case that would start after it is skipped and the
output says so. The cases with the GPT-2-small model run first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)

import batchfit  # noqa: E402

#: (model, factory arguments, amp, target truths). Targets stay small enough that the
#: exhaustive scan (every size from 1) fits the time budget.
GPU_MODELS: tuple[tuple[str, dict[str, Any], str | None, tuple[int, ...]], ...] = (
    ("gpt2_small", {"seq_len": 1024}, "bf16", (8, 24)),
    ("mlp", {"in_features": 4096, "hidden": 4096, "depth": 4, "classes": 1000}, None, (32, 96)),
    ("cnn", {"image_size": 224, "width": 32}, None, (32, 96)),
    ("gpt", {"vocab_size": 8192, "seq_len": 512, "d_model": 512, "n_layers": 6, "n_heads": 8}, None, (24, 64)),
)


def calibrate(
    model_name: str, kwargs: dict[str, Any], amp: str | None, targets: tuple[int, ...], device: torch.device, steps: int
) -> list[compare.Case]:
    """Caps that put each target batch size just inside the cap, from the reserved peaks of two
    uncapped trials (the CUDA cap counts reserved bytes, not allocated ones)."""
    small, large = 2, 8
    case = compare.Case(model_name, 1, kwargs, amp)
    model, sample = case.build()
    with batchfit.Prober(model, sample, device=device, amp=amp, steps_per_trial=steps) as prober:
        low, high = prober.trial(small), prober.trial(large)
    compare.release(device)
    if not (low.fits and high.fits and low.reserved_peak_bytes and high.reserved_peak_bytes):
        raise SystemExit(f"{model_name}: calibration trials at {small} and {large} did not fit on this GPU")
    per_sample = (high.reserved_peak_bytes - low.reserved_peak_bytes) / (large - small)
    fixed = low.reserved_peak_bytes - per_sample * small
    return [compare.Case(model_name, int(fixed + per_sample * (target + 0.5)), kwargs, amp) for target in targets]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="batchfit vs Lightning vs Accelerate on one CUDA GPU")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds after which no new case starts")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=compare.RESULTS)
    parser.add_argument("--finders", default="batchfit,lightning,accelerate")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_compare.py needs a CUDA GPU; on CPU run benchmarks/compare.py")
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    cases: list[compare.Case] = []
    for name, kwargs, amp, targets in GPU_MODELS:
        cases += calibrate(name, kwargs, amp, targets, device, args.steps)
        caps = ", ".join(compare.format_bytes(c.cap_bytes) for c in cases[-len(targets) :])
        print(f"calibrated {name}: caps {caps} for target truths {targets}", flush=True)
    compare.main(
        ["--device", str(device), "--steps", str(args.steps), "--out", str(args.out), "--finders", args.finders],
        cases=tuple(cases),
        name="gpu",
        deadline_s=args.deadline - (time.perf_counter() - started),
    )


if __name__ == "__main__":
    main()

"""``batchfit.noise_scale()`` on language models trained here on real text: what it costs, in training
steps, and how much it moves from one seed to the next.

Run from the repository root::

    python benchmarks/noise_scale.py              # both cases, about 3-4 minutes on 2 idle cores
    python benchmarks/noise_scale.py --case gpt   # one case (repeat --case for more)
    python benchmarks/noise_scale.py --quick      # a smoke run: the small GPT, smaller, well under a minute

The text is real: the source of a dozen modules of Python's standard library, as bytes (token ids
0-255, no tokenizer, nothing downloaded), cut into sequences of ``--seq-len`` tokens; a
``DataLoader`` of batches of 16 sequences, shuffled by a generator seeded per run. Cases:

* ``gpt``: ``batchfit.examples.gpt`` (4 layers, d=128, 4 heads, tied embeddings), vocabulary 256;
* ``hf_gpt2``: a Hugging Face ``GPT2LMHeadModel`` from a ``GPT2Config`` of the same shape (skipped
  when transformers is missing).

Per case the model (seeded) is measured at initialisation, then trained ``--train-steps`` AdamW
steps (lr 1e-3) on the same text, as a user would measure from a warm checkpoint, and measured
again with ``--seeds`` seeds (each seed shuffles the loader differently and seeds the bootstrap):
``batchfit.noise_scale(model, loader, passes=128)``, the defaults otherwise (windows of 8
micro-batches of the loader's 16 rows). Reported per stage: ``B_simple`` (in sequences, and in
tokens), its mean, standard deviation and coefficient of variation over the seeds, each seed's 90%
interval and whether it covers the seeds' mean, and the wall time of each measurement.

The cost is put in training steps measured in the same process on the same model: the median of
20 plain steps (forward, loss, backward, ``AdamW.step()``, ``zero_grad``; 3 untimed first) on a copy
of the trained model at the same batch of 16, and of 20 bare forward+backward passes (what each of
the measurement's passes runs). ``cost in steps`` is a measurement's wall time over one training
step's; ``x fwd+bwd`` its time per pass over a bare pass (the measurement's own overhead: set-up,
restore, the squared norms). A tiny ``noise_scale()`` runs once first to pay first-use costs (its
time is reported apart). Benchmarks are not tests: nothing asserts a timing. Output: a table on
stdout and JSON under ``benchmarks/results/noise_scale-cpu-*.json``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)

import batchfit  # noqa: E402
from batchfit import examples  # noqa: E402
from batchfit.examples import gpt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 16
SOURCES = (
    "argparse", "ast", "collections", "dataclasses", "fractions", "inspect", "json.decoder",
    "pathlib", "statistics", "string", "textwrap", "typing",
)  # fmt: skip


@dataclass(frozen=True)
class Size:
    seq_len: int
    layers: int
    width: int
    heads: int
    train_steps: int
    seeds: int
    passes: int


FULL = Size(seq_len=64, layers=4, width=128, heads=4, train_steps=200, seeds=5, passes=128)
QUICK = Size(seq_len=32, layers=2, width=64, heads=2, train_steps=50, seeds=2, passes=32)


class Chunks(Dataset):
    """Non-overlapping sequences of ``seq_len`` byte tokens: ``{"input_ids", "labels"}``."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.rows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def text_ids() -> torch.Tensor:
    return examples.text_ids(SOURCES)


def loader(dataset: Dataset, seed: int) -> DataLoader:
    return DataLoader(
        dataset, batch_size=BATCH, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed)
    )


def build_gpt(size: Size) -> nn.Module:
    model, _ = gpt(vocab_size=256, seq_len=size.seq_len, d_model=size.width, n_layers=size.layers, n_heads=size.heads)
    return model


def build_hf_gpt2(size: Size) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=size.seq_len, n_embd=size.width, n_layer=size.layers, n_head=size.heads,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


CASES: dict[str, tuple[Callable[[Size], nn.Module], str | None]] = {
    "gpt": (build_gpt, None),
    "hf_gpt2": (build_hf_gpt2, "transformers"),
}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    return out["loss"] if isinstance(out, dict) else out.loss


def train(model: nn.Module, dataset: Dataset, steps: int) -> tuple[float, float]:
    """``steps`` AdamW steps over the shuffled text: (the last 20 steps' mean loss, seconds)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    started = time.perf_counter()
    batches = iter(())
    for step in range(steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader(dataset, seed=1000 + step))
            batch = next(batches)
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return statistics.fmean(losses[-20:]), time.perf_counter() - started


def step_times(model: nn.Module, dataset: Dataset) -> dict[str, float]:
    """Median seconds of a plain training step and of a bare forward+backward, at batch 16."""
    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    batches = [batch for batch, _ in zip(loader(dataset, seed=7), range(23))]

    def timed(fn: Callable[[dict[str, torch.Tensor]], None]) -> float:
        times = []
        for index, batch in enumerate(batches):
            start = time.perf_counter()
            fn(batch)
            if index >= 3:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss_of(twin, batch).backward()
        optimizer.step()
        optimizer.zero_grad()

    def forward_backward(batch: dict[str, torch.Tensor]) -> None:
        loss_of(twin, batch).backward()
        twin.zero_grad()

    return {"train_step_s": timed(step), "forward_backward_s": timed(forward_backward)}


def measure(model: nn.Module, dataset: Dataset, seeds: range, passes: int) -> list[dict[str, Any]]:
    runs = []
    for seed in seeds:
        noise = batchfit.noise_scale(model, loader(dataset, seed), passes=passes, seed=seed)
        runs.append({"seed": seed, **asdict(noise), "summary": noise.summary()})
        print(f"    seed {seed}: {noise.summary()}", flush=True)
    return runs


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    values = [r["b_simple"] for r in runs if r["b_simple"] is not None]
    mean = statistics.fmean(values) if values else None
    sd = statistics.stdev(values) if len(values) > 1 else None
    covered = [
        mean is not None and r["low"] <= mean and (r["high"] is None or mean <= r["high"]) for r in runs
    ]  # fmt: skip
    return {
        "b_simple_mean": mean,
        "b_simple_sd": sd,
        "b_simple_cv": sd / mean if sd is not None and mean else None,
        "b_simple_min": min(values, default=None),
        "b_simple_max": max(values, default=None),
        "drowned": len(runs) - len(values),
        "intervals": [(r["low"], r["high"]) for r in runs],
        "intervals_covering_mean": sum(covered),
        "elapsed_s_mean": statistics.fmean(r["elapsed_s"] for r in runs),
        "passes": runs[0]["passes"],
        "windows": runs[0]["windows"],
        "small_batch": runs[0]["small_batch"],
        "big_batch": runs[0]["big_batch"],
    }


def run_case(name: str, size: Size, dataset: Dataset) -> dict[str, Any]:
    build, _ = CASES[name]
    model = build(size)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"\n== {name}: {parameters:,} parameters, sequences of {size.seq_len}, batch {BATCH}", flush=True)
    print("  at initialisation:", flush=True)
    at_init = measure(model, dataset, range(1), size.passes)
    loss, train_s = train(model, dataset, size.train_steps)
    print(f"  trained {size.train_steps} steps in {train_s:.1f} s (loss {loss:.3f}); {size.seeds} seeds:", flush=True)
    trained = measure(model, dataset, range(size.seeds), size.passes)
    times = step_times(model, dataset)
    stages = {"init": spread(at_init), "trained": spread(trained)}
    for stage in stages.values():
        stage["cost_in_train_steps"] = stage["elapsed_s_mean"] / times["train_step_s"]
        stage["per_pass_over_forward_backward"] = (
            stage["elapsed_s_mean"] / stage["passes"] / times["forward_backward_s"]
        )
    return {
        "case": name,
        "parameters": parameters,
        "seq_len": size.seq_len,
        "batch": BATCH,
        "train_steps": size.train_steps,
        "train_s": train_s,
        "final_loss": loss,
        **times,
        "stages": stages,
        "runs": {"init": at_init, "trained": trained},
    }


def warm_up() -> float:
    """One tiny measurement first: imports and first-use costs are paid here, not by a case."""
    started = time.perf_counter()
    model = nn.Linear(8, 1)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(8)]
    batchfit.noise_scale(model, iter(data), criterion=nn.MSELoss(), passes=8, per_window=4)
    return time.perf_counter() - started


def number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def print_table(cases: list[dict[str, Any]]) -> None:
    print(
        f"\n{'case':<9}{'stage':<9}{'seeds':>6}{'B_simple':>10}{'sd':>8}{'cv':>6}{'min-max':>13}{'tokens':>9}"
        f"{'covers':>8}{'cost s':>8}{'step ms':>9}{'cost/steps':>11}{'x fwd+bwd':>10}"
    )
    for case in cases:
        for stage, row in case["stages"].items():
            seeds = len(case["runs"][stage])
            cv = "-" if row["b_simple_cv"] is None else f"{row['b_simple_cv']:.0%}"
            spanned = f"{number(row['b_simple_min'])}-{number(row['b_simple_max'])}"
            tokens = None if row["b_simple_mean"] is None else row["b_simple_mean"] * case["seq_len"]
            print(
                f"{case['case']:<9}{stage:<9}{seeds:>6}{number(row['b_simple_mean']):>10}{number(row['b_simple_sd']):>8}"
                f"{cv:>6}{spanned:>13}{number(tokens):>9}{row['intervals_covering_mean']:>5}/{seeds:<2}"
                f"{row['elapsed_s_mean']:>8.1f}{case['train_step_s'] * 1000:>9.1f}{row['cost_in_train_steps']:>11.0f}"
                f"{row['per_pass_over_forward_backward']:>10.2f}"
            )
    print(
        "\nB_simple in sequences (tokens: x the sequence length), mean over the seeds; covers: the seeds whose 90% "
        "interval holds that mean;\ncost s: one measurement's wall time (passes of batch 16, windows of 8); "
        "cost/steps: that over one plain training step;\nx fwd+bwd: its time per pass over a bare forward+backward."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=list(CASES), action="append", help="only this case (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smoke run: the small GPT, smaller, 2 seeds, 32 passes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the cores)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        transformers.logging.set_verbosity_error()
    size = QUICK if args.quick else FULL
    started = time.perf_counter()
    meta = {
        **compare.stamp(argv),
        "quick": args.quick,
        "size": asdict(size),
        "machine": compare.machine(),
        "versions": {
            "torch": torch.__version__,
            "batchfit": batchfit.__version__,
            "transformers": importlib.import_module("transformers").__version__
            if importlib.util.find_spec("transformers")
            else None,
        },
    }
    machine = meta["machine"]
    print(
        f"batchfit noise_scale() benchmark: {machine['cpu']}, {machine['cores']} cores, "
        f"{torch.get_num_threads()} torch threads; {meta['versions']}"
    )
    first = warm_up()
    print(f"first use (paid once before the cases): {first:.2f} s")
    ids = text_ids()
    dataset = Chunks(ids, size.seq_len)
    print(f"text: {len(ids):,} bytes of the standard library's source, {len(dataset):,} sequences of {size.seq_len}")
    selected = args.case or (["gpt"] if args.quick else list(CASES))
    results, skipped = [], []
    for name in CASES:
        if name not in selected:
            continue
        needs = CASES[name][1]
        if needs is not None and importlib.util.find_spec(needs) is None:
            print(f"== {name} skipped: {needs} is not installed")
            skipped.append(name)
            continue
        results.append(run_case(name, size, dataset))
    meta["total_wall_s"] = time.perf_counter() - started
    meta["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if results:
        print_table(results)
    print(f"\ntotal {meta['total_wall_s']:.0f} s")
    document = {
        "schema": "batchfit.benchmark/1",
        **meta,
        "first_use_s": first,
        "text_bytes": len(ids),
        "cases": results,
        "skipped_cases": skipped,
    }
    if not args.no_json:
        compare.write_results(document, args.out, "noise_scale-cpu")
    return document


if __name__ == "__main__":
    main()

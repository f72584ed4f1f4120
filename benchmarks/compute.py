"""Time to answer on compute-dominated cases: batchfit against Lightning, Accelerate and three plain steps.

Run from the repository root (Lightning, Accelerate and transformers are optional; a row whose
package is missing says so)::

    python benchmarks/compute.py                 # every case, about 10 minutes on 2 idle cores
    python benchmarks/compute.py --case gpt      # one case

``compare.py`` counts trials on small cases, where fixed per-trial overheads decide the wall
time. Here every step costs real compute: models nobody tuned for batchfit (a GPT-2 and a BERT
built from a Hugging Face config, a ``torch.nn.TransformerEncoder``, the built-in GPT at two
caps), CPU caps that put the boundary at 100-500 samples, and a step at the boundary of 0.5 s or
more on two cores. Per case, one after another in this process, each on a freshly built (seeded,
identical) model under the same live-tensor cap:

* **batchfit** ``find()`` with its defaults: the whole answer (the exact maximum, a verified
  safe batch, the sizes around the throughput knee and the safe batch timed warm); and with ``timed_steps=0``, the
  largest and safe batch without that timing (what the peers answer, and less).
* **Lightning** ``Tuner.scale_batch_size(mode="binsearch", margin=0)`` with
  ``steps_per_trial=2``: the fewest steps that show the optimizer state (Lightning builds a new
  optimizer for every trial, so its step 1 runs without the state); its default of 3 only costs
  it more.
* **Accelerate** ``find_executable_batch_size`` started at 2x the truth (a start no user knows),
  two steps per trial.
* **three plain steps**: a user's loop (fresh AdamW, forward, loss, backward, step) at the batch
  batchfit found, with no meter: the yardstick of the goals (issue 34: the whole answer <= 2.5x this,
  ``timed_steps=0`` <= 1.5x).

The truth is checked, not assumed: the size batchfit found must fit and the next size must run
out of memory, each with a fresh optimizer and three steps (the classic trial), and the memory
under the cap grows with the batch on these models, so that pair is the boundary.

Per finder: wall time, **sample-steps** (the samples of every step it started: a trial at ``b``
that ran ``k`` steps costs ``b * k``, a failure counts the step it died in), trials, found vs
truth, and batchfit's wall time as a fraction of each peer's and of the three plain steps.
Benchmarks are not tests: nothing asserts a timing. Output: a table on stdout and JSON under
``benchmarks/results/compute-cpu-*.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)

import batchfit  # noqa: E402
from batchfit import examples  # noqa: E402
from batchfit.probe.batches import batch_size_of, tile  # noqa: E402
from batchfit.probe.workload import call_model, default_loss  # noqa: E402
from batchfit.units import format_bytes, parse_memory_limit  # noqa: E402

#: Steps per trial for the peers: the fewest that show the optimizer state with a fresh optimizer.
PEER_STEPS = 2


# Models ----------------------------------------------------------------------------------------------
def gpt() -> tuple[nn.Module, Any]:
    """The built-in GPT at 4 layers, d=256, vocab 2048, sequence 32 (5.2M parameters)."""
    return examples.gpt(vocab_size=2048, seq_len=32, d_model=256, n_layers=4, n_heads=4)


def hf_gpt2(n_layer: int = 4, seq_len: int = 32) -> tuple[nn.Module, Any]:
    """A Hugging Face ``GPT2LMHeadModel`` from a config: 4 layers, d=256, vocab 2048, sequence 32
    (``benchmarks/checkpointing.py`` builds it with 6 layers at 64)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=n_layer, n_embd=256, n_head=4, vocab_size=2048, n_positions=seq_len, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(0, 2048, (2, seq_len), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids.clone()}


def hf_bert() -> tuple[nn.Module, Any]:
    """A Hugging Face ``BertForSequenceClassification`` from a config: 4 layers, d=256, sequence 64."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=2048,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(2, dtype=torch.long)
    return BertForSequenceClassification(config), {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
    }


class EncoderClassifier(nn.Module):
    """``torch.nn.TransformerEncoder`` (4 layers, d=256, 4 heads, dropout) with a mean-pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2048, 256)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(256, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))


def encoder() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return EncoderClassifier(), torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))


MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], str | None]] = {
    "gpt": (gpt, None),
    "hf_gpt2": (hf_gpt2, "transformers"),
    "hf_bert": (hf_bert, "transformers"),
    "encoder": (encoder, None),
}


@dataclass(frozen=True)
class ComputeCase:
    """A model and a CPU cap; duck-typed like ``compare.Case`` so its peers' runners take it."""

    model: str
    cap_bytes: int
    amp: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.model} @ {format_bytes(self.cap_bytes)}"

    def build(self) -> tuple[nn.Module, Any]:
        return MODELS[self.model][0]()

    @property
    def missing(self) -> str | None:
        """The optional package the model needs and this environment lacks, if any."""
        package = MODELS[self.model][1]
        return package if package and importlib.util.find_spec(package) is None else None


#: Caps that put the boundary at 100-500 samples with a step of 0.5-2.5 s there on 2 cores.
CASES: tuple[ComputeCase, ...] = (
    ComputeCase("gpt", parse_memory_limit("650MiB", None)),
    ComputeCase("hf_gpt2", parse_memory_limit("700MiB", None)),
    ComputeCase("hf_bert", parse_memory_limit("700MiB", None)),
    ComputeCase("encoder", parse_memory_limit("800MiB", None)),
    ComputeCase("gpt", parse_memory_limit("1600MiB", None)),
)


# Rows ---------------------------------------------------------------------------------------------------
@dataclass
class Row:
    finder: str
    setting: str
    found: int | None = None
    trials: int | None = None
    sample_steps: int | None = None
    wall_s: float | None = None
    sizes: list[int] = field(default_factory=list)
    note: str = ""
    skipped: str | None = None
    delta: int | None = None
    batchfit_fraction: float | None = None  # batchfit's wall time / this row's


def sample_steps_of(sizes: list[int], completed: list[int], fits: list[bool]) -> int:
    """Samples of every step started: completed steps, plus the one a failed trial died in."""
    return sum(size * (done + (0 if fit else 1)) for size, done, fit in zip(sizes, completed, fits))


def run_batchfit(case: ComputeCase, **options: Any) -> tuple[Row, batchfit.Result]:
    """``find()`` with its defaults, or with ``options`` (``timed_steps=0``: no warm timing after
    the search, the largest and safe batch alone, as the peers answer)."""
    model, sample = case.build()
    started = time.perf_counter()
    result = batchfit.find(model, sample, memory_limit=case.cap_bytes, device="cpu", **options)
    wall = time.perf_counter() - started
    compare.release(torch.device("cpu"))
    trials = result.trials
    row = Row(
        "batchfit",
        ", ".join(f"{k}={v}" for k, v in options.items()) if options else "find() defaults",
        found=result.max_batch,
        trials=len(trials),
        sample_steps=sample_steps_of(
            [t.batch_size for t in trials], [t.steps for t in trials], [t.fits for t in trials]
        ),
        wall_s=wall,
        sizes=[t.batch_size for t in trials],
    )
    throughput = result.throughput
    knee = f", knee {throughput.knee_batch}" if throughput else ""
    kinds = {kind: sum(t.kind == kind for t in trials) for kind in ("search", "verify", "time")}
    timing = f" ({throughput.timing_s:.1f} s)" if throughput and throughput.timing_s is not None else ""
    row.note = (
        f"{kinds['search']} search + {kinds['verify']} verify + {kinds['time']} time{timing}; "
        f"safe {result.safe_batch}{' verified' if result.safe_verified else ''}{knee}"
    )
    return row, result


def peer_row(row: compare.Row, finder: str, setting: str) -> Row:
    return Row(
        finder,
        setting,
        found=row.found,
        trials=row.trials,
        sample_steps=sample_steps_of(row.sizes, row.completed, row.fits),
        wall_s=row.wall_s,
        sizes=row.sizes,
        note=row.note,
    )


def run_lightning(case: ComputeCase, truth: int) -> Row:
    if not compare.lightning_available():
        return Row("Lightning", "binsearch", skipped="lightning is not installed")
    above = max(8192, 4 * truth)  # margin 0 and a cap above the truth: neither decides the row
    row = compare.run_lightning(case, torch.device("cpu"), PEER_STEPS, "binsearch", 0.0, above)  # type: ignore[arg-type]
    return peer_row(row, "Lightning", f"binsearch, margin=0, {PEER_STEPS} steps")


def run_accelerate(case: ComputeCase, truth: int) -> Row:
    if not compare.accelerate_available():
        return Row("Accelerate", "start 2x truth", skipped="accelerate is not installed")
    row = compare.run_accelerate(case, torch.device("cpu"), PEER_STEPS, 2 * truth, "2x truth")  # type: ignore[arg-type]
    return peer_row(row, "Accelerate", f"start 2x truth, {PEER_STEPS} steps")


def plain_steps(case: ComputeCase, batch_size: int, steps: int = 3) -> Row:
    """``steps`` training steps as a user writes them, at ``batch_size``, with no meter and no cap."""
    model, sample = case.build()
    model.train()
    batch = tile(sample, batch_size, batch_size_of(sample))
    optimizer = torch.optim.AdamW(model.parameters())
    started = time.perf_counter()
    for _ in range(steps):
        output = call_model(model, batch)
        loss = default_loss(output)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del output, loss
    wall = time.perf_counter() - started
    del model, optimizer, batch
    compare.release(torch.device("cpu"))
    return Row(
        "plain steps",
        f"{steps} steps at {batch_size}, no meter",
        trials=1,
        sample_steps=steps * batch_size,
        wall_s=wall,
        sizes=[batch_size],
    )


def warm_up_imports() -> None:
    """Build one optimizer before any row is timed: torch imports ``torch._dynamo`` on the first
    optimizer a process builds (about 1.4 s on these cores), which every training process pays
    once; without this the first row of the first case paid it alone."""
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])


def check_truth(case: ComputeCase, found: int) -> tuple[int | None, str]:
    """``found`` fits and ``found + 1`` does not, each with a fresh optimizer and three steps."""
    with compare.capped(case, torch.device("cpu"), 3) as (_, _, prober):  # type: ignore[arg-type]
        fits = prober.trial(found, steps=3, fresh_optimizer=True).fits
        above = prober.trial(found + 1, steps=3, fresh_optimizer=True).fits
    if fits and not above:
        return found, f"checked: {found} fits and {found + 1} runs out of memory (fresh optimizer, 3 steps)"
    return None, f"CHECK FAILED: {found} fits={fits}, {found + 1} fits={above}"


# One case ----------------------------------------------------------------------------------------------
def run_case(case: ComputeCase, peers: set[str]) -> dict[str, Any]:
    print(f"\n== {case.label} ==", flush=True)
    cpu_at_start = compare._cpu_snapshot()
    bf_row, result = run_batchfit(case)
    print(f"   batchfit {bf_row.found} in {bf_row.wall_s:.1f} s", flush=True)
    truth, truth_note = check_truth(case, result.max_batch)
    print(f"   truth {truth_note}", flush=True)
    reference = truth if truth is not None else result.max_batch
    rows = [bf_row, run_batchfit(case, timed_steps=0)[0]]
    if "lightning" in peers:
        rows.append(run_lightning(case, reference))
    if "accelerate" in peers:
        rows.append(run_accelerate(case, reference))
    rows.append(plain_steps(case, result.max_batch))
    for row in rows:
        if row.found is not None:
            row.delta = row.found - reference
        if row.wall_s and bf_row.wall_s:
            row.batchfit_fraction = bf_row.wall_s / row.wall_s
    contention = compare.others_cpu_share(cpu_at_start)
    print_table(case, rows, truth_note, contention)
    step_at_boundary = next(
        (t.step_time_s for t in result.trials if t.fits and t.batch_size == result.max_batch and t.step_time_s), None
    )
    return {
        "case": case.label,
        "model": case.model,
        "cap_bytes": case.cap_bytes,
        "truth": truth,
        "truth_check": truth_note,
        "step_at_boundary_s": step_at_boundary,
        "others_cpu_share": contention,
        "rows": [asdict(row) for row in rows],
        "result": json.loads(result.to_json()),
    }


COLUMNS = (
    ("finder", "<11"),
    ("setting", "<34"),
    ("found", ">6"),
    ("vs truth", ">8"),
    ("trials", ">6"),
    ("sample-steps", ">12"),
    ("wall s", ">7"),
    ("bf / this", ">9"),
)


def line(cells: list[str], note: str = "") -> str:
    return " ".join(f"{cell[:34]:{spec}}" for cell, (_, spec) in zip(cells, COLUMNS)) + (f"  {note}" if note else "")


def print_table(case: ComputeCase, rows: list[Row], truth_note: str, contention: float | None) -> None:
    print(f"\n{case.label}: truth {truth_note}; 'bf / this' = batchfit's wall time / this row's")
    print(line([name for name, _ in COLUMNS], "note"))
    for row in rows:
        if row.skipped:
            print(line([row.finder, row.setting] + ["-"] * 6, f"skipped: {row.skipped}"))
            continue
        cells = [
            row.finder,
            row.setting,
            "-" if row.found is None else str(row.found),
            "-" if row.delta is None else f"{row.delta:+d}",
            "-" if row.trials is None else str(row.trials),
            "-" if row.sample_steps is None else f"{row.sample_steps:,}",
            "-" if row.wall_s is None else f"{row.wall_s:.1f}",
            "-" if row.batchfit_fraction is None else f"{row.batchfit_fraction:.2f}x",
        ]
        print(line(cells, row.note))
    shown = "unknown" if contention is None else f"{contention:.0%}"
    print(f"other processes used {shown} of the machine's cores during this case")


def print_summary(cases: list[dict[str, Any]]) -> None:
    print("\nSummary: batchfit's wall time as a multiple of each peer's (goals: defaults <= 0.35x Lightning and")
    print("<= 2.50x three plain steps at the batch found; timed_steps=0 <= 1.00x Accelerate and <= 1.50x three")
    print("plain steps); per case find()'s defaults, then")
    print("timed_steps=0 (no warm timing after the search: the largest and the safe batch, as the peers answer)")
    header = f"{'case':<22}{'truth':>6}{'step at max':>12}{'bf s':>7}{'Lightning':>11}{'Accelerate':>11}{'3 plain':>9}"
    print(header)
    for case in cases:
        by = {row["finder"]: row for row in case["rows"] if row["finder"] != "batchfit"}
        step = case["step_at_boundary_s"]
        for number, row in enumerate(r for r in case["rows"] if r["finder"] == "batchfit"):
            wall = row["wall_s"]
            ratios = [_fraction(wall, by.get(name)) for name in ("Lightning", "Accelerate", "plain steps")]
            label = case["case"] if number == 0 else f"  {row['setting']}"
            truth = (case["truth"] or "?") if number == 0 else ""
            at_max = (f"{step:.2f} s" if step else "-") if number == 0 else ""
            print(f"{label:<22}{truth:>6}{at_max:>12}{wall:>7.1f}{ratios[0]:>11}{ratios[1]:>11}{ratios[2]:>9}")


def _fraction(wall: float, row: dict[str, Any] | None) -> str:
    return "-" if row is None or not row.get("wall_s") else f"{wall / row['wall_s']:.2f}x"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(MODELS), help="only this model")
    parser.add_argument("--peers", default="lightning,accelerate", help="comma-separated subset of the peers")
    parser.add_argument("--out", type=Path, default=compare.RESULTS, help="directory for the JSON file")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    peers = {p.strip() for p in args.peers.split(",") if p.strip()}
    compare.quiet_lightning()
    warm_up_imports()
    started = time.perf_counter()
    meta = {
        **compare.stamp(argv),
        "machine": compare.machine(),
        "versions": {**compare.versions(), "transformers": _version("transformers")},
        "peer_steps_per_trial": PEER_STEPS,
    }
    machine = meta["machine"]
    print(f"batchfit time-to-answer benchmark: {machine['cpu']}, {machine['cores']} cores; {meta['versions']}")
    results, skipped = [], []
    for case in CASES:
        if args.case is not None and case.model != args.case:
            continue
        if case.missing:
            print(f"\n== {case.label} == skipped: {case.missing} is not installed")
            skipped.append(case.label)
            continue
        results.append(run_case(case, peers))
    meta["total_wall_s"] = time.perf_counter() - started
    document = {"schema": "batchfit.compute-benchmark/1", **meta, "cases": results, "skipped_cases": skipped}
    print_summary(results)
    print(f"\ntotal {meta['total_wall_s']:.0f} s")
    if not args.no_json:
        compare.write_results(document, args.out, "compute-cpu")
    return document


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

"""``batchfit.frontier()`` against one ``batchfit.find()`` per sequence length: the same points, in how many trials.

Run from the repository root (transformers is needed; a case whose package is missing says so)::

    python benchmarks/frontier.py                          # every case, about 6 minutes on 2 idle cores
    python benchmarks/frontier.py --case gpt2_sdpa         # one case (repeat --case for more)
    python benchmarks/frontier.py --quick                  # a smoke run: one case, smaller, under a minute

The frontier (``batchfit.frontier``, see ``batchfit/probe/lengths.py``) searches the longest
length as ``find()`` does and every other length from the boundary its fitted memory surface
``fixed + b (a s + q s^2)`` predicts there, so it should cost far fewer trials than one search per
length (the aim: the whole frontier for 4 lengths at most 2x the trials of one search), with every
point still exact. This measures that on real Hugging Face models built from configs (no
download), one after another in this process, each side on a freshly built (seeded, identical)
model under the same live-tensor cap:

* **frontier**: ``batchfit.frontier(model, make_batch, seq_lens=..., memory_limit=cap,
  device="cpu", longest_at_batch_1=True)``, find()'s defaults otherwise;
* **1-D finds**: ``batchfit.find(model, make_batch=lambda b: make_batch(b, s), memory_limit=cap,
  device="cpu")`` at each length, one after another (the longest first, as the frontier orders them).

The order of the two sides alternates from case to case (the frontier first in the first case, the
finds first in the next) to spread the machine's drift. ``make_batch(b, s)``: token ids from a
generator seeded the same for every call, ``{"input_ids": ids, "labels": ids}``.

Cases (``attn_pdrop=0`` everywhere: with attention dropout SDPA falls back to its math kernel on
the CPU and keeps the ``s x s`` scores like eager attention):

* ``gpt2_eager``: ``GPT2LMHeadModel``, 2 layers, d=128, 4 heads, vocab 2000, 2048 positions,
  eager attention (the ``s x s`` scores kept for backward: a real ``s^2`` term);
* ``gpt2_sdpa``: the same with ``attn_implementation="sdpa"`` (no ``s^2`` term expected);
* ``llama_sdpa``: ``LlamaForCausalLM``, 2 layers, hidden 128, 4 heads, MLP 256, vocab 2000, 2048
  positions, SDPA.

Per length: both max batches (``exact`` when equal, ``DIFFERENT`` otherwise: a bug), both safe
batches, trials (the frontier's point against the find; verification included), the sizes each
tried, sample-steps (the samples of every step started: a trial at ``b`` that ran ``k`` steps
costs ``b * k``, a failed trial counts the step it died in) and wall time (a frontier point's is
the time from the previous point to it). Per case: the frontier's trials (points only, and with
the length axis at batch 1) against the sum of the finds, that ratio, and the ratio to ONE 1-D
search (the mean of the finds' trials); the wall-time and sample-steps ratios; the surface (a, q,
the quadratic share, what it means); the longest length at batch 1, what limited it and its
trials; the token budget; ``str(frontier)``. The first case's frontier is also drawn to
``benchmarks/results/frontier-<case>.png`` (``Frontier.plot``; needs matplotlib).

Torch runs with its default threads (the cores; ``--threads N`` to change): on the idle 2-core
machine one ``find()`` of ``gpt2_eager`` at 128 under 1 GiB took 5.5-5.7 s with 2 threads and
8.6-8.7 s with 1 (with another job busy on a core, two threads wait on each other and take much
longer: ``--quick`` under such load took 123 s with 2 threads and 18 s with 1 under the same load, so
``--quick``, a smoke run whose times mean nothing, uses 1 thread unless ``--threads`` says
otherwise; the JSON records the threads and the share of the cores other processes used).
Before the cases a tiny ``find()`` and ``frontier()`` run once to pay first-use costs; their times
are reported apart. Benchmarks are not tests: nothing asserts a timing. Output: a table on stdout
and JSON under ``benchmarks/results/frontier-cpu-*.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)

import batchfit  # noqa: E402
from batchfit.units import format_bytes, parse_memory_limit  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 2000
POSITIONS = 2048


# Models -------------------------------------------------------------------------------------------------
def gpt2_eager() -> nn.Module:
    """``GPT2LMHeadModel``: 2 layers, d=128, 4 heads, vocab 2000, 2048 positions, eager attention."""
    return _gpt2("eager")


def gpt2_sdpa() -> nn.Module:
    """``GPT2LMHeadModel``: 2 layers, d=128, 4 heads, vocab 2000, 2048 positions, SDPA attention."""
    return _gpt2("sdpa")


def _gpt2(attention: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=128,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attention,
    )
    return GPT2LMHeadModel(config)


def llama_sdpa() -> nn.Module:
    """``LlamaForCausalLM``: 2 layers, hidden 128, 4 heads, MLP 256, vocab 2000, 2048 positions, SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=VOCAB,
        max_position_embeddings=POSITIONS,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Token ids of ``batch_size`` sequences of ``seq_len``, the same generator seed every call."""
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    memory: str
    seq_lens: tuple[int, ...]
    needs: str | None = "transformers"

    @property
    def cap_bytes(self) -> int:
        return parse_memory_limit(self.memory, None)

    @property
    def missing(self) -> str | None:
        return self.needs if self.needs and importlib.util.find_spec(self.needs) is None else None


LENGTHS = (128, 256, 512, 1024)
#: Caps that put the shortest length's boundary in the low hundreds.
CASES: tuple[Case, ...] = (
    Case("gpt2_eager", gpt2_eager, "1536MiB", LENGTHS),
    Case("gpt2_sdpa", gpt2_sdpa, "1536MiB", LENGTHS),
    Case("llama_sdpa", llama_sdpa, "1536MiB", LENGTHS),
)
#: ``--quick``: the same models, shorter lengths under a smaller cap.
QUICK_LENGTHS = (64, 128, 256)
QUICK_MEMORY = "160MiB"


# Measuring ----------------------------------------------------------------------------------------------
def sample_steps(trials: tuple[batchfit.Trial, ...]) -> int:
    """Samples of every step started: completed steps, plus the one a failed trial died in."""
    return sum(t.batch_size * (t.steps + (0 if t.fits else 1)) for t in trials)


def sizes(trials: tuple[batchfit.Trial, ...]) -> list[str]:
    """``["2", "7", "160", "161x", "144v"]``: each trial's size, ``x`` when it ran out of memory,
    ``v`` for a verification."""
    return [f"{t.batch_size}{'' if t.fits else 'x'}{'v' if t.kind == 'verify' else ''}" for t in trials]


def side(result: batchfit.Result, wall: float) -> dict[str, Any]:
    return {
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "safe_verified": result.safe_verified,
        "boundary_reached": result.boundary_reached,
        "trials": len(result.trials),
        "search_trials": len(result.search_trials),
        "sample_steps": sample_steps(result.trials),
        "wall_s": wall,
        "sizes": sizes(result.trials),
    }


def run_frontier(case: Case, lengths: tuple[int, ...], cap: int) -> tuple[batchfit.Frontier, dict[int, float], float]:
    """The frontier on a fresh model; each point's wall time (from the previous point); the total."""
    model = case.build()
    marks: dict[int, float] = {}
    started = time.perf_counter()
    last = [started]

    def on_point(point: Any) -> None:
        now = time.perf_counter()
        marks[point.seq_len] = now - last[0]
        last[0] = now

    frontier = batchfit.frontier(
        model,
        make_batch,
        seq_lens=list(lengths),
        memory_limit=cap,
        device="cpu",
        longest_at_batch_1=True,
        on_point=on_point,
    )
    wall = time.perf_counter() - started
    marks[0] = wall - (last[0] - started)  # the length axis at batch 1, after the last point
    del model
    compare.release(torch.device("cpu"))
    return frontier, marks, wall


def run_finds(case: Case, lengths: tuple[int, ...], cap: int) -> dict[int, tuple[batchfit.Result, float]]:
    """One ``find()`` per length, the longest first, each on a fresh model."""
    done: dict[int, tuple[batchfit.Result, float]] = {}
    for s in sorted(lengths, reverse=True):
        model = case.build()
        started = time.perf_counter()
        result = batchfit.find(model, make_batch=lambda b, s=s: make_batch(b, s), memory_limit=cap, device="cpu")
        done[s] = (result, time.perf_counter() - started)
        del model
        compare.release(torch.device("cpu"))
        print(f"   find at {s}: max {result.max_batch}, {len(result.trials)} trials, {done[s][1]:.1f} s", flush=True)
    return done


def run_case(case: Case, frontier_first: bool, quick: bool, plot: Path | None) -> dict[str, Any]:
    lengths = QUICK_LENGTHS if quick else case.seq_lens
    memory = QUICK_MEMORY if quick else case.memory
    cap = parse_memory_limit(memory, None)
    print(f"== {case.name} @ {memory}, seq_lens {list(lengths)}, {'frontier' if frontier_first else 'finds'} first")
    cpu_at_start = compare._cpu_snapshot()
    if frontier_first:
        frontier, marks, frontier_wall = run_frontier(case, lengths, cap)
        print(f"   frontier: {frontier.trials} trials, {frontier_wall:.1f} s", flush=True)
        finds = run_finds(case, lengths, cap)
    else:
        finds = run_finds(case, lengths, cap)
        frontier, marks, frontier_wall = run_frontier(case, lengths, cap)
        print(f"   frontier: {frontier.trials} trials, {frontier_wall:.1f} s", flush=True)
    contention = compare.others_cpu_share(cpu_at_start)

    rows = []
    for point in frontier.points:
        s = point.seq_len
        result, wall = finds[s]
        f_side = side(point.result, marks.get(s, float("nan")))
        f_side["tokens_per_s"] = point.tokens_per_s
        d_side = side(result, wall)
        rows.append(
            {
                "seq_len": s,
                "exact": point.max_batch == result.max_batch,
                "same_safe": point.safe_batch == result.safe_batch,
                "frontier": f_side,
                "find": d_side,
            }
        )
    point_trials = sum(point.trials for point in frontier.points)
    find_trials = [row["find"]["trials"] for row in rows]
    find_wall = sum(row["find"]["wall_s"] for row in rows)
    one_search = statistics.mean(find_trials)
    frontier_steps = sum(row["frontier"]["sample_steps"] for row in rows)
    find_steps = sum(row["find"]["sample_steps"] for row in rows)
    surface = frontier.surface
    record: dict[str, Any] = {
        "case": case.name,
        "model": (case.build.__doc__ or "").strip().splitlines()[0],
        "memory_limit": memory,
        "cap_bytes": cap,
        "seq_lens": list(lengths),
        "order": "frontier first" if frontier_first else "finds first",
        "rows": rows,
        "all_exact": all(row["exact"] for row in rows),
        "frontier_point_trials": point_trials,
        "frontier_length_axis_trials": frontier.longest_trials,
        "frontier_trials": frontier.trials,
        "find_trials": sum(find_trials),
        "trials_ratio_points": point_trials / sum(find_trials),
        "trials_ratio_all": frontier.trials / sum(find_trials),
        "one_search_trials": one_search,
        "points_per_one_search": point_trials / one_search,
        "all_per_one_search": frontier.trials / one_search,
        "aim_at_most_2x_one_search": point_trials <= 2 * one_search,
        "frontier_wall_s": frontier_wall,
        "frontier_points_wall_s": frontier_wall - marks[0],
        "frontier_length_axis_wall_s": marks[0],
        "find_wall_s": find_wall,
        "wall_ratio": frontier_wall / find_wall,
        "wall_ratio_points": (frontier_wall - marks[0]) / find_wall,
        "frontier_sample_steps": frontier_steps,
        "find_sample_steps": find_steps,
        "sample_steps_ratio": frontier_steps / find_steps if find_steps else None,
        "surface": None
        if surface is None
        else {
            "fixed_bytes": surface.fixed_bytes,
            "a_bytes_per_token": surface.per_token_bytes,
            "q_bytes_per_token_squared": surface.per_token_squared_bytes,
            "quadratic_share": surface.quadratic_share,
            "quadratic": surface.quadratic,
            "meaning": surface.meaning(),
        },
        "longest_at_batch_1": frontier.longest_at_batch_1,
        "longest_limited_by": frontier.longest_limited_by,
        "longest_trials": frontier.longest_trials,
        "token_budget": frontier.token_budget,
        "safe_token_budget": frontier.safe_token_budget,
        "others_cpu_share": contention,
        "frontier_text": str(frontier),
        "frontier_result": frontier.to_dict(),
        "find_results": {str(s): json.loads(finds[s][0].to_json()) for s in sorted(finds)},
    }
    if plot is not None:
        try:
            record["plot"] = frontier.plot(plot)
        except ImportError as exc:
            record["plot"] = f"not drawn: {exc}"
        print(f"   picture: {record['plot']}")
    return record


def warm_up() -> dict[str, float]:
    """First-use costs (imports, transformers' first forward) paid once, here, and reported."""
    model = gpt2_eager()
    started = time.perf_counter()
    batchfit.find(model, make_batch=lambda b: make_batch(b, 32), memory_limit="64MiB", device="cpu", max_batch=8)
    find_s = time.perf_counter() - started
    started = time.perf_counter()
    batchfit.frontier(
        model, make_batch, seq_lens=[16, 32], memory_limit="64MiB", device="cpu", max_batch=8, longest_at_batch_1=False
    )
    return {"find_s": find_s, "frontier_s": time.perf_counter() - started}


# Printing -----------------------------------------------------------------------------------------------
def print_table(cases: list[dict[str, Any]]) -> None:
    print("\nper length: max/safe batch, trials (verification included), sample-steps and wall time of the")
    print("frontier's point and of an independent find() at that length; x = ran out of memory, v = verify")
    print(
        f"{'case':<12}{'seq':>6}{'frontier max/safe':>18}{'find max/safe':>15}{'':>10}"
        f"{'tr fr':>6}{'tr 1-D':>7}{'steps fr':>10}{'steps 1-D':>10}{'s fr':>7}{'s 1-D':>7}"
    )
    for c in cases:
        for row in c["rows"]:
            f, d = row["frontier"], row["find"]
            print(
                f"{c['case']:<12}{row['seq_len']:>6}{f['max_batch']:>12}/{f['safe_batch']:<5}"
                f"{d['max_batch']:>9}/{d['safe_batch']:<5}{'exact' if row['exact'] else 'DIFFERENT':>10}"
                f"{f['trials']:>6}{d['trials']:>7}{f['sample_steps']:>10,}{d['sample_steps']:>10,}"
                f"{f['wall_s']:>7.1f}{d['wall_s']:>7.1f}"
            )
    for c in cases:
        for row in c["rows"]:
            where = f"{c['case']} {row['seq_len']}:"
            print(f"  {where} frontier {' '.join(row['frontier']['sizes'])}")
            print(f"  {' ' * len(where)} find     {' '.join(row['find']['sizes'])}")
    print("\nper case: trials of the frontier (its points; + the length axis at batch 1) against the 1-D finds")
    print("at the same lengths; 'x one' = the frontier's point trials over ONE 1-D search (the finds' mean; aim <= 2);")
    print("wall = the frontier's wall time (length axis included) over the finds', pts wall = its points' only;")
    print("steps = the frontier's sample-steps over the finds'; others = other processes' share of the cores")
    print(
        f"{'case':<12}{'points exact':>13}{'frontier tr':>13}{'1-D tr':>8}{'ratio':>7}{'x one':>7}{'aim':>5}"
        f"{'fr s':>7}{'1-D s':>7}{'wall':>7}{'pts wall':>9}{'steps':>7}{'others':>8}"
    )
    for c in cases:
        exact = f"{sum(row['exact'] for row in c['rows'])}/{len(c['rows'])}"
        trials = f"{c['frontier_point_trials']} + {c['frontier_length_axis_trials']}"
        others = "-" if c["others_cpu_share"] is None else f"{c['others_cpu_share']:.0%}"
        print(
            f"{c['case']:<12}{exact:>13}{trials:>13}{c['find_trials']:>8}"
            f"{c['trials_ratio_points']:>7.2f}{c['points_per_one_search']:>7.2f}"
            f"{'yes' if c['aim_at_most_2x_one_search'] else 'no':>5}"
            f"{c['frontier_wall_s']:>7.1f}{c['find_wall_s']:>7.1f}{c['wall_ratio']:>7.2f}{c['wall_ratio_points']:>9.2f}"
            f"{c['sample_steps_ratio'] or 0:>7.2f}"
            f"{others:>8}"
        )
    print()
    for c in cases:
        sf = c["surface"]
        if sf is not None:
            print(
                f"{c['case']}: surface {format_bytes(sf['fixed_bytes'])} + b x ({sf['a_bytes_per_token']:,.0f} B x s"
                f" + {sf['q_bytes_per_token_squared']:,.2f} B x s^2), s^2 share {sf['quadratic_share']:.0%}"
            )
            print(f"  {sf['meaning']}")
        print(
            f"  longest at batch 1: {c['longest_at_batch_1']:,} ({c['longest_limited_by']}, {c['longest_trials']} "
            f"trials, {c['frontier_length_axis_wall_s']:.1f} s); token budget {c['token_budget']:,}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [case.name for case in CASES]
    parser.add_argument("--case", choices=names, action="append", help="only this case (repeatable)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: lengths {list(QUICK_LENGTHS)} under {QUICK_MEMORY}, the first case unless --case",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's, the cores; 1 with --quick)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file and the picture")
    parser.add_argument("--no-json", action="store_true")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the first case's frontier")
    args = parser.parse_args(argv)
    if args.threads is None and args.quick:
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with_transformers = importlib.util.find_spec("transformers") is not None
    if with_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    meta = {
        **compare.stamp(argv),
        "quick": args.quick,
        "machine": compare.machine(),
        "versions": {
            "torch": torch.__version__,
            "batchfit": batchfit.__version__,
            "transformers": transformers.__version__ if with_transformers else None,
        },
    }
    machine = meta["machine"]
    print(
        f"batchfit frontier() benchmark: {machine['cpu']}, {machine['cores']} cores, "
        f"{torch.get_num_threads()} torch threads; {meta['versions']}"
    )
    selected = args.case or (names[:1] if args.quick else names)
    results, skipped = [], []
    first: dict[str, float] | None = None
    for case in CASES:
        if case.name not in selected:
            continue
        if case.missing:
            print(f"== {case.name} skipped: {case.missing} is not installed")
            skipped.append(case.name)
            continue
        if first is None:
            first = warm_up()
            print("first use (paid once before the cases): " + ", ".join(f"{k} {v:.2f} s" for k, v in first.items()))
        plot = None if args.no_plot or results else args.out / f"frontier-{case.name}.png"
        if plot is not None:
            args.out.mkdir(parents=True, exist_ok=True)
        results.append(run_case(case, frontier_first=len(results) % 2 == 0, quick=args.quick, plot=plot))
    meta["total_wall_s"] = time.perf_counter() - started
    if results:
        print_table(results)
    print(f"\ntotal {meta['total_wall_s']:.0f} s")
    document = {
        "schema": "batchfit.frontier-benchmark/1",
        **meta,
        "first_use": first,
        "cases": results,
        "skipped_cases": skipped,
    }
    if not args.no_json:
        compare.write_results(document, args.out, "frontier-cpu")
    return document


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

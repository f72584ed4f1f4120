"""``batchfit.buckets()`` on long-tail lengths: its sizes against plain searches, its epochs, rival policies' tokens/s.

Run from the repository root (transformers needed; a missing package is said)::

    python benchmarks/buckets.py                     # HF GPT-2 and Llama from configs, about 5 minutes on 2 cores
    python benchmarks/buckets.py --case hf_gpt2      # one case
    python benchmarks/buckets.py --quick             # a smoke run: GPT-2, 300 rows up to 192 tokens, about 30 s

Issue 50's goals, measured side by side in one process, per case (a model built from a config, no
download; its memory cap, which leaves the longest length a handful of rows and the shortest over a
hundred; the same seeded lengths, 3000 rows, median 40, longest 400; every model built fresh from
seed 0). Cases: ``hf_gpt2`` (``GPT2LMHeadModel``, 2 layers, d=64, eager attention: an ``s^2``
term, 64 MiB) and ``hf_llama`` (``LlamaForCausalLM``, 2 layers, hidden 64, SDPA, 48 MiB).

1. **analysis**: ``plan = batchfit.buckets(model, make_batch, lengths=L, memory_limit=cap,
   pack_length=longest)`` timed, against ONE ``batchfit.frontier(model, make_batch, seq_lens=<the
   plan's candidate lengths>, memory_limit=cap, longest_at_batch_1=False)`` timed (the order
   alternates between cases). Goal: the plan <= 3x the frontier.
2. **per bucket**: the bucket's batch against ``batchfit.find(model, make_batch=lambda b:
   make_batch(b, longest), memory_limit=cap)`` at the bucket's longest length: ``batch / find's
   max`` (goal >= 90%) and whether the bucket's ``max_batch`` is find's exactly. The default
   headroom (10% of the cap kept free) costs more than 10% of the batch where the model's fixed
   bytes are a large share or the batch is a handful (90% of a max of 8 is 7.2: only 8 passes),
   so the buckets are also planned (``token_budget=False``) at each ``--rerun-headroom`` (default
   0.05, half the margin, and 0, the verified max itself: what a user wanting 90% everywhere
   passes) and set against the same finds.
3. **soak, 0 OOM**: ``batchfit.soak(model, make_batch, steps, memory_limit=cap)`` over the whole
   epoch of each policy (the count of steps that ran out of memory is the soak's ``oom``):
   ``buckets`` (``BucketBatchSampler(L, plan.boundaries, plan.batch_sizes, seed=0)``), ``token
   budget`` (``TokenBudgetBatchSampler(L, plan.token_budget.max_tokens, seed=0)``, padded), and the
   baselines: ``fixed`` (the safe batch at the longest length, rows of a seeded shuffle, each batch
   padded to its own longest), verl's rule ``ppo_max_token_len_per_gpu = 2 x (max_prompt +
   max_response)`` = 2 x longest modelled twice: ``verl padded`` (a padded token budget of 2 x
   longest: rows x the batch's longest row <= it) and ``verl packed`` (how verl counts: the
   unpadded tokens, ``attention_mask.sum()``, of a micro-batch <= it, which ``use_remove_padding``
   runs as ONE packed row of their sum, positions restarting at each row). On the CPU neither
   model has a varlen attention kernel (flash-attention's, which verl uses with
   ``use_remove_padding`` on a GPU): a packed row of 2 x longest tokens pays the whole ``s^2`` of
   eager attention, so ``verl packed`` is the harsher model here; both are reported.
4. **tokens/s**: real (unpadded) tokens per second of each policy over the same epoch of the same
   rows, by a plain training loop (no batchfit: ``model.train()``, AdamW, forward with labels,
   backward, step, zero_grad; each policy its own model and optimizer from seed 0; one warm-up step
   on the policy's first batch, not timed; ``time.perf_counter`` around the model's work only).
   The policies run interleaved: the epoch of each is cut in ``--rounds`` parts and round r runs
   part r of every policy, so the machine's drift falls on all of them; the spread is the lowest
   and highest part's tokens/s. Also ``packing``: the rows packed best fit (longest first) into
   rows of ``plan.packing.pack_length`` with ``position_ids`` restarting at each (no
   ``attention_mask``, as ``DataCollatorWithFlattening``), ``plan.packing.batch_size`` per step,
   against the buckets (and the plan's own ``best_layout``, from the frontier's rates). Goals:
   buckets and token budget >= 1.3x ``fixed``, and >= each verl model that had 0 OOM (one that
   ran out of memory is not at equal safety: said; the plain loop has no cap, so its tokens/s
   there is what it would have done had memory allowed).

How to read the table: one block per case. ``analysis``: the plan's and the frontier's seconds
and their ratio. ``buckets``: per bucket its lengths, rows, padding, batch (default headroom), the
exact max, find's max and safe, batch / find's max, then each rerun's batch and share at the same
bucket end (``-``: that rerun chose other ends; its own are listed below, with theirs).
``policies``: per policy the steps an epoch, its padding, the soak's OOMs and peak (share of the
cap), real tokens/s (the spread over rounds) and the ratio to ``fixed``. ``goals``: each goal,
held or not, with its number. ``make_batch(b, s)``: random token ids (a generator seeded by
``s``), ``labels = input_ids``; a padded batch costs its shape, so the loop trains on the same
shapes. Lengths: lognormal (``--median``, sigma 0.7), rounded, clamped to [8, ``--longest``],
with ``max(3, rows / 500)`` rows set to the longest so the tail is there at any seed.

Torch runs with 1 thread unless ``--threads``: on this shared 2-core machine two threads wait on
each other when another job is busy (``frontier.py``'s note); the JSON records the threads and the
share of the cores other processes used. Benchmarks are not tests: nothing asserts a timing.
Output: a table on stdout and JSON under ``benchmarks/results/buckets-cpu-*.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
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
from batchfit.probe.packing import packed_batches  # noqa: E402
from batchfit.report.bucketing import candidate_lengths, histogram_of  # noqa: E402
from batchfit.report.varlen import Bucket  # noqa: E402
from batchfit.samplers import BucketBatchSampler, TokenBudgetBatchSampler  # noqa: E402
from batchfit.units import format_bytes, parse_memory_limit  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 256
POSITIONS = 1024  # >= 2 x longest: verl's packed row of 2 x longest tokens


# Models and data ----------------------------------------------------------------------------------------
def hf_gpt2() -> nn.Module:
    """``GPT2LMHeadModel``: 2 layers, d=64, 4 heads, vocab 256, 1024 positions, eager attention (an ``s^2`` term)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=POSITIONS, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def hf_llama() -> nn.Module:
    """``LlamaForCausalLM``: 2 layers, hidden 64, 4 heads, MLP 176, vocab 256, 1024 positions, SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=176, vocab_size=VOCAB,
        max_position_embeddings=POSITIONS, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def make_batch(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Token ids of ``batch_size`` rows of ``seq_len`` (a generator seeded by the length), labels the same."""
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "labels": ids}


def packed_batch(rows: list[list[int]], pack_length: int) -> dict[str, torch.Tensor]:
    """Rows of documents end to end, padded to ``pack_length``, positions restarting at each document."""
    ids = torch.randint(0, VOCAB, (len(rows), pack_length), generator=torch.Generator().manual_seed(pack_length))
    positions = torch.zeros(len(rows), pack_length, dtype=torch.long)
    for r, documents in enumerate(rows):
        at = 0
        for length in documents:
            positions[r, at : at + length] = torch.arange(length)
            at += length
        positions[r, at:] = torch.arange(pack_length - at)  # the pad, one more "document"
    return {"input_ids": ids, "labels": ids, "position_ids": positions}


def long_tail(rows: int, median: int, longest: int, seed: int = 0) -> list[int]:
    """Lognormal lengths (sigma 0.7) around ``median``, in [8, longest], ``max(3, rows // 500)`` at ``longest``."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(rows, generator=generator) * 0.7 + math.log(median)).round().clamp(8, longest)
    lengths = drawn.long().tolist()
    for i in torch.randperm(rows, generator=generator)[: max(3, rows // 500)].tolist():
        lengths[i] = longest
    return lengths


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    memory: str

    @property
    def missing(self) -> str | None:
        return None if importlib.util.find_spec("transformers") else "transformers"


#: Caps that leave the longest length a handful of rows and the short ones tens to hundreds.
CASES = (Case("hf_gpt2", hf_gpt2, "64MiB"), Case("hf_llama", hf_llama, "48MiB"))
#: ``--quick``: the first case, fewer and shorter rows under a smaller cap (about 30 s).
QUICK = {"rows": 300, "median": 24, "longest": 192, "memory": "24MiB"}
FULL = {"rows": 3000, "median": 40, "longest": 400}


# Policies: an epoch as steps --------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """One way to batch the epoch: its steps as the rows' indices, padded (or packed) to ``seq_len``."""

    name: str
    steps: list[Any]  # per step: row indices (padded) or packed rows, each a list of row indices
    packed: bool = False
    pack_length: int | None = None  # packed rows padded to this (None: to the step's fullest row)

    def shapes(self, lengths: list[int]) -> list[tuple[int, int]]:
        """``(rows, seq_len)`` per step, as memory sees it."""
        if self.packed:
            return [(len(step), self.pack_length or max(_tokens(row, lengths) for row in step)) for step in self.steps]
        return [(len(step), max(lengths[i] for i in step)) for step in self.steps]

    def padding(self, lengths: list[int]) -> float:
        real = sum(lengths[i] for step in self.steps for i in _flat(step))
        return 1 - real / sum(r * s for r, s in self.shapes(lengths))


def _tokens(row: list[int], lengths: list[int]) -> int:
    return sum(lengths[i] for i in row)


def _flat(step: list[Any]) -> list[int]:
    return [i for row in step for i in row] if step and isinstance(step[0], list) else step


def fixed_steps(lengths: list[int], batch: int, seed: int = 0) -> list[list[int]]:
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def verl_packed_steps(lengths: list[int], max_tokens: int) -> list[list[list[int]]]:
    """verl's packed micro-batches: rows whose unpadded tokens sum to <= ``max_tokens``, one packed row each."""
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, padded=False, seed=0)
    return [[batch] for batch in sampler]


def packing_steps(lengths: list[int], pack_length: int, batch: int, seed: int = 0) -> list[list[list[int]]]:
    """The rows packed best fit, longest first, into rows of ``pack_length``; shuffled; ``batch`` per step."""
    rooms: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fitting = [k for k, (room, _) in enumerate(rooms) if room >= lengths[i]]
        if fitting:
            k = min(fitting, key=lambda k: rooms[k][0])
            rooms[k] = (rooms[k][0] - lengths[i], [*rooms[k][1], i])
        else:
            rooms.append((pack_length - lengths[i], [i]))
    order = torch.randperm(len(rooms), generator=torch.Generator().manual_seed(seed)).tolist()
    packed = [rooms[k][1] for k in order]
    return [packed[i : i + batch] for i in range(0, len(packed), batch)]


def batch_of(policy: Policy, step: list[Any], lengths: list[int]) -> dict[str, torch.Tensor]:
    if policy.packed:
        width = policy.pack_length or max(_tokens(row, lengths) for row in step)
        return packed_batch([[lengths[i] for i in row] for row in step], width)
    return make_batch(len(step), max(lengths[i] for i in step))


# Measuring -------------------------------------------------------------------------------------------
def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - started
    compare.release(torch.device("cpu"))
    return result, seconds


def train_rates(case: Case, policies: list[Policy], lengths: list[int], rounds: int) -> dict[str, dict[str, Any]]:
    """Real tokens/s of each policy's epoch by a plain loop, the policies interleaved in ``rounds`` parts."""
    state = {}
    for policy in policies:
        model = case.build()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        state[policy.name] = (model, optimizer, [0.0] * rounds, [0] * rounds)
        step_once(model, optimizer, batch_of(policy, policy.steps[0], lengths))  # warm-up, not timed
    for r in range(rounds):
        for policy in policies:
            model, optimizer, seconds, tokens = state[policy.name]
            n = len(policy.steps)
            for step in policy.steps[r * n // rounds : (r + 1) * n // rounds]:
                batch = batch_of(policy, step, lengths)
                started = time.perf_counter()
                step_once(model, optimizer, batch)
                seconds[r] += time.perf_counter() - started
                tokens[r] += sum(lengths[i] for i in _flat(step))
    rates = {}
    for name, (_, _, seconds, tokens) in state.items():
        parts = [t / s for t, s in zip(tokens, seconds) if s > 0]
        rates[name] = {
            "tokens_per_s": sum(tokens) / sum(seconds),
            "seconds": sum(seconds),
            "tokens": sum(tokens),
            "spread": [min(parts), max(parts)],
        }
    return rates


def step_once(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_case(case: Case, args: argparse.Namespace, plan_first: bool) -> dict[str, Any]:
    memory = QUICK["memory"] if args.quick else case.memory
    rows = args.rows
    cap = parse_memory_limit(memory, None)
    lengths = long_tail(rows, args.median, args.longest)
    longest = max(lengths)
    print(
        f"== {case.name} @ {memory}: {rows} rows, median {statistics.median(lengths):g}, longest {longest}", flush=True
    )
    before = compare._cpu_snapshot()

    def analyse() -> batchfit.LengthPlan:
        return batchfit.buckets(case.build(), make_batch, lengths=lengths, memory_limit=cap, pack_length=longest)

    def one_frontier(seq_lens: list[int]) -> batchfit.Frontier:
        return batchfit.frontier(
            case.build(), make_batch, seq_lens=seq_lens, memory_limit=cap, longest_at_batch_1=False
        )

    if plan_first:
        plan, plan_s = timed(analyse)
        candidates = [p.seq_len for p in plan.frontier.points]
        frontier, frontier_s = timed(lambda: one_frontier(candidates))
    else:  # the candidates are a function of the lengths alone: the same ones, before the plan
        candidates = list(candidate_lengths(histogram_of(lengths)))
        frontier, frontier_s = timed(lambda: one_frontier(candidates))
        plan, plan_s = timed(analyse)
        assert candidates == [p.seq_len for p in plan.frontier.points]
    print(f"   plan {plan_s:.1f} s, frontier {frontier_s:.1f} s ({plan_s / frontier_s:.2f}x)", flush=True)
    reruns = {}
    for headroom in args.rerun_headroom:
        reruns[f"h={headroom:g}"] = timed(
            lambda h=headroom: batchfit.buckets(
                case.build(), make_batch, lengths=lengths, memory_limit=cap, headroom=h, token_budget=False
            )
        )
        print(f"   buckets at headroom {headroom:g}: {reruns[f'h={headroom:g}'][1]:.1f} s", flush=True)
    runs = {"default": plan, **{run: again for run, (again, _) in reruns.items()}}
    finds = {}
    for end in sorted({bucket.longest for again in runs.values() for bucket in again.buckets}):
        found, seconds = timed(
            lambda s=end: batchfit.find(case.build(), make_batch=lambda b: make_batch(b, s), memory_limit=cap)
        )
        finds[end] = {"max_batch": found.max_batch, "safe_batch": found.safe_batch, "wall_s": seconds}
    buckets = [bucket_row(b, finds, run) for run, again in runs.items() for b in again.buckets]

    safe_longest = plan.frontier.points[-1].safe_batch
    policies = [
        Policy("buckets", list(BucketBatchSampler(lengths, plan.boundaries, plan.batch_sizes, seed=0))),
        Policy("token budget", list(TokenBudgetBatchSampler(lengths, plan.token_budget.max_tokens, seed=0))),
        Policy("fixed", fixed_steps(lengths, safe_longest)),
        Policy("verl padded", list(TokenBudgetBatchSampler(lengths, 2 * longest, seed=0))),
        Policy("verl packed", verl_packed_steps(lengths, 2 * longest), packed=True),
    ]
    packing = plan.packing
    if packing is not None:
        steps = packing_steps(lengths, packing.pack_length, packing.batch_size)
        policies.append(Policy("packing", steps, packed=True, pack_length=packing.pack_length))
    soaks = {}
    for policy in policies:
        # packed rows: positions restarting at documents drawn from the lengths (batchfit's packed batches)
        maker = packed_batches(make_batch, _histogram(lengths)) if policy.packed else make_batch
        soaked = batchfit.soak(case.build(), maker, policy.shapes(lengths), name=policy.name, memory_limit=cap)
        compare.release(torch.device("cpu"))
        soaks[policy.name] = dataclasses.asdict(soaked)
        print(f"   soak {policy.name}: {soaked.steps} steps, {soaked.oom} OOM, {soaked.seconds:.1f} s", flush=True)
    rates = train_rates(case, policies, lengths, args.rounds)
    contention = compare.others_cpu_share(before)
    table = []
    for policy in policies:
        table.append(
            {
                "policy": policy.name,
                "steps": len(policy.steps),
                "padding": policy.padding(lengths),
                "largest_step": max(policy.shapes(lengths), key=lambda shape: shape[0] * shape[1]),
                "soak": soaks[policy.name],
                **rates[policy.name],
                "x_fixed": rates[policy.name]["tokens_per_s"] / rates["fixed"]["tokens_per_s"],
            }
        )
    record = {
        "case": case.name,
        "model": (case.build.__doc__ or "").strip().splitlines()[0],
        "memory_limit": memory,
        "cap_bytes": cap,
        "rows": rows,
        "lengths": {
            "median": statistics.median(lengths),
            "longest": longest,
            "shortest": min(lengths),
            "mean": statistics.mean(lengths),
            "candidates": candidates,
        },
        "order": "plan first" if plan_first else "frontier first",
        "plan_s": plan_s,
        "frontier_s": frontier_s,
        "analysis_ratio": plan_s / frontier_s,
        "frontier_trials": frontier.trials,
        "plan_frontier_trials": plan.frontier.trials,
        "reruns": {run: {"headroom": float(run[2:]), "wall_s": seconds} for run, (_, seconds) in reruns.items()},
        "buckets": buckets,
        "finds": {str(s): v for s, v in sorted(finds.items())},
        "policies": table,
        "plan_best_layout": plan.best_layout,
        "plan_tokens_per_s": plan.tokens_per_s,
        "plan_packing_tokens_per_s": None if packing is None else packing.tokens_per_s,
        "others_cpu_share": contention,
        "plan_text": str(plan),
        "plan": json.loads(plan.to_json()),
        "rerun_buckets": {run: json.loads(again.to_json())["buckets"] for run, (again, _) in reruns.items()},
    }
    record["goals"] = goals(record)
    return record


def _histogram(lengths: list[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for length in lengths:
        counts[length] = counts.get(length, 0) + 1
    return counts


def bucket_row(bucket: Bucket, finds: dict[int, dict[str, Any]], run: str) -> dict[str, Any]:
    found = finds[bucket.longest]
    return {
        "run": run,
        "shortest": bucket.shortest,
        "longest": bucket.longest,
        "rows": bucket.rows,
        "padding": bucket.padding,
        "batch_size": bucket.batch_size,
        "max_batch": bucket.max_batch,
        "find_max": found["max_batch"],
        "find_safe": found["safe_batch"],
        "exact": bucket.max_batch == found["max_batch"],
        "of_ceiling": bucket.batch_size / found["max_batch"],
    }


def goals(record: dict[str, Any]) -> dict[str, Any]:
    """Each goal of the issue: held or not, with its number."""
    by = {row["policy"]: row for row in record["policies"]}
    ours = [by["buckets"], by["token budget"]]
    safe_verl = [by[name] for name in ("verl padded", "verl packed") if by[name]["soak"]["oom"] == 0]
    best_verl = max((v["tokens_per_s"] for v in safe_verl), default=0.0)
    share: dict[str, float] = {}
    for b in record["buckets"]:
        share[b["run"]] = min(share.get(b["run"], 1.0), b["of_ceiling"])
    return {
        "zero_oom": {
            "held": all(p["soak"]["oom"] == 0 for p in ours),
            "ooms": {p["policy"]: p["soak"]["oom"] for p in by.values()},
        },
        "x_fixed_ge_1.3": {"held": all(p["x_fixed"] >= 1.3 for p in ours), "x_fixed": [p["x_fixed"] for p in ours]},
        "ge_verl_at_equal_safety": {
            "held": all(p["tokens_per_s"] >= best_verl for p in ours),
            "verl_safe": [v["policy"] for v in safe_verl],
            "x_best_safe_verl": [p["tokens_per_s"] / best_verl if best_verl else None for p in ours],
        },
        **{
            f"bucket_ge_90pct{'' if run == 'default' else ' at ' + run}": {"held": low >= 0.9, "min": low}
            for run, low in share.items()
        },
        "bucket_max_exact": {"held": all(b["exact"] for b in record["buckets"])},
        "analysis_le_3x": {"held": record["analysis_ratio"] <= 3, "ratio": record["analysis_ratio"]},
    }


# Printing -----------------------------------------------------------------------------------------------
def print_case(c: dict[str, Any]) -> None:
    lengths = c["lengths"]
    print(
        f"\n### {c['case']}: {c['model']}\ncap {c['memory_limit']}; {c['rows']} rows, lengths "
        f"{lengths['shortest']}-{lengths['longest']}, median {lengths['median']:g}; "
        f"others used {_share(c['others_cpu_share'])} of the cores"
    )
    print(
        f"analysis: buckets() {c['plan_s']:.1f} s ({c['plan_frontier_trials']} frontier trials, then the budget and "
        f"packing) vs one frontier() {c['frontier_s']:.1f} s ({c['frontier_trials']} trials) over "
        f"{lengths['candidates']}: {c['analysis_ratio']:.2f}x"
    )
    runs = [run for run in c["reruns"]]
    by_run = {run: {b["longest"]: b for b in c["buckets"] if b["run"] == run} for run in runs}
    print(
        f"{'bucket':>11}{'rows':>6}{'pad':>6}{'batch':>7}{'max':>6}{'find max/safe':>15}{'exact':>7}{'batch/find':>12}"
        + "".join(f"{run + ' batch':>13}{'/find':>7}" for run in runs)
    )
    default = [b for b in c["buckets"] if b["run"] == "default"]
    for b in default:
        again = [by_run[run].get(b["longest"]) for run in runs]
        print(
            f"{b['shortest']:>5}-{b['longest']:<5}{b['rows']:>6}{b['padding']:>6.0%}{b['batch_size']:>7}"
            f"{b['max_batch']:>6}{b['find_max']:>9}/{b['find_safe']:<5}{'yes' if b['exact'] else 'NO':>7}"
            f"{b['of_ceiling']:>12.0%}" + "".join(f"{a['batch_size'] if a else '-':>13}{_pct(a):>7}" for a in again)
        )
    ends = {d["longest"] for d in default}
    for run in runs:
        for b in (b for end, b in by_run[run].items() if end not in ends):
            print(
                f"  ({run} only) {b['shortest']}-{b['longest']}: batch {b['batch_size']}, "
                f"find max {b['find_max']}, {b['of_ceiling']:.0%}{'' if b['exact'] else ' (max NOT exact)'}"
            )
    print(f"{'policy':<14}{'steps':>6}{'pad':>6}{'OOM':>5}{'peak/cap':>9}{'tokens/s':>10}{'spread':>15}{'x fixed':>8}")
    for p in c["policies"]:
        soak, spread = p["soak"], f"{p['spread'][0]:,.0f}-{p['spread'][1]:,.0f}"
        print(
            f"{p['policy']:<14}{p['steps']:>6}{p['padding']:>6.0%}{soak['oom']:>5}"
            f"{soak['peak_bytes'] / c['cap_bytes']:>9.0%}{p['tokens_per_s']:>10,.0f}{spread:>15}{p['x_fixed']:>8.2f}"
        )
    print(
        f"plan's own rates: buckets {c['plan_tokens_per_s'] or 0:,.0f} tokens/s, packing "
        f"{c['plan_packing_tokens_per_s'] or 0:,.0f}: best_layout={c['plan_best_layout']}"
    )
    for name, goal in c["goals"].items():
        said = json.dumps({k: v for k, v in goal.items() if k != "held"})
        print(f"  goal {name}: {'held' if goal['held'] else 'NOT HELD'}  {said}")


def _pct(bucket: dict[str, Any] | None) -> str:
    return "-" if bucket is None else f"{bucket['of_ceiling']:.0%}"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=[c.name for c in CASES], action="append", help="only this case (repeatable)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: the first case, {QUICK}")
    parser.add_argument("--rows", type=int, help=f"rows of the length distribution (default {FULL['rows']})")
    parser.add_argument("--median", type=int, help=f"the lengths' median (default {FULL['median']})")
    parser.add_argument("--longest", type=int, help=f"the longest length, >= 8x the median (default {FULL['longest']})")
    parser.add_argument(
        "--rerun-headroom",
        type=float,
        nargs="*",
        default=[0.05, 0.0],
        help="the buckets planned again at these headrooms",
    )
    parser.add_argument("--rounds", type=int, default=3, help="parts each policy's timed epoch is cut in, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the cores are shared)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if name != "memory" and getattr(args, name) is None:
            setattr(args, name, value)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    meta = {
        **compare.stamp(argv),
        "quick": args.quick,
        "machine": compare.machine(),
        "settings": {**vars(args), "out": str(args.out)},
        "versions": {
            "torch": torch.__version__,
            "batchfit": batchfit.__version__,
            "transformers": transformers.__version__,
        },
    }
    print(f"batchfit buckets() benchmark: {meta['machine']['cpu']}, {args.threads} torch threads; {meta['versions']}")
    selected = args.case or ([CASES[0].name] if args.quick else [c.name for c in CASES])
    cases = [case for case in CASES if case.name in selected]
    results = [run_case(case, args, plan_first=i % 2 == 0) for i, case in enumerate(cases)]
    meta["total_wall_s"] = time.perf_counter() - started
    for record in results:
        print_case(record)
    print(f"\ntotal {meta['total_wall_s']:.0f} s; caps {[format_bytes(r['cap_bytes']) for r in results]}")
    document = {"schema": "batchfit.buckets-benchmark/1", **meta, "cases": results}
    if not args.no_json:
        compare.write_results(document, args.out, "buckets-cpu")
    return document


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

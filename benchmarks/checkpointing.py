"""``batchfit.fit()`` against the truth and against one ``find()``: batch x activation checkpointing on the CPU.

Run from the repository root (transformers needed)::

    python benchmarks/checkpointing.py                 # HF GPT-2 and Llama from configs, about 4 minutes
    python benchmarks/checkpointing.py --case hf_gpt2  # one case

Per case, under the case's memory cap, each on a freshly built (seeded) model:

* **find**: ``batchfit.find(model, sample, memory_limit=cap)`` with its defaults, timed: the cost unit;
* **fit**: ``batchfit.fit(model, sample, target_batch=T, memory_limit=cap)``, T twice find's safe batch,
  timed, with its rows, trials and recommendation;
* **truth, per row**: in a fresh ``python`` process the policy is applied by hand (here, not by
  batchfit: a Hugging Face block's ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``,
  the model's own flag for the cache), and one ``Prober`` under the same cap runs two steps at the
  row's max (must fit) and at max + 1 (must not);
* **in one step**: ``fit(..., accumulate=False)``: the fewest blocks that hold the target, whose rate
  by hand is set against the best rate by hand over every k whose max reaches the target;
* **rates by hand**: every k from 0 to N blocks (the first k) at the target in one step where its
  line says it fits, and the model as it is at its accumulation micro-batch: a plain training loop
  (AdamW, 2 warm-up steps, 4 timed), no batchfit; the recommended candidate's rate against the best.

Benchmarks are not tests: nothing asserts a timing. JSON (each fit's document included) under
``benchmarks/results/checkpointing-cpu-*.json``; each fit's picture beside it (``--plot``, matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import batchfit  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import compute  # noqa: E402  (its models)

CAPS = {"hf_gpt2": "400MiB", "hf_llama": "400MiB"}


def hf_gpt2() -> tuple[nn.Module, Any]:
    """``GPT2LMHeadModel`` from a config: `compute.hf_gpt2` with 6 layers, d=256, vocab 2048, sequence 64."""
    return compute.hf_gpt2(n_layer=6, seq_len=64)


def hf_llama() -> tuple[nn.Module, Any]:
    """``LlamaForCausalLM`` from a config: 6 layers, d=256, 4 heads (2 KV), MLP 688, vocab 2048, sequence 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=688, vocab_size=2048, max_position_embeddings=64,
    )  # fmt: skip
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}


CASES = {"hf_gpt2": hf_gpt2, "hf_llama": hf_llama}


def by_hand(model: nn.Module, checkpointed: list[str]) -> None:
    """Checkpoint these blocks the way transformers does, without batchfit."""
    from torch.utils.checkpoint import checkpoint

    if not checkpointed:
        return
    function = functools.partial(checkpoint, use_reentrant=False)
    for name, module in model.named_modules():
        if isinstance(getattr(module, "gradient_checkpointing", None), bool):
            is_block = any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)
            if not is_block or name in checkpointed:
                module.gradient_checkpointing, module._gradient_checkpointing_func = True, function


def truth(case: str, checkpointed: list[str], size: int) -> dict[str, bool]:
    """In this (fresh) process: does ``size`` fit under the case's cap with the policy by hand, and ``size + 1``?"""
    model, sample = CASES[case]()
    by_hand(model, checkpointed)
    out = {}
    with batchfit.Prober(model, sample, memory_limit=CAPS[case], steps_per_trial=2) as prober:
        for b in (size, size + 1):
            out[str(b)] = prober.trial(b, fresh_optimizer=True).fits
    return out


def plain_rate(model: nn.Module, sample: dict[str, torch.Tensor], size: int, steps: int = 4) -> float:
    """Samples/s of a plain loop at ``size`` (2 warm-up steps, then ``steps`` timed)."""
    batch = {k: v.repeat((size + 1) // 2, 1)[:size] for k, v in sample.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(2 + steps):
        if i == 2:
            started = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return size * steps / (time.perf_counter() - started)


def run_case(case: str, plot_to: Path | None) -> dict[str, Any]:
    model, sample = CASES[case]()
    started = time.perf_counter()
    found = batchfit.find(model, sample, memory_limit=CAPS[case])
    find_s = time.perf_counter() - started
    target = 2 * found.safe_batch
    model, sample = CASES[case]()
    started = time.perf_counter()
    fit = batchfit.fit(model, sample, target_batch=target, memory_limit=CAPS[case])
    fit_s = time.perf_counter() - started
    print(fit, flush=True)
    if plot_to is not None:
        print(f"drew {fit.plot(plot_to.with_name(f'{plot_to.stem}-{case}.png'))}")
    rows = []
    for row in fit.rows:
        names = json.dumps(list(row.policy.checkpointed))
        args = [sys.executable, __file__, "--truth", case, names, str(row.max_batch)]
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        seen = json.loads(out.strip().splitlines()[-1])
        rows.append({"policy": row.policy.label, "k": row.policy.k, "max": row.max_batch, "safe": row.safe_batch,
                     "trials": row.trials, "micro": row.micro_batch, "accumulation": row.accumulation,
                     "samples_per_s": row.samples_per_s, "max_fits_fresh": seen[str(row.max_batch)],
                     "max_plus_1_fits_fresh": seen[str(row.max_batch + 1)]})  # fmt: skip
    hand: dict[str, float] = {}
    predicted = dict(fit.predicted)
    n = len(fit.blocks)
    for k in range(n + 1):
        if predicted[k] >= target:  # only policies whose line says the target fits in one step
            model, sample = CASES[case]()
            by_hand(model, list(fit.blocks[:k]))
            hand[f"k={k} at {target}"] = plain_rate(model, sample, target)
    none = fit.row(0)
    if none is not None and none.micro_batch:
        model, sample = CASES[case]()
        hand[f"none at {none.micro_batch} x {none.accumulation}"] = plain_rate(model, sample, none.micro_batch)
    chosen = fit.rows[fit.chosen]
    none_key = f"none at {chosen.micro_batch} x {chosen.accumulation}"
    key = f"k={chosen.policy.k} at {target}" if chosen.policy.k else none_key
    best = max(hand.values())
    # The same target in one step (accumulate=False): which k fit() picks, against every k by hand.
    model, sample = CASES[case]()
    started = time.perf_counter()
    one = batchfit.fit(model, sample, target_batch=target, memory_limit=CAPS[case], accumulate=False)
    one_s = time.perf_counter() - started
    by_k = {key: rate for key, rate in hand.items() if key.startswith("k=")}
    one_key = f"k={one.policy.k} at {target}"
    return {
        "case": case, "cap": CAPS[case], "target": target, "find_s": find_s, "find_trials": len(found.trials),
        "fit_s": fit_s, "fit_trials": fit.trials, "fit_over_find": fit_s / find_s, "rows": rows,
        "recommended": fit.policy.label, "split": fit.recommendation.split(), "rates_by_hand": hand,
        "recommended_by_hand_over_best": hand.get(key, float("nan")) / best, "notes": list(fit.notes),
        "fit": fit.to_dict(),
        "one_step": {"fit_s": one_s, "trials": one.trials, "recommended": one.policy.label,
                     "by_hand_over_best_k": by_k.get(one_key, float("nan")) / max(by_k.values()),
                     "best_k_by_hand": max(by_k, key=by_k.__getitem__), "fit": one.to_dict()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--truth", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--plot", action="store_true", help="draw each fit beside the JSON (matplotlib)")
    args = parser.parse_args()
    if args.truth:
        case, names, size = args.truth
        print(json.dumps(truth(case, json.loads(names), int(size))))
        return
    torch.set_num_threads(os.cpu_count() or 1)
    path = Path(args.out) / f"checkpointing-cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    results = [run_case(case, path if args.plot else None) for case in args.case or sorted(CASES)]
    head = f"{'case':<10} {'target':>6} {'find s':>7} {'fit s':>7} {'fit/find':>8}  {'recommended':<28}"
    print(f"\n{head} {'by hand/best':>12}")
    for r in results:
        print(f"{r['case']:<10} {r['target']:>6} {r['find_s']:>7.1f} {r['fit_s']:>7.1f} {r['fit_over_find']:>8.2f}  "
              f"{r['recommended'] + ', ' + r['split'].split(' = ')[1]:<28} {r['recommended_by_hand_over_best']:>12.3f}")
        for row in r["rows"]:
            print(f"    {row['policy']:<28} max {row['max']:>4} fits fresh: {row['max_fits_fresh']}, "
                  f"max+1 fits fresh: {row['max_plus_1_fits_fresh']}; trials {row['trials']}")
        print("    by hand (samples/s): " + ", ".join(f"{k} {v:.1f}" for k, v in r["rates_by_hand"].items()))
        one = r["one_step"]
        print(f"    in one step (accumulate=False): {one['recommended']} in {one['fit_s']:.1f} s, "
              f"{one['trials']} trials; by hand {one['by_hand_over_best_k']:.3f} of the best k "
              f"({one['best_k_by_hand']})")
    path.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

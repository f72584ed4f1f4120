"""``find(mode="generate")`` and ``find(eval=True)`` against the truth and HF's and lm-eval's finders, on the CPU.

Run from the repository root (transformers and accelerate needed)::

    python benchmarks/eval_generate.py                  # HF GPT-2 and Llama from configs, about 3-4 minutes
    python benchmarks/eval_generate.py --case hf_llama  # one model

Two models from configs (no download): a ``GPT2LMHeadModel`` and a ``LlamaForCausalLM`` (6 blocks,
d=256, vocab 2048, 128 positions). Per model and per step sized ("generate": greedy generation of
`NEW_TOKENS` tokens after `PROMPT_TOKENS`-token prompts; "eval": the evaluation step of a training run,
on 64-token sequences with labels), under that row's CPU memory cap (`CAPS`), each on a freshly built
(seeded) model:

* **batchfit**, timed: ``find(model, prompts, mode="generate", max_new_tokens=N, memory_limit=cap)``,
  or ``find(model, sample, eval=True, memory_limit=cap)`` (the train search, then the eval one);
* **truth**: in a fresh ``python`` process per size, no batchfit step: a real
  ``model.generate(**batch, max_new_tokens=N, min_new_tokens=N, do_sample=False)``, or a real eval loop
  (AdamW state live after a real training step, gradients set to None, ``model.eval()``, forward and
  loss under ``torch.no_grad()``), two steps at batchfit's max (must fit) and at max + 1 (must not).
  The cap is enforced as batchfit's CPU backend enforces it, by its own meter (`capped`): the weights,
  buffers, sample (and optimizer state) are live, and the operation that takes live tensor bytes over
  the cap raises a real ``torch.OutOfMemoryError``;
* **HF-style**, timed: Accelerate's ``find_executable_batch_size`` (the installed one, called, not
  copied), what ``Trainer(auto_find_batch_size=True)`` wraps its training loop in
  (``transformers/trainer.py``, ``Trainer.train``), here wrapped around the same real loop of two
  batches, from Accelerate's default start of 128; after an out-of-memory it retries at
  ``int(0.9 * size)`` (``accelerate/utils/memory.py``, accelerate 1.15). ``Trainer`` itself sizes no
  evaluation (its ``auto_find_batch_size`` help: "The evaluation batch size is not adjusted";
  ``per_device_eval_batch_size`` stays at its default, 8) and no generation;
* **lm-eval-style**, timed: lm-evaluation-harness's ``batch_size="auto"``
  (``lm_eval/models/huggingface.py``, ``HFLM._detect_batch_size``, read at commit 0068151d): the same
  Accelerate decorator from ``max_batch_size`` (default 64) around five forwards of
  ``torch.ones((b, max_length))`` under ``no_grad`` with ``log_softmax`` on the logits; ``max_length``
  is the model's ``n_positions``/``max_position_embeddings`` for ``generate_until`` (no requests
  passed) and the longest request's tokens minus one for loglikelihood (its ``_batch_scheduler``).
  For the eval rows it runs with the training state live, as the eval loop has it.

Both other finders run under the same cap through the same meter, one meter for the whole search (what
a failed try leaves behind counts, as on a device). Benchmarks are not tests: nothing asserts a timing.
JSON under ``benchmarks/results/eval-generate-cpu-*.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import batchfit  # noqa: E402
from batchfit.backends import backend_for  # noqa: E402
from batchfit.units import format_bytes, parse_memory_limit  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, EVAL_TOKENS, POSITIONS = 32, 64, 64, 128
#: The cap per (model, step): boundaries near 100, below the HF-style start of 128.
CAPS = {
    ("hf_gpt2", "generate"): "160MiB",
    ("hf_gpt2", "eval"): "250MiB",
    ("hf_llama", "generate"): "90MiB",
    ("hf_llama", "eval"): "200MiB",
}
ACCELERATE_START = 128  # accelerate.utils.find_executable_batch_size's default starting_batch_size
LM_EVAL_START = 64  # HFLM(max_batch_size=64), the start of its _detect_batch_size
LOOP_BATCHES = 2  # batches per call of the loop the truth and the HF-style finder run


def hf_gpt2() -> nn.Module:
    """``GPT2LMHeadModel`` from a config: 6 layers, d=256, 4 heads, vocab 2048, 128 positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=2048, n_positions=POSITIONS,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def hf_llama() -> nn.Module:
    """``LlamaForCausalLM`` from a config: 6 layers, d=256, 4 heads (2 KV), MLP 688, vocab 2048, 128 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=688, vocab_size=2048, max_position_embeddings=POSITIONS,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


CASES: dict[str, Callable[[], nn.Module]] = {"hf_gpt2": hf_gpt2, "hf_llama": hf_llama}


def sample_for(what: str) -> dict[str, torch.Tensor]:
    """Two rows: prompts (ids and mask) to generate from, or sequences with labels to evaluate."""
    tokens = PROMPT_TOKENS if what == "generate" else EVAL_TOKENS
    ids = torch.randint(1, 2048, (2, tokens), generator=torch.Generator().manual_seed(0))
    if what == "generate":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return {"input_ids": ids, "labels": ids.clone()}


def prepared(case: str, what: str) -> tuple[nn.Module, dict[str, torch.Tensor], list[torch.Tensor]]:
    """The model as the step meets it, its sample, and every tensor live before the step.

    For "eval": one real training step (AdamW) on the sample, gradients set to None, ``model.eval()``:
    the optimizer's moments stay live, as in an evaluation during training."""
    model, sample = CASES[case](), sample_for(what)
    held = [*model.parameters(), *model.buffers(), *sample.values()]
    if what == "eval":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(**sample).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        held += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    model.eval()
    return model, sample, held


def tile(sample: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """``size`` rows: the sample's rows repeated, each tensor a fresh allocation."""
    index = torch.arange(size) % next(iter(sample.values())).shape[0]
    return {key: value[index] for key, value in sample.items()}


def step(model: nn.Module, what: str, batch: dict[str, torch.Tensor]) -> None:
    """One real step at the batch: a greedy generation of every new token, or an eval forward and loss."""
    if what == "generate":
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.shape[1] == PROMPT_TOKENS + NEW_TOKENS, out.shape
        return
    with torch.no_grad():
        out = model(**batch)
        float(out.loss)  # the metric reads the loss; the output lives until the step ends


@contextlib.contextmanager
def capped(cap: str, held: list[torch.Tensor]) -> Iterator[Any]:
    """Run the code inside under ``cap`` of live tensors, enforced by batchfit's CPU meter as a probe does.

    The meter is made by the CPU backend from the limit as `batchfit.Prober` makes it (told of the tensors
    already live: weights, buffers, the sample, optimizer state); the operation that takes live tensor
    bytes over the cap raises a real ``torch.OutOfMemoryError``. Its peak is ``max(meter.phase_peaks())``."""
    device = torch.device("cpu")
    backend = backend_for(device)
    limit = parse_memory_limit(cap, backend.limit_total_bytes(device))
    reachable = backend.reachable_bytes(device)
    if reachable is not None and limit > reachable:  # a probe would clip it (and say so): not the same cap
        raise SystemExit(f"cap {cap} is more than this host lets a probe reach ({format_bytes(reachable)})")
    meter = backend.make_meter(device, limit, limit, tensors=held)
    with meter.active():
        meter.begin_trial()
        with meter.tracking():
            yield meter


def loop(model: nn.Module, what: str, sample: dict[str, torch.Tensor], size: int, meter: Any) -> None:
    """The real loop at ``size``: `LOOP_BATCHES` batches, each built, stepped and dropped."""
    for _ in range(LOOP_BATCHES):
        with meter.phase(what):
            step(model, what, tile(sample, size))


def truth(case: str, what: str, size: int) -> dict[str, Any]:
    """In this (fresh) process: does the real loop at ``size`` run under the row's cap?"""
    model, sample, held = prepared(case, what)
    with capped(CAPS[case, what], held) as meter:
        try:
            loop(model, what, sample, size, meter)
            fits, error = True, None
        except torch.OutOfMemoryError as exc:
            fits, error = False, str(exc).split(" (DefaultCPUAllocator")[0]
        peak = max(meter.phase_peaks().values(), default=meter.baseline_bytes)
    return {"size": size, "fits": fits, "peak_bytes": peak, "error": error}


def fresh(case: str, what: str, size: int) -> dict[str, Any]:
    """`truth` in a new ``python`` process."""
    args = [sys.executable, __file__, "--truth", case, what, str(size), "--threads", str(torch.get_num_threads())]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def accelerate_style(case: str, what: str) -> dict[str, Any]:
    """Accelerate's ``find_executable_batch_size`` (as ``Trainer(auto_find_batch_size=True)`` uses it)
    around the real loop, from its default start."""
    from accelerate.utils import find_executable_batch_size

    model, sample, held = prepared(case, what)
    tried: list[int] = []
    started = time.perf_counter()
    with capped(CAPS[case, what], held) as meter:

        def run(batch_size: int) -> int:
            tried.append(batch_size)
            loop(model, what, sample, batch_size, meter)
            return batch_size

        answer = find_executable_batch_size(run, starting_batch_size=ACCELERATE_START)()
    return {"answer": answer, "seconds": time.perf_counter() - started, "tried": tried}


def lm_eval_style(case: str, what: str) -> dict[str, Any]:
    """lm-evaluation-harness's ``HFLM._detect_batch_size`` (``batch_size="auto"``), its causal branch."""
    from accelerate.utils import find_executable_batch_size

    model, _, held = prepared(case, what)
    if what == "generate":  # generate_until: _detect_batch_size() with no requests, at the model's max length
        max_length = model.config.max_position_embeddings  # GPT2Config maps it to n_positions
    else:  # loglikelihood: the longest request, (context + continuation)[-(max_length + 1):][:-1]
        max_length = EVAL_TOKENS - 1
    tried: list[int] = []
    started = time.perf_counter()
    with capped(CAPS[case, what], held) as meter:

        @find_executable_batch_size(starting_batch_size=LM_EVAL_START)
        def forward_batch(batch_size: int) -> int:
            tried.append(batch_size)
            with meter.phase("lm-eval"):
                test_batch = torch.ones((batch_size, max_length)).long()
                for _ in range(5):
                    with torch.no_grad():  # HFLM._model_call
                        out = F.log_softmax(model(test_batch).logits, dim=-1)  # noqa: F841
                del out, test_batch
            return batch_size

        try:
            answer = forward_batch()
        except RuntimeError as exc:
            if "No executable batch size found" not in str(exc):
                raise
            answer = 1
    return {"answer": answer, "seconds": time.perf_counter() - started, "tried": tried, "max_length": max_length}


def batchfit_find(case: str, what: str) -> dict[str, Any]:
    """batchfit's answer, timed, on a fresh model (it makes its own optimizer state for eval)."""
    model, sample = CASES[case](), sample_for(what)
    started = time.perf_counter()
    if what == "generate":
        model.eval()
        result = batchfit.find(model, sample, mode="generate", max_new_tokens=NEW_TOKENS, memory_limit=CAPS[case, what])
    else:
        result = batchfit.find(model, sample, eval=True, memory_limit=CAPS[case, what])
    seconds = time.perf_counter() - started
    print(result, flush=True)
    evaluation = result.evaluation
    out: dict[str, Any] = {"seconds": seconds, "max": result.max_batch, "safe": result.safe_batch,
                           "trials": len(result.trials), "notes": list(result.notes),
                           "kinds": dict(Counter(t.kind for t in result.trials)),
                           "result": result.to_dict()}  # fmt: skip
    if what == "eval":
        assert evaluation is not None, "find(eval=True) left result.evaluation unset"
        out.update(train_max=result.max_batch, train_safe=result.safe_batch, max=result.eval_max_batch,
                   safe=result.eval_safe_batch, eval_trials=len(evaluation.trials),
                   eval_kinds=dict(Counter(t.kind for t in evaluation.trials)))  # fmt: skip
    else:
        generation = result.generation
        assert generation is not None, 'find(mode="generate") left result.generation unset'
        out.update(kv_bytes_per_token=generation.kv_bytes_per_token, context_tokens=generation.context_tokens)
    trials = result.trials if evaluation is None else evaluation.trials
    out["peak_at_max"] = next((t.peak_bytes for t in trials if t.fits and t.batch_size == out["max"]), None)
    return out


def run_row(case: str, what: str) -> dict[str, Any]:
    found = batchfit_find(case, what)
    top = found["max"]
    at_max, above = fresh(case, what, top), fresh(case, what, top + 1)
    hf = accelerate_style(case, what)
    gc.collect()
    lm = lm_eval_style(case, what)
    gc.collect()
    return {"case": case, "what": what, "cap": CAPS[case, what], "batchfit": found,
            "fresh": {"max": at_max, "max_plus_1": above, "exact": at_max["fits"] and not above["fits"]},
            "hf_style": hf, "lm_eval_style": lm}  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    """One row per model and step: each finder's answer and seconds, and the fresh processes' verdict."""
    head = (f"{'model':<9} {'what':<9} {'cap':>7} {'batchfit max (safe)':>20} {'s':>6}  "
            f"{'fresh: max fits / max+1 fails':<29} {'HF-style':>12} {'s':>6} {'lm-eval':>12} {'s':>6}")  # fmt: skip
    lines = [head]
    for r in results:
        b, f = r["batchfit"], r["fresh"]
        check = f"{'yes' if f['max']['fits'] else 'NO'} / {'yes' if not f['max_plus_1']['fits'] else 'NO'}"
        answer = f"{b['max']} ({b['safe']})"
        hf, lm = (f"{x} ({x / b['max'] - 1:+.0%})" for x in (r["hf_style"]["answer"], r["lm_eval_style"]["answer"]))
        lines.append(
            f"{r['case']:<9} {r['what']:<9} {r['cap']:>7} {answer:>20} {b['seconds']:>6.1f}  {check:<29} "
            f"{hf:>12} {r['hf_style']['seconds']:>6.1f} {lm:>12} {r['lm_eval_style']['seconds']:>6.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--what", action="append", choices=["generate", "eval"])
    parser.add_argument("--truth", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, here and in each fresh process "
        "(default 1: on a shared 2-core machine two OpenMP threads ran generation 10-25x slower)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.truth:
        case, what, size = args.truth
        print(json.dumps(truth(case, what, int(size))))
        return
    import accelerate
    import transformers

    path = Path(args.out) / f"eval-generate-cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    results = [run_row(case, what) for case in args.case or sorted(CASES) for what in args.what or ["generate", "eval"]]
    print()
    print(table(results))
    for r in results:
        b, f = r["batchfit"], r["fresh"]
        if r["what"] == "eval":
            extra = f"train max {b['train_max']}, {b['trials']} train + {b['eval_trials']} eval trials"
        else:
            extra = f"{b['trials']} trials, KV {b['kv_bytes_per_token']} B/token"
        print(
            f"  {r['case']} {r['what']}: batchfit {extra}; peak at max: batchfit's {b['peak_at_max']} B, "
            f"fresh {f['max']['peak_bytes']} B; fresh max+1: {f['max_plus_1']['error'] or 'fit'}; "
            f"HF-style tried {r['hf_style']['tried']}; lm-eval-style tried {r['lm_eval_style']['tried']} "
            f"at {r['lm_eval_style']['max_length']} tokens"
        )
    failed = [f"{r['case']} {r['what']}" for r in results if not r["fresh"]["exact"]]
    print(
        f"exact in fresh processes: {len(results) - len(failed)} of {len(results)}"
        + (f"; NOT: {failed}" if failed else "")
    )
    document = {"torch": torch.__version__, "transformers": transformers.__version__,
                "accelerate": accelerate.__version__, "threads": torch.get_num_threads(),
                "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "eval_tokens": EVAL_TOKENS,
                "results": results}  # fmt: skip
    path.write_text(json.dumps(document, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

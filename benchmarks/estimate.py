"""``batchfit.estimate()`` against ``batchfit.find()`` on the CPU: the same answer, in how much less time.

Run from the repository root (transformers is optional; a case whose package is missing says so)::

    python benchmarks/estimate.py                          # every case, about 3 minutes on 2 idle cores
    python benchmarks/estimate.py --case hf_bert@512MiB    # one case (repeat --case for more)
    python benchmarks/estimate.py --large                  # only the 1.5B Llama for 80 GiB (cuda, bf16), timed twice

``estimate()`` runs ``find()``'s search on fake tensors (see its module docs); on the CPU the
live-tensor meter counts fake storages as it counts real ones, so its answer should be ``find()``'s
byte for byte. Per case, one after another in this process, each on a freshly built (seeded,
identical) model under the same memory cap:

* **find**: ``batchfit.find(model, sample, memory_limit=cap, device="cpu")`` with its defaults:
  real steps, the exact maximum, a verified safe batch.
* **estimate cpu**: ``batchfit.estimate(model, sample, memory_limit=cap, for_device="cpu")``.
* **estimate cuda**: ``batchfit.estimate(model, sample, memory_limit=cap, for_device="cuda", reserve=0)``:
  the same trace fed to the modelled CUDA caching allocator, the budget counting reserved bytes.
  ``reserve=0`` means the whole cap is the allocator's, as on the CPU (if this batchfit refuses
  ``reserve=0``, ``memory`` is the cap plus 512 MiB and ``reserve="512MiB"``, which leaves the
  same budget; the JSON says which). The modelled allocator holds the cuBLAS workspaces
  (2 x 33 MiB) on top of the model, so a second run gives it the cap plus those bytes: the same
  room for the model as the CPU's. No GPU is involved: these rows are **modelled, not
  validated**, and are compared only with the CPU estimate.

Per case: max/safe batch, trials and wall time of find and of the CPU estimate; whether the
answers are equal and whether the trial lists are identical (size, kind, outcome, peaks); the
largest relative difference of peak allocated bytes over the trials both ran (matched by batch
size, kind and occurrence), and the same for the per-phase peaks; the speedup (find's wall time
/ the estimate's); whether the estimate fell back to real steps and extrapolation
(``"extrapolated"`` in ``result.assumptions``); the share of the cores other processes used. Then
the modelled CUDA rows, and one **big model** row: the built-in GPT (d_model 1024, 12 layers,
16 heads, vocab 32000, sequence 1024; 185M parameters) built on the ``meta`` device, so no weight
exists and no ``find()`` can run, estimated for ``memory_limit="80GiB", device="cuda"`` (default
reserve: 1 GiB for the CUDA context, the top of its 0.5-1 GiB range).

``--large`` runs only the issue-34 target instead: ``LlamaForCausalLM`` with 28 layers, d=2048 (1.57B
parameters) on the meta device, sample ``(1, 2048)`` token ids and labels, estimated with
``memory_limit="80GiB", device="cuda", amp="bf16"``, timed ``--runs`` times on a fresh model each
(the call alone), with its trials and the verification's step count; JSON ``estimate-large-*.json``.

Before the cases a tiny ``find()`` and ``estimate()`` run once to pay first-use costs (imports,
the fake-tensor machinery); their times are reported apart. Benchmarks are not tests: nothing
asserts a timing. Output: a table on stdout and JSON under
``benchmarks/results/estimate-cpu-*.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)

import batchfit  # noqa: E402
from batchfit import examples  # noqa: E402
from batchfit.errors import NothingFitsError  # noqa: E402
from batchfit.units import format_bytes, parse_memory_limit  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SEQ = 128
VOCAB = 8192


def _ids(batch: int = 2, seq: int = SEQ, low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


# Models -------------------------------------------------------------------------------------------------
def hf_gpt2() -> tuple[nn.Module, Any]:
    """``GPT2LMHeadModel``: 3 layers, d=192, 4 heads, vocab 8192, sequence 128 (2.9M parameters)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3, n_embd=192, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    ids = _ids()
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids.clone()}


def hf_bert() -> tuple[nn.Module, Any]:
    """``BertForSequenceClassification``: 3 layers, d=192, vocab 8192, sequence 128, attention_mask, labels."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=3,
        hidden_size=192,
        num_attention_heads=4,
        intermediate_size=768,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    ids = _ids()
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(2, dtype=torch.long)}
    return BertForSequenceClassification(config), sample


def hf_llama() -> tuple[nn.Module, Any]:
    """``LlamaForCausalLM``: 2 layers, d=192, 4 heads (2 KV heads), MLP 512, vocab 8192, sequence 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    ids = _ids()
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}


def hf_t5() -> tuple[nn.Module, Any]:
    """``T5ForConditionalGeneration``: 2+2 layers, d=128, 4 heads, vocab 8192, input 128, labels 32."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=128,
        d_kv=32,
        d_ff=512,
        num_heads=4,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config), {"input_ids": _ids(low=1), "labels": _ids(seq=32, low=1)}


def hf_vit() -> tuple[nn.Module, Any]:
    """``ViTForImageClassification``: 64x64 images, patch 8, 3 layers, d=192, 10 classes."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=64,
        patch_size=8,
        num_hidden_layers=3,
        hidden_size=192,
        num_attention_heads=4,
        intermediate_size=768,
        num_labels=10,
    )
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return ViTForImageClassification(config), {"pixel_values": pixels, "labels": torch.zeros(2, dtype=torch.long)}


def big_gpt() -> tuple[nn.Module, Any]:
    """The built-in GPT on the meta device: d=1024, 12 layers, 16 heads, vocab 32000, sequence 1024."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = examples.GPT(vocab_size=32000, seq_len=1024, d_model=1024, n_layers=12, n_heads=16)
    ids = torch.randint(0, 32000, (2, 1024), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def large_llama() -> tuple[nn.Module, Any]:
    """``LlamaForCausalLM`` on the meta device: 28 layers, d=2048, MLP 5632, 16 heads, vocab 32000, sequence 2048."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, 2048, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, Any]]
    memory: str
    needs: str | None = None

    @property
    def cap_bytes(self) -> int:
        return parse_memory_limit(self.memory, None)

    @property
    def missing(self) -> str | None:
        return self.needs if self.needs and importlib.util.find_spec(self.needs) is None else None


#: Caps that put the boundary at tens to hundreds (the built-in mlp/cnn/gpt at their test caps too).
CASES: tuple[Case, ...] = (
    Case("mlp@32MiB", examples.mlp, "32MiB"),
    Case("cnn@64MiB", examples.cnn, "64MiB"),
    Case("gpt@64MiB", examples.gpt, "64MiB"),
    Case("gpt@1GiB", examples.gpt, "1GiB"),
    Case("hf_gpt2@1GiB", hf_gpt2, "1GiB", "transformers"),
    Case("hf_bert@512MiB", hf_bert, "512MiB", "transformers"),
    Case("hf_llama@1GiB", hf_llama, "1GiB", "transformers"),
    Case("hf_t5@512MiB", hf_t5, "512MiB", "transformers"),
    Case("hf_vit@512MiB", hf_vit, "512MiB", "transformers"),
)
BIG = Case("big_gpt@80GiB", big_gpt, "80GiB")
#: ``--large``: the 1.5B Llama shape estimated for an 80 GiB CUDA card in bf16 (issue 34: under 5 s).
LARGE = Case("llama_1.5b@80GiB", large_llama, "80GiB", "transformers")


# Measuring ----------------------------------------------------------------------------------------------
def timed(call: Callable[[], batchfit.Result]) -> tuple[batchfit.Result | None, float, str | None]:
    started = time.perf_counter()
    try:
        result = call()
    except NothingFitsError as exc:
        return None, time.perf_counter() - started, f"nothing fits: {str(exc).splitlines()[0]}"
    return result, time.perf_counter() - started, None


def on_fresh_model(
    case: Case, call: Callable[[nn.Module, Any], batchfit.Result]
) -> tuple[batchfit.Result | None, float, str | None]:
    """``call`` on a freshly built model and sample (the build is not timed); memory released after."""
    outcome = _build_and_time(case, call)  # the model is gone when this returns
    compare.release(torch.device("cpu"))
    return outcome


def _build_and_time(
    case: Case, call: Callable[[nn.Module, Any], batchfit.Result]
) -> tuple[batchfit.Result | None, float, str | None]:
    model, sample = case.build()
    return timed(lambda: call(model, sample))


def summary(result: batchfit.Result | None, wall: float, error: str | None) -> dict[str, Any]:
    if result is None:
        empty = ("max_batch", "safe_batch", "trials", "sizes", "max_peak_bytes", "max_reserved_peak_bytes")
        return {**dict.fromkeys(empty), "wall_s": wall, "extrapolated": False, "error": error}
    fitting = [t for t in result.trials if t.fits]
    return {
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "trials": len(result.trials),
        "wall_s": wall,
        "sizes": [t.batch_size for t in result.trials],
        "max_peak_bytes": max((t.peak_bytes or 0 for t in fitting), default=None),
        "max_reserved_peak_bytes": max((t.capped_peak_bytes or 0 for t in fitting), default=None),
        "extrapolated": any("extrapolated" in a for a in result.assumptions),
        "error": None,
    }


def _keyed(trials: tuple[batchfit.Trial, ...]) -> dict[tuple[int, str, int], batchfit.Trial]:
    seen: Counter[tuple[int, str]] = Counter()
    keyed = {}
    for trial in trials:
        key = (trial.batch_size, trial.kind)
        keyed[(*key, seen[key])] = trial
        seen[key] += 1
    return keyed


def peak_difference(real: batchfit.Result, fake: batchfit.Result) -> tuple[float | None, int]:
    """The largest |estimate - find| / find of peak allocated bytes over the trials both ran, and how many."""
    ours, theirs = _keyed(real.trials), _keyed(fake.trials)
    diffs = [
        abs(theirs[key].peak_bytes - trial.peak_bytes) / trial.peak_bytes  # type: ignore[operator]
        for key, trial in ours.items()
        if key in theirs and trial.peak_bytes and theirs[key].peak_bytes is not None
    ]
    return (max(diffs) if diffs else None), len(diffs)


def phase_peak_difference(real: batchfit.Result, fake: batchfit.Result) -> tuple[float | None, str | None]:
    """The largest relative difference of a per-phase peak over the trials both ran, and where."""
    ours, theirs = _keyed(real.trials), _keyed(fake.trials)
    worst: tuple[float, str] | None = None
    for key, trial in ours.items():
        if key not in theirs:
            continue
        other = dict(theirs[key].phase_peaks)
        for phase, peak in trial.phase_peaks:
            if peak and phase in other:
                diff = abs(other[phase] - peak) / peak
                if diff and (worst is None or diff > worst[0]):
                    worst = (
                        diff,
                        f"{phase} at batch {key[0]} ({key[1]}): find {peak:,} B, estimate {other[phase]:,} B",
                    )
    return (worst[0], worst[1]) if worst else (0.0, None)


def same_trials(real: batchfit.Result, fake: batchfit.Result) -> bool:
    def shape(result: batchfit.Result) -> list[tuple[Any, ...]]:
        return [(t.batch_size, t.kind, t.fits, t.phase, t.peak_bytes, t.phase_peaks) for t in result.trials]

    return shape(real) == shape(fake)


def estimate_cuda(case: Case, memory_bytes: int) -> tuple[batchfit.Result | None, float, str | None, str]:
    """The modelled CUDA estimate with the whole of ``memory_bytes`` for the allocator."""
    try:
        result, wall, error = on_fresh_model(
            case, lambda m, s: batchfit.estimate(m, s, memory_limit=memory_bytes, for_device="cuda", reserve=0)
        )
        return result, wall, error, "reserve=0"
    except ValueError as exc:
        if "reserve" not in str(exc):
            raise
        refused = str(exc).splitlines()[0]
    aside = 512 * 2**20  # any size: memory and reserve both carry it, the budget is memory_bytes
    result, wall, error = on_fresh_model(
        case, lambda m, s: batchfit.estimate(m, s, memory_limit=memory_bytes + aside, for_device="cuda", reserve=aside)
    )
    return result, wall, error, f"reserve=0 refused ({refused}): memory = budget + 512 MiB, reserve=512MiB"


def run_case(case: Case) -> dict[str, Any]:
    from batchfit.backends.simulated import CUBLAS_HANDLES, CUBLAS_WORKSPACE_BYTES

    print(f"== {case.name}", flush=True)
    cpu_at_start = compare._cpu_snapshot()
    cap = case.cap_bytes
    real, real_wall, real_error = on_fresh_model(case, lambda m, s: batchfit.find(m, s, memory_limit=cap, device="cpu"))
    fake, fake_wall, fake_error = on_fresh_model(
        case, lambda m, s: batchfit.estimate(m, s, memory_limit=cap, for_device="cpu")
    )
    cuda, cuda_wall, cuda_error, how = estimate_cuda(case, cap)
    room = cap + CUBLAS_HANDLES * CUBLAS_WORKSPACE_BYTES
    cuda_room, room_wall, room_error, _ = estimate_cuda(case, room)
    contention = compare.others_cpu_share(cpu_at_start)

    record: dict[str, Any] = {
        "case": case.name,
        "cap_bytes": cap,
        "model": (case.build.__doc__ or "").strip().splitlines()[0],
        "find": summary(real, real_wall, real_error),
        "estimate_cpu": summary(fake, fake_wall, fake_error),
        "estimate_cuda": {**summary(cuda, cuda_wall, cuda_error), "budget_bytes": cap, "how": how},
        "estimate_cuda_plus_cublas": {
            **summary(cuda_room, room_wall, room_error),
            "budget_bytes": room,
            "how": f"{how}; budget = cap + cuBLAS workspaces {format_bytes(room - cap)}",
        },
        "cuda_label": "modelled, not validated",
        "others_cpu_share": contention,
    }
    if real is not None and fake is not None:
        diff, matched = peak_difference(real, fake)
        record["equal"] = (real.max_batch, real.safe_batch) == (fake.max_batch, fake.safe_batch)
        record["identical_trials"] = same_trials(real, fake)
        record["max_peak_rel_diff"] = diff
        record["max_phase_peak_rel_diff"], record["max_phase_peak_diff_at"] = phase_peak_difference(real, fake)
        record["matched_trials"] = matched
        record["speedup"] = real_wall / fake_wall if fake_wall else None
    record["results"] = {
        name: None if result is None else json.loads(result.to_json())
        for name, result in (("find", real), ("estimate_cpu", fake), ("estimate_cuda", cuda))
    }
    return record


def run_big() -> dict[str, Any]:
    print(f"== {BIG.name}", flush=True)
    model, sample = BIG.build()
    parameters = sum(p.numel() for p in model.parameters())
    result, wall, error = timed(lambda: batchfit.estimate(model, sample, memory_limit=BIG.memory, for_device="cuda"))
    return {
        "case": BIG.name,
        "model": (big_gpt.__doc__ or "").strip().rstrip("."),
        "parameters": parameters,
        "memory": BIG.memory,
        "estimate_cuda": summary(result, wall, error),
        "label": "modelled, not validated; no find(): the weights are on the meta device",
        "assumptions": list(result.assumptions) if result is not None else [],
        "result": None if result is None else json.loads(result.to_json()),
    }


def run_large(runs: int) -> dict[str, Any]:
    """``LARGE`` estimated ``runs`` times, each on a freshly built model: the wall time of the call alone."""
    from batchfit.probe import Options

    print(f"== {LARGE.name} (cuda, bf16), {runs} run(s)", flush=True)
    walls, others, summaries = [], [], []
    result = None
    for _ in range(runs):
        cpu_at_start = compare._cpu_snapshot()
        result, wall, error = _build_and_time(
            LARGE, lambda m, s: batchfit.estimate(m, s, memory_limit=LARGE.memory, for_device="cuda", amp="bf16")
        )
        others.append(compare.others_cpu_share(cpu_at_start))
        walls.append(wall)
        summaries.append(summary(result, wall, error))
    trials = [] if result is None else [[t.batch_size, t.kind, t.fits, t.steps] for t in result.trials]
    return {
        "case": LARGE.name,
        "model": (large_llama.__doc__ or "").strip().rstrip("."),
        "memory": LARGE.memory,
        "call": "estimate(model, sample, memory_limit='80GiB', for_device='cuda', amp='bf16')",
        "wall_s": walls,
        "best_wall_s": min(walls),
        "others_cpu_share": others,
        "verify_steps": Options().verify_steps,
        "estimate_cuda": summaries[-1],
        "trials": trials,
        "label": "modelled, not validated; no find(): the weights are on the meta device",
    }


def print_large(large: dict[str, Any]) -> None:
    e = large["estimate_cuda"]
    print(f"\nlarge model, {large['label']}:")
    print(f"  {large['model']}: {large['call']}, verify_steps={large['verify_steps']}")
    walls = ", ".join(f"{wall:.2f} s" for wall in large["wall_s"])
    shares = ", ".join("-" if share is None else f"{share:.0%}" for share in large["others_cpu_share"])
    print(f"  max batch {e['max_batch']}, safe batch {e['safe_batch']}, {e['trials']} trials")
    print(f"  wall {walls} (other processes' share of the cores: {shares})")
    trials = " ".join(f"({b} {k} {'T' if f else 'F'} {n})" for b, k, f, n in large["trials"])
    print(f"  trials (batch, kind, fits, steps): {trials}")


def warm_up() -> dict[str, float]:
    """First-use costs (imports, the fake-tensor machinery) paid once, here, and reported."""
    model, sample = examples.mlp(in_features=16, hidden=16, depth=1)
    _, find_s, _ = timed(lambda: batchfit.find(model, sample, memory_limit="8MiB", device="cpu", max_batch=64))
    _, estimate_s, _ = timed(
        lambda: batchfit.estimate(model, sample, memory_limit="8MiB", for_device="cpu", max_batch=64)
    )
    # reserve=0: the whole GiB is the allocator's (the default keeps 1 GiB aside for the CUDA context).
    _, cuda_s, _ = timed(
        lambda: batchfit.estimate(model, sample, memory_limit="1GiB", for_device="cuda", reserve=0, max_batch=64)
    )
    return {"find_s": find_s, "estimate_cpu_s": estimate_s, "estimate_cuda_s": cuda_s}


# Printing -----------------------------------------------------------------------------------------------
def _pair(side: dict[str, Any]) -> str:
    return "error" if side["max_batch"] is None else f"{side['max_batch']}/{side['safe_batch']}"


def print_table(cases: list[dict[str, Any]]) -> None:
    print("\nfind() vs estimate(for_device='cpu'): max/safe batch, trials, wall time; peak diff = largest")
    print("|estimate - find| / find of peak allocated bytes over the trials both ran (matched by size, kind);")
    print("phase diff = the same for the per-phase peaks (forward, backward, ...); others = other processes'")
    print("share of the machine's cores during the case (wall times under load mean less)")
    header = (
        f"{'case':<16}{'find max/safe':>14}{'tr':>4}{'find s':>8}{'est max/safe':>14}{'tr':>4}{'est s':>7}"
        f"{'equal':>7}{'same trials':>12}{'peak diff':>11}{'phase diff':>11}{'speedup':>9}{'extrap':>8}{'others':>8}"
    )
    print(header)
    for c in cases:
        f, e = c["find"], c["estimate_cpu"]
        diff = c.get("max_peak_rel_diff")
        speed = c.get("speedup")
        phase, others = c.get("max_phase_peak_rel_diff"), c["others_cpu_share"]
        print(
            f"{c['case']:<16}{_pair(f):>14}{f['trials'] or '-':>4}{f['wall_s']:>8.2f}{_pair(e):>14}"
            f"{e['trials'] or '-':>4}{e['wall_s']:>7.2f}{str(c.get('equal', '-')):>7}"
            f"{str(c.get('identical_trials', '-')):>12}"
            f"{('-' if diff is None else f'{diff:.2e}'):>11}{('-' if phase is None else f'{phase:.2e}'):>11}"
            f"{('-' if speed is None else f'{speed:.1f}x'):>9}{('yes' if e['extrapolated'] else 'no'):>8}"
            f"{('-' if others is None else f'{others:.0%}'):>8}"
        )
    for c in cases:
        if c.get("max_phase_peak_diff_at"):
            print(f"  {c['case']}: largest phase-peak difference: {c['max_phase_peak_diff_at']}")
    print(
        "\nestimate(for_device='cuda', reserve=0): modelled, not validated (no GPU here; compared with the "
        "CPU estimate)"
    )
    print("  reserved = largest reserved peak of a fitting trial; +cuBLAS = budget raised by the 66 MiB of workspaces")
    print(
        f"{'case':<16}{'budget':>11}{'cuda max/safe':>15}{'reserved':>12}{'est s':>7}"
        f"{'cpu max':>8}{'cpu peak':>12}{'cuda/cpu':>9}{'+cuBLAS max/safe':>18}{'reserved':>12}"
    )
    for c in cases:
        g, e, r = c["estimate_cuda"], c["estimate_cpu"], c["estimate_cuda_plus_cublas"]
        cuda_cell = "nothing fits" if g["max_batch"] is None else _pair(g)
        ratio = "-" if g["max_batch"] is None or not e["max_batch"] else f"{g['max_batch'] / e['max_batch']:.2f}"
        print(
            f"{c['case']:<16}{format_bytes(c['cap_bytes']):>11}{cuda_cell:>15}"
            f"{format_bytes(g['max_reserved_peak_bytes']):>12}{g['wall_s']:>7.2f}"
            f"{e['max_batch'] or '-':>8}{format_bytes(e['max_peak_bytes']):>12}{ratio:>9}"
            f"{('nothing fits' if r['max_batch'] is None else _pair(r)):>18}"
            f"{format_bytes(r['max_reserved_peak_bytes']):>12}"
        )
    hows = {c["estimate_cuda"]["how"] for c in cases} - {"reserve=0"}
    for how in sorted(hows):
        print(f"  note: {how}")


def print_big(big: dict[str, Any]) -> None:
    e = big["estimate_cuda"]
    print(f"\nbig model, {big['label']}:")
    print(f"  {big['model']} ({big['parameters'] / 1e6:.0f}M parameters), memory_limit={big['memory']}, device='cuda'")
    if e["max_batch"] is None:
        print(f"  {e['error']} in {e['wall_s']:.2f} s")
    else:
        print(
            f"  max batch {e['max_batch']}, safe batch {e['safe_batch']}, {e['trials']} trials, "
            f"{e['wall_s']:.2f} s, largest reserved peak {format_bytes(e['max_reserved_peak_bytes'])}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [case.name for case in CASES] + [BIG.name]
    parser.add_argument("--case", choices=names, action="append", help="only this case (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file")
    parser.add_argument("--no-json", action="store_true")
    parser.add_argument(
        "--large",
        action="store_true",
        help=f"only {LARGE.name}: the 1.5B Llama shape for an 80 GiB CUDA card in bf16, timed (JSON: estimate-large-*)",
    )
    parser.add_argument("--runs", type=int, default=2, help="with --large: how many times to time it (default 2)")
    args = parser.parse_args(argv)
    with_transformers = importlib.util.find_spec("transformers") is not None
    if with_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    meta = {
        **compare.stamp(argv),
        "machine": compare.machine(),
        "versions": {
            "torch": torch.__version__,
            "batchfit": batchfit.__version__,
            "transformers": transformers.__version__ if with_transformers else None,
        },
    }
    machine = meta["machine"]
    print(f"batchfit estimate() benchmark: {machine['cpu']}, {machine['cores']} cores; {meta['versions']}")
    first = warm_up()
    print(
        "first use (a tiny mlp, paid once before the cases): "
        + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in first.items())
    )
    if args.large:
        large = run_large(args.runs)
        print_large(large)
        document = {"schema": "batchfit.estimate-large-benchmark/1", **meta, "first_use": first, "large_model": large}
        if not args.no_json:
            compare.write_results(document, args.out, "estimate-large")
        return document
    selected = set(args.case or names)
    results, skipped = [], []
    for case in CASES:
        if case.name not in selected:
            continue
        if case.missing:
            print(f"== {case.name} skipped: {case.missing} is not installed")
            skipped.append(case.name)
            continue
        results.append(run_case(case))
    big = run_big() if BIG.name in selected else None
    meta["total_wall_s"] = time.perf_counter() - started
    if results:
        print_table(results)
    if big is not None:
        print_big(big)
    print(f"\ntotal {meta['total_wall_s']:.0f} s")
    document = {
        "schema": "batchfit.estimate-benchmark/1",
        **meta,
        "first_use": first,
        "cases": results,
        "big_model": big,
        "skipped_cases": skipped,
    }
    if not args.no_json:
        compare.write_results(document, args.out, "estimate-cpu")
    return document


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

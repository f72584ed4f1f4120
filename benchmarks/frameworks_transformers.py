"""HF ``Trainer(auto_find_batch_size=True)`` vs ``batchfit.transformers.autosize``: same model, data and CPU cap.

Run from the repository root: ``python benchmarks/frameworks_transformers.py --cap 64MiB --starts 2,128,512
--scan 60,73`` (``--scan``: a plain ``train()`` at each size, the truth for HF's own loop).

The cap is batchfit's live-tensor meter (as benchmarks/compare.py drives Accelerate's finder): HF's
_inner_training_loop (the function Accelerate's find_executable_batch_size retries) runs inside
prober.meter.tracking(), so every tensor HF's loop makes counts against the cap and the operation
that crosses it raises a real torch.OutOfMemoryError; Accelerate's retry wrapper sits outside it.
"""

import argparse
import datetime as _dt
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import batchfit
from batchfit.transformers import autosize

warnings.filterwarnings("ignore")
transformers.utils.logging.set_verbosity_error()
L = 64


class DS(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 1000, (n, L), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.mask = torch.ones(n, L, dtype=torch.long)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def model():
    torch.manual_seed(0)
    return BertForSequenceClassification(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=1000,
            max_position_embeddings=64,
        )
    )


def targs(out, bs, auto):
    return TrainingArguments(
        output_dir=out,
        use_cpu=True,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        per_device_train_batch_size=bs,
        disable_tqdm=True,
        auto_find_batch_size=auto,
    )


def hf(cap, start, data, auto=True):
    """HF's own finder (auto=True) from `start`, or one plain train() at `start` (auto=False): (found, tried)."""
    m = model()
    sample = {
        k: v[:2].clone() for k, v in {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}.items()
    }
    tried = []
    with batchfit.Prober(m, sample, memory_limit=cap) as prober, tempfile.TemporaryDirectory() as out:

        class Capped(Trainer):
            def _inner_training_loop(
                self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
            ):
                tried.append(batch_size if batch_size is not None else self._train_batch_size)
                with prober.meter.tracking():
                    return super()._inner_training_loop(
                        batch_size, args, resume_from_checkpoint, trial, ignore_keys_for_eval
                    )

        tr = Capped(model=m, args=targs(out, start, auto), train_dataset=data)
        try:
            tr.train()
            ok = tr.state.global_step == 2
        except torch.OutOfMemoryError:
            ok = False
        return (tr._train_batch_size if ok else None), tried


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cap", default="64MiB")
    p.add_argument("--starts", default="128,512")
    p.add_argument("--scan", default="", help="lo,hi: plain HF train() at each size under the cap")
    a = p.parse_args()
    data = DS(4096)
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer(model=model(), args=targs(out, 2, False), train_dataset=data)
        t = time.perf_counter()
        sized = autosize(tr, memory_limit=a.cap)
        print(f"batchfit autosize: {sized}; {len(sized.result.trials)} trials, {time.perf_counter() - t:.1f} s")
        print("  trials:", [(x.batch_size, x.fits, x.kind) for x in sized.result.trials])
    builtin = {}
    for start in map(int, a.starts.split(",")):
        t = time.perf_counter()
        found, tried = hf(a.cap, start, data)
        builtin[str(start)] = {"found": found, "tried": tried}
        print(f"HF auto_find_batch_size from {start}: {found}; tried {tried}; {time.perf_counter() - t:.1f} s")
    if a.scan:
        lo, hi = map(int, a.scan.split(","))
        for b in range(lo, hi + 1):
            found, _ = hf(a.cap, b, data, auto=False)
            print(f"  plain HF train() at {b}: {'fits' if found else 'OOM'}")
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    path = results / f"frameworks-transformers-cpu-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    document = {
        "schema": "batchfit.frameworks-benchmark/1",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "framework": "transformers " + transformers.__version__,
        "cap": a.cap,
        "batchfit": {"max_batch": sized.result.max_batch, "safe_batch": sized.result.safe_batch},
        "builtin": {"auto_find_batch_size_from": builtin},
    }
    path.write_text(json.dumps(document, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

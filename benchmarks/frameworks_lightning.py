"""Lightning's BatchSizeFinder (binsearch) vs batchfit.lightning.BatchFit on tests/test_lightning.py's
Classifier, under the same CPU live-tensor cap, the way benchmarks/compare.py drives Lightning's finder:
inside a batchfit Prober on the same model, the meter active while the DataLoader collates and inside
optimizer_step (training_step + backward + optimizer step).

Run from the repository root: ``python benchmarks/frameworks_lightning.py``."""

import datetime as _dt
import json
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path[:0] = [".", "tests"]
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402
from test_lightning import LIMIT, Classifier, dataset, trainer  # noqa: E402
from torch.utils.data import DataLoader, default_collate  # noqa: E402

import batchfit  # noqa: E402
from batchfit.lightning import BatchFit  # noqa: E402
from benchmarks.compare import cap_during  # noqa: E402

logging.getLogger("lightning").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
METER = None


class Capped(Classifier):
    def train_dataloader(self) -> DataLoader:
        def collate(items):
            with cap_during(METER):
                return default_collate(items)

        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=True, collate_fn=collate)

    def optimizer_step(self, *args, **kwargs):
        with cap_during(METER):
            super().optimizer_step(*args, **kwargs)


def lightning(**options) -> int:
    global METER
    model = Capped()
    sample = next(iter(DataLoader(dataset(), batch_size=4)))
    with batchfit.Prober(model, sample, memory_limit=LIMIT, step_fn=lambda m, b: m.training_step(b, 0)) as prober:
        METER = prober.meter
        return Tuner(trainer(max_epochs=1, max_steps=-1)).scale_batch_size(model, mode="binsearch", **options)


callback = BatchFit(memory_limit=LIMIT)
started = time.perf_counter()
trainer(callback, max_steps=0).fit(Classifier())  # the probe only (on_fit_start), no training steps
batchfit_s = time.perf_counter() - started
started = time.perf_counter()
found = lightning()
lightning_s = time.perf_counter() - started
result = callback.result
print(f"cap {LIMIT} (live tensor bytes)")
print(
    f"batchfit BatchFit: max_batch {result.max_batch}, safe_batch {result.safe_batch} (headroom 10%), "
    f"{len(result.trials)} trials, fit() {batchfit_s:.1f} s"
)
print(f"Lightning BatchSizeFinder binsearch, defaults (margin 5%, steps_per_trial 3): {found}, {lightning_s:.1f} s")
exact = lightning(margin=0.0)
print(f"Lightning BatchSizeFinder binsearch, margin=0: {exact}")
RESULTS = Path(__file__).resolve().parent / "results"
RESULTS.mkdir(exist_ok=True)
path = RESULTS / f"frameworks-lightning-cpu-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
document = {
    "schema": "batchfit.frameworks-benchmark/1",
    "date": _dt.datetime.now().isoformat(timespec="seconds"),
    "framework": "lightning " + pl.__version__,
    "cap": LIMIT,
    "batchfit": {"max_batch": result.max_batch, "safe_batch": result.safe_batch, "trials": len(result.trials)},
    "builtin": {"binsearch_default": found, "binsearch_margin_0": exact},
}
path.write_text(json.dumps(document, indent=1))
print(f"wrote {path}")

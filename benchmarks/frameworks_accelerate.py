"""Accelerate's ``find_executable_batch_size`` vs batchfit's drop-in, on one training function under
batchfit's CPU live-tensor cap (the rig of ``tests/test_accelerate_integration.py``: a small MLP, AdamW,
three steps per call, real out-of-memory errors at the cap).

Run from the repository root: ``python benchmarks/frameworks_accelerate.py``. Prints, per starting
size, what each returns and how many calls it made, beside the exact boundary (a size that fits
and the next that does not, called directly); writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path

sys.path[:0] = [".", "tests"]
import accelerate  # noqa: E402
from accelerate.utils import find_executable_batch_size as accelerates  # noqa: E402
from test_accelerate_integration import CAP, capped  # noqa: E402

from batchfit.accelerate import find_executable_batch_size  # noqa: E402

rows = []
with capped() as rig:
    for start in (256, 512, 1024):
        rig.calls.clear()
        theirs = accelerates(rig.without_probe(), starting_batch_size=start)()
        their_calls = len(rig.calls)
        ours = find_executable_batch_size(rig.with_probe(), starting_batch_size=start)
        ours()
        drop_in = find_executable_batch_size(rig.without_probe(), starting_batch_size=start)
        drop_in()
        boundary = ours.largest_fit
        assert boundary is not None and rig.fits(boundary) and not rig.fits(boundary + 1)
        rows.append({"start": start, "boundary": boundary, "accelerate": theirs, "accelerate_calls": their_calls,
                     "batchfit_probe": ours.batch_size, "batchfit_probe_calls": len(ours.trials),
                     "batchfit_without_probe": drop_in.batch_size})  # fmt: skip
print(f"cap {CAP} of live tensors; accelerate {accelerate.__version__}")
print(
    f"{'start':>6} {'boundary':>9} {'Accelerate':>11} {'calls':>6} {'batchfit probe':>15} {'calls':>6} {'no probe':>9}"
)
for r in rows:
    print(f"{r['start']:>6} {r['boundary']:>9} {r['accelerate']:>11} {r['accelerate_calls']:>6} "
          f"{r['batchfit_probe']:>15} {r['batchfit_probe_calls']:>6} {r['batchfit_without_probe']:>9}")  # fmt: skip
results = Path(__file__).resolve().parent / "results"
results.mkdir(exist_ok=True)
path = results / f"frameworks-accelerate-cpu-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
document = {"schema": "batchfit.frameworks-benchmark/1", "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "framework": "accelerate " + accelerate.__version__, "cap": CAP, "rows": rows}  # fmt: skip
path.write_text(json.dumps(document, indent=1))
print(f"wrote {path}")

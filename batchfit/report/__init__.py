"""What a probe reports: frozen records, the memory equation, throughput, JSON and text.

Pure Python (no torch import): a result can be loaded and read on a machine without torch.

* `batchfit.report.boundary`: the boundary every answer shares ([`Boundary`][batchfit.report.boundary.Boundary]:
  max and safe batch, verified, reached);
* `batchfit.report.records`: [`Trial`][batchfit.Trial], [`DeviceInfo`][batchfit.DeviceInfo],
  [`Settings`][batchfit.Settings], `SizedOn`, [`CacheHit`][batchfit.report.records.CacheHit];
* `batchfit.report.memory`: the fitted memory equation ([`MemoryModel`][batchfit.MemoryModel]);
* `batchfit.report.throughput`: the best size, the knee and the noise ([`Throughput`][batchfit.Throughput]);
* `batchfit.report.noise`: the gradient noise scale ([`NoiseScale`][batchfit.report.noise.NoiseScale])
  and its estimator;
* `batchfit.report.recommendation`: the batch to train with ([`Recommendation`][batchfit.Recommendation],
  `recommend`), by the rules of `recommendation_rules`;
* `batchfit.report.evaluation`, `batchfit.report.generation`: what ``find(eval=True)`` and
  ``mode="generate"`` add to a result ([`Evaluation`][batchfit.Evaluation], [`Generation`][batchfit.Generation]);
* `batchfit.report.uneven`: ranks that fit different batches: each rank's own answer
  ([`RankBatch`][batchfit.report.uneven.RankBatch]) and a global batch split unevenly over them
  ([`UnevenSplit`][batchfit.report.uneven.UnevenSplit]), with the loss weights that keep the mean;
* `batchfit.report.result`: [`Result`][batchfit.Result] and its versioned JSON document;
* `batchfit.report.codec`: reading a document back, every field checked against its type and
  the constraints its hint declares (`Batch`, `Bytes`, ...), for other records too, and JSON both
  ways for any record (`JsonRecord`);
* `batchfit.report.text`: ``str(result)`` and a device's one-line description;
* `batchfit.report.frontier`: [`Frontier`][batchfit.Frontier] (the largest batch per sequence length, the
  memory surface), with its text (`frontier_text`) and its image
  (`frontier_plot`, matplotlib imported only when one is drawn);
* `batchfit.report.varlen`: [`LengthPlan`][batchfit.LengthPlan] (buckets, a token budget and packing for
  variable-length data), with its text (`varlen_text`), the knobs frameworks take (`knobs`) and the
  arithmetic that chooses them (`bucketing`);
* `batchfit.report.checkpointing`: [`Fit`][batchfit.Fit] (the checkpointing policies measured and the one
  to train with), with its text and image (`checkpointing_text`).
"""

from batchfit._lazy import lazy_surface
from batchfit.report.checkpointing import Fit, Placement, Policy, PolicyRow
from batchfit.report.evaluation import Evaluation
from batchfit.report.frontier import Frontier, FrontierPoint, LongestLimit, Surface
from batchfit.report.generation import Generation
from batchfit.report.memory import MemoryModel, PhaseLine
from batchfit.report.noise import NoiseScale
from batchfit.report.recommendation import Recommendation, recommend
from batchfit.report.records import CacheHit, DeviceInfo, Phase, Settings, SizedOn, Trial, TrialKind, Unit
from batchfit.report.result import Result
from batchfit.report.text import device_text
from batchfit.report.throughput import Throughput
from batchfit.report.uneven import RankBatch, UnevenSplit
from batchfit.report.varlen import LengthPlan

__all__ = [
    "CacheHit",
    "DeviceInfo",
    "Evaluation",
    "Fit",
    "Frontier",
    "FrontierPoint",
    "Generation",
    "LengthPlan",
    "LongestLimit",
    "MemoryModel",
    "NoiseScale",
    "Phase",
    "PhaseLine",
    "Placement",
    "Policy",
    "PolicyRow",
    "RankBatch",
    "Recommendation",
    "Result",
    "Settings",
    "SizedOn",
    "Surface",
    "Throughput",
    "Trial",
    "TrialKind",
    "Unit",
    "UnevenSplit",
    "device_text",
    "recommend",
]

#: Names this surface exported before issue 33 that are internals: they still import, with a warning.
_MOVED = {
    **dict.fromkeys(("Batch", "Bytes", "Count", "Seconds", "read_document", "read_json"), "batchfit.report.codec"),
    **dict.fromkeys(("PlotUnavailableError", "save_frontier_plot"), "batchfit.report.frontier_plot"),
    "render_frontier": "batchfit.report.frontier_text",
    **dict.fromkeys(("is_warm", "warm_rates"), "batchfit.report.throughput"),
}

__getattr__, _ = lazy_surface(__name__, globals(), {}, _MOVED)

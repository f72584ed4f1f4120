"""What a probe reports: frozen records, the memory equation, throughput, JSON and text.

Pure Python (no torch import): a result can be loaded and read on a machine without torch.

* :mod:`batchfit.report.records`: :class:`Trial`, :class:`DeviceInfo`, :class:`Settings`,
  :class:`SizedOn`, :class:`CacheHit`;
* :mod:`batchfit.report.memory`: the fitted memory equation (:class:`MemoryModel`);
* :mod:`batchfit.report.throughput`: the best size, the knee and the noise (:class:`Throughput`);
* :mod:`batchfit.report.noise`: the gradient noise scale (:class:`NoiseScale`) and its estimator;
* :mod:`batchfit.report.recommendation`: the batch to train with (:class:`Recommendation`,
  :func:`recommend`), by the rules of :mod:`~batchfit.report.recommendation_rules`;
* :mod:`batchfit.report.result`: :class:`Result` and its versioned JSON document;
* :mod:`batchfit.report.codec`: reading a document back, every field checked against its type and
  the constraints its hint declares (:data:`Batch`, :data:`Bytes`, ...), for other records too;
* :mod:`batchfit.report.text`: ``str(result)`` and a device's one-line description;
* :mod:`batchfit.report.frontier`: :class:`Frontier` (the largest batch per sequence length, the
  memory surface), with its text (:mod:`~batchfit.report.frontier_text`) and its image
  (:mod:`~batchfit.report.frontier_plot`, matplotlib imported only when one is drawn).
"""

from batchfit.report.codec import Batch, Bytes, Count, Seconds, read_document, read_json
from batchfit.report.frontier import FRONTIER_SCHEMA, Frontier, FrontierPoint, LongestLimit, Surface
from batchfit.report.frontier_plot import PLOT_EXTRA, PlotUnavailableError, require_matplotlib, save_frontier_plot
from batchfit.report.frontier_text import (
    TABLE_TITLES,
    compact_rate,
    format_rate,
    headline_lines,
    point_cells,
    render_frontier,
    summary_rows,
    surface_equation,
)
from batchfit.report.memory import ON_LINE, MemoryModel, PhaseLine
from batchfit.report.noise import NoiseScale, NoiseSource
from batchfit.report.recommendation import Recommendation, recommend
from batchfit.report.records import (
    DEVICE_TYPES,
    PHASES,
    CacheHit,
    DeviceInfo,
    Phase,
    Settings,
    SizedOn,
    SizedOnSource,
    Trial,
    TrialKind,
    Unit,
)
from batchfit.report.result import SCHEMA, Result
from batchfit.report.text import device_text, render_text
from batchfit.report.throughput import KNEE_FRACTION, Throughput, best_timed, is_warm, warm_rates

__all__ = [
    "DEVICE_TYPES",
    "FRONTIER_SCHEMA",
    "KNEE_FRACTION",
    "ON_LINE",
    "PHASES",
    "PLOT_EXTRA",
    "SCHEMA",
    "TABLE_TITLES",
    "Batch",
    "Bytes",
    "CacheHit",
    "Count",
    "DeviceInfo",
    "Frontier",
    "FrontierPoint",
    "LongestLimit",
    "MemoryModel",
    "NoiseScale",
    "NoiseSource",
    "Phase",
    "PhaseLine",
    "PlotUnavailableError",
    "Recommendation",
    "Result",
    "Seconds",
    "Settings",
    "SizedOn",
    "SizedOnSource",
    "Surface",
    "Throughput",
    "Trial",
    "TrialKind",
    "Unit",
    "best_timed",
    "is_warm",
    "compact_rate",
    "device_text",
    "format_rate",
    "headline_lines",
    "point_cells",
    "read_document",
    "read_json",
    "recommend",
    "render_frontier",
    "render_text",
    "require_matplotlib",
    "save_frontier_plot",
    "summary_rows",
    "surface_equation",
    "warm_rates",
]

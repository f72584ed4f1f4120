"""What a probe reports: frozen records, the memory equation, throughput, JSON and text.

Pure Python (no torch import): a result can be loaded and read on a machine without torch.

* :mod:`batchfit.report.records`: :class:`Trial`, :class:`DeviceInfo`, :class:`Settings`;
* :mod:`batchfit.report.memory`: the fitted memory equation (:class:`MemoryModel`);
* :mod:`batchfit.report.throughput`: the best size, the knee and the noise (:class:`Throughput`);
* :mod:`batchfit.report.result`: :class:`Result` and its versioned JSON document;
* :mod:`batchfit.report.codec`: reading a document back, every field checked against its type and
  the constraints its hint declares (:data:`Batch`, :data:`Bytes`, ...), for other records too;
* :mod:`batchfit.report.text`: ``str(result)`` and a device's one-line description.
"""

from batchfit.report.codec import Batch, Bytes, Count, Seconds, read_document, read_json
from batchfit.report.memory import ON_LINE, MemoryModel, PhaseLine
from batchfit.report.records import DEVICE_TYPES, PHASES, DeviceInfo, Phase, Settings, Trial, TrialKind, Unit
from batchfit.report.result import SCHEMA, Result
from batchfit.report.text import device_text, render_text
from batchfit.report.throughput import KNEE_FRACTION, Throughput, best_timed

__all__ = [
    "DEVICE_TYPES",
    "KNEE_FRACTION",
    "ON_LINE",
    "PHASES",
    "SCHEMA",
    "Batch",
    "Bytes",
    "Count",
    "DeviceInfo",
    "MemoryModel",
    "Phase",
    "PhaseLine",
    "Result",
    "Seconds",
    "Settings",
    "Throughput",
    "Trial",
    "TrialKind",
    "Unit",
    "best_timed",
    "device_text",
    "read_document",
    "read_json",
    "render_text",
]

"""A loader scanned for the batch that drives memory: which batches are read, the worst of them,
and what the scan did not read.

What is read, at most ``limit`` batches (``None``: every batch of the epoch):

* a ``DataLoader`` over a map-style dataset whose batch sampler has a ``len()``: the sampler's
  index lists are read (that loads no item) and the batches picked are fetched by index, in this
  process, with the loader's own ``collate_fn``. The whole epoch when it has at most ``limit``
  batches; else ``limit`` of them spread evenly across it, its first and last included (a loader
  sorted by length, either way, holds its longest batch at one end);
* any other iterable of batches is drawn in order, ``limit`` batches, and on while the worst is
  in the last quarter of those drawn (the data still grows), up to ``EDGE_STRETCH x limit``.

What is trusted: the batch sampler's index lists are the epoch's (a shuffling sampler's are one
draw of it), the worst batch is the one whose rows hold the most elements (the first of equals),
and every batch holds the first's tensors (``batches.structure``): one that does not is another
input or another objective, refused by name. What is not: a batch not read. A scan that did not
read the whole epoch says so (`Scan.gap`), and its caller warns with it.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchfit.probe.batches import batch_size_of, check_structure, structure, tensor_leaves
from batchfit.report import SizedOn

__all__ = ["EDGE_STRETCH", "Scan", "scan", "spread", "warn_at_caller"]

#: An in-order scan whose worst batch is still in the last quarter of what it drew reads on, up to
#: this many times its ``limit``.
EDGE_STRETCH = 4
#: At least this many batches read, all of the first's shape: a loader of fixed shape (text packed
#: into blocks, images of one size), whose unread batches are not warned about, only noted.
ONE_SHAPE_EVIDENCE = 16
#: batchfit's own directory: a warning points at the first frame outside it (the user's line).
_PACKAGE = str(Path(__file__).resolve().parents[1])


@dataclass
class Scan:
    """What a scan of a loader read: the worst batch, which dims varied, and how much of the epoch.

    ``number`` is a batch's place in the loader's order (1: the first), read in order or not."""

    name: str
    total: int | None
    spread: bool = False
    scanned: int = 0
    ended: bool = False
    worst: Any = None
    worst_number: int = 0
    first: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the worst batch's
    varying: dict[str, list[int]] = field(default_factory=dict)
    structure: dict[str, int] = field(default_factory=dict)
    worst_elements: int = 0
    worst_rows: int = 1

    def add(self, number: int, batch: Any) -> None:
        """Take one more batch: refuse another structure, note the dims that differ from the
        first's, keep it if its rows hold more elements than the worst's so far."""
        what = f"batch {number} of the sample {self.name}"
        rows = batch_size_of(batch, what)
        if not self.scanned:
            self.structure = structure(batch)
        check_structure(
            self.structure,
            batch,
            what,
            "a probe sizes on one batch and repeats its rows, so every batch must hold the same tensors; pass a "
            "loader whose batches do",
        )
        shapes = {path: tuple(tensor.shape) for path, tensor in tensor_leaves(batch, "sample")}
        elements = sum(tensor.numel() for _, tensor in tensor_leaves(batch, "sample"))
        if not self.scanned:
            self.first = shapes
        self.scanned += 1
        for path, shape in shapes.items():
            for dim in range(1, len(shape)):
                if shape[dim] != self.first[path][dim] and dim not in self.varying.setdefault(path, []):
                    self.varying[path].append(dim)
        if self.worst is None or elements * self.worst_rows > self.worst_elements * rows:
            self.worst, self.worst_number, self.shapes = batch, number, shapes
            self.worst_elements, self.worst_rows = elements, rows

    def one_shape(self) -> bool:
        """Whether every batch read (`ONE_SHAPE_EVIDENCE` or more) had the first's shape."""
        return self.scanned >= ONE_SHAPE_EVIDENCE and not any(self.varying.values())

    def at_edge(self, drawn: int) -> bool:
        """Whether the worst is in the last quarter of the ``drawn`` batches: the data still grows."""
        return self.worst_number > drawn - max(1, drawn // 4)

    def main(self) -> tuple[str, int] | None:
        """The varying tensor and dim the notes name: the first in the worst batch's order."""
        for path in self.shapes:
            if self.varying.get(path):
                return path, self.varying[path][0]
        return None

    def record(self) -> SizedOn:
        main = self.main()
        leaf, dim = main if main is not None else (None, None)
        return SizedOn(
            source="loader scan",
            batches_scanned=self.scanned,
            total_batches=self.total,
            leaf=leaf,
            dim=dim,
            length=self.shapes[leaf][dim] if leaf is not None and dim is not None else None,
            first_length=self.first[leaf][dim] if leaf is not None and dim is not None else None,
            batch_number=self.worst_number,
        )

    def seen(self) -> str:
        plural = "es" if self.scanned != 1 else ""
        return f"{self.scanned:,} batch{plural} scanned" + (f" (of {self.total:,})" if self.total is not None else "")

    def gap(self) -> str | None:
        """What the scan did not read, and what that risks; ``None`` when it read the whole epoch.
        What to pass instead is the caller's to say (`batchfit.probe.real_data`, which reads the options)."""
        if self.ended or (self.total is not None and self.scanned >= self.total):
            return None
        if self.spread and self.total is not None:
            read = (
                f"the scan read {self.scanned:,} of the {self.name}'s {self.total:,} batches, spread across the epoch "
                f"(its first and last included): a longer batch may be among the {self.total - self.scanned:,} not read"
            )
        else:
            read = f"the scan read the first {self.scanned:,} batches of the {self.name}" + (
                f" (of {self.total:,})" if self.total is not None else ", not to its end"
            )
            if self.at_edge(self.scanned):
                read += f", and they were still growing (its worst was batch {self.worst_number:,}, near its end)"
            else:
                read += ": a longer batch may come later"
        return f"{read}; a batch longer than the worst read runs out of memory at a size this answer calls safe"


def scan(loader: Any, limit: int | None) -> Scan:
    """Read ``loader`` as the module says: by index where its batch sampler allows, else in order."""
    name = type(loader).__name__
    total = _indexed_batches(loader)
    result = _by_index(loader, name, total, limit) if total is not None else _in_order(loader, name, limit)
    for dims in result.varying.values():
        dims.sort()
    return result


def spread(total: int, limit: int | None) -> list[int]:
    """Which of ``total`` batches to read (0-based): every one when ``limit`` allows, else
    ``limit`` of them spread evenly, the first and last included (``limit=1``: the first)."""
    if limit is None or total <= limit:
        return list(range(total))
    if limit == 1:
        return [0]
    return [round(k * (total - 1) / (limit - 1)) for k in range(limit)]  # steps > 1: no two alike


def warn_at_caller(message: str) -> None:
    """``warnings.warn`` (a ``UserWarning``) pointed at the first caller outside batchfit: the
    line of the user's that asked for the probe, whichever entry point it went through."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _indexed_batches(loader: Any) -> int | None:
    """How many batches the loader's epoch has, where its batches can be fetched by index: a
    ``DataLoader`` over a map-style dataset with a sized batch sampler; else ``None``."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
        return None
    if isinstance(loader.dataset, IterableDataset):
        return None
    try:
        return len(loader.batch_sampler)
    except (TypeError, NotImplementedError):
        return None


def _by_index(loader: Any, name: str, total: int, limit: int | None) -> Scan:
    """The batches `spread` picks, fetched by their index lists as the loader's own fetch
    does (``__getitems__`` where the dataset has it, then ``collate_fn``)."""
    positions = spread(total, limit)
    result = Scan(name, total, spread=len(positions) < total)
    wanted = iter(positions)
    next_position = next(wanted, None)
    dataset = loader.dataset
    many = getattr(dataset, "__getitems__", None)
    for position, indices in enumerate(loader.batch_sampler):
        if next_position is None:
            break
        if position != next_position:
            continue
        items = many(list(indices)) if many else [dataset[index] for index in indices]
        result.add(position + 1, loader.collate_fn(items))
        next_position = next(wanted, None)
    result.ended = result.scanned == total
    return result


def _in_order(loader: Any, name: str, limit: int | None) -> Scan:
    """Draw in order, ``limit`` batches and on while the worst is at the edge (module docs)."""
    result = Scan(name, _length_of(loader))
    iterator = iter(loader)
    try:
        for number in itertools.count(1):
            drawn = number - 1
            if limit is not None and drawn >= limit and (drawn >= EDGE_STRETCH * limit or not result.at_edge(drawn)):
                break
            try:
                batch = next(iterator)
            except StopIteration:
                result.ended = True
                break
            result.add(number, batch)
            del batch
    finally:
        del iterator  # a loader's worker processes end with their iterator
    return result


def _length_of(loader: Any) -> int | None:
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None

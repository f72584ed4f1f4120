"""Batches as trees of tensors: find their leaves, their batch size and structure, move and tile them.

A sample is a tensor, or tuples, lists and mappings (a Hugging Face ``BatchEncoding`` too) of
them, nested; dim 0 of every tensor is the batch. Everything that reads or rebuilds a batch goes
through here, so every entry point agrees on what a batch is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch


def tensor_leaves(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested tuple/list/mapping, with a readable path like ``sample['ids']``."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from tensor_leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (tuple, list)):
        for index, value in enumerate(obj):
            yield from tensor_leaves(value, f"{path}[{index}]")


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/mapping, keeping the containers.

    Mappings become plain dicts (Hugging Face ``BatchEncoding`` is a mapping and ``model(**d)``
    only needs the keys); named tuples keep their type.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {key: map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(value, fn) for value in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(value, fn) for value in obj)
    return obj


def batch_size_of(batch: Any, what: str = "sample") -> int:
    """The common leading dimension of every tensor in ``batch``; a clear error if there is none."""
    if batch is None:
        raise ValueError(
            f"the {what} is None: a batch is a tensor, or a tuple/list/dict of tensors whose first dimension is "
            "the batch; does the collate function (or the generator) return the batch it builds?"
        )
    leaves = list(tensor_leaves(batch, what))
    if not leaves:
        raise ValueError(
            f"the {what} holds no tensor: pass a tensor, or a tuple/list/dict of tensors whose "
            f"first dimension is the batch (got {type(batch).__name__})"
        )
    sizes: dict[int, list[str]] = {}
    for path, tensor in leaves:
        if tensor.dim() == 0:
            raise ValueError(f"{path} is a 0-dim tensor: every tensor in the {what} needs a batch dimension")
        sizes.setdefault(tensor.shape[0], []).append(path)
    if len(sizes) > 1:
        detail = "; ".join(f"{', '.join(paths)}: {size}" for size, paths in sorted(sizes.items()))
        raise ValueError(f"the tensors of the {what} disagree on the batch size (dim 0): {detail}")
    (size,) = sizes
    if size == 0:
        raise ValueError(f"the {what} is empty: its tensors have batch size 0")
    return size


def structure(batch: Any) -> dict[str, int]:
    """What a batch is made of: each tensor's path and number of dims. The batches of one source
    share it: one made of other tensors is another input, or another objective (no ``labels``: no
    loss), and neither a probe nor the noise scale can stand for both at once."""
    return {path: tensor.dim() for path, tensor in tensor_leaves(batch, "batch")}


def check_structure(first: Mapping[str, int], batch: Any, what: str, why: str) -> None:
    """``ValueError`` when ``batch`` is made of other tensors than ``first`` (a `structure`):
    it names ``what`` (the batch), what differs, and ``why`` that matters to the caller. The order
    of a mapping's keys does not count."""
    now = structure(batch)
    said = [f"no {path}" for path in first if path not in now]
    said += [f"{path}, which the first has not" for path in now if path not in first]
    said += [f"{path} of {now[path]} dims, not {dims}" for path, dims in first.items() if now.get(path, dims) != dims]
    if said:
        raise ValueError(f"{what} differs in structure from its first batch ({'; '.join(said)}): {why}")


#: What to do with a ``make_batch`` of meta tensors (`check_has_values`), wherever a real step needs it.
META_BATCH = (
    "build the batches on the CPU or the device, as a real step trains on their values "
    "(batchfit.estimate(model, make_batch=...) sizes from meta tensors, without a step)"
)


def check_has_values(batch: Any, what: str, instead: str) -> None:
    """Refuse a batch on the ``meta`` device: a real step copies and trains on its values, which
    it has none of (torch's own "Cannot copy out of meta tensor" names neither the batch nor what to
    do). ``what`` names the batch in the paths, ``instead`` says what to pass."""
    for path, tensor in tensor_leaves(batch, what):
        if tensor.is_meta:
            raise ValueError(f"{path} is on the meta device, which holds no data: {instead}")


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch on ``device``, detached from any autograd graph: the probe never backpropagates
    into (or leaves a ``.grad`` on) the user's sample. Inference tensors (made under
    ``torch.inference_mode()``) are cloned into ordinary ones, which a training step can save."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.detach().to(device)
        return moved.clone() if moved.is_inference() else moved

    with torch.inference_mode(False):
        return map_tensors(batch, move)


def tile(sample: Any, batch_size: int, sample_size: int) -> Any:
    """A batch of ``batch_size`` rows built by repeating the sample's rows along dim 0.

    Every tensor is a fresh contiguous allocation (``index_select``), so the batch costs the
    memory a real batch of that size costs.
    """
    index = torch.arange(batch_size) % sample_size

    def grow(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(0, index.to(tensor.device))

    return map_tensors(sample, grow)


def spread(batch: Any) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """The arguments a batch is called with: `model(x)`, `model(*x)` or `model(**x)`."""
    if isinstance(batch, Mapping):
        return (), batch
    if isinstance(batch, (tuple, list)):
        return batch, {}
    return (batch,), {}

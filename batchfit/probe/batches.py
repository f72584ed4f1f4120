"""Batches as trees of tensors: find their leaves, their batch size, move and tile them.

A sample is a tensor, or tuples, lists and mappings (a Hugging Face ``BatchEncoding`` too) of
them, nested; dim 0 of every tensor is the batch. Everything that reads or rebuilds a batch goes
through here, so every entry point agrees on what a batch is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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

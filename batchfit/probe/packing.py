"""Packed rows: documents end to end in a row, positions restarting at each (varlen attention).

Why: transformers' ``DataCollatorWithFlattening`` and torchtune's packed datasets hand the model
rows of several documents with ``position_ids`` that restart at each document and no
``attention_mask``; attention that reads them (flash-attention's varlen kernel, transformers'
block-causal mask from packed positions) keeps each document to itself. A packed batch is built
here from the user's ``make_batch`` at the packed length, so its memory is measured as training
sees it, with the documents drawn from the data's own lengths.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["check_takes_positions", "packed_batches"]

#: Documents drawn from the length distribution to fill packed rows (cycled).
DRAWN = 4096


def check_takes_positions(model: nn.Module) -> None:
    """``ValueError`` unless the model's ``forward`` takes ``position_ids``: packing restarts them
    at each document, and a model that cannot take them attends across documents."""
    forward = getattr(model, "forward", None)
    try:
        parameters = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    if "position_ids" not in parameters:
        raise ValueError(
            f"packing needs a model whose forward takes position_ids (packed rows restart them at each document, "
            f"so attention keeps each to itself); {type(model).__name__}.forward takes "
            f"({', '.join(parameters) or 'nothing readable'}): size buckets or a token budget instead "
            "(pack_length=None)"
        )


def packed_batches(
    make_batch: Callable[[int, int], Any], histogram: Mapping[int, int], seed: int = 0
) -> Callable[[int, int], Any]:
    """``make_batch`` whose rows are packed: ``position_ids`` restarting at each document (their
    lengths drawn from ``histogram``), no ``attention_mask`` (as a flattening collator gives)."""
    lengths = torch.tensor(list(histogram), dtype=torch.long)
    weights = torch.tensor(list(histogram.values()), dtype=torch.double)
    generator = torch.Generator().manual_seed(seed)
    drawn = lengths[torch.multinomial(weights, DRAWN, replacement=True, generator=generator)].tolist()

    def packed(batch_size: int, seq_len: int) -> Any:
        batch = make_batch(batch_size, seq_len)
        if not isinstance(batch, Mapping):
            raise ValueError(
                "packing adds position_ids to the batch: make_batch must build a dict of tensors, "
                f"got {type(batch).__name__}"
            )
        positions = torch.empty(batch_size, seq_len, dtype=torch.long)
        at = 0
        for row in range(batch_size):
            filled = 0
            while filled < seq_len:
                length = min(drawn[at % DRAWN], seq_len - filled)
                positions[row, filled : filled + length] = torch.arange(length)
                filled, at = filled + length, at + 1
        reference = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
        if reference is not None:
            positions = positions.to(reference.device)
        return {**{k: v for k, v in batch.items() if k != "attention_mask"}, "position_ids": positions}

    return packed

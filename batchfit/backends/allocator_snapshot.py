"""Read a caching allocator's memory snapshot (``torch.cuda.memory_snapshot()``): the block each live tensor occupies.

Why: the allocator hands a tensor a *block*, which can be bigger than the tensor's bytes rounded to
512: the large pool keeps a remainder of up to 1 MiB inside the block rather than split it off
(``should_split`` in ``c10/cuda/CUDACachingAllocator.cpp``), and a ``max_split_size_mb`` block can
serve a request up to 20 MiB smaller. ``torch.cuda.memory_allocated()`` counts those blocks. A meter
that counts the tensors it knows of in 512-byte rounding instead comes up short of that statistic,
and the difference reads as memory leaked (on GPT-2-small, about 12 MiB of AdamW state sits in such
remainders). `block_bytes_by_address` gives each live block's size by its address, which is
a storage's ``data_ptr()``, so a meter counts what the allocator counts.

The format is torch's (``torch/csrc/cuda/Module.cpp``, ``_cuda_memorySnapshot``, and the
``DeviceCachingAllocator::snapshot`` behind it): a list of segments by address, each with its
blocks in address order, an expandable segment as one entry per mapped range;
`SnapshotSegment` and `SnapshotBlock` name the keys. `snapshot_of` writes it
for the allocator model (``CachingAllocatorModel.snapshot()``), so what reads a GPU's snapshot can
be tested on the model's.

Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypedDict

from batchfit.backends.allocator_blocks import Block

__all__ = ["BlockState", "SnapshotBlock", "SnapshotSegment", "block_bytes_by_address", "snapshot_of"]

#: ``active_allocated``: held by a tensor; ``active_pending_free``: freed, waiting for another
#: stream's work (counted as allocated by no statistic); ``inactive``: cached, free.
BlockState = Literal["active_allocated", "active_pending_free", "inactive"]


class SnapshotBlock(TypedDict):
    """One block of a segment: a piece handed out, or cached free."""

    address: int
    size: int
    requested_size: int
    state: BlockState
    frames: list[Any]


class SnapshotSegment(TypedDict):
    """One segment (a ``cudaMalloc``, or one mapped range of an expandable segment) and its blocks."""

    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    requested_size: int
    stream: int
    segment_type: Literal["small", "large"]
    segment_pool_id: tuple[int, int]
    is_expandable: bool
    frames: list[Any]
    blocks: list[SnapshotBlock]


def block_bytes_by_address(snapshot: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """The size of every ``active_allocated`` block of ``snapshot``, by the block's address.

    A block's address is its ``address`` where the snapshot gives one, else its segment's address
    plus the sizes of the blocks before it (snapshots rebuilt from a trace by
    ``torch.cuda._memory_viz`` leave block addresses out). The values sum to what
    ``torch.cuda.memory_allocated()`` says for the snapshot's pools.
    """
    sizes: dict[int, int] = {}
    for segment in snapshot:
        address = int(segment["address"])
        for block in segment["blocks"]:
            size = int(block["size"])
            start = int(block.get("address", address))
            if block["state"] == "active_allocated":
                sizes[start] = size
            address = start + size
    return sizes


def snapshot_of(blocks: Iterable[Block]) -> list[SnapshotSegment]:
    """The snapshot of the segments that ``blocks`` (every mapped block of the model: cached and
    allocated) tile, by address. A cached block's ``requested_size`` is 0 (torch keeps its last
    request's); device, stream and memory pool are 0, as for the default pool of device 0."""
    mapped = list(blocks)
    heads = sorted((b for b in mapped if b.prev is None or not b.prev.mapped), key=lambda b: b.addr)
    segments: list[SnapshotSegment] = []
    for head in heads:
        listed: list[SnapshotBlock] = []
        block: Block | None = head
        while block is not None and block.mapped:
            state: BlockState = "active_allocated" if block.allocated else "inactive"  # one stream: no pending
            size, requested = block.size, block.nbytes
            listed.append(
                SnapshotBlock(address=block.addr, size=size, requested_size=requested, state=state, frames=[])
            )
            block = block.next
        allocated = sum(b["size"] for b in listed if b["state"] == "active_allocated")
        segments.append(
            {
                "device": 0,
                "address": head.addr,
                "total_size": sum(b["size"] for b in listed),
                "allocated_size": allocated,
                "active_size": allocated,
                "requested_size": sum(b["requested_size"] for b in listed),
                "stream": 0,
                "segment_type": "small" if head.segment.small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": head.segment.expandable,
                "frames": [],
                "blocks": listed,
            }
        )
    return segments

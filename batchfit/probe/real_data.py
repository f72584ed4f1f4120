"""The batch that drives memory, picked from the user's real data.

A probe builds every batch size by repeating one batch's rows along dim 0, so its answer holds
for what that batch holds. With variable-length data the first batch of a loader is the wrong
one: a loader sorted or bucketed by length hands out its short batches first, and an answer
sized on them runs out of memory at the first long batch. `worst_batch` picks the batch to
size on instead:

* a plain batch (a tensor, mapping, tuple or list) is used as it is;
* a loader whose dataset declares its items' ``lengths`` (most bucketing datasets keep them, and
  Hugging Face's ``LengthGroupedSampler`` on the loader's sampler; a ``datasets.Dataset`` with a
  ``length`` column too) gives its longest item, collated alone by the loader's own
  ``collate_fn``: no other item is loaded;
* any other loader (or iterable of batches) is scanned (`scan`: the whole
  epoch where ``scan_batches`` allows, else batches spread across it, or drawn in order while the
  data still grows), and the batch whose rows hold the most elements wins (the first of equals):
  its real rows, padded as the user's collate function padded them. A scan that did not read the
  whole epoch says so, in the note and in a ``UserWarning`` that names what to pass;
* ``seq_len=`` sizes on exactly that length instead: the chosen rows are cut to it, or extended
  by repeating their own content along the sequence dimension (never with invented values).

It says what it chose in a note and in a `SizedOn` for the result.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchfit.probe.batches import batch_size_of, map_tensors, tensor_leaves
from batchfit.probe.scan import Scan, scan, warn_at_caller
from batchfit.report import SizedOn

if TYPE_CHECKING:
    from batchfit.probe.options import Options

__all__ = ["at_length", "generators_kept", "is_batch_source", "loader_lengths", "sequence_dims", "worst_batch"]

#: What to pass when a scan did not read the whole epoch (`Scan.gap` says what it missed).
_SCAN_ADVICE = (
    "Pass scan_batches=None to read every batch, seq_len= the longest length you train with, or a DataLoader whose "
    "dataset declares `lengths` (one per item: its longest item is read alone)"
)

#: Where the sizes come from, said once in every note.
_REPEATED = "repeated along dim 0 to build every size"


def worst_batch(
    sample: Any,
    options: Options | None = None,
    *,
    scan_batches: int | None = 64,
    seq_len: int | None = None,
    keep_rng: bool = True,
) -> tuple[Any, str | None, SizedOn | None]:
    """The batch to size on, the note that says what it is, and the record for the result.

    ``sample``: a batch, a ``DataLoader`` or any other iterable of batches, or ``None`` (the
    probe builds batches with ``make_batch``). ``options``: the probe's, which say the three
    below (``restore_rng`` is ``keep_rng``); the keywords are for a caller without them.
    ``scan_batches``: how many batches a scan reads
    (``None``: the whole epoch; `scan`). ``seq_len``: the sequence length to
    size on. ``keep_rng``: draw on copies of the random generators (a loader's iterator seeds
    itself from torch's), so they come back as they were (`generators_kept`). A scan that
    did not read the whole epoch says so in the note and in a ``UserWarning``, unless ``seq_len``
    fixed the length.
    """
    if options is not None:
        scan_batches, seq_len, keep_rng = options.scan_batches, options.seq_len, options.restore_rng
    if sample is None:
        if seq_len is None:
            return None, None, None
        note = f"make_batch(batch_size, {seq_len}) builds every batch at seq_len={seq_len:,}"
        return None, note, SizedOn(source="seq_len", length=seq_len)
    if not is_batch_source(sample):
        return _given_batch(sample, seq_len)
    name = type(sample).__name__
    with generators_kept(sample) if keep_rng else contextlib.nullcontext():
        longest = _longest_by_lengths(sample)
        scanned = scan(sample, scan_batches) if longest is None else None
    if longest is not None:
        return _from_lengths(longest, name, seq_len)
    assert scanned is not None
    if scanned.scanned == 0:
        raise ValueError(f"the sample {name} yielded no batch: it is empty")
    if seq_len is not None:
        return _scan_at_length(scanned, seq_len)
    record = scanned.record()
    note = _scan_note(scanned, record)
    gap = scanned.gap()
    if gap is not None:
        gap += f". {_SCAN_ADVICE}"
        note += f"; {gap}"
        if not scanned.one_shape():  # a loader of one shape throughout is said in the note alone
            warn_at_caller(f"batchfit: {gap}")
    return scanned.worst, note, record


def is_batch_source(sample: Any) -> bool:
    """Whether ``sample`` hands out batches (a ``DataLoader``, any iterable that is not itself a
    batch) rather than being one."""
    from torch.utils.data import DataLoader

    if sample is None or isinstance(sample, (torch.Tensor, Mapping, tuple, list, str, bytes)):
        return False
    return isinstance(sample, DataLoader) or hasattr(sample, "__iter__")


def sequence_dims(batch: Any, seq_len: int | None = None) -> dict[str, int]:
    """The sequence dimension of each tensor of one batch: the one dim >= 1 that every tensor of
    rank >= 2 has, with the same size (``input_ids``, ``attention_mask`` and ``labels``, all
    ``(B, S)``). Tensors of rank 1 (a class label per row) have none. ``ValueError`` naming the
    tensors and their shapes when no such dim, or more than one, exists."""
    leaves = list(tensor_leaves(batch, "sample"))
    ranked = [(path, tensor) for path, tensor in leaves if tensor.dim() >= 2]
    shapes = ", ".join(f"{path} {tuple(tensor.shape)}" for path, tensor in leaves) or "no tensor"
    asked = f"seq_len={seq_len:,}" if seq_len is not None else "the sequence length"
    if not ranked:
        raise ValueError(f"{asked}: no tensor of the sample has a dimension beyond the batch ({shapes})")
    rank = min(tensor.dim() for _, tensor in ranked)
    shared = [d for d in range(1, rank) if len({tensor.shape[d] for _, tensor in ranked}) == 1]
    if len(shared) != 1:
        which = "no dim >= 1 is" if not shared else f"dims {', '.join(map(str, shared))} all are"
        raise ValueError(
            f"{asked}: cannot tell which dimension of the sample is the sequence, as {which} shared by every "
            f"tensor of rank >= 2 ({shapes}): pass make_batch= "
            "(see docs/how-to/real-data.md#seq_len-the-length-you-know-better)"
        )
    return {path: shared[0] for path, _ in ranked}


def at_length(batch: Any, dims: Mapping[str, int], seq_len: int) -> Any:
    """``batch`` with each tensor named in ``dims`` made exactly ``seq_len`` long along its dim:
    cut when longer, extended by repeating its own content when shorter (as `tile` repeats
    rows along dim 0). Every such tensor is a fresh allocation, as a real batch of that length."""
    paths = iter([path for path, _ in tensor_leaves(batch, "sample")])

    def resize(tensor: torch.Tensor) -> torch.Tensor:
        dim = dims.get(next(paths))
        if dim is None:
            return tensor
        index = torch.arange(seq_len, device=tensor.device) % tensor.shape[dim]
        return tensor.index_select(dim, index)

    return map_tensors(batch, resize)


@contextlib.contextmanager
def generators_kept(loader: Any) -> Iterator[None]:
    """torch's CPU generator and the generators a loader and its samplers own, as they were.

    Drawing batches moves random generators even without shuffling: a ``DataLoader``'s iterator
    draws its base seed from torch's CPU generator (or the loader's ``generator``), and a
    ``RandomSampler`` draws from the global generator or its own."""
    owned = [
        getattr(holder, "generator", None)
        for holder in (
            loader,
            getattr(loader, "sampler", None),
            getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        )
    ]
    generators = {id(g): g for g in owned if isinstance(g, torch.Generator)}
    states = [(g, g.get_state()) for g in generators.values()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            for generator, state in states:
                generator.set_state(state)


# A plain batch ---------------------------------------------------------------------------------------
def _given_batch(sample: Any, seq_len: int | None) -> tuple[Any, str | None, SizedOn | None]:
    if seq_len is None:
        return sample, None, None
    dims = sequence_dims(sample, seq_len)
    leaf, dim = next(iter(dims.items()))
    had = dict(tensor_leaves(sample, "sample"))[leaf].shape[dim]
    note = f"sample: {_resized(had, seq_len, leaf, dim)}, {_REPEATED}"
    return (
        at_length(sample, dims, seq_len),
        note,
        SizedOn(source="seq_len", leaf=leaf, dim=dim, length=seq_len, first_length=had),
    )


def _resized(had: int, seq_len: int, leaf: str, dim: int) -> str:
    if had == seq_len:
        how = "as it is"
    elif had > seq_len:
        how = "cut to it"
    else:
        how = "its own tokens repeated along the sequence to reach it"
    return f"built at seq_len={seq_len:,} from rows of length {had:,} (dim {dim} of {leaf}; {how})"


# A loader whose dataset declares its lengths ---------------------------------------------------------
@dataclass(frozen=True)
class _Longest:
    batch: Any
    index: int
    declared: int
    items: int
    lengths: list[int]  # every item's, as declared


def _longest_by_lengths(loader: Any) -> _Longest | None:
    """The longest item of a map-style dataset that declares its lengths, collated alone by the
    loader's own ``collate_fn``; ``None`` where the lengths are not there to read."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
        return None
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return None
    lengths = _declared_lengths(dataset)
    if lengths is None:  # Hugging Face's LengthGroupedSampler keeps the dataset's lengths itself
        lengths = _declared_lengths(getattr(loader, "sampler", None))
    try:
        items = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if not lengths or len(lengths) != items:
        return None
    index = max(range(items), key=lengths.__getitem__)  # the first of the longest
    return _Longest(loader.collate_fn([dataset[index]]), index, lengths[index], items, lengths)


def loader_lengths(loader: Any) -> tuple[list[int], Any, dict[str, int]] | None:
    """A loader's declared lengths (its dataset's ``lengths`` or ``length`` column), its longest
    item collated alone, and that batch's sequence dims; ``None`` where none are declared. A
    ``ValueError`` when the longest item does not collate to the length declared for it: lengths
    that disagree with the batches the loader yields size the wrong rows."""
    longest = _longest_by_lengths(loader)
    if longest is None:
        return None
    dims = sequence_dims(longest.batch, longest.declared)
    leaf, dim = next(iter(dims.items()))
    built = dict(tensor_leaves(longest.batch, "sample"))[leaf].shape[dim]
    if built != longest.declared:
        raise ValueError(
            f"the dataset's lengths disagree with the batches the loader yields: item {longest.index:,} is declared "
            f"{longest.declared:,} long, and collated alone it is {built:,} (dim {dim} of {leaf}); give lengths= "
            "as the collated lengths (a pad_to_multiple_of rounds them up)"
        )
    return longest.lengths, longest.batch, dims


def _declared_lengths(dataset: Any) -> list[int] | None:
    """A dataset's (or a length-grouped sampler's) ``lengths`` (a sequence of ints), or a Hugging
    Face dataset's ``length`` column; ``None`` when it has neither (reading them loads no item)."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is None and "length" in (getattr(dataset, "column_names", None) or ()):
        with contextlib.suppress(Exception):  # a column that cannot be read is no column
            lengths = dataset["length"]
    if lengths is None or isinstance(lengths, (str, bytes, Mapping)) or not hasattr(lengths, "__len__"):
        return None
    try:
        return [operator.index(value) for value in lengths]
    except TypeError:
        return None


def _from_lengths(longest: _Longest, name: str, seq_len: int | None) -> tuple[Any, str, SizedOn]:
    batch = longest.batch
    try:
        dims: dict[str, int] | None = sequence_dims(batch, seq_len)
    except ValueError:
        if seq_len is not None:
            raise
        dims = None
    leaf, dim = next(iter(dims.items())) if dims else (None, None)
    length = dict(tensor_leaves(batch, "sample"))[leaf].shape[dim] if leaf is not None and dim is not None else None
    said = (
        f"sample: the longest of the {longest.items:,} samples by the dataset's lengths (sample {longest.index:,}, "
        f"length {longest.declared:,}), collated alone by the {name}'s collate function"
    )
    if length is not None:
        said += f" to length {length:,} (dim {dim} of {leaf})"
    record = SizedOn(
        source="dataset lengths",
        leaf=leaf,
        dim=dim,
        length=length,
        dataset_size=longest.items,
        dataset_length=longest.declared,
    )
    if seq_len is not None and dims is not None and length is not None and leaf is not None and dim is not None:
        said += f"; {_resized(length, seq_len, leaf, dim)}"
        batch = at_length(batch, dims, seq_len)
        record = SizedOn(
            source="seq_len",
            leaf=leaf,
            dim=dim,
            length=seq_len,
            dataset_size=longest.items,
            dataset_length=longest.declared,
        )
    return batch, f"{said}; no batch was scanned; its row is {_REPEATED}", record


# Any other loader: a scan (batchfit.probe.scan) ----------------------------------------------------------
def _scan_note(scan: Scan, record: SizedOn) -> str:
    rows = batch_size_of(scan.worst)
    main = scan.main()
    if main is None:
        which = "first batch" if scan.worst_number == 1 else f"batch {scan.worst_number} (its rows hold the most)"
        same = f"the {scan.seen()} have the same shapes"
        return f"sample: the {which} of the {scan.name} (batch size {rows}), {_REPEATED}; {same}"
    leaf, dim = main
    others = [f"dim {d} of {p}" for p, dims in scan.varying.items() for d in dims if (p, d) != main]
    same_dim = all(dims == [dim] for dims in scan.varying.values() if dims)
    what = "sequence length" if same_dim else "size"
    which = "the first" if scan.worst_number == 1 else f"batch {scan.worst_number} of the {scan.name}"
    note = (
        f"sample: the worst of {scan.seen()} of the {scan.name}: {what} {record.length:,} "
        f"(dim {dim} of {leaf}), {which} (batch size {rows}); the first batch had length {record.first_length:,}"
    )
    if others and not same_dim:
        note += f" (also varying: {', '.join(others)})"
    return f"{note}; its rows are {_REPEATED}"


def _scan_at_length(scan: Scan, seq_len: int) -> tuple[Any, str, SizedOn]:
    """The scan's worst rows at exactly ``seq_len``, along the dim that varied (or, when none did,
    the one dim the batch's tensors share)."""
    if scan.varying:
        several = {path: dims for path, dims in scan.varying.items() if len(dims) > 1}
        if several:
            shown = "; ".join(f"dims {', '.join(map(str, dims))} of {path}" for path, dims in several.items())
            raise ValueError(
                f"seq_len={seq_len:,}: more than one dimension varies across the batches of the {scan.name} ({shown}), "
                "so which one is the sequence is ambiguous: pass make_batch=(batch_size, seq_len) -> batch"
            )
        dims = {path: found[0] for path, found in scan.varying.items()}
    else:
        try:
            dims = sequence_dims(scan.worst, seq_len)
        except ValueError as exc:
            raise ValueError(
                f"seq_len={seq_len:,}: no dimension varies in the {scan.seen()} of the {scan.name}, and {exc}"
            ) from None
    leaf = next((path for path in scan.shapes if path in dims), None)
    if leaf is None:
        raise ValueError(f"seq_len={seq_len:,}: the worst batch of the {scan.name} holds none of the tensors that vary")
    dim = dims[leaf]
    had = scan.shapes[leaf][dim]
    first = scan.first[leaf][dim] if leaf in scan.first else None
    number = "the first" if scan.worst_number == 1 else f"batch {scan.worst_number} of the {scan.name}"
    note = (
        f"sample: the worst of {scan.seen()} of the {scan.name} ({number}), {_resized(had, seq_len, leaf, dim)}"
        + (f"; the first batch had length {first:,}" if first is not None else "")
        + f"; its rows are {_REPEATED}"
    )
    record = SizedOn(
        source="seq_len",
        batches_scanned=scan.scanned,
        total_batches=scan.total,
        leaf=leaf,
        dim=dim,
        length=seq_len,
        first_length=first,
        batch_number=scan.worst_number,
    )
    return at_length(scan.worst, dims, seq_len), note, record

"""``batchfit probe --buckets LENGTHS``'s flags, and the lengths LENGTHS names.

LENGTHS is a file (``-``: stdin) holding a JSON list of lengths (one per row), a JSON object
``{length: rows}`` (a histogram), or one length per line; or the word ``dataset``: the lengths the
target's ``DataLoader`` declares (its dataset's ``lengths``). A file is read and checked here,
before the target loads (`read_lengths`), so a bad one costs nothing; what is wrong is named with
the file and the line or entry (`batchfit.report.bucketing.histogram_of` checks each value).

Pure Python, no torch: the parser declares these flags for ``batchfit --help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batchfit.cli.output import UsageError
from batchfit.cli.values import positive_int
from batchfit.report.bucketing import DEFAULT_MAX_BUCKETS, histogram_of

__all__ = ["DATASET", "WITH_BUCKETS", "add_buckets_flags", "read_lengths", "uses_lengths"]

#: ``--buckets dataset``: the lengths the target's loader declares.
DATASET = "dataset"

#: The flags that only go with ``--buckets`` (their ``args`` names): any of them sends ``probe`` there.
WITH_BUCKETS = ("token_budget", "no_token_budget", "max_buckets", "pack_length", "soak", "soak_steps")


def add_buckets_flags(probe: argparse.ArgumentParser) -> None:
    """``--buckets`` and the flags that go with it, on ``batchfit probe``."""
    group = probe.add_argument_group(
        "variable-length data (--buckets)",
        "size per-bucket batches, a token budget and packed rows from the data's own lengths "
        "(batchfit.buckets); the memory, headroom, optimizer and search flags act as for a probe",
    )
    group.add_argument(
        "--buckets",
        metavar="LENGTHS",
        help="the data's lengths: a file with a JSON list (one length per row), a JSON object {length: rows}, "
        "or one length per line ('-' for stdin); or 'dataset': the lengths the target's DataLoader sample "
        "declares (its dataset's lengths). Batches come from the target's make_batch(batch_size, seq_len), "
        "else from the loader's longest item cut to each length",
    )
    group.add_argument(
        "--token-budget",
        action="store_true",
        help="with --buckets: the token budget is the answer: its line comes first (in --quiet's line too), and "
        "exit 3 when no padded budget holds the longest row; the buckets are still sized and shown after it",
    )
    group.add_argument(
        "--no-token-budget",
        action="store_true",
        help="with --buckets: size the buckets only, without the token budget and its compositions",
    )
    group.add_argument(
        "--max-buckets",
        type=positive_int,
        metavar="N",
        help=f"with --buckets: the most buckets to use (default {DEFAULT_MAX_BUCKETS}; the fastest epoch among the "
        "candidates)",
    )
    group.add_argument(
        "--pack-length",
        type=positive_int,
        metavar="N",
        help="with --buckets: also size rows packed to N tokens (position_ids restarting at each row, as "
        "DataCollatorWithFlattening packs them; the model's forward must take position_ids) and say whether "
        "packing or buckets trains faster here",
    )
    group.add_argument(
        "--soak",
        action="store_true",
        help="with --buckets: replay an epoch of the samplers that take the answer as real steps "
        "(verify='epoch'): the peak, its step, and the steps that ran out of memory; exit 3 when any did",
    )
    group.add_argument(
        "--soak-steps",
        type=positive_int,
        metavar="N",
        help="with --soak: replay at most N steps of each epoch",
    )


def uses_lengths(args: argparse.Namespace) -> bool:
    """Whether a ``probe`` command line sizes variable-length data: ``--buckets`` or a flag of `WITH_BUCKETS` given."""
    return any(getattr(args, name, None) not in (None, False) for name in ("buckets", *WITH_BUCKETS))


def read_lengths(source: str) -> Any:
    """The lengths ``--buckets`` names: `DATASET`, a list (one per row) or a dict ``{length: rows}``,
    each value checked; a `UsageError` naming the file and what is wrong in it."""
    if source == DATASET:
        return DATASET
    name = "stdin" if source == "-" else source
    try:
        if source == "-":
            text = sys.stdin.read()
        else:
            with open(source, encoding="utf-8") as stream:
                text = stream.read()
    except FileNotFoundError:
        raise UsageError(
            f"--buckets {source!r}: no such file (give a file of lengths, '-' for stdin, or 'dataset')"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--buckets {source!r}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    lengths = _parse(text, name)
    try:
        histogram_of(lengths, f"--buckets {name}")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return lengths


def _parse(text: str, name: str) -> Any:
    """JSON (a list or an object with whole-number keys), else one length per line."""
    stripped = text.strip()
    if not stripped:
        raise UsageError(f"--buckets {name} holds no lengths")
    if stripped[0] in "[{":
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--buckets {name} is not valid JSON: {exc}") from None
        if isinstance(value, dict):
            return {_key(key, name): rows for key, rows in value.items()}
        return value
    lengths = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            lengths.append(int(line))
        except ValueError:
            raise UsageError(
                f"--buckets {name}, line {number}: {line!r} is not a length (a whole number of tokens)"
            ) from None
    return lengths


def _key(key: str, name: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise UsageError(
            f"--buckets {name}: the key {key!r} is not a length: a histogram maps lengths to rows, "
            '{"128": 900, "512": 40}'
        ) from None

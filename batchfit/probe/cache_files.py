"""The result cache's entries on disk: the read, the document, why one cannot be trusted, the atomic write.

An entry is read from a directory others may write (a cache shared by nodes), so nothing in it
is taken on trust: only a regular file is opened, and no more than `ENTRY_CAP_BYTES` of it
(`read_file`: a FIFO would block the read, ``/dev/zero`` would fill the memory); its
answer must agree with its own trials (`contradiction`); and every string it holds is made
printable before anything can show it (`printable`: a note holding ``"\\x1b[2J"`` must not
clear the screen of the user who prints the result).

No torch: an entry can be written, read and checked where torch is not loaded (the writers of
``tests/test_cache.py``, a tool that lists a cache). The cache itself is ``batchfit.probe.cache``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.probe.notes import non_monotone
from batchfit.report import Result
from batchfit.units import format_bytes

__all__ = [
    "CACHE_SCHEMA",
    "ENTRY_CAP_BYTES",
    "canonical_json",
    "check_entry",
    "contradiction",
    "entry_document",
    "hash_fields",
    "printable",
    "read_entry",
    "read_file",
    "write_atomically",
]

#: The schema a cache entry names; another one is ignored (and overwritten).
CACHE_SCHEMA = "batchfit.cache/1"
#: The most of an entry's file that is read: 64 MiB. A real entry is kilobytes (about 12 KB for a
#: small GPT with its trials) and grows with the model's module list (a few MB for ten thousand
#: modules); a larger file is not an entry, and is not read into memory.
ENTRY_CAP_BYTES = 64 * 2**20
#: How `entry_document` writes ``written_at``; an entry that says it otherwise is not one.
WRITTEN_AT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def canonical_json(fields: Mapping[str, Any]) -> str:
    """The one JSON text of key fields the key hashes: sorted keys, no spaces, ASCII."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def hash_fields(fields: Mapping[str, Any]) -> str:
    """The key of ``fields``: the SHA-256 (hex) of their canonical JSON."""
    return hashlib.sha256(canonical_json(fields).encode("ascii")).hexdigest()


def check_entry(text: bytes, key: str) -> str | None:
    """Why the entry ``text`` of key ``key`` cannot be trusted, or ``None`` when it can."""
    return read_entry(text, key)[1]


def read_file(path: Path) -> tuple[bytes | None, str | None]:
    """The bytes of the entry file ``path``: ``(text, None)``; ``(None, None)`` when there is none;
    ``(None, why)`` when it is not a regular file of at most `ENTRY_CAP_BYTES` or cannot be
    read. The file type is checked before opening (opening a device can act on it), the open
    cannot block (``O_NONBLOCK``: a FIFO swapped in after the check) and is checked again on the
    open file, and the read stops past the cap."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None, "it is not a regular file"
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (FileNotFoundError, NotADirectoryError):  # no entry (a file in the way is the write's to say)
        return None, None
    except OSError as error:
        return None, f"it cannot be read ({error.strerror or error})"
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None, "it is not a regular file"
        chunks: list[bytes] = []
        size = 0
        while size <= ENTRY_CAP_BYTES:
            chunk = os.read(descriptor, min(2**20, ENTRY_CAP_BYTES + 1 - size))
            if not chunk:
                return b"".join(chunks), None
            chunks.append(chunk)
            size += len(chunk)
        return None, f"it is larger than {format_bytes(ENTRY_CAP_BYTES)}, more than any entry"
    except OSError as error:
        return None, f"it cannot be read ({error.strerror or error})"
    finally:
        os.close(descriptor)


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on written as its Python escape
    (``"\\x1b[2J"`` becomes the seven characters ``\\x1b[2J``): control characters, line breaks,
    bidirectional overrides, anything ``str.isprintable`` refuses. The one place an entry's text
    is made safe to show: `read_entry` passes every string of the stored result through it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _printable_tree(data: Any) -> Any:
    """Every string value in the JSON data ``data`` made `printable` (keys are checked by
    the codec, which refuses any it does not know)."""
    if isinstance(data, str):
        return printable(data)
    if isinstance(data, list):
        return [_printable_tree(item) for item in data]
    if isinstance(data, dict):
        return {key: _printable_tree(value) for key, value in data.items()}
    return data


def contradiction(result: Result) -> str | None:
    """How ``result`` contradicts its own trials, or ``None``. An entry's answer is what its trials
    measured; one that says otherwise was edited (or written by something else), and its answer
    is not used. Checked: ``max_batch`` fitted a trial run under the budget; no such trial failed
    at or below it unless memory was not monotone, which the trials must then show; a verified
    ``safe_batch`` passed a verification trial; ``best_throughput_batch`` fitted a trial; a
    boundary reached is a size that failed above ``max_batch``."""
    top = result.max_batch
    uncapped = [t for t in result.trials if t.cap_bytes is None]  # a verification runs under a lower cap
    fitted = {t.batch_size for t in result.trials if t.fits}
    if not any(t.fits and t.batch_size == top for t in uncapped):
        return f"max_batch {top} fitted no trial under the budget"
    failed = sorted(t.batch_size for t in uncapped if not t.fits)
    below = [b for b in failed if b <= top]
    shown = non_monotone(result.trials, top)
    if below and not result.non_monotone:
        return f"max_batch {top} is at or above batch {below[0]}, which ran out of memory in its trials"
    if result.non_monotone != shown:
        return f"it says memory was{' not' if result.non_monotone else ''} monotone, and its trials say otherwise"
    if result.safe_verified and not any(
        t.kind == "verify" and t.fits and t.batch_size == result.safe_batch for t in result.trials
    ):
        return f"safe_batch {result.safe_batch} is said to be verified, and no verification of it fitted"
    if result.best_throughput_batch not in fitted:
        return f"best_throughput_batch {result.best_throughput_batch} fitted no trial"
    if result.boundary_reached and not any(b > top for b in failed):
        return f"it says the boundary was reached, and no trial above max_batch {top} ran out of memory"
    return None


def read_entry(text: bytes, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """The entry ``text`` of key ``key``, parsed once and checked: ``(entry, None)``, or ``(None,
    why)`` when it cannot be trusted. The entry's ``result`` comes back with every string made
    `printable`."""
    if not text.strip():
        return None, "it is empty"
    try:
        entry = json.loads(text)
    except (ValueError, RecursionError) as error:
        return None, f"not valid JSON ({str(error)[:80]})"
    if not isinstance(entry, dict):
        return None, "not a JSON object"
    if entry.get("schema") != CACHE_SCHEMA:
        return None, f"its schema is {str(entry.get('schema'))[:40]!r}, not {CACHE_SCHEMA!r}"
    if entry.get("key") != key:
        return None, "the key inside it is not its file's"
    fields = entry.get("key_fields")
    try:
        hashed = hash_fields(fields) if isinstance(fields, dict) else ""
    except (TypeError, ValueError):
        hashed = ""
    if hashed != key:
        return None, "its key fields do not hash to its key"
    written_at = entry.get("written_at")
    if not isinstance(written_at, str) or not WRITTEN_AT.fullmatch(written_at):
        return None, "it says not when it was written"
    shown = _printable_tree(entry.get("result"))
    try:
        result = Result.from_dict(shown)
    except ValueError as error:
        return None, f"its result is refused ({str(error)[:120]})"
    contradicted = contradiction(result)
    if contradicted is not None:
        return None, f"its answer contradicts its own trials: {contradicted}"
    return {**entry, "result": shown}, None


def entry_document(key: str, key_fields: dict[str, Any], result: Result) -> dict[str, Any]:
    """The entry of ``result`` under ``key`` (hashed from ``key_fields``), stamped with the time
    it is written (UTC)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "schema": CACHE_SCHEMA,
        "key": key,
        "key_fields": key_fields,
        "written_at": now,
        "result": result.to_dict(),
    }


def write_atomically(path: Path, text: str) -> str | None:
    """Write ``text`` to ``path`` so that no reader ever sees part of it: a unique temporary file
    beside it (this process's id and random bytes), flushed and fsynced, then ``os.replace``d over
    it. ``None`` when written, else what went wrong (the directory made if missing)."""
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "x", encoding="ascii") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        return f"{type(error).__name__}: {error.strerror or error}"
    return None

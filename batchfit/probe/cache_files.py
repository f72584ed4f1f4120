"""The result cache's entries on disk: the document, why one cannot be trusted, the atomic write.

No torch: an entry can be written, read and checked where torch is not loaded (the writers of
``tests/test_cache.py``, a tool that lists a cache). The cache itself is ``batchfit.probe.cache``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.report import Result

__all__ = [
    "CACHE_SCHEMA",
    "canonical_json",
    "check_entry",
    "entry_document",
    "hash_fields",
    "read_entry",
    "write_atomically",
]

#: The schema a cache entry names; another one is ignored (and overwritten).
CACHE_SCHEMA = "batchfit.cache/1"


def canonical_json(fields: Mapping[str, Any]) -> str:
    """The one JSON text of key fields the key hashes: sorted keys, no spaces, ASCII."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def hash_fields(fields: Mapping[str, Any]) -> str:
    """The key of ``fields``: the SHA-256 (hex) of their canonical JSON."""
    return hashlib.sha256(canonical_json(fields).encode("ascii")).hexdigest()


def check_entry(text: bytes, key: str) -> str | None:
    """Why the entry ``text`` of key ``key`` cannot be trusted, or ``None`` when it can."""
    return read_entry(text, key)[1]


def read_entry(text: bytes, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """The entry ``text`` of key ``key``, parsed once and checked: ``(entry, None)``, or ``(None,
    why)`` when it cannot be trusted."""
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
    if not isinstance(entry.get("written_at"), str):
        return None, "it says not when it was written"
    try:
        Result.from_dict(entry.get("result"))  # type: ignore[arg-type]
    except ValueError as error:
        return None, f"its result is refused ({str(error)[:120]})"
    return entry, None


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

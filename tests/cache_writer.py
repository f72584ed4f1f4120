"""One of the writers at once of ``tests/test_cache.py``: a process that writes one cache entry
over and over, with its own time stamp each time. Torch-free, so that a spawned writer starts fast."""

from __future__ import annotations

import json
from pathlib import Path

from batchfit.probe.cache_files import write_atomically


def write_many(path: str, text: str, writer: int, times: int) -> None:
    entry = json.loads(text)
    for i in range(times):
        entry["written_at"] = f"2026-01-01T00:{writer:02d}:{i % 60:02d}Z"
        problem = write_atomically(Path(path), json.dumps(entry, indent=1))
        assert problem is None, problem

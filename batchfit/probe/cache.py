"""The result cache: a probe's answer stored in a directory, so that the same probe runs once.

``find(model, sample, cache=DIR)`` (``batchfit probe ... --cache DIR``) keys the probe
(``batchfit.probe.keys``: the device, the model's structure, the batch, the step, the
search's settings, the versions; not the weights, not the world size) and looks for
``DIR/<key>.json``:

* **hit**: no trial runs, no callback is called (``callback``, ``on_trial_start``, ``on_start``)
  and the model never runs. The answer is the stored one, every measurement identical (trials,
  memory equation, throughput, notes), with ``Result.from_cache`` (a :class:`CacheHit`: the
  entry, when it was written, the world size that measured it and how long that probe took) and a
  note saying so; ``elapsed_s`` is the hit's own time. Measured with another world size: the
  batch sizes are per rank and hold as stored, ``world_size`` is the current one, and a note says
  that the rates are those of the ranks that measured them (the key leaves the world size out on
  purpose: ``batchfit.probe.keys``);
* **miss**: the probe runs as usual and its answer is written at the end. An entry that cannot be
  trusted (not JSON, empty or truncated, another schema, a key that is not its file's, key fields
  that do not hash to it, a result the codec refuses) is ignored with a note naming the file and
  why, and overwritten by the fresh answer: never trusted, never a crash. A probe that ends
  otherwise (Ctrl-C, an error) writes nothing.

The gradient noise scale depends on the current weights, which the key leaves out: it is never
stored, and ``noise_scale=True`` measures it again on a hit (real forward and backward passes at
the stored safe batch, not trials). An entry is ``{"schema": "batchfit.cache/1", "key": ...,
"key_fields": ..., "written_at": "2026-11-25T10:00:00Z", "result": <Result.to_dict()>}``, written
atomically (a unique temporary file in the same directory, flushed and fsynced, then
``os.replace``), so that many writers at once (workers, nodes on shared storage) never leave a torn
file: the last complete write wins. A directory that cannot be written is a note, not an error
that loses the probe.

Across ranks (``batchfit.distributed.Group``) rank 0 reads the entry and decides; the decision
and the stored document reach every rank through the probe's side group (``Solo.share``), so every
rank hits or misses together; only rank 0 writes (a note that it could not is rank 0's alone).

``batchfit.estimate`` and ``batchfit.frontier`` take no cache: an estimate costs seconds and no
device, and a frontier is another answer (a point per length) with its own document.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchfit.distributed import Solo
from batchfit.probe.cache_files import entry_document, read_entry, write_atomically
from batchfit.probe.keys import CacheKey, probe_key
from batchfit.probe.options import Options
from batchfit.probe.prober import Prober
from batchfit.report import CacheHit, Result

__all__ = ["ResultCache", "open_cache"]

def open_cache(prober: Prober, options: Options) -> ResultCache:
    """The cache entry of the probe ``prober`` is set up for (built, not entered)."""
    assert options.cache is not None
    return ResultCache(options.cache, probe_key(prober, options), prober)


class ResultCache:
    """One probe's entry in a cache directory: :meth:`look_up` before the probe, :meth:`store` after."""

    def __init__(self, directory: str | os.PathLike[str], key: CacheKey, prober: Prober) -> None:
        self.directory = Path(os.fsdecode(os.fspath(directory))).expanduser()
        self.key = key
        self.path = self.directory / f"{key.hex}.json"
        self._prober = prober
        self._ranks: Solo = prober.ranks
        #: What the look-up and the write have to say (an entry ignored, a directory not writable).
        self.notes: list[str] = []

    def look_up(self, started: float) -> Result | None:
        """The stored answer as a hit (see the module docs), or ``None``: probe. Every rank gets the
        same decision, rank 0's. ``started``: the ``time.monotonic()`` the hit's time counts from."""
        ranks = self._ranks
        self._prober.join_ranks()  # the side group the decision travels on
        try:
            entry, why = self._read() if ranks.is_leader else (None, None)
            entry, why = ranks.share((entry, why))
        except BaseException:
            ranks.close()
            raise
        if why is not None:
            self.notes.append(f"the cache entry {self.path} was ignored: {why}; probed again")
        if entry is None:
            return None  # the probe meets the ranks again as joined, and closes the group at its end
        ranks.close()
        stored = Result.from_dict(entry["result"])  # rank 0 read it already: it loads
        hit = CacheHit(
            path=str(self.path),
            key=self.key.hex,
            written_at=entry["written_at"],
            world_size=stored.world_size,
            elapsed_s=stored.elapsed_s,
        )
        notes = [*stored.notes, f"from the cache: {self.path}, written {hit.written_at}; no trial ran"]
        if stored.world_size != ranks.world_size:
            notes.append(
                f"measured on {stored.world_size} rank{'s' if stored.world_size != 1 else ''}, now "
                f"{ranks.world_size}: the batch sizes are per rank and hold as measured; samples/s are those of the "
                f"{stored.world_size} that measured them"
            )
        return replace(
            stored,
            from_cache=hit,
            world_size=ranks.world_size,
            elapsed_s=time.monotonic() - started,
            notes=tuple(notes),
        )

    def store(self, result: Result) -> Result:
        """Write ``result`` (rank 0 only), and return it with what the cache has to say. The
        entry holds the answer as measured: without the cache's notes and the noise scale."""
        if self._ranks.is_leader:
            document = entry_document(self.key.hex, self.key.fields, replace(result, noise_scale=None, from_cache=None))
            problem = write_atomically(self.path, json.dumps(document, indent=1, sort_keys=True))
            if problem is not None:
                self.notes.append(
                    f"the answer could not be stored in the cache {self.directory} ({problem}); nothing was cached"
                )
        return replace(result, notes=(*result.notes, *self.notes)) if self.notes else result

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The entry, checked, or ``None`` and why it was ignored (``None``: there was none)."""
        try:
            text = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # no entry (a file in the way is the write's to say)
            return None, None
        except OSError as error:
            return None, f"it cannot be read ({error.strerror or error})"
        return read_entry(text, self.key.hex)

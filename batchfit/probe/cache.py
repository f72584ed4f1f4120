"""The result cache: a probe's answer stored in a directory, so that the same probe runs once.

``find(model, sample, cache=DIR)`` (``batchfit probe ... --cache DIR``) keys the probe
(``batchfit.probe.keys``: the device, the model's structure, the batch, the step, the
search's settings, the versions; not the weights, not the world size) and looks for
``DIR/<key>.json``:

* **hit**: no search runs, no callback is called (``callback``, ``on_trial_start``, ``on_start``).
  The answer is the stored one, every measurement identical (trials, memory equation, throughput,
  notes), with ``Result.from_cache`` (a [`CacheHit`][batchfit.report.records.CacheHit]: the entry,
  when it was written, the world size that measured it and how long that probe took) and a note
  saying so and what was checked; ``elapsed_s`` is the hit's own time. Measured with another world
  size: the batch sizes are per rank and hold as stored, ``world_size`` is the current one, and a
  note says that the rates are those of the ranks that measured them (the key leaves the world size
  out on purpose: ``batchfit.probe.keys``);
* **the check on a hit** (on by default; ``verify_steps=0``, which verifies nothing, skips it and
  a hit never runs the model): before the stored answer is returned, its safe batch runs for real
  once, under the cap its verification ran under (the budget less its headroom), for the fewest
  steps that show the peak with the optimizer state live (two on a fresh process), then its
  ``max_batch`` once under the budget itself (one step: the state is live by then; skipped where
  it is the safe batch), on every rank, outside the trial callbacks. If either runs out of
  memory, the entry is ignored with a note and the probe runs.
  Why on by default: the key cannot see everything that changes memory (the model's Python code,
  a configuration attribute that is not a module or a parameter, another process on the device,
  a driver), and a directory shared by nodes can be written by anyone who reaches it, with an
  entry that agrees with itself (issue 48: the boundary's failing trial flipped to "fits" and
  ``max_batch`` moved onto it, one above the truth). The two runs cost about two training steps,
  against the tens of trials of the probe a hit saves; the hit still never searches. What a
  checked hit proves: the safe batch fits with its headroom and ``max_batch`` fits, on this
  device now. What it does not: that ``max_batch + 1`` does not fit (an entry whose max was moved
  *down* answers smaller than the truth, never a batch that runs out of memory), and the rates,
  which stay the stored ones;
* **miss**: the probe runs as usual and its answer is written at the end. An entry that cannot be
  trusted is ignored with a note naming the file and why, and overwritten by the fresh answer: never
  trusted, never a crash. That is: not a regular file (a FIFO, a device: the file type is checked
  before anything opens it), larger than `ENTRY_CAP_BYTES` (64 MiB, thousands of times a real
  entry), not JSON, empty or truncated, another schema, a key that is not its file's, key fields
  that do not hash to it, a time not as batchfit writes it, a result the codec refuses, an answer
  its own trials contradict (`contradiction`: ``max_batch`` at or above a size that ran out of
  memory, a max, safe or best-throughput size no trial fitted), or a safe or max batch that no
  longer fits (the check). A probe that ends otherwise (Ctrl-C, an error) writes nothing.

Every string of a stored answer (notes, names, the device's configuration, the settings' words)
is made printable as it is read (`printable`: escapes are
shown as ``\\x1b[2J``, not sent to the terminal), so neither ``str(result)``, the CLI, the rich
view nor a user's own ``print`` can be made to act on a terminal by an entry.

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
from batchfit.probe.cache_files import entry_document, read_entry, read_file, write_atomically
from batchfit.probe.keys import CacheKey, probe_key
from batchfit.probe.options import Options
from batchfit.probe.prober import Prober
from batchfit.probe.runner import TrialRequest, opened
from batchfit.probe.safe_batch import safe_cap
from batchfit.report import CacheHit, Result
from batchfit.units import format_bytes

__all__ = ["ResultCache", "open_cache"]


def open_cache(prober: Prober, options: Options) -> ResultCache:
    """The cache entry of the probe ``prober`` is set up for (built, not entered)."""
    assert options.cache is not None
    return ResultCache(options.cache, probe_key(prober, options), prober, verify=options.verify_steps > 0)


class ResultCache:
    """One probe's entry in a cache directory: `look_up` before the probe, `store` after."""

    def __init__(
        self, directory: str | os.PathLike[str], key: CacheKey, prober: Prober, *, verify: bool = True
    ) -> None:
        self.directory = Path(os.fsdecode(os.fspath(directory))).expanduser()
        self.key = key
        self.path = self.directory / f"{key.hex}.json"
        self._prober = prober
        self._ranks: Solo = prober.ranks
        #: Check the stored safe batch with a real run before a hit is answered (see the module docs).
        self._verify = verify
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
        ran = "no trial ran"
        if entry is not None and self._verify:  # every rank runs the check: the ranks still agree
            why, ran = self._check(Result.from_dict(entry["result"]))  # rank 0 read it already: it loads
            entry = None if why is not None else entry
        if why is not None:
            self.notes.append(f"the cache entry {self.path} was ignored: {why}; probed again")
        if entry is None:
            return None  # the probe meets the ranks again (as joined), and closes the group at its end
        ranks.close()  # closed already where the check ran (the prober's exit)
        stored = Result.from_dict(entry["result"])
        hit = CacheHit(
            path=str(self.path),
            key=self.key.hex,
            written_at=entry["written_at"],
            world_size=stored.world_size,
            elapsed_s=stored.elapsed_s,
        )
        notes = [*stored.notes, f"from the cache: {self.path}, written {hit.written_at}; {ran}"]
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
        text, why = read_file(self.path)
        return (None, why) if text is None else read_entry(text, self.key.hex)

    def _check(self, stored: Result) -> tuple[str | None, str]:
        """Run the stored safe batch for real, once, under the cap its verification ran under (the
        budget less its headroom), then the stored max under the budget itself: ``(None, what was
        checked)`` when both fit, else ``(why, "")``. Every rank runs them and takes the group's
        verdict (``Prober.trial``), so the ranks still agree. The max is skipped where it is the
        safe batch (the first run was it, under at most the budget)."""
        prober, settings = self._prober, stored.settings
        before = len(prober.notes)  # the set-up's notes: the probe that may follow says them again
        with opened(prober) as setup:
            budget = setup.budget_bytes
            lowered = budget is not None and stored.safe_batch > settings.init_batch  # as safe_batch() runs it
            cap = safe_cap(budget, settings.headroom) if budget is not None and lowered else None
            safe = prober.run(TrialRequest(stored.safe_batch, kind="verify", cap_bytes=cap))
            above = safe.fits and stored.max_batch > stored.safe_batch
            top = prober.run(TrialRequest(stored.max_batch)) if above else None
        del prober.notes[before:]
        under = f" under {format_bytes(cap)}" if cap is not None else ""
        if not safe.fits:
            return f"its safe batch {stored.safe_batch} ran out of memory when checked{under}", ""
        said = f"no search ran; safe batch {stored.safe_batch} checked with {_steps(safe.steps)}{under}: it fits"
        if top is None:
            return None, said
        within = f" under {format_bytes(budget)}" if budget is not None else ""
        if not top.fits:
            return f"its max batch {stored.max_batch} ran out of memory when checked{within}", ""
        return None, f"{said}; max batch {stored.max_batch} with {_steps(top.steps)}{within}: it fits"


def _steps(count: int) -> str:
    return f"{count} step{'s' if count != 1 else ''}"

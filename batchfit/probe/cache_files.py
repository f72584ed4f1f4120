"""The result cache's entries and the trial log on disk: the read, the document, why one cannot be
trusted, the atomic write, the append.

An entry is read from a directory others may write (a cache shared by nodes), so nothing in it
is taken on trust: only a regular file is opened, and no more than `ENTRY_CAP_BYTES` of it
(`read_file`: a FIFO would block the read, ``/dev/zero`` would fill the memory); its
answer must agree with its own trials (`contradiction`); and every string it holds is made
printable before anything can show it (`printable`: a note holding ``"\\x1b[2J"`` must not
clear the screen of the user who prints the result).

The trial log of a job search (``batchfit.probe.job_runner``) is read through the same `read_file`, and
its lines are held to the same standard (`read_trial_log`): a job's verdicts are reused only when
every rank's agrees with itself and a fit is every rank's; a line cut off by a crash is skipped,
with a note; a file that is not a trial log is an error that names it.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit.probe.notes import non_monotone
from batchfit.report import DeviceInfo, Result, Trial
from batchfit.units import format_bytes

__all__ = [
    "CACHE_SCHEMA",
    "ENTRY_CAP_BYTES",
    "TRIAL_LOG_CAP_BYTES",
    "TRIAL_LOG_SCHEMA",
    "LoggedEntries",
    "append_line",
    "canonical_json",
    "check_entry",
    "contradiction",
    "entry_document",
    "hash_fields",
    "printable",
    "read_entry",
    "read_file",
    "read_trial_log",
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
#: The schema of a trial log line: a job's verdicts (``batchfit.probe.job_runner``), or with ``"kind":
#: "estimate"`` the sharded estimate the search started from (``batchfit.probe.job_search``).
TRIAL_LOG_SCHEMA = "batchfit.trial-log/1"
#: The most of a trial log that is read: 256 MiB. A job's line holds a verdict of about 2 KB per
#: rank, so a search of 30 jobs of 1024 ranks stays well below it.
TRIAL_LOG_CAP_BYTES = 256 * 2**20


def canonical_json(fields: Mapping[str, Any]) -> str:
    """The one JSON text of key fields the key hashes: sorted keys, no spaces, ASCII."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def hash_fields(fields: Mapping[str, Any]) -> str:
    """The key of ``fields``: the SHA-256 (hex) of their canonical JSON."""
    return hashlib.sha256(canonical_json(fields).encode("ascii")).hexdigest()


def check_entry(text: bytes, key: str) -> str | None:
    """Why the entry ``text`` of key ``key`` cannot be trusted, or ``None`` when it can."""
    return read_entry(text, key)[1]


def read_file(path: Path, cap_bytes: int = ENTRY_CAP_BYTES, what: str = "entry") -> tuple[bytes | None, str | None]:
    """The bytes of the entry file ``path``: ``(text, None)``; ``(None, None)`` when there is none;
    ``(None, why)`` when it is not a regular file of at most ``cap_bytes`` (a trial log's
    `TRIAL_LOG_CAP_BYTES`, ``what`` it is then) or cannot be read. The file type is checked
    before opening (opening a device can act on it), the open cannot block (``O_NONBLOCK``: a FIFO
    swapped in after the check) and is checked again on the open file, and the read stops past the
    cap."""
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
        while size <= cap_bytes:
            chunk = os.read(descriptor, min(2**20, cap_bytes + 1 - size))
            if not chunk:
                return b"".join(chunks), None
            chunks.append(chunk)
            size += len(chunk)
        return None, f"it is larger than {format_bytes(cap_bytes)}, more than any {what}"
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


@dataclass(frozen=True)
class LoggedEntries:
    """What a trial log holds under one key: the jobs' entries that can be trusted, in order, the
    sharded estimate logged under it (the last one), and a note on each line that was not used."""

    jobs: tuple[dict[str, Any], ...] = ()
    estimate: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()


#: What a line of a trial log holds, by its kind: a job's verdicts, or the sharded estimate.
LOG_FIELDS = {"job": ("key", "batch_size", "steps", "ranks"), "estimate": ("key", "result", "failed")}
#: What a rank's verdict holds (what the driver reads of it), unless it is a rank's error.
VERDICT_FIELDS = ("trial", "counts", "device", "limit_bytes", "limit_source", "reserve_bytes")


def read_trial_log(path: Path, key: Mapping[str, Any], world_size: int) -> LoggedEntries:
    """The entries of the trial log ``path`` logged under ``key`` (jobs of ``world_size`` ranks), each
    checked (`distrusted_job`); ``LoggedEntries()`` when there is no such file. A line cut off (a
    run that ended while writing it) is skipped, with a note; the rest stay usable.

    Raises:
        ValueError: naming the file, when it is not one to read as a trial log: not a regular file
            (a FIFO would block the read, ``/dev/zero`` never ends), larger than
            `TRIAL_LOG_CAP_BYTES`, a line that is not a trial log's, an entry without its fields.
    """
    text, why = read_file(path, TRIAL_LOG_CAP_BYTES, "trial log")
    if why is not None:
        raise ValueError(f"the trial log {path} cannot be read: {why}; name another file or remove it")
    jobs: list[dict[str, Any]] = []
    estimate: dict[str, Any] | None = None
    notes: list[str] = []
    for number, line in enumerate((text or b"").split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            if not line.lstrip().startswith(b"{"):
                why = f"line {number} is not JSON"
                raise ValueError(f"the trial log {path} is not a batchfit trial log: {why}") from None
            notes.append(f"line {number} of the trial log {path} is cut off (a run ended while writing it): skipped")
            continue
        kind = _check_line(entry)
        if kind.startswith("not "):
            raise ValueError(f"the trial log {path} is not a batchfit trial log: line {number} is {kind}")
        if entry["key"] != key:
            continue  # another target, device, ranks' command line or version: not this search's
        refused = _distrusted_estimate(entry) if kind == "estimate" else distrusted_job(entry, world_size)
        if refused is not None:
            notes.append(f"line {number} of the trial log {path} was not used: {refused}")
        elif kind == "estimate":
            estimate = _printable_tree(entry)
        else:
            jobs.append({**entry, "ranks": _printable_tree(entry["ranks"])})
    return LoggedEntries(tuple(jobs), estimate, tuple(notes))


def _check_line(entry: Any) -> str:
    """A trial log line's kind (``"job"``, ``"estimate"``), or ``"not ..."``: what it lacks."""
    if not isinstance(entry, dict) or entry.get("schema") != TRIAL_LOG_SCHEMA:
        return f"not a {TRIAL_LOG_SCHEMA!r} entry"
    kind = entry.get("kind", "job")
    if kind not in LOG_FIELDS:
        return f"not of a kind it knows ({str(kind)[:40]!r})"
    missing = [name for name in LOG_FIELDS[kind] if name not in entry]
    if missing:
        return f"not whole: it has no {missing[0]!r}"
    if not isinstance(entry["key"], dict):
        return "not keyed (its 'key' is not an object)"
    if kind == "job":
        ranks = entry["ranks"]
        if not isinstance(ranks, dict) or not all(isinstance(v, dict) for v in ranks.values()):
            return "not whole: its 'ranks' are not verdicts"
        for rank, verdict in ranks.items():
            lacks = [] if "error" in verdict else [name for name in VERDICT_FIELDS if name not in verdict]
            if lacks:
                return f"not whole: rank {str(rank)[:20]}'s verdict has no {lacks[0]!r}"
    return kind


def distrusted_job(entry: Mapping[str, Any], world_size: int) -> str | None:
    """Why a logged job's verdicts cannot be reused, or ``None``. Each rank's must agree with itself
    (`distrusted_verdict`), and a job that fitted fitted on every one of its ``world_size`` ranks (a job
    ends at its first failure, so a failure may come from one rank alone)."""
    size, steps, ranks = entry["batch_size"], entry["steps"], entry["ranks"]
    if not (_count(size) and _count(steps) and ranks):
        return "its batch size, steps or ranks are not a job's"
    fitted: set[int] = set()
    for name, verdict in ranks.items():
        if not (isinstance(name, str) and name.isdigit() and int(name) < world_size):
            return f"it holds a verdict of rank {name[:20]!r}, not one of the {world_size} ranks"
        if "error" in verdict:
            if not isinstance(verdict["error"], str):
                return f"rank {name}'s error is not a message"
            continue
        why = distrusted_verdict(verdict, size)
        if why is not None:
            return f"rank {name}'s verdict {why}"
        if verdict["trial"]["fits"]:
            fitted.add(int(name))
    if len(fitted) == len(ranks) and fitted != set(range(world_size)):
        missing = ", ".join(str(rank) for rank in sorted(set(range(world_size)) - fitted))
        return f"it says the job fitted, and rank(s) {missing} gave no verdict"
    return None


def distrusted_verdict(verdict: Mapping[str, Any], batch_size: int) -> str | None:
    """How a rank's verdict contradicts itself, or ``None``: a fit names no out-of-memory (no
    phase, no message) and peaked within the rank's limit; a failure says what failed."""
    try:
        trial = Trial.from_dict(verdict["trial"])
        DeviceInfo.from_dict(verdict["device"])
    except (ValueError, TypeError) as error:
        return f"is refused ({str(error)[:120]})"
    if verdict["counts"] not in ("allocated", "reserved"):
        return "counts no memory it knows"
    if trial.batch_size != batch_size:
        return f"is of batch size {trial.batch_size}, not the job's {batch_size}"
    if not trial.fits:
        return None if trial.message else "says it ran out of memory, and names no error"
    if trial.phase is not None or trial.message:
        return f"says it fits, and names an out-of-memory (in {trial.phase or 'a phase'}: {trial.message!r:.80})"
    limits = [verdict.get(name) for name in ("cap_bytes", "budget_bytes", "limit_bytes")]
    ceiling = max((limit for limit in limits if _count(limit)), default=None)
    if trial.peak_bytes is not None and ceiling is not None and trial.peak_bytes > ceiling:
        peak, limit = format_bytes(trial.peak_bytes), format_bytes(ceiling)
        return f"says it fits, with a peak of {peak} over its limit of {limit}"
    return None


def _distrusted_estimate(entry: Mapping[str, Any]) -> str | None:
    """Why a logged sharded estimate cannot be used, or ``None``: a result, or why it failed."""
    if entry["result"] is None:
        return None if isinstance(entry["failed"], str) else "its estimate neither answers nor says why it failed"
    try:
        Result.from_dict(entry["result"])
    except (ValueError, TypeError) as error:
        return f"its estimate is refused ({str(error)[:120]})"
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def append_line(path: Path, text: str) -> None:
    """Append the line ``text`` to the log ``path`` (made when missing), after a newline when the
    file ends in a line a crash cut off, so the new line stands alone. Only a regular file is
    written, and the open cannot block (a FIFO swapped in after the read)."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    descriptor = os.open(path, flags, 0o666)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"the trial log {path} is not a regular file: name another file or remove it")
        torn = status.st_size > 0 and os.pread(descriptor, 1, status.st_size - 1) != b"\n"
        data = ("\n" if torn else "") + text + "\n"
        written = data.encode("utf-8")
        while written:
            written = written[os.write(descriptor, written) :]
    finally:
        os.close(descriptor)

"""``batchfit probe``'s second answer under expandable segments: the same target probed again in a child process.

Why: on CUDA's native allocator, fragmentation can cost a quarter of the batch (the proof's GPT-2-small in bf16
under 24 GiB: 21-22 native, 27 under ``expandable_segments:True``), and the allocator's settings are read once,
when CUDA starts in a process: this process cannot try the other setting. A command-line target can be built
again, so when the answer advises expandable segments (split-free bytes over the headroom, data whose lengths
vary: `batchfit.backends.allocator_rule`), or ``--compare-expandable`` asks, the same command runs in a child
process under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` and its answer joins this one's notes (the
text and the JSON). Not for a gate or a rank of a ``torchrun`` job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfit.errors import first_line
from batchfit.report import Result

#: What the child's environment sets, and what a note that advises it names.
EXPANDABLE = "expandable_segments:True"
#: The flags of this process's command line the child does not take (it writes its own JSON, quietly).
_DROPPED = ("--json", "--compare-expandable", "--quiet", "-q")


def advised(result: Any) -> bool:
    """Whether the answer advises expandable segments (only a caching allocator's facts do) and this process
    does not run them yet."""
    if EXPANDABLE in _alloc_conf():
        return False
    return any(f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}" in note for note in result.notes)


def child_argv(argv: Sequence[str]) -> list[str]:
    """This command line without the flags the child does not take (``--json PATH`` and ``--json=PATH`` both)."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in _DROPPED:
            skip = name == "--json" and "=" not in word
            continue
        kept.append(word)
    return kept


def expandable_note(argv: Sequence[str], result: Any, timeout_s: float | None = None) -> str:
    """The note that gives the answer under expandable segments, measured in a child process (or why not)."""
    here = f"max {result.max_batch}, safe {result.safe_batch} under {_alloc_conf() or 'the default allocator'}"
    with tempfile.TemporaryDirectory(prefix="batchfit-expandable-") as folder:
        path = Path(folder) / "result.json"
        command = [sys.executable, "-m", "batchfit", *child_argv(argv), "--quiet", "--json", str(path)]
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": _with_expandable(_alloc_conf())}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return f"the probe under {EXPANDABLE} (a child process) did not finish in {timeout_s:.0f} s; here: {here}"
        if done.returncode != 0 or not path.exists():
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return f"the probe under {EXPANDABLE} (a child process) failed: {why[:200]}; here: {here}"
        try:
            other = Result.from_json(path.read_text())
        except ValueError as exc:
            return f"the probe under {EXPANDABLE} (a child process) wrote no readable answer: {first_line(exc)}"
    gain = f" ({other.max_batch / result.max_batch - 1:+.0%})" if result.max_batch else ""
    return (
        f"under PYTORCH_CUDA_ALLOC_CONF={_with_expandable(_alloc_conf())} (measured in a child process): max "
        f"{other.max_batch}{gain}, safe {other.safe_batch}; here: {here}"
    )


def _alloc_conf() -> str:
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


def _with_expandable(conf: str) -> str:
    """``conf`` with expandable segments on (a later entry for the same key wins, as torch reads it)."""
    return f"{conf},{EXPANDABLE}" if conf.strip() else EXPANDABLE

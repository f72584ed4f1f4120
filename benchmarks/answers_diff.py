"""Two runs of a benchmark, compared on their answers: did a change keep every answer, trial and size?

A refactor must leave the answers as they were (issue 49). Two runs on a shared machine differ in
their timings, and so in what follows from the rates: the throughput knee, the sizes timed warm
around it, a recommendation the knee decided, the notes on timing. This compares everything else:
every max and safe batch, every search and verification trial (size, kind, fit, peak bytes), every
other finder's answer, and prints the differences (0 when the answers are the same)::

    python benchmarks/answers_diff.py BEFORE.json AFTER.json

A probe's trial count and size list (``trials``, ``sizes``, ``find_trials``, ``eval_trials`` as
numbers) include its timed trials, so they are left out; where the JSON holds the trials themselves,
those are compared, the timed ones left out.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

#: Keys whose values move with the machine's load: timings, rates, and what the rates decide.
MOVES_WITH_LOAD = re.compile(
    r"(^|_)(s|wall|date|load|time|times|rate|rates|speed|ratio|over|share|seconds|elapsed|machine|versions|"
    r"platform|duration|throughput|knee|best|spread|points|recommendation|notes|speedup|note)($|_)|_s$|per_s|"
    r"load_average|cpu_share|by_hand|torch$|threads|step_times|phase_peaks|phase_reserved|allocator|"
    r"largest_request|recommended|split$|micro|accumulation|samples"
)


#: A benchmark's summary of a batchfit probe: how many trials and which sizes, its timed ones included.
SUMMARIES = ("trials", "sizes", "find_trials", "eval_trials")


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _untimed(trials: list[Any]) -> list[Any]:
    return [t for t in trials if not (isinstance(t, dict) and t.get("kind") == "time")]


def differences(before: Any, after: Any, path: str = "") -> list[str]:
    """Where ``after`` differs from ``before``, outside `MOVES_WITH_LOAD`."""
    found: list[str] = []
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            if MOVES_WITH_LOAD.search(str(key)):
                continue
            if key not in before or key not in after:
                found.append(f"{path}.{key}: only {'after' if key not in before else 'before'}")
                continue
            old, new = before[key], after[key]
            if key == "trials" and isinstance(old, list) and isinstance(new, list):
                old, new = _untimed(old), _untimed(new)
            elif key in SUMMARIES and not _is_records(old):
                continue  # a probe's count or sizes, timed trials included: its records are compared instead
            found += differences(old, new, f"{path}.{key}")
    elif isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            found.append(f"{path}: {len(before)} items before, {len(after)} after")
        for index, (old, new) in enumerate(zip(before, after)):
            found += differences(old, new, f"{path}[{index}]")
    elif before != after:
        found.append(f"{path}: {before!r} -> {after!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    found = differences(json.loads(args.before.read_text()), json.loads(args.after.read_text()))
    print(f"{args.before.name} vs {args.after.name}: {len(found)} differences in the answers")
    for line in found:
        print("  " + line[:220])
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())

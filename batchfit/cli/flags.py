"""Each option's command-line flag, declared once: the flag is the option's name with dashes, its
help the keyword's one documentation (`batchfit.probe.keywords`), its default `Options`'.

A command adds the flags of the options its Python function takes (`add_option_flags`), and
`batchfit.cli.arguments.option_keywords` passes what was given back under the option's name, so a
new option with a line in `FLAGS` reaches every command whose function takes it.
"""

from __future__ import annotations

import argparse
from typing import Any

from batchfit.cli.values import (
    batch_count,
    count,
    finite_seconds,
    fraction,
    int_at_least,
    positive_int,
    reserve,
    seconds,
)
from batchfit.probe import Options
from batchfit.probe.keywords import keyword_docs, keywords_of
from batchfit.probe.options import AMPS, MODES

#: How the command line reads each option it has a flag for (argparse's keywords). An option not
#: here has no flag: a callable comes from the target file (`batchfit.targets.EXTRA_KEYS`), and
#: `restore_rng` / `distributed` are the Python caller's (a command restores its own process, and
#: joins a process group when launched under `torchrun`).
FLAGS: dict[str, dict[str, Any]] = {
    "reserve": {"type": reserve, "metavar": "SIZE|auto"},
    "rank_timeout": {"type": finite_seconds, "metavar": "SECONDS"},
    "amp": {"choices": AMPS},
    "mode": {"choices": MODES},
    "headroom": {"type": fraction},
    "init_batch": {"type": positive_int, "metavar": "N"},
    "max_batch": {"type": positive_int, "metavar": "N"},
    "multiple_of": {"type": positive_int, "metavar": "N"},
    "strategy": {"choices": ("interpolate", "binary")},
    "steps_per_trial": {"type": positive_int, "metavar": "N"},
    "verify_steps": {"type": count, "metavar": "N"},
    "time_budget": {"type": seconds, "metavar": "SECONDS"},
    "seq_len": {"type": positive_int, "metavar": "N"},
    "scan_batches": {"type": batch_count, "metavar": "N|all"},
    "timed_steps": {"type": count, "metavar": "N"},
    "max_new_tokens": {"type": positive_int, "metavar": "N"},
    "eval": {"action": "store_true"},
    "noise_scale": {"action": "store_true"},
    "noise_passes": {"type": int_at_least(4), "metavar": "N"},
    "cache": {"metavar": "DIR"},
}

#: `find`'s options without a flag on ``batchfit fit``: those `batchfit.fit` refuses (it sizes training,
#: and keys no cache), and the wait for other ranks (the command refuses ``torchrun``: one process).
FIT_REFUSES = ("mode", "max_new_tokens", "eval", "cache", "noise_scale", "noise_passes", "rank_timeout")


def rank_wait_s(args: argparse.Namespace) -> float:
    """``--rank-timeout``, else ``find()``'s default: also how long a rank waits for the others to
    join the process group (``Launch.start``), which comes before the target and its keywords."""
    return float(args.rank_timeout if args.rank_timeout is not None else Options.rank_timeout)


#: Options whose value the command line reads itself (the header's mode): their flag defaults to `Options`'.
READ_BY_THE_COMMAND = ("mode",)


def add_option_flags(parser: argparse.ArgumentParser, group: type, *, own: tuple[str, ...] = ()) -> None:
    """A flag for every option of `group` (a `TypedDict` of `batchfit.probe.keywords`) that has one,
    but those the command declares itself or has no use for (`own`: its device and memory limit,
    whose help is its own; ``batchfit fit``'s options that `batchfit.fit` refuses)."""
    docs = keyword_docs()
    for name in keywords_of(group):
        if name in own or name not in FLAGS:
            continue
        spec = {"help": docs[name].replace("`", "").replace("%", "%%"), **FLAGS[name]}
        if name in READ_BY_THE_COMMAND:
            spec["default"] = getattr(Options(), name)
        parser.add_argument("--" + name.replace("_", "-"), **spec)

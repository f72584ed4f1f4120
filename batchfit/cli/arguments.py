"""From the parsed command line to a probe's settings: the device, the limit and the header lines
that say where the probe runs, and ``find()``'s keywords (a probe's, a frontier's, a fit's)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from batchfit.backends import backend_for, default_device
from batchfit.backends.cpu import cap_words
from batchfit.backends.select import is_host
from batchfit.cli.output import UsageError
from batchfit.cli.values import as_keyword
from batchfit.distributed import Launch
from batchfit.probe.keywords import FindOptions, keywords_of
from batchfit.probe.options import check_rank_limits
from batchfit.probe.wire import CLI_CPU_MEMORY_LIMIT
from batchfit.targets import Target
from batchfit.units import format_bytes, parse_memory_limit
from batchfit.version import __version__


def probe_plan(args: argparse.Namespace, launch: Launch | None = None) -> tuple[str, str | None, list[str], int | None]:
    """The device, the memory limit, the header lines that say where the probe runs and under
    which limit, and the budget as far as it is known before the probe starts. Under
    ``torchrun`` (``launch``) each rank takes the GPU of its local rank, and its own limit when
    ``--memory-limit-per-rank`` names it."""
    device = args.device or default_device()
    if launch is not None:
        device = launch.device_for(device)
    limit, source = rank_limit(args, launch)
    header = [f"batchfit {__version__}: probing {args.target} ({args.mode}) on {device}"]
    limit, lines, expected = limit_lines(device, limit, bool(args.device), args.reserve, source)
    header += lines
    if args.require_batch is not None:
        header.append(f"gate: does batch {args.require_batch} fit?")
    return device, limit, header, expected


def rank_limit(args: argparse.Namespace, launch: Launch | None) -> tuple[str | None, str]:
    """``--memory-limit``, or this rank's own from ``--memory-limit-per-rank`` (every use of the
    flag checked together against the job's ranks: `batchfit.probe.options.check_rank_limits`),
    and the flag it came from. Without ``torchrun`` the per-rank flag is refused."""
    given = getattr(args, "memory_limit_per_rank", None)
    if not given:
        return args.memory_limit, "--memory-limit"
    if launch is None:
        raise UsageError(
            "--memory-limit-per-rank gives each rank of a torchrun job its own limit: run it under torchrun "
            "(torchrun --nproc-per-node N -m batchfit probe ...), or use --memory-limit for one process"
        )
    try:
        limits = check_rank_limits([pair for pairs in given for pair in pairs], launch.world_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if launch.rank in limits:
        return str(limits[launch.rank]), f"--memory-limit-per-rank for rank {launch.rank}"
    return args.memory_limit, f"--memory-limit; rank {launch.rank} is not in --memory-limit-per-rank"


def limit_lines(
    device: str, limit: str | None, device_given: bool, reserve: str | None, source: str = "--memory-limit"
) -> tuple[str | None, list[str], int | None]:
    """The limit a command probes under on ``device`` (on the CPU without one, the CLI's default),
    the header lines that say it, and the budget in bytes as far as it is known now. A CPU limit
    over what the host lets a probe take is said capped here, before the probe
    (`cpu_budget`), not only in a note after it."""
    lines: list[str] = []
    if is_host(device):
        why = "" if device_given else "no GPU: "
        if limit is None:
            limit, source = CLI_CPU_MEMORY_LIMIT, "the CLI's CPU default; --memory-limit SIZE to change"
        budget, capped = cpu_budget(limit)
        if budget is not None and capped is not None:
            lines.append(
                f"{why}running on CPU under a limit of {format_bytes(budget)} on live tensor bytes: {source} "
                f"{shown_limit(limit, 'the host memory available')} is capped: on the CPU {capped}"
            )
        else:
            shown = shown_limit(limit, "the host memory available")
            lines.append(f"{why}running on CPU under a limit of {shown} on live tensor bytes ({source})")
        return limit, lines, budget if budget is not None else _bytes(limit)
    if limit is not None:
        taken = f" less --reserve {reserve}" if reserve else ""
        lines.append(f"memory limit {shown_limit(limit)} ({source}{taken}), counting reserved bytes")
    return limit, lines, _bytes(limit)


def cpu_budget(limit: int | float | str) -> tuple[int | None, str | None]:
    """A CPU limit (bytes, a size, or a fraction of the host memory available) as a probe started now
    holds it: capped at what the CPU backend lets a probe reach (`SAFE_CPU_FRACTION` of the memory
    available, as the README promises), and the words that say so when the cap applies; ``(None,
    None)`` where the host's memory cannot be read (the probe then says what it does)."""
    host = torch.device("cpu")
    backend = backend_for(host)
    available, cap = backend.limit_total_bytes(host), backend.reachable_bytes(host)
    if available is None or cap is None:
        return None, None
    wanted = parse_memory_limit(limit, available)
    return (wanted, None) if wanted <= cap else (cap, cap_words(available))


def _bytes(limit: str | None) -> int | None:
    """A limit's bytes where they are known before the probe (a fraction is known once it has read the device)."""
    try:
        return parse_memory_limit(limit, None) if limit is not None else None
    except ValueError:
        return None


def shown_limit(limit: str, of: str = "the device's memory") -> str:
    try:
        return format_bytes(parse_memory_limit(limit, None))
    except ValueError:
        return f"{float(limit):.0%} of {of}"


def find_kwargs(args: argparse.Namespace, target: Target | None, device: str, limit: str | None) -> dict[str, Any]:
    """`batchfit.find`'s keywords for `batchfit probe`: the target's extras, the command line's
    options, and the device and limit the probe resolved."""
    extras = target.extras if target is not None else {}
    return {**extras, **option_keywords(args, FindOptions), "device": device, "memory_limit": limit}


def option_keywords(args: argparse.Namespace, group: type) -> dict[str, Any]:
    """Every option of `group` (a `TypedDict` of `batchfit.probe.keywords`) the command line gave:
    a flag is the option's name with dashes (`--init-batch` is `init_batch`), so a new option
    reaches every command that declares its flag without being listed here; unset flags are left
    to [`Options`][batchfit.Options]' defaults."""
    return {
        name: as_keyword(getattr(args, name)) for name in keywords_of(group) if getattr(args, name, None) is not None
    }

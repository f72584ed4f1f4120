"""From the parsed command line to a probe's settings: the device, the limit and the header lines
that say where the probe runs, and ``find()``'s keywords. Shared by a probe and by one rank of a
``--nproc-per-trial`` job, which must run with exactly the same settings."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from batchfit.cli.parser import CLI_CPU_MEMORY_LIMIT
from batchfit.cli.values import as_keyword
from batchfit.probe.keywords import FindOptions, keywords_of
from batchfit.units import format_bytes, parse_memory_limit
from batchfit.version import __version__

if TYPE_CHECKING:
    from batchfit.cli.targets import Target
    from batchfit.distributed import Launch


def probe_plan(args: argparse.Namespace, launch: Launch | None = None) -> tuple[str, str | None, list[str], int | None]:
    """The device, the memory limit, the header lines that say where the probe runs and under
    which limit, and the budget as far as it is known before the probe starts. Under
    ``torchrun`` (``launch``) each rank takes the GPU of its local rank."""
    from batchfit.backends import default_device

    device = args.device or default_device()
    if launch is not None:
        device = launch.device_for(device)
    limit = args.memory_limit
    header = [f"batchfit {__version__}: probing {args.target} ({args.mode}) on {device}"]
    on_cpu = device.split(":")[0] == "cpu"
    if on_cpu:
        why = "" if args.device else "no GPU: "
        if limit is None:
            limit = CLI_CPU_MEMORY_LIMIT
            source = "the CLI's CPU default; --memory-limit SIZE to change"
        else:
            source = "--memory-limit"
        shown = shown_limit(limit)
        header.append(f"{why}running on CPU under a limit of {shown} on live tensor bytes ({source})")
    elif limit is not None:
        reserve = f" less --reserve {args.reserve}" if args.reserve else ""
        header.append(f"memory limit {shown_limit(limit)} (--memory-limit{reserve}), counting reserved bytes")
    if args.require_batch is not None:
        header.append(f"gate: does batch {args.require_batch} fit?")
    try:
        expected = parse_memory_limit(limit, None) if limit is not None else None
    except ValueError:  # a fraction: known once the probe has read the device
        expected = None
    return device, limit, header, expected


def shown_limit(limit: str) -> str:
    try:
        return format_bytes(parse_memory_limit(limit, None))
    except ValueError:
        return f"{float(limit):.0%} of the device's memory"


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
        name: as_keyword(getattr(args, name))
        for name in keywords_of(group)
        if getattr(args, name, None) is not None
    }

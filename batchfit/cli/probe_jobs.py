"""``--nproc-per-trial``: the driver's side (a search whose trials are fresh torchrun jobs) and the
side of one rank of such a job. The jobs themselves are ``batchfit.probe.job_runner``'s."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchfit.cli.arguments import find_kwargs, probe_plan
from batchfit.cli.output import EXIT_ERROR
from batchfit.errors import first_line

if TYPE_CHECKING:
    from batchfit.distributed import Launch


def run_jobs(args: argparse.Namespace, kwargs: dict[str, Any], callbacks: dict[str, Any]) -> Any:
    """The search whose trials are jobs: [`find_sharded`][batchfit.find_sharded]'s, one path for both."""
    from batchfit.api_jobs import find_sharded

    return find_sharded(
        args.target,
        args.nproc_per_trial,
        trial_log=args.trial_log,
        trial_timeout=args.trial_timeout,
        guess=args.guess,
        estimate=not args.no_estimate,
        **kwargs,
        **callbacks,
    )


def rank_timeout(args: argparse.Namespace) -> float:
    """``--rank-timeout``, else ``find()``'s default: also how long a rank waits for the others to
    join the process group (``Launch.start``), which comes before the target and its keywords."""
    from batchfit.probe import Options

    return float(args.rank_timeout if args.rank_timeout is not None else Options.rank_timeout)


def trial_worker(args: argparse.Namespace, launch: Launch) -> int:
    """One rank of a ``--nproc-per-trial`` job: join the group, *then* load the target (its factory
    may shard the model), run one trial, write the verdict (``batchfit.probe.job_runner``). Silent."""
    from batchfit.probe import Options, run_worker_trial, write_verdict
    from batchfit.targets import load_target

    out = Path(args.trial_dir)
    device, limit, _, _ = probe_plan(args, launch)
    owned = False
    try:
        _, owned = launch.start(device, rank_timeout(args))
        target = load_target(args.target)
        options = Options(**find_kwargs(args, target, device, limit))
    except BaseException as exc:  # noqa: BLE001 (the driver reads the verdict; this rank ends)
        write_verdict(out, launch.rank, {"error": first_line(exc), "phase": "loading the target"})
        launch.finish(owned)
        return EXIT_ERROR
    try:
        return run_worker_trial(
            target.model,
            target.sample,
            options,
            args.trial_batch,
            args.trial_steps,
            out,
            launch.rank,
            args.trial_cap,
            args.trial_headroom,
        )
    finally:
        launch.finish(owned)

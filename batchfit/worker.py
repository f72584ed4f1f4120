"""``python -m batchfit.worker REQUEST``: the process a library call starts, never a user.

Why: a job per trial (every rank of each job, `batchfit.probe.job_runner`), the sharded estimate
(`batchfit.estimation.rank_estimate.estimate_sharded`) and the soak of a target
([`batchfit.soak`][batchfit.soak] given ``"module:factory"``) need their model in a fresh process. That
process reads one `batchfit.probe.wire.WorkerRequest` (`worker_command` starts it) and runs it:

* ``"trial"``: join the job's process group *before* the target loads (its factory may call
  ``fully_shard``), run one trial, write this rank's verdict (`batchfit.probe.job_worker`); silent;
* ``"estimate"``: join a fake process group of the request's ranks as rank 0, load the target in it,
  and write the estimate's [`Result`][batchfit.Result] (or `batchfit.errors.error_document` of what
  it raised, for the caller to raise again) to the request's ``answer_path``;
* ``"soak"``: load the target, replay the request's steps with its model and ``make_batch``
  (`batchfit.probe.soak.soak_with`, its first step from scratch, as the training run's first is) and
  write the [`Soak`][batchfit.report.varlen.Soak] (``process="fresh"``) or the error the same way.

The command line (`batchfit.cli`) is not on the way: the options come as JSON (`batchfit.probe.wire`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from batchfit.distributed import from_environment
from batchfit.errors import error_document, first_line
from batchfit.estimation.fake_ranks import fake_group
from batchfit.estimation.rank_estimate import estimate_in_group
from batchfit.probe import Options, Prober
from batchfit.probe.job_worker import run_worker_trial, write_verdict
from batchfit.probe.soak import soak_with
from batchfit.probe.wire import WorkerRequest, from_wire
from batchfit.targets import TargetError, load_sharded, load_target, sharded_builder

__all__ = ["main"]

#: The worker's exit codes: its answer is in its files; these say only whether it has one.
_OK, _FAILED, _USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the one request named on the command line; the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m batchfit.worker REQUEST (started by batchfit itself)", file=sys.stderr)
        return _USAGE
    request = WorkerRequest.read(Path(args[0]))
    run = {"trial": run_trial, "estimate": run_estimate, "soak": run_soak}[request.kind]
    return run(request)


def run_trial(request: WorkerRequest) -> int:
    """One rank of a job: join the group, *then* load the target, run one trial, write the verdict."""
    launch = from_environment()
    if launch is None:
        print("batchfit: error: a trial worker is a rank of a torchrun job: batchfit starts it so", file=sys.stderr)
        return _USAGE
    out = Path(request.out)
    owned = False
    try:
        given = from_wire(request.options)
        device = launch.device_for(str(given.device))
        _, owned = launch.start(device, given.wait_for_ranks_s)
        target = load_target(request.target)
        options = replace(from_wire(request.options, **target.extras), device=device)
    except BaseException as exc:  # noqa: BLE001 (the driver reads the verdict; this rank ends)
        write_verdict(out, launch.rank, {"error": first_line(exc), "phase": "loading the target"})
        launch.finish(owned)
        return _FAILED
    try:
        return run_worker_trial(
            target.model,
            target.sample,
            options,
            int(request.batch_size or 1),
            int(request.steps or 1),
            out,
            launch.rank,
            request.cap_bytes,
            request.headroom,
        )
    finally:
        launch.finish(owned)


def run_estimate(request: WorkerRequest) -> int:
    """The sharded estimate, as rank 0 of a fake group: its `Result`, or its error, to ``answer_path``."""
    world_size, spec = request.world_size, request.target
    try:
        with fake_group(world_size):
            target = load_sharded(spec, world_size)
            kwargs = {**target.extras, **request.options}
            del target
            result = estimate_in_group(sharded_builder(spec, world_size), world_size, where=spec, **kwargs)
    except Exception as exc:  # noqa: BLE001 (raised again by estimate_sharded, in the caller's process)
        request.answer_path.write_text(json.dumps(error_document(exc)))
        print(f"batchfit: error: {exc}", file=sys.stderr)
        return _FAILED
    request.answer_path.write_text(result.to_json())
    return _OK


def run_soak(request: WorkerRequest) -> int:
    """The soak of the target's model and ``make_batch``, in this process started for it: its `Soak`
    (``process="fresh"``), or its error, to ``answer_path``."""
    try:
        target = load_target(request.target, lengths=True)  # of a sample and a make_batch: make_batch
        code = dict(target.extras)
        make_batch = code.pop("make_batch", None)
        if make_batch is None:
            raise TargetError(
                f"{request.target} gave no make_batch(batch_size, seq_len): a soak in a fresh process builds "
                "each step's batch with the target's; return a mapping with 'model' and 'make_batch'"
            )
        options = from_wire(request.options, **code)
        model = target.model
        del target

        def make_prober(shaped: Options) -> Prober:
            return Prober(model, None, options=shaped)

        shapes = [(rows, seq_len) for rows, seq_len in request.shapes or []]
        soak = soak_with(make_batch, shapes, options, make_prober, request.name or "sampler")
    except Exception as exc:  # noqa: BLE001 (raised again by batchfit.soak, in the caller's process)
        request.answer_path.write_text(json.dumps(error_document(exc)))
        print(f"batchfit: error: {exc}", file=sys.stderr)
        return _FAILED
    request.answer_path.write_text(replace(soak, process="fresh").to_json())
    return _OK


if __name__ == "__main__":
    raise SystemExit(main())

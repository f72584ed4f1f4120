"""``batchfit estimate TARGET --world-size W``: one rank's answer for an FSDP2 job of W ranks, on fake tensors.

The process joins a fake process group of W ranks as rank 0 *before* the target loads (as a rank
of a ``--nproc-per-trial`` job joins its group first), so the target's ``fully_shard`` shards over
W ranks; `batchfit.estimation.rank_estimate` does the rest. With the hidden ``--keywords-json PATH`` it
is `batchfit.estimation.rank_estimate.estimate_sharded`'s process: the keywords come from that file and
the answer, or the error, goes to ``--json`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfit.cli.output import EXIT_ERROR, EXIT_OK, EXIT_USAGE, UsageError, error, report_exception, write_json

#: Messages of torch when a target asks for CUDA on a machine without it.
_NO_CUDA = ("Torch not compiled with CUDA", "Found no NVIDIA driver", "No CUDA GPUs are available")


def check_sharded_flags(args: argparse.Namespace) -> None:
    """What ``--world-size`` does not go with, refused before the target loads."""
    alone = [name for name, given in (("--seq-lens", args.seq_lens is not None), ("--what-if", args.what_if)) if given]
    if alone:
        raise UsageError(f"--world-size (a sharded estimate) does not go with {', '.join(alone)} yet")


def load_sharded(spec: str, world_size: int) -> Any:
    """The target, loaded in the fake group; a mesh the group cannot build, or a target that asks
    for CUDA where there is none, is a ``ValueError`` that says so."""
    from batchfit.errors import first_line
    from batchfit.targets import TargetCallError, load_target

    try:
        return load_target(spec)
    except TargetCallError as exc:
        cause = exc.__cause__
        if cause is None:
            raise
        frames = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(cause.__traceback__)]
        if any(name.endswith("torch/distributed/device_mesh.py") for name in frames):
            raise ValueError(
                f"{spec} builds a device mesh that the fake process group of {world_size} rank(s) cannot build "
                f"({first_line(cause)}): give --world-size the ranks the mesh spans"
            ) from None
        if any(said in str(cause) for said in _NO_CUDA):
            raise ValueError(
                f"{spec} puts its model on CUDA, which this machine does not have ({first_line(cause)}): a sharded "
                "estimate runs rank 0's program on this CPU on fake tensors. Build the model on the CPU or the meta "
                "device (fully_shard takes the mesh's device from torch.accelerator), and estimate for the card with "
                "--device cuda"
            ) from None
        raise


def _builder(spec: str, world_size: int) -> Any:
    """Builds the target afresh (a fresh job's model): ``(model, sample, optimizer)``, the optimizer
    the target gave (over that model's parameters) or ``None``."""

    def build() -> tuple[Any, Any, Any]:
        target = load_sharded(spec, world_size)
        return target.model, target.sample, target.extras.get("optimizer")

    return build


def estimate_sharded_command(
    args: argparse.Namespace, keywords: dict[str, Any], human: Any, estimated: Callable[..., tuple[Any, int | None]]
) -> int:
    """The estimate, shown and written as ``batchfit estimate``'s (keywords: the flags' own; ``estimated``:
    its way of turning a failure into an exit code)."""
    from batchfit.cli.output import plan_line
    from batchfit.estimation.fake_ranks import fake_group
    from batchfit.estimation.rank_estimate import estimate_in_group
    from batchfit.targets import TargetCallError, TargetError
    from batchfit.view.progress import make_view

    with fake_group(args.world_size):
        try:
            target = load_sharded(args.target, args.world_size)
        except (TargetError, ValueError) as exc:
            error(str(exc))
            return EXIT_USAGE
        except TargetCallError as exc:
            report_exception(exc, args.traceback, cause=True)
            return EXIT_ERROR
        kwargs = {**target.extras, **keywords}
        build = _builder(args.target, args.world_size)
        del target
        result, failed = estimated(
            lambda: estimate_in_group(build, args.world_size, where=args.target, **kwargs), args.traceback
        )
    if failed is not None:
        return failed
    make_view(human, plain=True).summary(result)
    if args.target_batch is not None or args.target_tokens is not None:
        print(plan_line(result, args.target_batch, target_tokens=args.target_tokens, seq_len=args.seq_len), file=human)
    if args.json:
        write_json(args.json, result.to_json())
    return EXIT_OK


def sharded_child(args: argparse.Namespace) -> int:
    """`estimate_sharded`'s process: keywords from ``--keywords-json``, the result or the error to ``--json``."""
    from batchfit.estimation.fake_ranks import fake_group
    from batchfit.estimation.rank_estimate import error_document, estimate_in_group

    if args.world_size is None or not args.json:
        raise UsageError("--keywords-json goes with --world-size and --json")
    try:
        keywords = json.loads(Path(args.keywords_json).read_text())
        with fake_group(args.world_size):
            target = load_sharded(args.target, args.world_size)
            kwargs = {**target.extras, **keywords}
            del target
            result = estimate_in_group(
                _builder(args.target, args.world_size), args.world_size, where=args.target, **kwargs
            )
    except Exception as exc:  # noqa: BLE001 (raised again by estimate_sharded, in the caller's process)
        write_json(args.json, json.dumps(error_document(exc)))
        print(f"batchfit: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    write_json(args.json, result.to_json())
    return EXIT_OK

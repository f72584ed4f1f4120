"""The ``batchfit`` command line: its parser, every command's arguments (their types: ``batchfit.cli.values``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from batchfit.cli.flags import FIT_REFUSES, add_option_flags
from batchfit.cli.lengths_arguments import add_buckets_flags
from batchfit.cli.output import EXIT_USAGE
from batchfit.cli.values import (
    block_names,
    int_at_least,
    memory_limit,
    positive_int,
    rank_limits,
    seconds,
    seq_lens,
    size,
)
from batchfit.probe.keywords import EstimateOptions, FindOptions, FrontierOptions
from batchfit.probe.wire import CLI_CPU_MEMORY_LIMIT
from batchfit.version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, with batchfit's error prefix: a subcommand's parser would print
    ``batchfit probe: error: ...``; every batchfit error line starts ``batchfit: error:``."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"batchfit: error: {message}\n")


# Argument parsing -------------------------------------------------------------------------------
def _token_target(command: argparse.ArgumentParser) -> None:
    """``--target-tokens``, beside ``--target-batch``: the global batch in tokens (in sequences of
    ``--seq-len``, the length sized on, or the one the result records)."""
    command.add_argument(
        "--target-tokens",
        type=positive_int,
        metavar="N",
        help="instead of --target-batch: also print the plan for N tokens per optimizer step, in whole sequences "
        "of the length sized on (--seq-len, or the one the probe found); rounded up to whole sequences per rank",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="batchfit",
        description="Find the largest and the fastest batch size a PyTorch model trains with, by running real steps.",
    )
    parser.add_argument("--version", action="version", version=f"batchfit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    probe = commands.add_parser(
        "probe",
        help="probe a model's batch size limits",
        description=(
            "Run real training steps at growing batch sizes until one runs out of memory, then find the "
            "boundary. Exit codes: 0 ok, 1 error, 2 usage or bad target, 3 does not fit, 130 Ctrl-C, "
            "141 stdout closed, 143 SIGTERM."
        ),
        epilog=(
            "TARGET is 'package.module:factory' or 'path/to/file.py:factory'. The factory is called with no "
            "arguments and returns (model, sample), or a dict with 'model' and 'sample' and optionally "
            "'optimizer', 'loss_fn', 'make_batch', 'step_fn'. A DataLoader as the sample is sized on its worst "
            "batch. Built-in targets: batchfit.examples:mlp, "
            "batchfit.examples:cnn, batchfit.examples:gpt."
        ),
    )
    probe.add_argument("target", metavar="TARGET", help="package.module:attr or path/to/file.py:attr")
    probe.add_argument("--device", help="where to probe, e.g. cuda, cuda:1, cpu (default: cuda if available, else cpu)")
    probe.add_argument(
        "--memory-limit",
        type=memory_limit,
        metavar="SIZE|FRACTION",
        help=f"memory budget: a size (24GiB, 512MB) or a fraction of the device's total memory (0.8; on CPU, of "
        f"the available memory); on a GPU it caps what the allocator reserves; default: what the process can reach "
        f"on the GPU, or {CLI_CPU_MEMORY_LIMIT} of live tensors on CPU",
    )
    add_option_flags(probe, FindOptions, own=("device", "memory_limit"))
    probe.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-' for stdout)")
    probe.add_argument("--quiet", "-q", action="store_true", help="no live view: print one line with the answer")
    probe.add_argument(
        "--memory-limit-per-rank",
        type=rank_limits,
        action="append",
        metavar="RANK=SIZE,...",
        help="under torchrun: each listed rank's own memory budget (sizes or fractions, as --memory-limit), e.g. "
        "0=63.5MB,1=38.3MB for mixed cards; ranks not listed take --memory-limit (or its default); a rank listed "
        "twice, or one the job does not have, is refused. Each rank's own max and safe batch are then found too",
    )
    probe.add_argument(
        "--uneven",
        action="store_true",
        help="also split the recommended global batch (or --target-batch) over the ranks in proportion to each "
        "rank's own safe batch, with the loss weights that keep the gradient the mean (Result.recommend(uneven=True))",
    )
    probe.add_argument(
        "--nproc-per-trial",
        type=int_at_least(2),
        metavar="N",
        help="run every trial as a fresh torchrun job of N ranks, for sharded models (FSDP, FSDP2): the TARGET's "
        "factory runs on every rank after the process group is up, so it may shard the model; a rank that runs out "
        "of memory ends its job instead of leaving the others waiting. Run without torchrun",
    )
    probe.add_argument(
        "--trial-log",
        metavar="PATH",
        help="with --nproc-per-trial: append every job's verdicts to PATH (JSON lines); a rerun with the same "
        "settings reuses them instead of running those jobs again",
    )
    probe.add_argument(
        "--trial-timeout",
        type=seconds,
        default=600.0,
        metavar="SECONDS",
        help="with --nproc-per-trial: kill a job that gives no answer within this (default 600)",
    )
    probe.add_argument(
        "--guess",
        type=positive_int,
        metavar="N",
        help="with --nproc-per-trial: the safe batch per rank you expect; the first job verifies it and the next "
        "goes to the boundary (three jobs when it holds; the answer is exact either way)",
    )
    probe.add_argument(
        "--no-estimate",
        action="store_true",
        help="with --nproc-per-trial and no --guess: start from --init-batch, not from the sharded estimate",
    )
    probe.add_argument(
        "--require-batch",
        type=positive_int,
        metavar="N",
        help="CI gate: exit 3 unless batch N fits within the limit; runs one trial at N, and a search below N "
        "only if it fails",
    )
    probe.add_argument(
        "--target-batch",
        type=positive_int,
        metavar="N",
        help="also print the plan for a global batch of N: micro-batch x gradient-accumulation steps (x ranks)",
    )
    _token_target(probe)
    probe.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="plan and recommend for training on N ranks (default: the ranks that probed); an elastic job that "
        "restarts with other ranks keeps its --target-batch without a new probe",
    )
    probe.add_argument(
        "--compare-expandable",
        action="store_true",
        help="probe again in a child process under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and give both "
        "answers (on CUDA this happens by itself when the answer advises expandable segments)",
    )
    probe.add_argument("--traceback", action="store_true", help="on an error, print the full traceback")
    add_buckets_flags(probe)

    estimate = commands.add_parser(
        "estimate",
        help="estimate the batch limits for a memory size, without the device (fake tensors, seconds)",
        description=(
            "Run the probe's search on fake tensors: the same steps, counted as the device would count them, "
            "with no device and no memory used. Exit codes: 0 ok, 1 error, 2 usage or bad target, 3 nothing fits."
        ),
    )
    estimate.add_argument("target", metavar="TARGET", help="package.module:attr or path/to/file.py:attr")
    estimate.add_argument(
        "--memory-limit",
        type=size,
        metavar="SIZE",
        help="the device's memory: 80GiB, 24GB (required; the same option as the probe's)",
    )
    # The spelling of 0.1.0; it still works, with a deprecation warning (batchfit.cli.estimate).
    estimate.add_argument("--memory", type=size, metavar="SIZE", help=argparse.SUPPRESS)
    estimate.add_argument(
        "--device",
        metavar="cuda|rocm|cpu",
        help="what to estimate for: cuda (the caching allocator modelled; default), rocm (the same with "
        "hipBLAS/hipBLASLt workspaces) or cpu (live tensor bytes)",
    )
    estimate.add_argument(
        "--reserve",
        type=size,
        metavar="SIZE",
        help="memory outside the allocator, taken off --memory-limit (default on cuda and rocm: 1GiB, the top "
        "of the CUDA context's 0.5-1 GiB)",
    )
    add_option_flags(estimate, EstimateOptions)
    estimate.add_argument(
        "--what-if",
        action="append",
        metavar="OPTION",
        help="also estimate under OPTION (repeatable): amp=bf16, amp=fp16, checkpointing, optimizer=sgd, "
        "optimizer=adamw, optimizer=adafactor",
    )
    estimate.add_argument(
        "--target-batch", type=positive_int, metavar="N", help="also print the plan for global batch N"
    )
    _token_target(estimate)
    estimate.add_argument(
        "--seq-lens",
        type=seq_lens,
        metavar="N,N,...",
        help="estimate the frontier over these sequence lengths instead (as 'batchfit frontier' measures it): the "
        "target's make_batch takes (batch_size, seq_len)",
    )
    estimate.add_argument(
        "--max-seq-len",
        type=positive_int,
        metavar="N",
        help="with --seq-lens: the ceiling of the longest length at batch 1 (default: the model's positions)",
    )
    estimate.add_argument(
        "--no-longest", action="store_true", help="with --seq-lens: no search for the longest length at batch 1"
    )
    estimate.add_argument(
        "--plot", metavar="PATH", help="with --seq-lens: draw the frontier to an image (the plot extra)"
    )
    estimate.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="estimate one rank of a job sharded over N ranks (FSDP2): the target runs as rank 0 of a fake process "
        "group of N, after it is up, so its fully_shard calls shard over N; batch sizes are per rank",
    )
    estimate.add_argument("--json", metavar="PATH", help="write the estimate as JSON to PATH ('-' for stdout)")
    estimate.add_argument("--traceback", action="store_true", help="on an error, print the full traceback")

    _frontier_parser(commands)
    _fit_parser(commands)

    devices = commands.add_parser("devices", help="list NVIDIA GPUs: memory, utilisation, processes (via NVML)")
    devices.add_argument("--json", metavar="PATH", help="write the device list as JSON to PATH ('-' for stdout)")
    return parser


def _frontier_parser(commands: Any) -> None:
    """``batchfit frontier``: the probe's options, the lengths, and what to write."""
    frontier = commands.add_parser(
        "frontier",
        help="the largest batch at each sequence length, and the longest length at batch 1",
        description=(
            "Run the probe at each sequence length: the exact largest batch, the verified safe batch and tokens/s "
            "per length, the longest length that trains at batch 1, the token budget and the memory surface "
            "fixed + b (a s + q s^2). Exit codes: 0 ok, 1 error, 2 usage or bad target, 3 does not fit, 130 "
            "Ctrl-C, 141 stdout closed, 143 SIGTERM."
        ),
        epilog=(
            "TARGET is 'package.module:factory' or 'path/to/file.py:factory'. The factory is called with no "
            "arguments and returns a dict with 'model' and 'make_batch', a function (batch_size, seq_len) -> "
            "batch, and optionally 'optimizer', 'loss_fn', 'step_fn', 'criterion'."
        ),
    )
    frontier.add_argument("target", metavar="TARGET", help="package.module:attr or path/to/file.py:attr")
    frontier.add_argument(
        "--seq-lens",
        type=seq_lens,
        required=True,
        metavar="N,N,...",
        help="the sequence lengths to size, comma-separated: 128,256,512,1024",
    )
    frontier.add_argument(
        "--max-seq-len",
        type=positive_int,
        metavar="N",
        help="the ceiling of the search for the longest length at batch 1 (default: the model's position "
        "embeddings, when it has them)",
    )
    frontier.add_argument(
        "--no-longest", action="store_true", help="do not search for the longest length that trains at batch 1"
    )
    _add_device_and_limit(frontier)
    add_option_flags(frontier, FrontierOptions, own=("device", "memory_limit"))
    frontier.add_argument("--json", metavar="PATH", help="write the frontier as JSON to PATH ('-' for stdout)")
    frontier.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw the frontier to an image (.png, .svg, .pdf); needs the plot extra: "
        "pip install 'batchfit[plot]'",
    )
    _add_quiet_and_traceback(frontier)


def _fit_parser(commands: Any) -> None:
    """``batchfit fit``: `batchfit.fit`'s own arguments, and the probe's options that it takes."""
    fit = commands.add_parser(
        "fit",
        help="the activation-checkpointing policy that trains a target batch fastest (batchfit.fit)",
        description=(
            "Weigh, with real steps, the fewest of the model's repeated blocks checkpointed that fit --target-batch "
            "in one step against no checkpointing with gradient accumulation, and recommend the faster. Exit codes: "
            "0 ok, 1 error, 2 usage or bad target (no repeated blocks, a block name that is no module), 3 does not "
            "fit (nothing fits, or with --no-accumulate no policy fits the target in one step), 130 Ctrl-C, 141 "
            "stdout closed, 143 SIGTERM."
        ),
        epilog="TARGET is what 'batchfit probe' takes: a factory returning (model, sample) or a dict.",
    )
    fit.add_argument("target", metavar="TARGET", help="package.module:attr or path/to/file.py:attr")
    fit.add_argument(
        "--target-batch",
        type=positive_int,
        required=True,
        metavar="N",
        help="the samples one optimizer step should see (micro-batch x accumulation); required",
    )
    fit.add_argument(
        "--checkpointing",
        type=block_names,
        default="auto",
        metavar="auto|NAME,NAME,...",
        help="the blocks to choose from: auto (every nn.ModuleList or nn.Sequential of 2+ modules of one type, "
        "e.g. transformer.h; several groups ordered by the bytes they save, measured in one step) or their "
        "module names in order, comma-separated (default auto)",
    )
    fit.add_argument(
        "--placement",
        choices=("first", "evenly"),
        default="first",
        help="k blocks checkpointed are the first k (default: their activations live longest) or spread evenly",
    )
    fit.add_argument(
        "--no-accumulate",
        action="store_true",
        help="reach --target-batch in one step, without gradient accumulation (exit 3 when no policy fits it)",
    )
    _add_device_and_limit(fit)
    add_option_flags(fit, FindOptions, own=("device", "memory_limit", *FIT_REFUSES))
    fit.add_argument("--json", metavar="PATH", help="write the fit as JSON to PATH ('-' for stdout)")
    fit.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw max batch and samples/s against blocks checkpointed to an image (.png, .svg, .pdf); "
        "needs the plot extra: pip install 'batchfit[plot]'",
    )
    _add_quiet_and_traceback(fit)


def _add_device_and_limit(command: argparse.ArgumentParser) -> None:
    """``--device`` and ``--memory-limit`` as the probe's, for a command that runs trials as it does."""
    command.add_argument(
        "--device", help="where to probe, e.g. cuda, cuda:1, cpu (default: cuda if available, else cpu)"
    )
    command.add_argument(
        "--memory-limit",
        type=memory_limit,
        metavar="SIZE|FRACTION",
        help=f"memory budget, as the probe's (default: what the process can reach on the GPU, or "
        f"{CLI_CPU_MEMORY_LIMIT} of live tensors on CPU)",
    )


def _add_quiet_and_traceback(command: argparse.ArgumentParser) -> None:
    """``--quiet`` and ``--traceback`` as the probe's."""
    command.add_argument("--quiet", "-q", action="store_true", help="no live view: print one line with the answer")
    command.add_argument("--traceback", action="store_true", help="on an error, print the full traceback")

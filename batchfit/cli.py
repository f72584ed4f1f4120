"""The ``batchfit`` command: ``batchfit probe TARGET`` and ``batchfit devices``.

Exit codes are the interface a CI pipeline reads, so they are fixed and documented:

* 0: the probe finished (with ``--require-batch N``: batch N fits).
* 1: an error, including an exception raised by the user's factory or model.
* 2: a usage error: bad option, or a bad target (no such module or attribute, a factory that
  needs arguments, a value that is not ``(model, sample)``, a sample without tensors, a model
  or sample that ``find()`` rejects before its first trial), or a ``--json`` path that cannot be
  written.
* 3: does not fit: with ``--require-batch N``, batch N ran out of memory within the limit;
  without it, not even the smallest batch fitted.
* 130: interrupted by Ctrl-C. Once the probe had started, the model and optimizer were restored
  (the message says so); while the target was still loading there was nothing to restore.
* 141: the reader of stdout went away (``batchfit probe ... | head -1``): the probe stops at its
  next line of output, quietly, with the code a shell gives a tool killed by SIGPIPE (128 + 13),
  so ``set -o pipefail`` sees that the probe did not finish; no JSON file is written.
* 143: terminated by SIGTERM during a probe (128 + 15). It unwinds as Ctrl-C does: the live
  view is taken down (a terminal gets its cursor back) and the model is restored. A second
  SIGTERM stops a probe stuck in the user's code at once (see :class:`_SigtermUnwinds`).
  Outside a probe (the target loading) SIGTERM keeps its default action.

A target that calls ``sys.exit(n)`` (at import, in its factory, in the model) does not end
batchfit with its code: that is an error in the target, reported as such, exit 1.

Under ``torchrun`` every rank runs this command and exits with these codes; only rank 0 prints
the view and writes ``--json`` (``batchfit.launch``), and another rank's failure is told by rank 0
and by the rank that failed.

Human output goes to stdout (to stderr when ``--json -`` puts the JSON on stdout). Every error
goes to stderr in a line starting with ``batchfit: error:``: batchfit's own are that one line;
a command line that argparse rejects prints the usage first (argparse's ``batchfit probe:
error:`` prefix is replaced by the same ``batchfit: error:``). ``--json PATH`` is checked before
the target is loaded, so a path that cannot be written fails at once, not after the probe.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from batchfit.units import format_bytes, parse_memory_limit, parse_reserve
from batchfit.version import __version__

if TYPE_CHECKING:
    from batchfit.launch import Launch
    from batchfit.targets import Target
    from batchfit.view import View

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
EXIT_TERMINATED = 143  # 128 + SIGTERM

#: What an interrupted probe says once it had started: ``Prober`` restores on any exit.
RESTORED = "the model and optimizer were restored"

#: Without ``--memory-limit``, a CPU probe from the command line caps live tensor bytes at this.
#: On a CPU the time of a trial grows with the memory it touches, so the cap is what keeps
#: ``batchfit probe batchfit.examples:gpt`` under a minute on a 2-core machine; it also keeps a
#: first run from taking a large share of the host. (The Python API's default is half the
#: available memory: a caller of ``find()`` chose to probe on this machine.)
CLI_CPU_MEMORY_LIMIT = "256MiB"


class _UsageError(Exception):
    """Raised inside a subcommand for a usage problem found after argument parsing."""


class _Terminated(KeyboardInterrupt):
    """SIGTERM during a probe. A ``KeyboardInterrupt`` so that it unwinds exactly as Ctrl-C does:
    past the user's ``except Exception``, through the probe's restore, to the CLI, which takes the
    view down. ``forced``: raised at once by a second SIGTERM, wherever the probe stood."""

    def __init__(self, *, forced: bool = False) -> None:
        super().__init__()
        self.forced = forced


class _SigtermUnwinds:
    """While a probe runs, SIGTERM is delivered as a Ctrl-C instead of killing the process where
    it stands, so the probe unwinds as on Ctrl-C: the model restored, the live view stopped (a
    terminal gets its cursor back); :attr:`received` then turns exit 130 into 143. Around the
    probe only: outside it SIGTERM keeps its default. Off the main thread (``main()`` called from
    a thread) no handler can be set and nothing changes.

    Delivered as a Ctrl-C means: handed to the SIGINT handler in place. During a probe that is
    ``batchfit.interrupts``' guard, which defers it to the probe's next safe point (never inside
    a meter finalizer, where it would be lost, nor half-way through the restore); where Python's
    own handler is in place, :class:`_Terminated` is raised at once, as Python raises Ctrl-C.
    A probe stuck in the user's code where no safe point comes (a forward waiting on a queue,
    with no tensor operation) would then never stop, as it would not on Ctrl-C; so a second
    SIGTERM raises at once, wherever the probe stands (the restore may be cut short: the message
    says so). Once a SIGTERM has come, later ones are ignored after the probe (``SIG_IGN``, which
    Python keeps through its shutdown where it resets its own handlers): a supervisor repeating
    SIGTERM cannot kill batchfit half-way through saying why it stopped, and the exit code stays
    143.
    """

    def __init__(self) -> None:
        self.received = False
        self._holding = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _SigtermUnwinds:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        again, self.received = self.received, True
        if self._holding:
            return
        if again:
            raise _Terminated(forced=True)
        on_interrupt = signal.getsignal(signal.SIGINT)
        if callable(on_interrupt) and on_interrupt is not signal.default_int_handler:
            on_interrupt(signal.SIGINT, frame)
        else:
            raise _Terminated()

    def hold(self) -> None:
        """From here on a SIGTERM is only recorded: the clean-up that follows runs to its end."""
        self._holding = True

    def __exit__(self, *exc_info: object) -> None:
        self._holding = True
        if not self._installed:
            return
        if self.received:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)


class _Parser(argparse.ArgumentParser):
    """argparse, with batchfit's error prefix: a subcommand's parser would print
    ``batchfit probe: error: ...``; every batchfit error line starts ``batchfit: error:``."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"batchfit: error: {message}\n")


# Argument parsing -------------------------------------------------------------------------------
def _memory_limit(value: str) -> str:
    try:
        parse_memory_limit(value, 1 << 40)  # syntax only: fractions resolve on the device later
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _reserve(value: str) -> str:
    try:
        parse_reserve(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _size(value: str) -> str:
    try:
        parse_reserve(value)  # a size or bytes, no fraction
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value.strip().lower() == "auto":
        raise argparse.ArgumentTypeError("a size is needed here, such as 80GiB")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``minimum`` (1 for sizes, 0 for step counts)."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{value!r} must be at least {minimum}")
        return number

    return parse


_positive_int = _int_at_least(1)
_count = _int_at_least(0)


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be a fraction in [0, 1)")
    return number


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be more than 0 seconds")
    return number


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
            "'optimizer', 'loss_fn', 'make_batch', 'step_fn'. Built-in targets: batchfit.examples:mlp, "
            "batchfit.examples:cnn, batchfit.examples:gpt."
        ),
    )
    probe.add_argument("target", metavar="TARGET", help="package.module:attr or path/to/file.py:attr")
    probe.add_argument("--device", help="where to probe, e.g. cuda, cuda:1, cpu (default: cuda if available, else cpu)")
    probe.add_argument(
        "--memory-limit",
        type=_memory_limit,
        metavar="SIZE|FRACTION",
        help=f"memory budget: a size (24GiB, 512MB) or a fraction of the device's total memory (0.8; on CPU, of "
        f"the available memory); on a GPU it caps what the allocator reserves; default: what the process can reach "
        f"on the GPU, or {CLI_CPU_MEMORY_LIMIT} of live tensors on CPU",
    )
    probe.add_argument(
        "--reserve",
        type=_reserve,
        metavar="SIZE|auto",
        help="memory taken off --memory-limit for what a GPU of that size loses outside the allocator (CUDA "
        "context, handles): --memory-limit 24GB --reserve 600MiB stands for a 24 GB card; 'auto' measures what "
        "the device uses outside this process's allocator now",
    )
    probe.add_argument(
        "--headroom",
        type=_fraction,
        default=0.10,
        help="fraction of the budget the safe batch leaves free (default 0.10)",
    )
    probe.add_argument("--amp", choices=("bf16", "fp16"), help="run under autocast")
    probe.add_argument("--mode", choices=("train", "inference"), default="train", help="default: train")
    probe.add_argument("--max-batch", type=_positive_int, metavar="N", help="largest batch size to try (default 32768)")
    probe.add_argument(
        "--init-batch",
        type=_positive_int,
        metavar="N",
        help="first batch size to try (default 2, or --multiple-of when larger)",
    )
    probe.add_argument(
        "--multiple-of", type=_positive_int, default=1, metavar="N", help="only try multiples of N (default 1)"
    )
    probe.add_argument(
        "--steps-per-trial",
        type=_positive_int,
        metavar="N",
        help="steps per search trial (default: 2 in the first, then 1: the optimizer state is kept between trials)",
    )
    probe.add_argument(
        "--verify-steps",
        type=_count,
        metavar="N",
        help="steps that verify the safe batch with a fresh optimizer, as a real run starts (default 3; 0 skips)",
    )
    probe.add_argument("--time-budget", type=_seconds, metavar="SECONDS", help="start no new search trial after this")
    probe.add_argument(
        "--strategy",
        choices=("interpolate", "binary"),
        help="search strategy: aim at the budget from measured memory (default), or plain bisection",
    )
    probe.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-' for stdout)")
    probe.add_argument("--quiet", "-q", action="store_true", help="no live view: print one line with the answer")
    probe.add_argument(
        "--nproc-per-trial",
        type=_int_at_least(2),
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
        type=_seconds,
        default=600.0,
        metavar="SECONDS",
        help="with --nproc-per-trial: kill a job that gives no answer within this (default 600)",
    )
    # A rank's side of a --nproc-per-trial job (started by batchfit under torchrun, not by users).
    probe.add_argument("--trial-batch", type=_positive_int, help=argparse.SUPPRESS)
    probe.add_argument("--trial-steps", type=_positive_int, default=2, help=argparse.SUPPRESS)
    probe.add_argument("--trial-dir", help=argparse.SUPPRESS)
    probe.add_argument(
        "--require-batch",
        type=_positive_int,
        metavar="N",
        help="CI gate: exit 3 unless batch N fits within the limit; runs one trial at N, and a search below N "
        "only if it fails",
    )
    probe.add_argument(
        "--target-batch",
        type=_positive_int,
        metavar="N",
        help="also print the plan for a global batch of N: micro-batch x gradient-accumulation steps (x ranks)",
    )
    probe.add_argument("--traceback", action="store_true", help="on an error, print the full traceback")
    probe.set_defaults(handler=_probe)

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
        "--memory", required=True, type=_size, metavar="SIZE", help="the device's memory: 80GiB, 24GB"
    )
    estimate.add_argument(
        "--device",
        metavar="cuda|cpu",
        help="what to estimate for: cuda (the caching allocator modelled; default) or cpu (live tensor bytes)",
    )
    estimate.add_argument(
        "--reserve",
        type=_size,
        metavar="SIZE",
        help="memory outside the allocator, taken off --memory (default on cuda: 512MiB for the context)",
    )
    estimate.add_argument("--amp", choices=("bf16", "fp16"), help="under autocast")
    estimate.add_argument("--mode", choices=("train", "inference"), default="train", help="default: train")
    estimate.add_argument("--headroom", type=_fraction, default=0.10, help="fraction the safe batch leaves free")
    estimate.add_argument("--max-batch", type=_positive_int, metavar="N", help="largest batch size to try")
    estimate.add_argument("--multiple-of", type=_positive_int, default=1, metavar="N", help="only multiples of N")
    estimate.add_argument(
        "--what-if",
        action="append",
        metavar="OPTION",
        help="also estimate under OPTION (repeatable): amp=bf16, amp=fp16, checkpointing, optimizer=sgd, "
        "optimizer=adamw, optimizer=adafactor",
    )
    estimate.add_argument(
        "--target-batch", type=_positive_int, metavar="N", help="also print the plan for global batch N"
    )
    estimate.add_argument("--json", metavar="PATH", help="write the estimate as JSON to PATH ('-' for stdout)")
    estimate.add_argument("--traceback", action="store_true", help="on an error, print the full traceback")
    estimate.set_defaults(handler=_estimate)

    devices = commands.add_parser("devices", help="list NVIDIA GPUs: memory, utilisation, processes (via NVML)")
    devices.add_argument("--json", metavar="PATH", help="write the device list as JSON to PATH ('-' for stdout)")
    devices.set_defaults(handler=_devices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m batchfit``; returns the exit code."""
    # torch warns "Failed to initialize NumPy" at import when NumPy is missing (it is optional):
    # the first thing a new user sees must be batchfit's own output.
    warnings.filterwarnings("ignore", message=r".*Failed to initialize NumPy", category=UserWarning)
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error, as argparse does
    try:
        return int(args.handler(args))
    except _UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except _Terminated:
        _error("terminated by SIGTERM")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        # Not from inside a probe (_probe answers those): the target was loading, nothing to restore.
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Our stdout's reader went away (a BrokenPipeError from the user's model is reported as an
        # error inside _probe). Python's documented way out: point stdout at devnull, so the flush
        # at exit does not raise again, and leave without a word.
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE


# probe --------------------------------------------------------------------------------------------
def _probe(args: argparse.Namespace) -> int:
    from batchfit.launch import from_environment

    launch = from_environment()
    if args.trial_batch is not None:
        if launch is None or not args.trial_dir:
            raise _UsageError("--trial-batch is the rank side of --nproc-per-trial: batchfit starts it under torchrun")
        return _trial_worker(args, launch)
    if args.nproc_per_trial is not None:
        if launch is not None:
            raise _UsageError("--nproc-per-trial starts a torchrun job per trial itself: run it without torchrun")
        if args.require_batch is not None:
            raise _UsageError("--nproc-per-trial runs a full probe: drop --require-batch")
    elif args.trial_log is not None:
        raise _UsageError("--trial-log goes with --nproc-per-trial")
    if launch is None:
        return _probe_here(args, None)
    owned: list[bool] = []
    try:
        return _probe_here(args, launch, owned)
    finally:
        launch.finish(bool(owned and owned[0]))


def _probe_here(args: argparse.Namespace, launch: Launch | None, owned: list[bool] | None = None) -> int:
    """One probe: of this process, or of this rank of a ``torchrun`` job (``launch``; ``owned``
    gets whether this process started the process group)."""
    from batchfit.view import make_view

    if args.require_batch is not None:
        conflicting = [name for name in ("max_batch", "verify_steps", "time_budget") if getattr(args, name) is not None]
        if conflicting:
            raise _UsageError(
                f"--require-batch runs a gate, not a full probe: drop --{conflicting[0].replace('_', '-')}"
            )
    _check_json_path(args.json)
    device, limit, header, expected_budget = _plan(args, launch)
    backend = ""
    if launch is not None:
        # The group first: a target's factory may need it (fully_shard, a rank-dependent build).
        try:
            backend, started = launch.start(device)
        except Exception as exc:
            _report_exception(
                exc, args.traceback, cause=False, text=f"cannot join the torchrun job: {_first_line(exc)}"
            )
            return EXIT_ERROR
        if owned is not None:
            owned.append(started)
    target: Target | None = None
    if args.nproc_per_trial is None:  # with it, only the ranks of each job load the target
        loaded = _load(args)
        if isinstance(loaded, int):
            return loaded
        target = loaded

    human = sys.stderr if args.json == "-" else sys.stdout
    leader = launch is None or launch.is_leader
    if launch is not None and target is not None:
        try:
            model, wrapped = launch.wrap(target.model, device)
        except Exception as exc:
            _report_exception(
                exc, args.traceback, cause=False, text=f"cannot join the torchrun job: {_first_line(exc)}"
            )
            return EXIT_ERROR
        target = replace(target, model=model)
        header.append(
            f"torchrun: rank {launch.rank} of {launch.world_size} ({backend}); the model "
            + ("was wrapped in DistributedDataParallel" if wrapped else "was left as the target built it")
            + "; batch sizes are per rank"
        )
    if args.nproc_per_trial is not None:
        header.append(
            f"every trial runs as a fresh torchrun job of {args.nproc_per_trial} ranks (--nproc-per-trial)"
            + (f"; trial log {args.trial_log}" if args.trial_log else "")
        )
    # Only rank 0 speaks for the group; the others print only their own errors.
    view = make_view(human if leader else open(os.devnull, "w"), quiet=args.quiet or not leader)
    kwargs = _find_kwargs(args, target, device, limit)
    calls = _Calls(view)
    failure: BaseException | None = None
    with _SigtermUnwinds() as sigterm:
        try:
            try:
                view.start(header, expected_budget)
                outcome = _run_probe(args, target, kwargs, calls)
                view.set_budget(outcome.budget_bytes)  # the budget the probe really had, for the final frame
            except BaseException as exc:  # Ctrl-C and SIGTERM too: the view comes down either way
                failure = exc
        finally:
            sigterm.hold()
            view.stop()  # on a terminal this shows the cursor again, whatever ended the probe
    if sigterm.received and (failure is None or type(failure) is KeyboardInterrupt):
        # The Ctrl-C a SIGTERM was delivered as (or a SIGTERM that came as the probe returned).
        failure = _Terminated()
    if failure is not None:
        return _probe_failed(failure, calls, args.traceback, leader)
    if args.require_batch is not None:
        view.gate(outcome)
        code = EXIT_OK if outcome.fits else EXIT_DOES_NOT_FIT
    else:
        view.summary(outcome)
        code = EXIT_OK
        if args.target_batch is not None and leader:
            print(_plan_line(outcome, args.target_batch), file=human)
    if args.json and leader:
        _write_json(args.json, outcome.to_json())
    return code


def _run_probe(args: argparse.Namespace, target: Target | None, kwargs: dict[str, Any], calls: _Calls) -> Any:
    """The gate (``--require-batch``) or the full search; its ``GateReport`` or ``Result``.
    Without a target (``--nproc-per-trial``), a job per trial (``batchfit.relaunch``)."""
    if target is None:
        return _run_jobs(args, kwargs, calls)
    if args.require_batch is not None:
        from batchfit.testing import check_fits

        return check_fits(target.model, target.sample, batch_size=args.require_batch, **calls.kwargs(), **kwargs)
    from batchfit.finder import find_with
    from batchfit.options import Options

    return find_with(target.model, target.sample, Options(**kwargs), **calls.kwargs())


def _load(args: argparse.Namespace) -> Target | int:
    """The target, or the exit code of why it could not be loaded (said on stderr). Importing a
    model and building it can take seconds: a terminal is told meanwhile, on a line that goes
    away when the target is in."""
    from batchfit.targets import TargetCallError, TargetError, load_target

    stream = sys.stderr if getattr(args, "json", None) == "-" else sys.stdout
    waiting = _is_terminal(stream) and not getattr(args, "quiet", False)
    if waiting:
        stream.write(f"batchfit: loading {args.target} (importing it, building the model)...")
        stream.flush()
    try:
        return load_target(args.target)
    except TargetError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except TargetCallError as exc:
        _report_exception(exc, args.traceback, cause=True)
        return EXIT_ERROR
    finally:
        if waiting:
            stream.write("\r\x1b[2K")  # the loading line goes; the probe's header takes its place
            stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _plan_line(result: Any, target_batch: int) -> str:
    """The plan for ``--target-batch``, or why there is none (a target the ranks cannot share)."""
    from batchfit.planning import plan_for

    try:
        return f"plan             {plan_for(result, target_batch)}"
    except ValueError as exc:
        return f"plan             none: {exc}"


def _estimate(args: argparse.Namespace) -> int:
    from batchfit.backends.simulated import DEFAULT_ESTIMATE_TARGET, estimate_target
    from batchfit.errors import NothingFitsError
    from batchfit.estimation import estimate
    from batchfit.view import make_view
    from batchfit.whatif import OPTIONS, what_if

    for option in args.what_if or ():
        if option not in OPTIONS:
            raise _UsageError(f"unknown --what-if {option!r}: choose from {', '.join(OPTIONS)}")
    args.device = args.device or DEFAULT_ESTIMATE_TARGET
    try:
        estimate_target(args.device)
    except ValueError as exc:
        raise _UsageError(f"--device: {exc}") from None
    _check_json_path(args.json)
    human = sys.stderr if args.json == "-" else sys.stdout
    target = _load(args)
    if isinstance(target, int):
        return target
    kwargs: dict[str, Any] = {
        **{k: v for k, v in target.extras.items() if k in ("optimizer", "loss_fn", "step_fn", "make_batch")},
        "memory": args.memory,
        "device": args.device,
        "reserve": args.reserve,
        "amp": args.amp,
        "mode": args.mode,
        "headroom": args.headroom,
        "multiple_of": args.multiple_of,
    }
    if args.max_batch is not None:
        kwargs["max_batch"] = args.max_batch
    print(
        f"batchfit {__version__}: estimating {args.target} ({args.mode}) for {args.device} with {args.memory}: "
        "fake tensors, no device and no memory used",
        file=human,
    )
    try:
        result = estimate(target.model, target.sample, **kwargs)
        table = what_if(target.model, target.sample, options=args.what_if, **kwargs) if args.what_if else None
    except NothingFitsError as exc:
        _error(str(exc))
        return EXIT_DOES_NOT_FIT
    except (TypeError, ValueError) as exc:
        _error(_first_line(exc))
        return EXIT_USAGE
    except Exception as exc:
        _report_exception(exc, args.traceback, cause=False)
        return EXIT_ERROR
    make_view(human, plain=True).summary(result)
    if args.target_batch is not None:
        print(_plan_line(result, args.target_batch), file=human)
    if table is not None:
        print(table, file=human)
    if args.json:
        _write_json(args.json, result.to_json())
    return EXIT_OK


def _run_jobs(args: argparse.Namespace, kwargs: dict[str, Any], calls: _Calls) -> Any:
    import time

    import torch

    from batchfit.finder import search_with
    from batchfit.options import Options
    from batchfit.relaunch import JobPerTrial

    options = Options(**kwargs)
    worker = [args.target, "--device", str(kwargs["device"]), "--mode", args.mode]
    for flag, value in (("--memory-limit", kwargs["memory_limit"]), ("--reserve", args.reserve), ("--amp", args.amp)):
        if value is not None:
            worker += [flag, str(value)]
    key = {
        "target": args.target,
        "nproc": args.nproc_per_trial,
        "worker": worker[1:],
        "torch": torch.__version__,
        "batchfit": __version__,
    }
    log = Path(args.trial_log) if args.trial_log else None
    prober = JobPerTrial(worker, args.nproc_per_trial, options, log=log, timeout_s=args.trial_timeout, key=key)
    return search_with(prober, options, time.monotonic(), **calls.kwargs())


def _trial_worker(args: argparse.Namespace, launch: Launch) -> int:
    """One rank of a ``--nproc-per-trial`` job: join the group, *then* load the target (its factory
    may shard the model), run one trial, write the verdict (``batchfit.relaunch``). Silent."""
    from batchfit.options import Options
    from batchfit.relaunch import run_worker_trial, write_verdict
    from batchfit.targets import load_target

    out = Path(args.trial_dir)
    device, limit, _, _ = _plan(args, launch)
    owned = False
    try:
        _, owned = launch.start(device)
        target = load_target(args.target)
        options = Options(**_find_kwargs(args, target, device, limit))
    except BaseException as exc:  # noqa: BLE001 (the driver reads the verdict; this rank ends)
        write_verdict(out, launch.rank, {"error": _first_line(exc), "phase": "loading the target"})
        launch.finish(owned)
        return EXIT_ERROR
    try:
        return run_worker_trial(
            target.model, target.sample, options, args.trial_batch, args.trial_steps, out, launch.rank
        )
    finally:
        launch.finish(owned)


class _Calls:
    """Forwards ``find()``'s callbacks to the view and remembers the trial in flight: whether
    one started tells a rejected input (usage) from an error inside the user's model, and which
    one it was says where the user's code called ``sys.exit()``."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.started = False
        self.current: tuple[int, str] | None = None  # (batch size, kind) of the last trial started

    def on_trial_start(self, batch_size: int, kind: str) -> None:
        self.started = True
        self.current = (batch_size, kind)
        self.view.trial_started(batch_size, kind)

    def on_start(self, device: Any, budget_bytes: int | None) -> None:
        self.view.set_budget(budget_bytes)

    def kwargs(self) -> dict[str, Any]:
        return {"callback": self.view.trial_finished, "on_trial_start": self.on_trial_start, "on_start": self.on_start}


def _plan(args: argparse.Namespace, launch: Launch | None = None) -> tuple[str, str | None, list[str], int | None]:
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
        shown = _shown_limit(limit)
        header.append(f"{why}running on CPU under a limit of {shown} on live tensor bytes ({source})")
    elif limit is not None:
        reserve = f" less --reserve {args.reserve}" if args.reserve else ""
        header.append(f"memory limit {_shown_limit(limit)} (--memory-limit{reserve}), counting reserved bytes")
    if args.require_batch is not None:
        header.append(f"gate: does batch {args.require_batch} fit?")
    try:
        expected = parse_memory_limit(limit, None) if limit is not None else None
    except ValueError:  # a fraction: known once the probe has read the device
        expected = None
    return device, limit, header, expected


def _shown_limit(limit: str) -> str:
    try:
        return format_bytes(parse_memory_limit(limit, None))
    except ValueError:
        return f"{float(limit):.0%} of the device's memory"


def _find_kwargs(args: argparse.Namespace, target: Target | None, device: str, limit: str | None) -> dict[str, Any]:
    """``batchfit.options.Options`` keywords: the target's extras and the command line's options."""
    kwargs: dict[str, Any] = {
        **(target.extras if target is not None else {}),
        "device": device,
        "memory_limit": limit,
        "reserve": args.reserve,
        "amp": args.amp,
        "mode": args.mode,
        "multiple_of": args.multiple_of,
        "steps_per_trial": args.steps_per_trial,
        "headroom": args.headroom,
    }
    for name in ("max_batch", "init_batch", "verify_steps", "strategy"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.time_budget is not None:
        kwargs["time_budget"] = args.time_budget
    return kwargs


def _probe_failed(exc: BaseException, calls: _Calls, show_traceback: bool, leader: bool = True) -> int:
    """The exit code (and the one line) for whatever ended a probe that had started. Under
    ``torchrun`` another rank's failure is told by rank 0 (and by the failing rank) only."""
    from batchfit.errors import NothingFitsError, RankFailedError

    if isinstance(exc, RankFailedError) and not leader:
        return EXIT_ERROR
    from batchfit.targets import exit_call
    from batchfit.view import OutputClosedError

    if isinstance(exc, _Terminated):
        if exc.forced:
            _error("terminated by a second SIGTERM, at once: the model and optimizer may not have been restored")
        else:
            _error(f"terminated by SIGTERM ({RESTORED})")
        return EXIT_TERMINATED
    if isinstance(exc, KeyboardInterrupt):
        _error(f"interrupted ({RESTORED})")
        return EXIT_INTERRUPTED
    if isinstance(exc, OutputClosedError):  # our reader left: main() exits quietly
        raise exc
    if isinstance(exc, SystemExit):  # the user's code, in a trial: an error, not batchfit's exit code
        where = "during the probe"
        if calls.current is not None:
            batch_size, kind = calls.current
            where = f"during a {kind} trial at batch size {batch_size}"
        _report_exception(exc, show_traceback, cause=False, text=f"the target called {exit_call(exc)} {where}")
        return EXIT_ERROR
    if isinstance(exc, NothingFitsError):
        _error(str(exc))
        return EXIT_DOES_NOT_FIT
    if isinstance(exc, (TypeError, ValueError)) and not calls.started:
        # find() checks its input before the first trial: what it rejects there is the target's
        # sample or model, or an option (a device that is not there), not a failure of a run.
        _error(f"{_first_line(exc)}")
        return EXIT_USAGE
    if not isinstance(exc, Exception):
        raise exc
    _report_exception(exc, show_traceback, cause=False)
    return EXIT_ERROR


def _report_exception(exc: BaseException, show_traceback: bool, *, cause: bool, text: str | None = None) -> None:
    """One line for the error (with batchfit's note on where it happened), the traceback only
    when asked: the user's own frames are in it."""
    shown = exc.__cause__ if cause and exc.__cause__ is not None else exc
    if show_traceback:
        traceback.print_exception(shown, file=sys.stderr)
    notes = [n.removeprefix("batchfit: ") for n in getattr(shown, "__notes__", ())]
    if text is None:
        text = str(exc) if cause else _first_line(exc)
    if notes:
        text += f" ({'; '.join(notes)})"
    if not show_traceback:
        text += " [--traceback shows where]"
    _error(text)


def _first_line(exc: BaseException) -> str:
    from batchfit.oom import first_line

    return first_line(exc)


# devices ------------------------------------------------------------------------------------------
def _devices(args: argparse.Namespace) -> int:
    import json

    from batchfit.nvml import query_devices
    from batchfit.view import devices_lines

    _check_json_path(args.json)
    report = query_devices()
    human = sys.stderr if args.json == "-" else sys.stdout
    for line in devices_lines(report):
        print(line, file=human)
    if args.json:
        _write_json(args.json, json.dumps(asdict(report), indent=2, sort_keys=True))
    return EXIT_OK


# helpers ------------------------------------------------------------------------------------------
def _check_json_path(path: str | None) -> None:
    """Refuse (exit 2) a ``--json PATH`` that cannot be written before anything runs: found out
    after the probe, it would cost the whole probe. Permissions as ``os.access`` sees them (root
    passes); what only the write can find out (a full disk) is still reported by ``_write_json``."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(path) or os.curdir
    if os.path.isdir(path):
        problem = "it is a folder"
    elif not os.path.exists(folder):
        problem = f"its folder {folder!r} does not exist"
    elif not os.path.isdir(folder):
        problem = f"{folder!r} is not a folder"
    elif os.path.exists(path):
        problem = "" if os.access(path, os.W_OK) else "the file is not writable"
    else:
        problem = "" if os.access(folder, os.W_OK | os.X_OK) else f"its folder {folder!r} is not writable"
    if problem:
        raise _UsageError(f"cannot write --json {path!r}: {problem}")


def _stdout_to_devnull() -> None:
    """After a broken pipe: what is still buffered for stdout goes nowhere, quietly, at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (replaced, closed): nothing left to flush into a pipe
        pass


def _write_json(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    try:
        Path(path).write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise _UsageError(f"cannot write --json {path!r}: {exc.strerror or exc}") from None


def _error(message: str, stream: TextIO | None = None) -> None:
    try:
        print(f"batchfit: error: {message}", file=stream or sys.stderr)
    except BrokenPipeError:  # stderr's reader is gone too (`2>&1 | head`): no one is left to tell
        pass

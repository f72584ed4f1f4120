"""Every keyword an entry point takes, each named, typed and documented once, in groups.

An entry point takes the groups that apply to it as `**options: Unpack[...]`, so that type
checkers and the docs show each keyword without the entry point restating it: `find` takes
`FindOptions` (all of them), `frontier` `FrontierOptions`, `noise_scale` `NoiseOptions`, `estimate`
`EstimateOptions`, and the integrations and the gate `find`'s. The defaults live in one place,
[`Options`][batchfit.Options], which validates what an entry point was given
(`options_from`); `tests/test_options_once.py` holds the two to the same names and types.

Pure Python: no torch import (the CLI validates before loading torch).
"""

from __future__ import annotations

import ast
import difflib
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from batchfit.report import DeviceInfo, Result, Trial
from batchfit.report.records import Mode

if TYPE_CHECKING:
    import torch

    from batchfit.search import Strategy

#: The hooks' types: a finished trial; `(batch_size, kind)` before one; `(device, budget_bytes)` once set up.
TrialCallback = Callable[[Trial], None]
StartCallback = Callable[[int, str], None]
ProbeStartCallback = Callable[[DeviceInfo, "int | None"], None]


Amp = Literal["bf16", "fp16"]


class WorkOptions(TypedDict, total=False):
    """What one training step runs."""

    loss_fn: Callable[[Any, Any], Any] | None
    """`(output, batch) -> loss`, the output kept through backward as `loss_fn(model(x), batch)` keeps it.
    Default: the model's own `output.loss` (its output freed before backward), else the output's mean."""
    step_fn: Callable[[Any, Any], Any] | None
    """`(model, batch) -> loss`, replacing forward and loss; what it does not return is freed before backward."""
    criterion: Callable[[Any, Any], Any] | None
    """For `(inputs, targets)` batches: the model takes the inputs, the loss is `criterion(output, targets)`."""
    optimizer: Any
    """An optimizer (a fresh one of its class and settings is stepped, never yours), a factory
    `params -> optimizer`, or None: a fresh AdamW. It must hold some of the model's trainable parameters."""
    amp: Amp | None
    """Run under autocast in this dtype (fp16 with a grad scaler). Default: None, no autocast."""
    max_new_tokens: int | None
    """With `mode="generate"`: the tokens each row generates, all of them (stopping is disabled). Default: None."""
    generate_fn: Callable[[Any, Any, int], Any] | None
    """With `mode="generate"`: `(model, batch, max_new_tokens) -> output`, the loop to size instead of
    `model.generate`; it returns the ids (a tensor, or an object with `.sequences`) at full length, which
    is checked (an output that stopped early or cannot be read is refused). Default: None, the model's own
    greedy `generate` with its KV cache."""
    eval_step: Callable[[Any, Any], Any] | None
    """`(model, batch) -> anything`, the evaluation step `mode="eval"` and `eval=True` size. Default: None,
    forward and the loss as training computes them, under `torch.no_grad`."""


class PlacementOptions(TypedDict, total=False):
    """Where the probe runs, and within how much memory."""

    device: str | torch.device | None
    """Where to probe. Default: where the model is (it comes back there afterwards)."""
    memory_limit: int | float | str | None
    """Bytes, a size (`"24GiB"`) or a fraction of the device's memory. Default: on a GPU what this
    process can reach; on the CPU half the available memory, at most 1 GiB (docs: Concepts, What is measured)."""
    reserve: int | str | None
    """Bytes (or a size) taken off `memory_limit` for what lives outside the allocator (CUDA context, NCCL);
    `"auto"` measures it. Default: None, nothing."""


class RunOptions(TypedDict, total=False):
    """How a real probe treats the process and its ranks."""

    restore_rng: bool
    """Put the random generators back afterwards; `False` in a background thread. Default: True."""
    distributed: bool | None
    """Probe with every rank of the default process group, all calling alike. Default: None, when one
    of more than one rank is initialised."""
    rank_timeout: float
    """Seconds a rank waits for the others at a meeting point before raising `RanksTimeoutError`. Default: 300.0."""


class SearchOptions(TypedDict, total=False):
    """Which sizes the search tries, and what it keeps free."""

    mode: Mode
    """`"train"`; `"inference"`: forward only, under `torch.inference_mode`; `"eval"`: the evaluation step with the
    training state (weights, optimizer state) live; `"generate"`: generation of `max_new_tokens`. Default: `"train"`."""
    headroom: float
    """The fraction of the budget the safe batch leaves free. Default: 0.1."""
    init_batch: int | None
    """The first size tried. Default: 2 (BatchNorm cannot train on one sample), or `multiple_of` when larger."""
    max_batch: int
    """The largest size tried. Default: 32768."""
    multiple_of: int
    """Only multiples of this are tried (8 for tensor cores). Default: 1."""
    strategy: str | Strategy
    """`"interpolate"` (aims where the measured memory meets the budget, bracketed so it stays exact),
    `"binary"` (doubling and bisection) or a strategy object. Default: `"interpolate"`."""


class TrialOptions(TypedDict, total=False):
    """How many real steps a probe spends, and for how long."""

    steps_per_trial: int | None
    """Steps per search trial. Default: None, the fewest that give the memory verdict (2 the first time, then 1)."""
    verify_steps: int
    """Steps run at the safe batch to check it, with a fresh optimizer (step 2 is the first with its state
    in place; a step whose update a `GradScaler` skipped does not count); 0 skips the check. Default: 2."""
    time_budget: float | None
    """Seconds after which no new search trial starts. Default: None, no limit."""


class DataOptions(TypedDict, total=False):
    """The batches the probe sizes on, besides `sample`."""

    make_batch: Callable[..., Any] | None
    """Instead of `sample`: `batch_size -> batch`, or `(batch_size, seq_len) -> batch` with `seq_len`. Default: None."""
    seq_len: int | None
    """The sequence length to size on: the sample's rows cut or extended to it. Default: None, the data's own."""
    scan_batches: int | None
    """Batches a `DataLoader` sample's scan reads to find the worst one (spread, ends included);
    None (`all` on the command line) reads every batch. Default: 64."""


class AnswerOptions(TypedDict, total=False):
    """What `find` adds to its answer, and where it keeps it."""

    timed_steps: int
    """Warm timed steps per size the throughput answer compares (after one untimed; 2 or more also
    measure their spread); 0 skips it. Default: 1."""
    eval: bool
    """Also size the evaluation step (`mode="eval"`) after training's, into `Result.evaluation`. Default: False."""
    noise_scale: bool
    """Also measure the gradient noise scale from the sample's real batches, for the recommendation. Default: False."""
    noise_passes: int
    """Forward/backward passes the noise scale may take. Default: 128."""
    cache: str | os.PathLike[str] | None
    """A directory where the answer is kept, keyed by everything that changes it; a hit checks the
    stored safe batch and max batch with one real run each. Default: None, no cache."""


class NoiseOptions(WorkOptions, PlacementOptions, RunOptions, total=False):
    """`noise_scale`'s keywords: the work, the device, the process."""


class EstimateOptions(WorkOptions, SearchOptions, DataOptions, total=False):
    """`estimate`'s keywords besides its device, memory and reserve (which describe the card estimated for)."""


class FrontierOptions(WorkOptions, PlacementOptions, RunOptions, SearchOptions, TrialOptions, total=False):
    """`frontier`'s keywords: `find`'s but the data's (the length is the frontier's axis) and the answer's extras."""


class FindOptions(FrontierOptions, DataOptions, AnswerOptions, total=False):
    """Every option: `find`'s keywords, which the gate, `Prober`, the CLI and the integrations take too."""


class Hooks(TypedDict, total=False):
    """What a front end is told while a probe runs: not options, they never change the answer."""

    callback: TrialCallback | None
    """Called with every finished trial (search, timing and verification)."""
    on_trial_start: StartCallback | None
    """Called with `(batch_size, kind)` before each trial."""
    on_start: ProbeStartCallback | None
    """Called once with `(device_info, budget_bytes)` when the probe is set up, before the first trial."""
    progress: bool
    """Show the command line's live view on stderr and its summary at the end (rank 0 only). Default: False."""


#: What a hook is when it is not given.
HOOK_DEFAULTS: dict[str, Any] = {"callback": None, "on_trial_start": None, "on_start": None, "progress": False}


class FindKeywords(FindOptions, Hooks, total=False):
    """`find`'s keywords: its options and the hooks."""


class JobOptions(TypedDict, total=False):
    """How a search whose every trial is a fresh `torchrun` job runs (`find` of a target with
    `world_size`): not options of a probe in this process, so a model's `find` refuses them."""

    trial_log: str | os.PathLike[str] | None
    """A JSON-lines file every job's verdicts are appended to; a later call with the same settings
    reuses them instead of running those jobs again (resume after Ctrl-C), and the sharded estimate
    it started from. Default: None, no log."""
    trial_timeout: float
    """Seconds a job may take to answer before it is killed and reported. Default: 600.0."""
    guess: int | Result | None
    """Where to start: the safe batch per rank you expect, or a `Result` (an estimate, an earlier
    answer) whose safe batch and bytes per sample aim the search. Default: None, from the estimate."""
    estimate: bool
    """Without a `guess`, start from the sharded estimate (fake tensors, a fake process group, no
    job); it needs `memory_limit` as a size. Default: True."""


#: What a job search's own keyword is when it is not given.
JOB_DEFAULTS: dict[str, Any] = {"trial_log": None, "trial_timeout": 600.0, "guess": None, "estimate": True}


class FindJobKeywords(FindKeywords, JobOptions, total=False):
    """`find`'s keywords with a target's job search's own (`JobOptions`, refused with a model)."""


class FrontierKeywords(FrontierOptions, Hooks, total=False):
    """`frontier`'s keywords besides its lengths: its options and the hooks."""


@functools.cache
def keyword_docs() -> dict[str, str]:
    """Each keyword's documentation, read from this module's source as the docs site reads it (a
    `TypedDict` keeps no docstrings at run time): the command line's help is the same text."""
    docs: dict[str, str] = {}
    for node in ast.parse(Path(__file__).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            for statement, after in zip(node.body, [*node.body[1:], None]):
                documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and documented:
                    docs[statement.target.id] = " ".join(str(after.value.value).split())  # type: ignore[union-attr]
    return docs


def keywords_of(group: type) -> tuple[str, ...]:
    """The keyword names a group (a TypedDict above) declares, its bases' included, in order."""
    return tuple(group.__annotations__)


def check_keywords(where: str, given: Mapping[str, Any], group: type) -> None:
    """A `TypeError` for a keyword `where()` does not take, naming it and the nearest it does."""
    known = keywords_of(group)
    for name in given:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}{hint}")


def split_hooks(where: str, keywords: Mapping[str, Any], group: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """`keywords` as `(hooks, options)`, the hooks checked and the options checked against `group`'s
    names. Shared by `find`, `frontier` and the integrations."""
    hooks = {name: keywords[name] for name in keywords_of(Hooks) if name in keywords}
    options = {name: value for name, value in keywords.items() if name not in hooks}
    check_keywords(where, options, group)
    check_hooks(hooks)
    return hooks, options


def check_hooks(hooks: Mapping[str, Any]) -> None:
    """Name a hook that cannot be called (or a `progress` that is not a bool) before anything runs."""
    for name, hook in hooks.items():
        if name == "progress":
            if not isinstance(hook, bool):
                raise TypeError(f"progress must be True or False, got {type(hook).__name__} {hook!r}")
        elif hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable, got {type(hook).__name__}")

"""The Python entry points as users call them: keywords in, a frozen answer out.

[`find`][batchfit.find] turns its keywords into one validated [`Options`][batchfit.Options] and runs the
algorithm (`batchfit.probe.find_with`); with ``progress=True`` it also feeds the terminal
view (``batchfit.view``) through the probe's callbacks, which is why it sits here, above the
core: the probe itself never prints and never imports a view. [`plan`][batchfit.plan] probes (through
[`find`][batchfit.find]) or takes a result, and splits a global batch (``batchfit.estimation.planning``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from batchfit.api_jobs import find_target
from batchfit.estimation import Plan, check_target, plan_for
from batchfit.probe import Options
from batchfit.probe.keywords import FindOptions, FrontierOptions, JobOptions, NoiseOptions, keywords_of, split_hooks
from batchfit.probe.options import options_from
from batchfit.report import Fit, Frontier, NoiseScale, Placement, Result
from batchfit.view.frontier_view import FrontierProgress
from batchfit.view.progress import Progress

if TYPE_CHECKING:
    from torch import nn
    from typing_extensions import Unpack

    from batchfit.probe import PointCallback
    from batchfit.probe.keywords import FindJobKeywords, FindKeywords, FrontierKeywords

__all__ = ["find", "fit", "frontier", "noise_scale", "plan"]


def find(
    model_or_target: nn.Module | str,
    sample: Any = None,
    *,
    world_size: int | None = None,
    **keywords: Unpack[FindJobKeywords],
) -> Result:
    """Find the largest batch that trains, a safe batch with headroom, and the fastest batch.

    Runs real steps (forward, loss, backward, optimizer step; forward only with
    `mode="inference"`) at growing batch sizes until one runs out of memory, then searches the
    boundary, verifies the safe batch and times the sizes the throughput answer rests on. The
    model, its buffers, train/eval flags, gradients, the given optimizer and the RNG state come
    back exactly as they were, whatever happens (Ctrl-C included).

    A model is probed in this process, on the ranks launched (`distributed=`). A target,
    `"package.module:factory"` or `"path/to/file.py:factory"` with `world_size=N`, is a sharded
    model (FSDP, FSDP2) whose every trial is a fresh `torchrun` job of N ranks that builds it
    (`batchfit.api_jobs.find_target`; `find_sharded` is the same call).

    Args:
        model_or_target: the `nn.Module` to probe, or a target as `batchfit probe` takes it.
        sample: one batch as the model takes it (tensor -> `model(x)`, tuple/list -> `model(*x)`,
            mapping -> `model(**x)`), whose rows are repeated; or a `DataLoader` (any iterable of
            batches), sized on its worst batch (`Result.sized_on` says which). A target's factory
            returns its own.
        world_size: a target's ranks per job; batch sizes are per rank. Refused with a model.
        **keywords: the options, each documented once in
            [`FindOptions`][batchfit.probe.keywords.FindOptions] (defaults there), the
            [`Hooks`][batchfit.probe.keywords.Hooks] a front end is told through, and with a target
            the job search's own ([`JobOptions`][batchfit.probe.keywords.JobOptions]).

    Returns:
        The frozen [`Result`][batchfit.Result]: `max_batch`, `safe_batch`, `best_throughput_batch`,
        the trials, the memory equation, notes and `recommendation`.

    Raises:
        NothingFitsError: even the first size runs out of memory.
        LimitError: on a GPU, this process already holds more than `memory_limit`.
        DeviceFailedError: the device failed for good (device-side assert, illegal address).
        RankFailedError: across ranks, another rank raised an error that is not an out-of-memory.
        RanksTimeoutError: across ranks, not every rank reached a meeting point in time.
        TypeError, ValueError: a bad argument, named (a model with `world_size` or a job search's
            keyword; a target without `world_size`, or with a `sample`).
        Exception: the model's own error that is not an out-of-memory, unchanged, with a note
            naming the batch size.
    """
    if isinstance(model_or_target, str) and ":" not in model_or_target.strip(":"):
        raise TypeError(
            f"model must be a torch.nn.Module, got str {model_or_target!r} (a target is 'module:factory' or "
            "'path/to/file.py:factory', with world_size=)"
        )
    if isinstance(model_or_target, str):
        if sample is not None:
            raise TypeError(
                f"find({model_or_target!r}) got a sample: a target's factory returns the sample its ranks size on"
            )
        return find_target(model_or_target, world_size, **keywords)
    model = model_or_target
    refuse_job_keywords("find", world_size, keywords)
    hooks, given = split_hooks("find", keywords, FindOptions)
    options = Options(**given)
    progress = hooks.pop("progress", False)
    from batchfit.probe import find_with  # lazy: the algorithm loads torch, which a plan of a result must not

    if not shows_view(progress, options):
        return find_with(model, sample, options, **hooks)
    # The probe never prints: the view is fed through the same callbacks a caller could pass.
    told = (hooks.get(name) for name in ("callback", "on_trial_start", "on_start"))
    with Progress(type(model).__name__, *told) as shown:
        result = find_with(model, sample, options, **shown.callbacks())
        shown.summary(result)
    return result


def fit(
    model: nn.Module,
    sample: Any = None,
    *,
    target_batch: int,
    checkpointing: str | Sequence[str] = "auto",
    placement: Placement = "first",
    accumulate: bool = True,
    **keywords: Unpack[FindKeywords],
) -> Fit:
    """The activation-checkpointing policy that trains `target_batch` fastest, measured by real steps.

    Weighs, with real steps, the fewest of the model's repeated blocks checkpointed that fit
    `target_batch` in one step, against no checkpointing at a smaller micro-batch with gradient
    accumulation (and all blocks with accumulation when nothing fits the target at once). The
    model as it is is probed, and one trial with all blocks but the last checkpointed gives the
    saving per block; that line predicts every k, and the fewest blocks that hold the target are
    probed exactly from it (three trials when the prediction holds); the candidates are timed
    alike, warm, and the fastest is recommended. The model comes back exactly as it was
    (checkpointing undone), whatever happens, Ctrl-C included.

    Args:
        model: the `nn.Module` to probe, in one process.
        sample: one batch, or a `DataLoader`, as [`find`][batchfit.find] takes it.
        target_batch: the samples one optimizer step should see (micro-batch x accumulation).
        checkpointing: `"auto"`: the blocks found by structure (every `nn.ModuleList` or
            `nn.Sequential` of 2+ modules of one type: `transformer.h`, `model.layers`; several
            groups ordered by the bytes they save, measured in one step); or the blocks' module
            names, in order (a module that is never called, a `ModuleList`, is refused).
        placement: `"first"`: k blocks are the first k (their activations live longest, so
            recomputing them lowers the peak most); `"evenly"`: spread over the N.
        accumulate: allow gradient accumulation to reach the target; `False` asks for it in one step.
        **keywords: [`find`][batchfit.find]'s options and hooks (not `cache` or `noise_scale`);
            the warm timed steps count per candidate, at least 2.

    Returns:
        The frozen [`Fit`][batchfit.Fit]: a row per policy measured (max, safe batch, memory
        equation, samples/s where timed), the predicted max batch for every k, and the
        `recommendation` with its `policy`. `batchfit.probe.checkpointing_blocks.apply_policy` applies it.

    Raises:
        ValueError: no repeated blocks and no names; a name that is no module, or one never called; `mode` other than
            `"train"`; with `accumulate=False`, a target no policy fits (the closest is named).
        Exception: what [`find`][batchfit.find] raises.
    """
    hooks, given = split_hooks("fit", keywords, FindOptions)
    options = Options(**given)
    progress = hooks.pop("progress", False)
    from batchfit.probe import fit_with  # lazy: torch, as find's

    arguments: dict[str, Any] = {"checkpointing": checkpointing, "placement": placement, "accumulate": accumulate}
    if not shows_view(progress, options):
        return fit_with(model, sample, target_batch, options, **arguments, **hooks)
    told = (hooks.get(name) for name in ("callback", "on_trial_start", "on_start"))
    with Progress(type(model).__name__, *told) as shown:
        return fit_with(model, sample, target_batch, options, **arguments, **shown.callbacks())


def frontier(
    model: nn.Module,
    make_batch: Callable[[int, int], Any] | None = None,
    *,
    seq_lens: Iterable[int],
    longest_at_batch_1: bool = True,
    max_seq_len: int | None = None,
    on_point: PointCallback | None = None,
    **keywords: Unpack[FrontierKeywords],
) -> Frontier:
    """The largest batch at each sequence length, and the longest length that trains at batch 1.

    For each length `s` in `seq_lens`: the exact largest batch, the safe batch verified by real
    steps and tokens/s at it, as [`find`][batchfit.find] gives them with `make_batch(b, s)`; the
    longest length that trains at batch 1; the token budget; and the fitted memory surface
    `fixed + b * (a * s + q * s**2)` (`q`: eager attention keeps its `s x s` scores). Each further
    length is searched from the boundary the surface fitted so far predicts, so the frontier costs
    far fewer trials than one search per length, and every point is still exact.

    Args:
        model: the `nn.Module` to probe.
        make_batch: `(batch_size, seq_len) -> batch`.
        seq_lens: the lengths to size (any integral numbers), each at most the model's positions.
        longest_at_batch_1: also find the longest length that trains at batch 1.
        max_seq_len: that search's ceiling. Default: the model's positions.
        on_point: called with each `FrontierPoint` when its length is done.
        **keywords: [`FrontierOptions`][batchfit.probe.keywords.FrontierOptions], meaning what they
            mean for `find` at every length (`time_budget` counts for the whole frontier), and the
            [`Hooks`][batchfit.probe.keywords.Hooks].

    Raises:
        ValueError: a length longer than the model takes, before any trial.
        Exception: what [`find`][batchfit.find] raises.
    """
    hooks, given = split_hooks("frontier", keywords, FrontierOptions)
    options = Options(**given)
    progress = hooks.pop("progress", False)
    callback, on_trial_start, on_start = (hooks.get(name) for name in ("callback", "on_trial_start", "on_start"))
    from batchfit.probe import Prober, check_lengths, frontier_with  # lazy: torch, as find's

    def make_prober(at_length: Options) -> Prober:
        return Prober(model, None, options=at_length)

    lengths: dict[str, Any] = {"longest_at_batch_1": longest_at_batch_1, "max_seq_len": max_seq_len}
    if not shows_view(progress, options):
        return frontier_with(
            model,
            make_batch,  # type: ignore[arg-type]
            seq_lens,
            options,
            make_prober,
            on_point=on_point,
            **hooks,
            **lengths,
        )
    # As find(): the algorithm never prints; the view is fed through the callbacks.
    # The lengths read once (a generator or np.arange too), as the algorithm reads them, for the header.
    read = list(check_lengths(model, make_batch, seq_lens, max_seq_len, options.max_new_tokens or 0)[0])
    with FrontierProgress(type(model).__name__, read, on_point, callback, on_trial_start, on_start) as shown:
        answer = frontier_with(
            model,
            make_batch,  # type: ignore[arg-type]
            read,
            options,
            make_prober,
            on_length=shown.length_started,
            **shown.callbacks(),
            **lengths,
        )
        shown.summary(answer)
    return answer


def noise_scale(
    model: nn.Module,
    data: Any,
    *,
    micro_batch: int | None = None,
    passes: int = 128,
    per_window: int = 8,
    confidence: float = 0.9,
    seed: int = 0,
    **options: Unpack[NoiseOptions],
) -> NoiseScale:
    """The gradient noise scale `B_simple = tr(Sigma) / |G|^2` of `model` at its current weights
    (a checkpoint, or after warm-up steps: at initialisation it is near zero), from real batches.

    Nothing is trained, and everything comes back as after [`find`][batchfit.find]; `step_fn` must
    only return the loss. Details: `batchfit.probe.noise_measure.measure_noise`.

    Args:
        model: the `nn.Module` to measure.
        data: a `DataLoader` or any iterable of batches (one batch alone is refused: tiled copies
            of one sample carry no gradient noise).
        micro_batch: rows per micro-batch. Default: the first batch's size.
        passes: forward and backward passes at most.
        per_window: micro-batches per window.
        confidence: the interval's confidence, from resampling the windows.
        seed: the resampling's seed.
        **options: [`NoiseOptions`][batchfit.probe.keywords.NoiseOptions], as `find` takes them.
    """
    settings = options_from("noise_scale", options, NoiseOptions, noise_scale=True, noise_passes=passes)
    from batchfit.probe import measure_noise  # lazy: torch, as find's

    return measure_noise(
        model, data, settings, micro_batch=micro_batch, per_window=per_window, confidence=confidence, seed=seed
    )


def plan(
    model_or_result: Any,
    sample: Any = None,
    *,
    target_batch: int | None = None,
    target_tokens: int | None = None,
    seq_len: int | None = None,
    world_size: int | None = None,
    **find_kwargs: Any,
) -> Plan:
    """[`plan_for`][batchfit.estimation.planning.plan_for] on a [`Result`][batchfit.Result] (or a
    [`Frontier`][batchfit.Frontier]), or on a fresh probe of a model.

    Given an ``nn.Module``, runs ``batchfit.find(model, sample, **find_kwargs)`` first (the probe
    runs on one process unless launched across ranks; ``world_size`` then defaults to its
    ``world_size``). Given a result, ``sample`` and find keywords are refused rather than ignored:
    they would suggest a probe that does not run.

    The target is ``target_batch`` samples, or ``target_tokens`` tokens per optimizer step in
    sequences of ``seq_len`` tokens (rounded up to whole sequences on every rank; the plan's
    ``tokens_per_step`` says what a step holds). Given a model, ``seq_len`` is also [`find`][batchfit.find]'s:
    the probe sizes on that length (the sample's rows cut or extended to it, or
    ``make_batch(batch_size, seq_len)``), so the plan holds at the length it counts tokens in;
    without it, the length the probe sized on (a ``DataLoader`` sample's, ``Result.sized_on``).
    Given a result, ``seq_len`` defaults to the one it records; a frontier needs it, to choose its point.
    """
    if isinstance(model_or_result, Result) or _is_frontier(model_or_result):
        if sample is not None or find_kwargs:
            given = ["sample"] * (sample is not None) + sorted(find_kwargs)
            raise TypeError(
                f"plan() was given a {type(model_or_result).__name__}, so there is no probe to pass "
                f"{', '.join(given)} to; pass a model to probe instead"
            )
        return plan_for(model_or_result, target_batch, world_size, target_tokens=target_tokens, seq_len=seq_len)
    from torch import nn  # local: planning from a result must not need torch

    if not isinstance(model_or_result, nn.Module):
        raise TypeError(
            f"plan() needs a batchfit Result or a torch.nn.Module to probe, got {type(model_or_result).__name__}"
        )
    # Before the probe, not after minutes of it.
    check_target(target_batch, world_size, target_tokens=target_tokens, seq_len=seq_len)
    if target_tokens is not None and seq_len is None and not _records_length(sample):
        raise ValueError(
            f"target_tokens {target_tokens:,} needs seq_len=, the tokens in each sequence: a probe of a plain "
            "sample or make_batch does not record its length (a DataLoader sample's is found by the probe)"
        )
    if seq_len is not None:
        find_kwargs["seq_len"] = seq_len
    result = find(model_or_result, sample, **find_kwargs)
    return plan_for(result, target_batch, world_size, target_tokens=target_tokens, seq_len=seq_len)


def _is_frontier(value: Any) -> bool:
    return isinstance(value, Frontier)


def _records_length(sample: Any) -> bool:
    """Whether a probe of ``sample`` can record the sequence length it sized on
    (``Result.sized_on``): only a batch source (a ``DataLoader``) has its length found."""
    from batchfit.probe import is_batch_source  # lazy: torch, which a plan of a result must not load

    return is_batch_source(sample)


def shows_view(progress: bool, options: Options) -> bool:
    """Whether this process shows the terminal view: asked for, and the leader under torchrun (rank 0)."""
    if not progress:
        return False
    from batchfit.distributed import leads  # lazy: batchfit.distributed loads torch, which a plan of a result must not

    return leads(options.distributed)


def refuse_job_keywords(where: str, world_size: Any, keywords: Mapping[str, Any]) -> None:
    """A model with `world_size` or a job search's keyword, named: those are a target's."""
    if world_size is not None:
        raise TypeError(
            f"{where}() of a model got world_size={world_size!r}: the ranks of a model are the ones launched "
            "(torchrun; distributed=), each probing its own copy. world_size= is for a target, 'module:factory', "
            "whose every trial is a job of that many ranks"
        )
    jobs = [name for name in keywords_of(JobOptions) if name in keywords]
    if jobs:
        raise TypeError(
            f"{where}() of a model got {', '.join(f'{name}=' for name in jobs)}: a job search's own, for a target "
            "'module:factory' with world_size= (a model is probed in this process, with no jobs)"
        )

"""The Python entry points as users call them: keywords in, a frozen answer out.

:func:`find` turns its keywords into one validated :class:`~batchfit.probe.Options` and runs the
algorithm (:func:`batchfit.probe.find_with`); with ``progress=True`` it also feeds the terminal
view (``batchfit.view``) through the probe's callbacks, which is why it sits here, above the
core: the probe itself never prints and never imports a view. :func:`plan` probes (through
:func:`find`) or takes a result, and splits a global batch (``batchfit.estimation.planning``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from batchfit.estimation import Plan, check_target, plan_for
from batchfit.probe import DEFAULT_MAX_BATCH, Options
from batchfit.report import Frontier, NoiseScale, Result
from batchfit.search import Strategy
from batchfit.view import Progress

if TYPE_CHECKING:
    import torch
    from torch import nn

    from batchfit.probe import PointCallback, ProbeStartCallback, StartCallback, TrialCallback

__all__ = ["find", "frontier", "noise_scale", "plan"]

#: find()'s keywords that :func:`noise_scale` takes: the work, the device and the restore.
_NOISE_WORK = ("loss_fn", "step_fn", "criterion", "optimizer", "amp", "device", "memory_limit", "reserve")
_NOISE_WORK += ("restore_rng", "distributed", "rank_timeout")


def find(
    model: nn.Module,
    sample: Any = None,
    *,
    make_batch: Callable[..., Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    criterion: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    amp: str | None = None,
    mode: str = "train",
    device: str | torch.device | None = None,
    memory_limit: int | float | str | None = None,
    reserve: int | str | None = None,
    headroom: float = 0.10,
    init_batch: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    multiple_of: int = 1,
    steps_per_trial: int | None = None,
    verify_steps: int = 3,
    strategy: str | Strategy = "interpolate",
    time_budget: float | None = None,
    restore_rng: bool = True,
    distributed: bool | None = None,
    rank_timeout: float = 300.0,
    seq_len: int | None = None,
    scan_batches: int | None = 64,
    timed_steps: int = 2,
    noise_scale: bool = False,
    noise_passes: int = 128,
    cache: str | os.PathLike[str] | None = None,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    progress: bool = False,
) -> Result:
    """Find the largest batch that trains, a safe batch with headroom, and the fastest batch.

    Runs real steps (forward, loss, backward, optimizer step; forward only with
    ``mode="inference"``) at growing batch sizes until one runs out of memory, then
    searches the boundary. The model, its buffers, train/eval flags, gradients, the given
    optimizer and the RNG state are restored exactly afterwards, whatever happens.

    Args:
        model: the ``nn.Module`` to probe.
        sample: one batch as the model takes it (tensor -> ``model(x)``, tuple/list ->
            ``model(*x)``, mapping -> ``model(**x)``); batches are built by repeating its rows.
            Or a ``DataLoader`` (any iterable of batches): the batch that drives memory is
            picked from it (the worst of ``scan_batches`` batches scanned, or the longest item
            when its dataset declares ``lengths``), and its real rows are repeated; a note and
            ``Result.sized_on`` say which (``batchfit.probe.real_data``).
        make_batch: instead of ``sample``, a callable ``batch_size -> batch``; with ``seq_len``,
            ``(batch_size, seq_len) -> batch``.
        loss_fn: ``(output, batch) -> loss``; the output is kept through backward, as
            ``out = model(x); loss = loss_fn(out, batch)`` keeps it. Default: the model's own
            ``output.loss``, its output freed before backward as ``loss = model(**batch).loss``
            frees it, or else the output's mean.
        step_fn: ``(model, batch) -> loss``, replaces forward and loss entirely; what it does not
            return is freed before backward.
        optimizer: ``None`` (a fresh AdamW), an optimizer (a fresh one of its class and
            hyperparameters is used; yours is never stepped) or a factory ``params -> optimizer``.
            It must hold some of the model's trainable parameters (a subset is fine).
        amp: ``"bf16"`` or ``"fp16"`` to run under autocast (fp16 with a grad scaler; steps whose
            optimizer update the scaler skips do not count, see ``Trial.skipped_steps``).
        mode: ``"train"`` or ``"inference"`` (forward only, under ``torch.inference_mode``).
        device: where to probe; default: where the model is. The model comes back afterwards.
        memory_limit: bytes, a size (``"24GiB"``) or a fraction of the device's memory (CUDA: its
            total as the runtime reports it; CPU: what is available at the start). On CUDA it caps
            what the caching allocator may reserve; on the CPU, live tensor bytes. Without one:
            on CUDA the memory this process can reach, on the CPU half the available memory (at most
            1 GiB; a limit above 3/4 of the available memory is clipped to it, with a note).
            A limit above what the process can reach is clipped to it, with a note (on the CPU
            75% of the memory available at the start: the rest is for what the meter does not see).
        reserve: bytes (or a size) taken off ``memory_limit`` for memory a device of that size
            loses outside the caching allocator (CUDA context, library handles, NCCL), so that
            ``memory_limit="24GB", reserve="600MiB"`` stands for a 24 GB card. ``"auto"``: what
            the device uses outside this process's allocator now (the context, and any other
            process's memory). Default: nothing.
        headroom: the fraction of the budget the safe batch leaves free.
        init_batch: the first size tried. Default: 2, or ``multiple_of`` when that is larger.
            Batch 1 is skipped by default because BatchNorm cannot train on one sample
            ("Expected more than 1 value per channel"); pass ``init_batch=1`` to include it.
        max_batch: the largest size tried.
        multiple_of: only multiples of this are tried (e.g. 8 for tensor cores).
        steps_per_trial: steps per search trial. Default: the fewest that give the memory
            verdict. The optimizer (and its state) is kept from trial to trial, as a real run
            keeps it, so the first trial runs two steps (step 1 allocates the state) and every
            later one a single step whose peak has the state live. With N steps, step 1 warms
            up and steps 2..N are timed.
        verify_steps: steps run at the safe batch to check it, with a fresh optimizer as the
            first steps of a real run (default 3: step 1 allocates the optimizer state, steps
            2 and 3 run with it and are timed; 0 skips the check).
        strategy: ``"interpolate"`` (default: aims at the size where the measured memory lines
            meet the budget, bracketed so it stays exact) or ``"binary"`` (plain doubling and
            bisection), or a strategy object (see ``batchfit.search.Strategy``).
        time_budget: seconds after which no new search trial starts.
        restore_rng: put the CPU and device random generators back as they were (default). The
            generators are process-wide: a probe in a background thread that restores them
            replays numbers other threads drew meanwhile; pass ``False`` there (the probe's
            dropout then consumes random numbers as a training step would).
        distributed: probe with every rank of the initialised default process group (torchrun,
            DDP): every rank calls ``find()`` with the same arguments, the ranks agree on each
            trial, and every rank gets the same result, per-rank batch sizes that fit on every
            rank (see the README's "Many GPUs"). Default ``None``: when a default process group
            of more than one rank is initialised. ``False``: this process alone.
        rank_timeout: seconds a rank waits for the others at a meeting point (starting the
            probe, the end of each phase of a step) before raising
            :class:`~batchfit.errors.RanksTimeoutError` instead of hanging.
        callback: called with every finished :class:`Trial` (search and verification).
        on_trial_start: called with ``(batch_size, kind)`` before each trial.
        on_start: called once with ``(device_info, budget_bytes)`` when the probe is set up and
            before the first trial, so a front end can draw memory against the budget from the
            start (on CUDA without a limit the budget is only known then).
        progress: show the command line's view on stderr while it runs (a live table on a
            terminal, plain lines elsewhere) and its summary at the end; the callbacks above
            still run; across ranks only rank 0 shows it. Default: nothing is printed.
        seq_len: the sequence length to size on, when you know it better than the data seen:
            the sample's (or the loader's worst batch's) rows are cut to it, or extended by
            repeating their own content along the sequence dimension (the one that varies
            across the loader's batches, or the one every tensor of rank >= 2 shares); with
            ``make_batch`` it is passed on as ``make_batch(batch_size, seq_len)``. Longer than
            the model's position embeddings (``batchfit.probe.position_limit``) is refused
            before any trial.
        scan_batches: how many batches a ``DataLoader`` sample's scan reads to find the worst
            one (default 64: the whole epoch when it has no more, else 64 spread across it, its
            ends included); ``None`` reads every batch. A scan that did not read the whole epoch
            warns (``UserWarning``) and says so in a note.
        criterion: for ``(inputs, targets)`` batches (``find(resnet, (x, y), criterion=
            nn.CrossEntropyLoss())``): the model is called with the inputs and the loss is
            ``criterion(output, targets)``.
        timed_steps: after the search, the largest batch, the safe batch and the sizes around
            the throughput knee are timed again alike: one untimed step, then this many timed
            ones (``batchfit.probe.timing``), so that no size is ranked by a cold step. 0 skips
            it (the rates are then the search's own warm steps only).
        noise_scale: also measure the gradient noise scale from ``sample``'s real batches (a
            ``DataLoader`` or an iterable of batches; a single sample is refused) at the safe
            batch, into ``Result.noise_scale`` (:func:`batchfit.noise_scale`); it feeds
            ``Result.recommendation``, the batch to train with. It costs ``noise_passes``
            forward/backward passes.
        noise_passes: forward/backward passes the noise scale may take (default 128).
        cache: a directory (made if missing) where the answer is kept, keyed by everything that
            changes it (device, model structure, batch shapes, step, settings, versions; not the
            weights, not the world size: ``batchfit.probe.keys``). The same probe again is a
            hit: no search runs, no callback is called, the stored safe batch is checked with one
            real run (skipped with ``verify_steps=0``) and the stored answer comes back with
            ``Result.from_cache`` set; else it probes and writes the answer there. An entry that
            cannot be trusted, or a directory that cannot be written, is a note, never an error.

    Raises:
        NothingFitsError: even ``init_batch`` runs out of memory.
        LimitError: on CUDA, this process already holds more than ``memory_limit``.
        DeviceFailedError: the device failed for good (device-side assert, illegal address).
        RankFailedError: across ranks, another rank raised an error that is not an
            out-of-memory (it names the rank, the batch size and the error).
        RanksTimeoutError: across ranks, not every rank reached a meeting point in time.
        TypeError, ValueError: bad arguments, with a message naming the problem.
        Exception: any exception from the model that is not an out-of-memory, unchanged, with a
            note that names the batch size.
    """
    given = locals()
    options = Options(**{option.name: given[option.name] for option in fields(Options)})
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {type(progress).__name__} {progress!r}")
    from batchfit.distributed import leads  # under torchrun only rank 0 shows the view
    from batchfit.probe import find_with  # the algorithm, and torch, only once a probe runs

    if not progress or not leads(distributed):
        return find_with(model, sample, options, callback=callback, on_trial_start=on_trial_start, on_start=on_start)
    # The probe never prints: the view is fed through the same callbacks a caller could pass.
    with Progress(type(model).__name__, callback, on_trial_start, on_start) as shown:
        result = find_with(model, sample, options, **shown.callbacks())
        shown.summary(result)
    return result


def frontier(
    model: nn.Module,
    make_batch: Callable[[int, int], Any] | None = None,
    *,
    seq_lens: Iterable[int],
    longest_at_batch_1: bool = True,
    max_seq_len: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    criterion: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    amp: str | None = None,
    mode: str = "train",
    device: str | torch.device | None = None,
    memory_limit: int | float | str | None = None,
    reserve: int | str | None = None,
    headroom: float = 0.10,
    init_batch: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    multiple_of: int = 1,
    steps_per_trial: int | None = None,
    verify_steps: int = 3,
    strategy: str | Strategy = "interpolate",
    time_budget: float | None = None,
    restore_rng: bool = True,
    distributed: bool | None = None,
    rank_timeout: float = 300.0,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    on_point: PointCallback | None = None,
    progress: bool = False,
) -> Frontier:
    """The largest batch at each sequence length, and the longest length that trains at batch 1.

    For each length ``s`` in ``seq_lens``, the exact largest batch (fits; one more does not),
    the safe batch verified by real steps, and tokens/s at it, as :func:`find` gives them with
    ``make_batch(b, s)``; the longest length that trains at batch 1 (the same exact search, on
    the length axis); the token budget; and the fitted memory surface
    ``fixed + b * (a * s + q * s**2)`` with what ``q`` means (eager attention keeps its ``s x s``
    scores; SDPA's flash and memory-efficient kernels do not).

    The longest length is searched as :func:`find` searches, from the smallest batch; every other
    length from the boundary the surface fitted so far predicts there, so the frontier costs far
    fewer trials than one search per length, and every point is still exact (see
    ``batchfit.probe.frontier``).

    Args:
        make_batch: ``(batch_size, seq_len) -> batch``, a batch of that many sequences of that length.
        seq_lens: the lengths to size, any integral numbers (a list, ``np.arange(...)``, a 1-d tensor), each at
            most the model's position embeddings when it states them.
        longest_at_batch_1: also find the longest length that trains at batch 1 (default ``True``).
        max_seq_len: the ceiling of that search; default the model's positions
            (``config.max_position_embeddings``, ``n_positions``, a position embedding's size).
        on_point: called with each :class:`~batchfit.report.frontier.FrontierPoint` when its length is done.
        progress: show a view on stderr while it runs, and the frontier at the end (across ranks, rank 0 only).

    The other keywords are :func:`find`'s and mean the same, for every length (``time_budget``
    counts for the whole frontier). Raises what :func:`find` raises; a length longer than the
    model takes is a ``ValueError`` before any trial.
    """
    options = Options(
        make_batch=None,
        loss_fn=loss_fn,
        step_fn=step_fn,
        criterion=criterion,
        optimizer=optimizer,
        amp=amp,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
        device=device,
        memory_limit=memory_limit,
        reserve=reserve,
        steps_per_trial=steps_per_trial,
        headroom=headroom,
        init_batch=init_batch,
        max_batch=max_batch,
        multiple_of=multiple_of,
        verify_steps=verify_steps,
        strategy=strategy,
        time_budget=time_budget,
        restore_rng=restore_rng,
        distributed=distributed,
        rank_timeout=rank_timeout,
    )
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {type(progress).__name__} {progress!r}")
    from batchfit.distributed import leads  # under torchrun only rank 0 shows the view
    from batchfit.probe import Prober, check_callbacks, check_lengths, frontier_with  # torch, once a probe runs

    check_callbacks(callback, on_trial_start, on_start)

    def make_prober(at_length: Options) -> Prober:
        return Prober(model, None, options=at_length)

    keywords: dict[str, Any] = {"longest_at_batch_1": longest_at_batch_1, "max_seq_len": max_seq_len}
    if not progress or not leads(distributed):
        return frontier_with(
            model,
            make_batch,  # type: ignore[arg-type]
            seq_lens,
            options,
            make_prober,
            callback=callback,
            on_trial_start=on_trial_start,
            on_start=on_start,
            on_point=on_point,
            **keywords,
        )
    from batchfit.view import FrontierProgress

    # As find(): the algorithm never prints; the view is fed through the callbacks.
    # The lengths read once (a generator or np.arange too), as the algorithm reads them, for the header.
    lengths = list(check_lengths(model, make_batch, seq_lens, max_seq_len)[0])
    with FrontierProgress(type(model).__name__, lengths, on_point, callback, on_trial_start, on_start) as shown:
        answer = frontier_with(
            model,
            make_batch,  # type: ignore[arg-type]
            lengths,
            options,
            make_prober,
            on_length=shown.length_started,
            **shown.callbacks(),
            **keywords,
        )
        shown.summary(answer)
    return answer


def noise_scale(
    model: nn.Module,
    data: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    criterion: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    amp: str | None = None,
    device: str | torch.device | None = None,
    memory_limit: int | float | str | None = None,
    reserve: int | str | None = None,
    restore_rng: bool = True,
    distributed: bool | None = None,
    rank_timeout: float = 300.0,
    micro_batch: int | None = None,
    passes: int = 128,
    per_window: int = 8,
    confidence: float = 0.9,
    seed: int = 0,
) -> NoiseScale:
    """The gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` of ``model`` at its current weights
    (a checkpoint, or after warm-up steps: at initialisation it is near zero), from real batches.

    ``data``: a ``DataLoader`` or any iterable of batches (one batch alone is refused: tiled copies
    of one sample carry no gradient noise), cut into micro-batches of ``micro_batch`` rows (default:
    its first batch's size). Windows of ``per_window`` micro-batches, at most ``passes`` forward and
    backward passes; the interval (``confidence``) resamples the windows with ``seed``. Nothing is
    trained, and everything comes back as after :func:`find`; ``step_fn`` must only return the loss.
    The other keywords are :func:`find`'s. Details: :func:`batchfit.probe.measure_noise`.
    """
    given = locals()
    options = Options(**{name: given[name] for name in _NOISE_WORK}, noise_scale=True, noise_passes=passes)
    from batchfit.probe import measure_noise  # torch only once a measurement runs

    return measure_noise(
        model, data, options, micro_batch=micro_batch, per_window=per_window, confidence=confidence, seed=seed
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
    """:func:`plan_for` on a :class:`~batchfit.report.Result` (or a
    :class:`~batchfit.report.frontier.Frontier`), or on a fresh probe of a model.

    Given an ``nn.Module``, runs ``batchfit.find(model, sample, **find_kwargs)`` first (the probe
    runs on one process unless launched across ranks; ``world_size`` then defaults to its
    ``world_size``). Given a result, ``sample`` and find keywords are refused rather than ignored:
    they would suggest a probe that does not run.

    The target is ``target_batch`` samples, or ``target_tokens`` tokens per optimizer step in
    sequences of ``seq_len`` tokens (rounded up to whole sequences on every rank; the plan's
    ``tokens_per_step`` says what a step holds). Given a model, ``seq_len`` is also :func:`find`'s:
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
    from batchfit.probe import is_batch_source

    return is_batch_source(sample)

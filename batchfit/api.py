"""The Python entry points as users call them: keywords in, a frozen answer out.

:func:`find` turns its keywords into one validated :class:`~batchfit.probe.Options` and runs the
algorithm (:func:`batchfit.probe.find_with`); with ``progress=True`` it also feeds the terminal
view (``batchfit.view``) through the probe's callbacks, which is why it sits here, above the
core: the probe itself never prints and never imports a view. :func:`plan` probes (through
:func:`find`) or takes a result, and splits a global batch (``batchfit.estimation.planning``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchfit.estimation import Plan, check_target, plan_for
from batchfit.probe import DEFAULT_MAX_BATCH, Options
from batchfit.report import Result
from batchfit.search import Strategy
from batchfit.view import Progress

if TYPE_CHECKING:
    import torch
    from torch import nn

    from batchfit.probe import ProbeStartCallback, StartCallback, TrialCallback

__all__ = ["find", "plan"]


def find(
    model: nn.Module,
    sample: Any = None,
    *,
    make_batch: Callable[[int], Any] | None = None,
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
        make_batch: instead of ``sample``, a callable ``batch_size -> batch``.
        loss_fn: ``(output, batch) -> loss``; default: ``output.loss`` or the output's mean.
        step_fn: ``(model, batch) -> loss``, replaces forward and loss entirely.
        optimizer: ``None`` (a fresh AdamW), an optimizer (a fresh one of its class and
            hyperparameters is used; yours is never stepped) or a factory ``params -> optimizer``.
        amp: ``"bf16"`` or ``"fp16"`` to run under autocast (fp16 with a grad scaler; steps whose
            optimizer update the scaler skips do not count, see ``Trial.skipped_steps``).
        mode: ``"train"`` or ``"inference"`` (forward only, under ``torch.inference_mode``).
        device: where to probe; default: where the model is. The model comes back afterwards.
        memory_limit: bytes, a size (``"24GiB"``) or a fraction of the device's memory (CUDA: its
            total as the runtime reports it; CPU: what is available at the start). On CUDA it caps
            what the caching allocator may reserve; on the CPU, live tensor bytes. Without one:
            on CUDA the memory this process can reach, on the CPU half the available memory.
            A limit above what the process can reach is clipped to it, with a note.
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
            still run. Default: nothing is printed.
        criterion: for ``(inputs, targets)`` batches (``find(resnet, (x, y), criterion=
            nn.CrossEntropyLoss())``): the model is called with the inputs and the loss is
            ``criterion(output, targets)``.

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
    options = Options(
        make_batch=make_batch,
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
    from batchfit.probe import find_with  # the algorithm, and torch, only once a probe runs

    if not progress:
        return find_with(model, sample, options, callback=callback, on_trial_start=on_trial_start, on_start=on_start)
    # The probe never prints: the view is fed through the same callbacks a caller could pass.
    with Progress(type(model).__name__, callback, on_trial_start, on_start) as shown:
        result = find_with(model, sample, options, **shown.callbacks())
        shown.summary(result)
    return result


def plan(
    model_or_result: Any,
    sample: Any = None,
    *,
    target_batch: int,
    world_size: int | None = None,
    **find_kwargs: Any,
) -> Plan:
    """:func:`plan_for` on a :class:`~batchfit.report.Result`, or on a fresh probe of a model.

    Given an ``nn.Module``, runs ``batchfit.find(model, sample, **find_kwargs)`` first (the probe
    runs on one process unless launched across ranks; ``world_size`` then defaults to its
    ``world_size``). Given a result, ``sample`` and find keywords are refused rather than ignored:
    they would suggest a probe that does not run.
    """
    if isinstance(model_or_result, Result):
        if sample is not None or find_kwargs:
            given = ["sample"] * (sample is not None) + sorted(find_kwargs)
            raise TypeError(
                f"plan() was given a Result, so there is no probe to pass {', '.join(given)} to; "
                "pass a model to probe instead"
            )
        return plan_for(model_or_result, target_batch, world_size)
    from torch import nn  # local: planning from a result must not need torch

    if not isinstance(model_or_result, nn.Module):
        raise TypeError(
            f"plan() needs a batchfit Result or a torch.nn.Module to probe, got {type(model_or_result).__name__}"
        )
    check_target(target_batch, world_size)  # before the probe, not after minutes of it
    return plan_for(find(model_or_result, sample, **find_kwargs), target_batch, world_size)

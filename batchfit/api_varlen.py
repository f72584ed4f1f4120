"""The Python entry points for variable-length data: [`buckets`][batchfit.buckets] and [`soak`][batchfit.soak].

[`buckets`][batchfit.buckets] turns the data's lengths into per-bucket batch sizes, a token budget
and, asked, packed rows, each verified by real steps (`batchfit.probe.length_plan`); with
``verify="epoch"`` it then replays an epoch of the samplers that take them
(`batchfit.samplers`) through [`soak`][batchfit.soak] (`batchfit.probe.soak`). Given a target
``"module:factory"`` instead of a model, [`soak`][batchfit.soak] replays the steps in a fresh process
(`batchfit.worker`), as a training run starts: nothing of this process's caches or tensors in it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from batchfit.api import shows_view
from batchfit.errors import error_from
from batchfit.probe import Options, Prober, is_batch_source
from batchfit.probe.batches import tile
from batchfit.probe.generation_plan import plan_generation
from batchfit.probe.keywords import FrontierOptions, split_hooks
from batchfit.probe.length_plan import plan_lengths
from batchfit.probe.real_data import at_length, loader_lengths
from batchfit.probe.soak import checked_steps, soak_with
from batchfit.probe.wire import WorkerRequest, answer_of, to_wire
from batchfit.report import LengthPlan
from batchfit.report.bucketing import DEFAULT_MAX_BUCKETS, candidate_lengths, histogram_of, is_paired, pairs_of
from batchfit.report.varlen import Soak
from batchfit.samplers import BucketBatchSampler, TokenBudgetBatchSampler
from batchfit.units import positive_int
from batchfit.view.frontier_view import FrontierProgress

if TYPE_CHECKING:
    from torch import nn
    from typing_extensions import Unpack

    from batchfit.probe import PointCallback
    from batchfit.probe.keywords import FrontierKeywords

__all__ = ["buckets", "epoch_samplers", "soak"]

#: What ``verify=`` takes: ``"epoch"`` replays an epoch of each sampler the plan feeds.
Verify = Literal["epoch"]


def buckets(
    model: nn.Module,
    make_batch: Callable[[int, int], Any] | None = None,
    *,
    lengths: Any = None,
    boundaries: Sequence[int] | None = None,
    max_buckets: int = DEFAULT_MAX_BUCKETS,
    token_budget: bool = True,
    pack_length: int | None = None,
    world_size: int = 1,
    verify: Verify | None = None,
    soak_steps: int | None = None,
    seed: int = 0,
    on_point: PointCallback | None = None,
    **keywords: Unpack[FrontierKeywords],
) -> LengthPlan:
    """Batch sizes for variable-length data, from the data's own lengths, each verified by real steps.

    Buckets (each bucket's batch exact and verified at its longest length), the largest padded
    token budget every batch a token-budget sampler forms fits under (run at its worst
    compositions), and packed rows when ``pack_length`` is given; the knobs verl, slime, torchtune,
    transformers and lhotse take (`LengthPlan.knobs`).

    Args:
        model: the `nn.Module` to probe.
        make_batch: ``(batch_size, seq_len) -> batch``; or a `DataLoader` whose dataset declares
            ``lengths`` (its longest item, collated alone, is repeated and cut to each length).
        lengths: one length per row (a sequence, tensor or array) or a histogram ``{length: rows}``;
            default: the loader's dataset's ``lengths``. ``(prompt, response)`` pairs (or a histogram
            keyed by them) are generation-shaped data: each bucket is a ``mode="generate"`` search
            of its longest prompt generating its longest response (`batchfit.probe.generation_plan`).
        boundaries: the lengths a bucket may end at. Default: row quantiles, heavier in the tail.
        max_buckets: the most buckets to use (the fastest epoch among the candidates).
        token_budget: also find the padded token budget.
        pack_length: also size rows packed to this many tokens (the model must take ``position_ids``).
        world_size: the ranks a step spans, for the epoch's steps (each rank's batch is the one found).
        verify: ``"epoch"``: replay an epoch of each sampler the plan feeds, as real steps (`soak`).
        soak_steps: replay at most this many steps of each epoch.
        seed: the samplers' seed for the replayed epochs.
        on_point: called with each candidate length's `FrontierPoint` when it is done.
        **keywords: [`frontier`][batchfit.frontier]'s options (memory limit, headroom, optimizer...) and hooks.

    Raises:
        ValueError: lengths that do not cover the boundaries, disagree with the loader's batches,
            packing of a model without ``position_ids``: before any trial.
    """
    hooks, given = split_hooks("buckets", keywords, FrontierOptions)
    world_size = positive_int("world_size", world_size)
    if verify not in (None, "epoch"):
        raise ValueError(f"verify must be None or 'epoch', got {verify!r}")
    make_batch, per_row = _data(make_batch, lengths)
    progress = hooks.pop("progress", False)

    def make_prober(at_length: Options) -> Prober:
        return Prober(model, None, options=at_length)

    if is_paired(per_row):
        pairs = pairs_of(per_row)
        _check_generation(given, pack_length, verify, max(r for _, r in pairs))
        return plan_generation(
            model,
            make_batch,
            pairs,
            Options(**given),
            make_prober,
            boundaries=boundaries,
            max_buckets=max_buckets,
            world_size=world_size,
            on_point=on_point,
            **hooks,
        )
    options = Options(**given)
    histogram = histogram_of(per_row)

    run = dict(boundaries=boundaries, max_buckets=max_buckets, token_budget=token_budget, pack_length=pack_length)
    if not shows_view(progress, options):
        plan = plan_lengths(
            model, make_batch, histogram, options, make_prober, world_size=world_size, on_point=on_point, **run, **hooks
        )
    else:
        told = (hooks.get(name) for name in ("callback", "on_trial_start", "on_start"))
        ends = sorted(set(boundaries)) if boundaries else list(candidate_lengths(histogram, options.multiple_of))
        with FrontierProgress(type(model).__name__, ends, on_point, *told) as shown:
            plan = plan_lengths(
                model,
                make_batch,
                histogram,
                options,
                make_prober,
                world_size=world_size,
                on_length=shown.length_started,
                **run,
                **shown.callbacks(),
            )
    if verify == "epoch":
        for name, sampler in epoch_samplers(plan, histogram, seed):
            plan = plan.with_soak(soak(model, make_batch, sampler, name=name, max_steps=soak_steps, **given))
    return plan


def epoch_samplers(plan: LengthPlan, histogram: dict[int, int], seed: int = 0) -> list[tuple[str, Any]]:
    """The samplers that take ``plan``'s sizes over the rows of ``histogram`` (``{length: rows}``),
    each with its name for the soak: ``"buckets"``, then ``"token budget"``, those the plan has.

    Args:
        plan: the sizes, as [`buckets`][batchfit.buckets] found them.
        histogram: the data's rows, ``{length: rows}``.
        seed: the samplers' seed (the epoch they replay).
    """
    rows = [length for length, count in histogram.items() for _ in range(count)]
    samplers: list[tuple[str, Any]] = []
    if plan.buckets:
        samplers.append(("buckets", BucketBatchSampler(rows, plan.boundaries, plan.batch_sizes, seed=seed)))
    if plan.token_budget is not None:
        samplers.append(("token budget", TokenBudgetBatchSampler(rows, plan.token_budget.max_tokens, seed=seed)))
    return samplers


def soak(
    model: nn.Module | str,
    make_batch: Callable[[int, int], Any] | None,
    batches: Any,
    *,
    name: str = "sampler",
    max_steps: int | None = None,
    **keywords: Unpack[FrontierKeywords],
) -> Soak:
    """Replay an epoch's batches as real training steps, as a sampler forms them; the peak, where, and the OOMs.

    A model replays in this process (the first step from scratch: nothing cached, a fresh
    optimizer; ``Soak.process == "this"``). A target ``"module:factory"`` or
    ``"path/to/file.py:factory"`` (what [`find`][batchfit.find]'s ``world_size=`` and ``batchfit
    probe`` take; its factory returns a mapping with ``model`` and ``make_batch``, and ``optimizer``
    or ``loss_fn`` when it has them) replays in a fresh process started for it, as a training run
    starts (``"fresh"``); its options cross as JSON, and no hook does. Ctrl-C ends that process
    and all it started.

    Args:
        model: the `nn.Module` to train, or a target string: the soak runs in a fresh process.
        make_batch: ``(batch_size, seq_len) -> batch``: a step's rows, padded to its longest;
            ``None`` with a target (its own ``make_batch`` is used).
        batches: a batchfit sampler (its ``steps()``: ``(rows, padded length)`` per step) or an
            iterable of ``(rows, seq_len)`` pairs.
        name: what formed the batches, for the record.
        max_steps: replay at most this many steps.
        **keywords: [`frontier`][batchfit.frontier]'s options and hooks (``callback`` sees each step;
            not with a target: a hook cannot cross into its process).

    Raises:
        TypeError: a target with a ``make_batch`` or a hook, an option JSON cannot carry (give it
            from the target), ``batches`` that are no steps: before any step.
        ValueError: a step that is no ``(rows, seq_len)`` of positive ints, none at all; a target
            that gives no ``make_batch`` (from its process).
    """
    hooks, given = split_hooks("soak", keywords, FrontierOptions)
    options = Options(**given)
    steps = batches.steps() if callable(getattr(batches, "steps", None)) else batches
    if not isinstance(steps, Iterable):
        raise TypeError(
            f"batches must be a batchfit sampler or an iterable of (rows, seq_len), got {type(batches).__name__}"
        )
    if isinstance(model, str):
        return _soak_target(model, make_batch, checked_steps(steps, name, max_steps), name, given, hooks)
    if make_batch is None or not callable(make_batch):
        raise TypeError(
            f"soak() needs make_batch: a callable (batch_size, seq_len) -> batch, got {type(make_batch).__name__}"
        )

    def make_prober(shaped: Options) -> Prober:
        return Prober(model, None, options=shaped)

    return soak_with(make_batch, steps, options, make_prober, name, max_steps=max_steps, callback=hooks.get("callback"))


def _soak_target(
    target: str, make_batch: Any, steps: list[tuple[int, int]], name: str, given: dict[str, Any], hooks: Any
) -> Soak:
    """`soak` of ``target`` in a fresh process (`batchfit.worker`'s ``"soak"``): its `Soak`, or the
    error it raised, raised here as its own type; what cannot cross refused before it starts."""
    if ":" not in target.strip(":"):
        raise TypeError(
            f"model must be an nn.Module or a 'module:factory' / 'path/to/file.py:factory' target, got {target!r}"
        )
    if make_batch is not None:
        raise TypeError(
            f"soak() of the target {target!r} builds its batches with the target's make_batch: make_batch must be "
            f"None, got {type(make_batch).__name__}"
        )
    hook = next((name for name, value in hooks.items() if value not in (None, False)), None)
    if hook is not None:
        raise TypeError(f"{hook}= cannot cross into the soak's fresh process of {target!r}: drop it, or pass a model")
    wire = to_wire(given, process="the soak's fresh process")
    with tempfile.TemporaryDirectory(prefix="batchfit-soak-") as folder:
        shapes = [list(step) for step in steps]
        request = WorkerRequest("soak", target, wire, world_size=1, out=folder, shapes=shapes, name=name)
        code, document, tail = answer_of(request)
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        raise error_from(document, "the soak's process")
    if isinstance(document, dict):
        return Soak.from_dict(document)
    raise RuntimeError(f"the soak's process of {target!r} ended (exit code {code}) with:\n{tail}")


def _check_generation(given: dict[str, Any], pack_length: int | None, verify: Any, longest_response: int) -> None:
    """Generation-shaped lengths set each bucket's ``max_new_tokens`` and run ``mode="generate"``:
    name what does not go with them, before any trial (``token_budget`` is not offered: a
    generation's budget is the frontier's KV budget, `plan_generation`'s note says so)."""
    if given.setdefault("mode", "generate") != "generate":
        raise ValueError(
            f"(prompt, response) lengths are generation-shaped data, sized with mode='generate', not {given['mode']!r}"
        )
    if given.get("max_new_tokens") is not None:
        raise ValueError("(prompt, response) lengths set max_new_tokens per bucket (its longest response): drop it")
    if pack_length is not None or verify is not None:
        raise ValueError("(prompt, response) lengths are sized as buckets: pack_length= and verify= are for training")
    given["max_new_tokens"] = longest_response


def _data(make_batch: Any, lengths: Any) -> tuple[Callable[[int, int], Any], Any]:
    """``make_batch`` and the lengths: as given, or read from a loader whose dataset declares them."""
    if make_batch is not None and is_batch_source(make_batch):
        declared = loader_lengths(make_batch)
        if declared is None:
            raise ValueError(
                "buckets() reads a loader's lengths from its dataset's `lengths` (one per item) or a `length` column, "
                "and this loader's dataset has neither: pass lengths= and make_batch=(batch_size, seq_len) -> batch"
            )
        read, longest, dims = declared

        def from_longest(batch_size: int, seq_len: int) -> Any:
            return at_length(tile(longest, batch_size, 1), dims, seq_len)

        return from_longest, read if lengths is None else lengths
    if make_batch is None or not callable(make_batch):
        raise TypeError(
            f"buckets() needs make_batch: a callable (batch_size, seq_len) -> batch, or a DataLoader whose dataset "
            f"declares lengths, got {type(make_batch).__name__}"
        )
    if lengths is None:
        raise TypeError("buckets() needs lengths=: one length per row, or a histogram {length: rows}")
    return make_batch, lengths

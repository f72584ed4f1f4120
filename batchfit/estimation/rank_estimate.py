"""``estimate_sharded``: the per-rank answer of an FSDP2 job of ``world_size`` ranks, without the cluster.

Two halves. `estimate_in_group` runs in a process that is rank 0 of a fake process group
(`batchfit.estimation.fake_ranks.fake_group`) and has the target's builder: the probe's search over
`ShardedProbe`'s trials (each one a fresh build on fake tensors, as a job per trial would run it).
`estimate_sharded` is the Python way in: it starts that process (`batchfit.worker`, given a
`batchfit.probe.wire.WorkerRequest` with its keywords as JSON), so no process group, fake mode or
sharded model is left in the caller's process, and reads the [`Result`][batchfit.Result] back from
its JSON, or raises the error it raised, as its own type (`batchfit.errors.error_from`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchfit.backends.select import is_host
from batchfit.errors import EstimateTimeoutError, error_from
from batchfit.estimation.estimate_setup import EstimateSetup, for_device_of, foreach_assumption
from batchfit.estimation.fake_ranks import ShardedProbe, check_sharded, check_world_size
from batchfit.probe.checks import check_work
from batchfit.probe.finder import described, search_with
from batchfit.probe.real_data import worst_batch
from batchfit.probe.wire import WorkerRequest, answer_of, to_wire
from batchfit.report import Result, Trial
from batchfit.units import format_bytes

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from batchfit.probe.keywords import EstimateOptions

__all__ = ["ESTIMATE_TIMEOUT_S", "NCCL_RESERVE_BYTES", "estimate_in_group", "estimate_sharded", "sharded_assumptions"]

#: Kept aside on a GPU target for NCCL's buffers (outside the caching allocator) unless ``reserve=`` is given.
NCCL_RESERVE_BYTES = 512 * 2**20
#: `estimate_sharded`'s default limit on its process, in seconds (see its ``timeout_s``).
ESTIMATE_TIMEOUT_S = 1800.0


def estimate_sharded(
    target: str,
    world_size: int,
    *,
    memory_limit: int | str | None = None,
    for_device: str | None = None,
    reserve: int | str | None = None,
    timeout_s: float | None = ESTIMATE_TIMEOUT_S,
    device: str | None = None,
    **options: Unpack[EstimateOptions],
) -> Result:
    """Estimate one rank's answer for ``target`` sharded with FSDP2 over ``world_size`` ranks, in a fresh process.

    ``target`` is what ``batchfit probe`` takes (``"mymodels:build"``, ``"path/to/file.py:build"``):
    a factory that returns ``(model, sample)`` (or the dict form, with ``optimizer`` and the other
    keys). It is called after the process joined a fake process group of ``world_size`` ranks as
    rank 0, so its ``fully_shard`` calls shard as on the cluster; build the model on the CPU or on the
    ``meta`` device (no memory then). The other keywords are [`batchfit.estimate`][batchfit.estimate]'s,
    JSON values only (an object cannot cross into the process: give it from the target). A model
    fake tensors cannot trace runs rank 0's real CPU steps instead (for ``for_device="cpu"`` within
    256 MiB; the assumptions say so).

    ``timeout_s`` bounds the process (default `ESTIMATE_TIMEOUT_S`, 30 minutes): a target that
    hangs (waiting on a download, a lock, input) would otherwise hold the call forever. Every trial
    builds the target afresh and traces two steps, so a big model takes minutes (a 1.1B Llama at 8
    ranks 23 s on a laptop, a small model for 64 ranks of 80 GiB 40-80 s on 2 busy cores): half an
    hour is far above those, and still ends a hang the same working session. ``None`` waits without
    limit. At the limit the process and everything it started (its session) are killed.

    Returns:
        The [`Result`][batchfit.Result] (``estimated=True``, ``world_size`` = ``world_size``): the
        per-rank max and safe batch; ``global_max_batch`` and ``global_safe_batch`` are the global
        batch; ``assumptions`` say what is and is not modelled.

    Raises:
        TypeError, ValueError: bad arguments, a model not sharded as ``world_size`` says, a mesh the
            fake group cannot build (before anything is traced).
        NothingFitsError: not even ``init_batch`` fits one rank's memory.
        EstimateTimeoutError: no answer within ``timeout_s`` (the process was killed, with all it started).
        RankFailedError, LimitError, ...: the process raised one of batchfit's errors (as itself).
        RuntimeError: the process failed otherwise (its message says how).
    """
    device = for_device_of("estimate_sharded", for_device, device)  # device=: the old name, with a warning
    check_world_size(world_size)
    if not isinstance(target, str) or ":" not in target.strip(":"):
        raise TypeError(f"target must be a 'module:factory' or 'path/to/file.py:factory' string, got {target!r}")
    if memory_limit is None:
        raise TypeError(
            "estimate_sharded() needs memory_limit=: the memory of one rank's device to estimate for, e.g. '80GiB'"
        )
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        raise ValueError(f"timeout_s must be a positive number of seconds or None (no limit), got {timeout_s!r}")
    EstimateSetup.of(memory_limit, device, reserve, options)  # every keyword checked here, before the process
    wire = to_wire({"memory_limit": memory_limit, "device": device, "reserve": reserve, **options})
    with tempfile.TemporaryDirectory(prefix="batchfit-sharded-") as folder:
        request = WorkerRequest(kind="estimate", target=target, options=wire, world_size=world_size, out=folder)
        code, document, tail = answer_of(request, timeout_s)
    if code is None:
        raise EstimateTimeoutError(target, float(timeout_s or 0), tail)
    if isinstance(document, dict) and "schema" in document:
        return Result.from_dict(document)
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        raise error_from(document, "the sharded estimate")
    raise RuntimeError(f"the sharded estimate's process ended (exit code {code}) with:\n{tail}")


def sharded_assumptions(world_size: int, device_type: str, reserve: Any) -> list[str]:
    """What a sharded estimate models and what it does not, said in its result."""
    said = [
        f"rank 0 of {world_size} on torch's fake process group: FSDP2's own code allocated the all-gathered units "
        "(the prefetched next one too), the reduce-scattered gradient shards and the shards' optimizer state; the "
        "collectives moved no data. Ranks whose programs differ from rank 0's are not modelled",
        "not modelled: the communication library's own buffers (NCCL's live outside the allocator"
        + (
            f": {format_bytes(NCCL_RESERVE_BYTES)} are kept aside for them; reserve= sets what the cluster's keep"
            if not is_host(device_type) and reserve is None and world_size > 1
            else "; reserve= keeps room for them"
        )
        + "), CPU offload (refused), activation memory of other parallelisms",
    ]
    if not is_host(device_type):
        said.append(
            "FSDP's all-gather and reduce-scatter run on streams of their own on a GPU; the modelled allocator "
            "serves them from the compute stream's pool (per-stream pools can reserve more)"
        )
    return said


def estimate_in_group(
    build: Callable[[], tuple[Any, Any, Any]],
    world_size: int,
    *,
    where: str = "the target",
    memory_limit: int | str | None = None,
    device: str = "cpu",
    reserve: int | str | None = None,
    callback: Callable[[Trial], None] | None = None,
    **options: Any,
) -> Result:
    """`estimate_sharded`'s answer in this process, which is rank 0 of a fake group of ``world_size``.

    ``build()`` builds the target afresh each time (``(model, sample, optimizer or None)``: an
    optimizer the target made, over that build's parameters); ``where`` names the target in errors.
    """
    started = time.monotonic()
    check_world_size(world_size)
    nccl = (NCCL_RESERVE_BYTES, "NCCL's buffers on each rank (assumed)") if world_size > 1 else None
    setup = EstimateSetup.of(memory_limit, device, reserve, options, extra_reserve=None if is_host(device) else nccl)
    options_ = setup.options
    model, sample, _ = build()
    check_sharded(model, world_size, where)
    check_work(model, sample, options_)
    sample, drawn, sized_on = worst_batch(sample, options_)
    previous = [model]

    def fresh() -> tuple[Any, Any, Any]:
        """The target built again, as a job would: the same object twice is no fresh build."""
        built, _, optimizer = build()
        if any(built is seen for seen in previous):
            raise ValueError(
                f"{where} gave the same model object twice: a sharded estimate builds the target afresh for every "
                "trial, as a job per trial does; name a factory that builds the model"
            )
        previous[:] = [built]
        check_sharded(built, world_size, where)
        return built, None, optimizer

    del model
    probe = ShardedProbe(fresh, sample, options_, setup.target, setup.budget, world_size)
    probe.sized_on = sized_on
    if drawn is not None:
        probe.notes.append(drawn)
    result = search_with(probe, options_, started, callback=callback)
    setup.assumptions[1:1] = sharded_assumptions(world_size, setup.target.device_type, reserve)
    if probe.real is not None:  # real steps ran instead of the trace: its assumption no longer holds
        setup.assumptions[0] = (
            f"ran real CPU steps of rank 0 in the fake process group, under the live-tensor meter, a fresh build per "
            f"trial, instead of a trace: the model does data-dependent work that fake tensors cannot trace "
            f"({probe.real}); nothing is timed"
        )
    if probe.foreach_switched:
        setup.assumptions.append(foreach_assumption(sorted(probe.foreach_switched)))
    return setup.marked(described(result, sample, options_), started, sized_on)

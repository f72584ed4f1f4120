"""Rank 0 of a sharded job, on fake tensors, in a fake process group: the trials of ``estimate_sharded``.

FSDP2 (``fully_shard``) is a program, not a formula: each unit's parameters are all-gathered into
buffers FSDP allocates itself before its forward (and, with ``reshard_after_forward``, again before
its backward), gradients are reduce-scattered into shards, the optimizer holds the shards' state,
the next unit's all-gather is prefetched. So the estimate runs that program. The process joins
torch's fake process group (``FakeStore`` and the ``fake`` backend, as torchtitan's memory
estimation does) as rank 0 of ``world_size`` *before* the target is built, so the target's own
``fully_shard`` calls shard over ``world_size`` ranks; the collectives return at once and write
nothing, but every buffer they would fill is allocated by FSDP's own code, on this rank, as on a
real one. The model is then turned into fake tensors in place (``Module.to_empty`` under a
``FakeTensorMode``: FSDP2 re-points its sharded parameters, the path it documents for a model
built on the ``meta`` device), and `FakeProbe` runs the probe's steps on it without swapping any
parameter (they are fake already; a swap would break the ``DTensor`` each one is).

`ShardedProbe` stands in for a job per trial (``batchfit.probe.job_runner``), trial for trial: every
trial builds the target again (a fresh process would), starts a fresh optimizer and runs two
steps, and nothing it leaves behind weighs on the next (after an out-of-memory error FSDP's state
is not fit for another step; a job ends there). Rank 0 holds the largest shard (``fully_shard``
pads the last ranks'), so its peak is the job's.

A model fake tensors cannot trace (a value read in forward: ``DataDependentOutputException``)
runs rank 0's real CPU steps in the same fake group instead, a fresh build per trial, the trial a
job's rank runs (``run_worker_trial``): the answer for the CPU, so only for a CPU target within
``FALLBACK_CAP``; anything else is a ``ValueError`` that points to the jobs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from batchfit.backends import EstimateTarget
from batchfit.backends.select import is_host
from batchfit.distributed import Solo
from batchfit.estimation.estimate_setup import FALLBACK_CAP
from batchfit.estimation.fake_trials import FakeProbe, Untraceable
from batchfit.probe import Options, Prober
from batchfit.probe.batches import map_tensors
from batchfit.probe.checks import fit_memory, fixed_memory_advice
from batchfit.probe.job_runner import FRESH_STEPS  # a trial's steps, as a fresh job runs them
from batchfit.probe.notes import ranks_notes
from batchfit.probe.runner import Findings, GroupAnswer, Settled, Setup, Traits, TrialRequest, opened
from batchfit.report import DeviceInfo, SizedOn, Trial, TrialKind, Unit
from batchfit.units import format_bytes

__all__ = [
    "ShardedProbe",
    "check_sharded",
    "check_world_size",
    "fake_group",
    "local_bytes",
    "to_fake",
]

#: Builds the target again: ``(model, sample, optimizer)``, the model on the CPU or the meta device,
#: sharded; the optimizer the target made over its parameters, or ``None``.
Build = Callable[[], tuple[nn.Module, Any, Any]]


def check_world_size(world_size: Any) -> int:
    """``world_size`` as given, or a ``TypeError``/``ValueError`` that says what it must be."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be a positive int (the ranks the job shards over), got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive int (the ranks the job shards over), got {world_size}")
    return world_size


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a fake process group of ``world_size`` ranks, destroyed on exit.

    Refused where a process group is already up: the estimate would shard over that one instead."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check_world_size(world_size)
    if not dist.is_available():
        raise RuntimeError("this build of torch has no torch.distributed: a sharded estimate needs it")
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialized in this process: estimate_sharded() runs the target in a "
            "fresh process of its own (batchfit.estimation.rank_estimate)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_sharded(model: Any, world_size: int, where: str) -> None:
    """Refuse, by name, a model the sharded estimate cannot run as its job would: not an
    ``nn.Module``, not wrapped with ``fully_shard`` where ``world_size`` > 1, CPU offload (not
    modelled), or parameters on a device other than the CPU or ``meta`` (the trace runs on the CPU)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where} must give an nn.Module as its model, got {type(model).__name__}")
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if world_size > 1 and not units:
        raise ValueError(
            f"{where}'s model ({type(model).__name__}) is not wrapped with fully_shard, so at world size {world_size} "
            "every rank would hold all of it: shard it in the target (fully_shard on each block, then on the root; "
            "the target runs after the process group is up), or estimate it for one device without --world-size"
        )
    for unit in units:
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        if type(getattr(group, "offload_policy", None)).__name__ == "CPUOffloadPolicy":
            raise ValueError(
                f"{where}'s model offloads {type(unit).__name__}'s parameters to the CPU (CPUOffloadPolicy): a sharded "
                "estimate does not model CPU offload; shard it without offload_policy"
            )
    devices = sorted({t.device.type for t in [*model.parameters(), *model.buffers()]} - {"cpu", "meta"})
    if devices:
        raise ValueError(
            f"{where}'s model has tensors on {', '.join(devices)}: a sharded estimate runs rank 0's program on this "
            "machine's CPU, on fake tensors. Build the model on the CPU or the meta device (fully_shard takes its "
            "mesh's device from torch.accelerator, the CPU here) and give the card to estimate for as "
            "device= (--device), e.g. a GPU's name"
        )


def local_bytes(model: nn.Module) -> tuple[int, int]:
    """The bytes of this rank's shards of the parameters, and of those that train (``to_local``)."""
    weights = trainable = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        nbytes = local.numel() * local.element_size()
        weights += nbytes
        trainable += nbytes if param.requires_grad else 0
    return weights, trainable


def to_fake(model: nn.Module, sample: Any, mode: Any) -> Any:
    """``model``'s tensors made fake in place (FSDP2 re-points its shards), and ``sample`` faked."""
    with warnings.catch_warnings(), mode:
        # FSDP2 compares the storages' data pointers of a shard it re-points: a fake has none to compare.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        model.to_empty(device="cpu")
        return map_tensors(sample, lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))


class ShardedProbe:
    """A job per trial, on fake tensors in one process (see the module docs): `search_with`'s prober."""

    def __init__(
        self, build: Build, sample: Any, options: Options, target: EstimateTarget, budget: int, world_size: int
    ) -> None:
        self._build = build
        self._sample = sample  # the batch to size on, read once (a loader's worst batch)
        self.options = options
        self.target = target
        self.ranks = Solo(world_size)  # the job's ranks as the search sees them: one estimate speaks for all
        self.budget_bytes: int | None = budget
        self.limit_bytes: int | None = budget
        self.limit_source = "memory_limit"
        self.reserve_bytes = 0
        self.counts: Unit = target.counts
        self.device_info = DeviceInfo(type=target.device_type, name=f"estimate for {target.name}", total_bytes=None)
        self.notes: list[str] = []
        self.sized_on: SizedOn | None = None
        self.foreach_switched: set[str] = set()
        self.optimizer_state_bytes = 0
        self.builds = 0
        #: Why the trials run real CPU steps instead (`real_steps`), once a fake trace could not run.
        self.real: str | None = None
        self._weights = (0, 0)
        self._meter_notes: list[str] = []

    def open(self) -> Setup:
        """Nothing to set up: every trial builds the target afresh. Nothing carries from one trial to
        the next, nothing is timed."""
        facts = (self.budget_bytes, self.counts, self.device_info, self.ranks, self.limit_bytes, self.limit_source)
        return Setup(*facts, self.reserve_bytes, Traits(), self.sized_on, (*self.notes,))

    def run(self, request: TrialRequest) -> Trial:
        """One trial as a fresh job runs it: the target built anew, a fresh optimizer, two steps."""
        batch_size, kind, cap_bytes = request.batch_size, request.kind, request.cap_bytes
        steps = request.steps or self.options.steps_per_trial or FRESH_STEPS
        if self.real is None:
            try:
                return self._fake_trial(batch_size, steps, kind, cap_bytes)
            except Untraceable as why:
                self.real = str(why)
                self._check_real_steps()
        return self._real_trial(batch_size, steps, kind, cap_bytes)

    def _fake_trial(self, batch_size: int, steps: int, kind: TrialKind, cap_bytes: int | None) -> Trial:
        from torch._subclasses.fake_tensor import FakeTensorMode

        model, _, optimizer = self._build()
        self.builds += 1
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        sample = to_fake(model, self._sample, mode)  # the parameters stay the same objects, now fake
        # The target's own optimizer holds this build's parameters: its clone steps them.
        options = replace(self.options, optimizer=optimizer) if optimizer is not None else self.options
        self._weights = local_bytes(model)
        assert self.budget_bytes is not None
        probe = FakeProbe(model, sample, options, self.target, self.budget_bytes, fake_mode=mode)
        session = opened(probe, ())
        with session:
            trial = probe.run(TrialRequest(batch_size, steps, kind, True, cap_bytes))
        self._meter_notes = list(session.findings.notes) if session.findings is not None else []
        self.foreach_switched |= probe.foreach_switched
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, probe.optimizer_state_bytes)
        # What a trial left allocated dies with its job (`JobPerTrial` says the same).
        return replace(trial, leaked_bytes=0)

    def _check_real_steps(self) -> None:
        """Real CPU steps stand in for a trace only where they are the answer, and cheap: on the CPU,
        within `FALLBACK_CAP`."""
        assert self.budget_bytes is not None
        if not is_host(self.target.device_type) or self.budget_bytes > FALLBACK_CAP:
            raise ValueError(
                f"fake tensors cannot trace the model ({self.real}), and real CPU steps answer only for the CPU within "
                f"{format_bytes(FALLBACK_CAP)}: size it with real jobs (batchfit probe TARGET --nproc-per-trial "
                f"{self.ranks.world_size})"
            )

    def _real_trial(self, batch_size: int, steps: int, kind: TrialKind, cap_bytes: int | None) -> Trial:
        """The trial a job's rank 0 runs (``run_worker_trial``), here, in the fake group: real CPU steps."""
        model, _, optimizer = self._build()
        self.builds += 1
        if any(t.device.type == "meta" for t in model.parameters()):
            raise ValueError(
                f"fake tensors cannot trace the model ({self.real}), and it is built on the meta device, so no real "
                "step can run instead: build it with real weights on the CPU"
            )
        self._weights = local_bytes(model)
        options = replace(self.options, distributed=False, **({"optimizer": optimizer} if optimizer else {}))
        prober = Prober(model, self._sample, options=options)
        with opened(prober):
            trial = prober.run(TrialRequest(batch_size, steps, kind, cap_bytes=cap_bytes))
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, prober.optimizer_state_bytes)
        return replace(trial, leaked_bytes=0, step_time_s=None, samples_per_s=None, step_times_s=())

    def settle(self, trials: Sequence[Trial]) -> Settled:
        """The budget (a given size) and the memory equation with the last build's shards."""
        (weights, trainable), mode, state = self._weights, self.options.mode, self.optimizer_state_bytes
        memory = fit_memory(list(trials), weights, trainable, mode, state, self.counts, self.budget_bytes)
        return Settled(self.budget_bytes, self.limit_bytes, self.limit_source, self.reserve_bytes, memory)

    def close(self, trials: Sequence[Trial], answer: GroupAnswer | None, exc: BaseException | None) -> Findings:
        """Nothing to undo (each trial's build is gone): the last trace's meter notes, and the ranks'."""
        weights, trainable = self._weights
        advice = fixed_memory_advice(weights, trainable, self.options.mode, self.options.optimizer, self.budget_bytes)
        ranks = (
            f"estimated as rank 0 of {self.ranks.world_size} in a fake process group: the model's own FSDP code ran "
            "(its all-gather and reduce-scatter buffers, the shards' gradients and optimizer state, prefetch), the "
            "collectives wrote nothing; rank 0 holds the largest shard. Every trial built the target afresh, as a job "
            f"per trial would ({self.builds} builds)"
        )
        return Findings((*self._meter_notes, *ranks_notes(self.ranks.world_size, [ranks])), advice)

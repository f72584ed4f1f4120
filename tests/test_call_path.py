"""The path from `batchfit.find` to the model's forward stays short; every runner is a `Runner`.

A real `find` on a tiny model whose forward records the call stack: the frames from `find` to
`forward`, both counted, counting only batchfit's own frames (torch's `_call_impl`, contextlib's
and the like are not batchfit's to shorten).
"""

from __future__ import annotations

import inspect
import types
import typing
from pathlib import Path
from typing import Any

import torch
from torch import nn

import batchfit
from batchfit import examples
from batchfit.backends import estimate_target
from batchfit.estimation.fake_ranks import ShardedProbe
from batchfit.estimation.fake_trials import FakeProbe
from batchfit.probe.job_runner import JobPerTrial
from batchfit.probe.probing import FromInit, FromLine, SearchPlan
from batchfit.probe.runner import Runner, Setup, opened
from batchfit.probe.wire import WorkerRequest
from batchfit.report import Surface
from batchfit.search import make_strategy, search

PACKAGE = Path(batchfit.__file__).resolve().parent
API = PACKAGE / "api.py"
#: The most frames from `find` to the model's forward that any trial of a probe may take.
MOST_FRAMES = 10


def path_to_forward(stack: list[inspect.FrameInfo]) -> list[str]:
    """`module:function` of each frame from `find` (first) to the forward (last), batchfit's only."""
    path = [f"{Path(stack[0].filename).stem}:{stack[0].function}"]  # the forward itself
    for frame in stack[1:]:
        file = Path(frame.filename).resolve()
        if PACKAGE not in file.parents:
            continue
        path.append(f"{file.relative_to(PACKAGE).with_suffix('')}:{frame.function}")
        if file == API and frame.function == "find":
            return path[::-1]
    raise AssertionError(f"find is not on the stack: {path}")


class Recording(nn.Module):
    """A small MLP whose forward records each distinct path it was called through."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
        self.paths: dict[tuple[str, ...], None] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.paths[tuple(path_to_forward(inspect.stack(context=0)))] = None
        return self.body(x)


def test_find_reaches_the_forward_within_ten_frames() -> None:
    model = Recording()
    result = batchfit.find(model, torch.randn(1, 256), memory_limit="3MiB", steps_per_trial=1, max_batch=4096)
    kinds = {t.kind for t in result.trials}
    assert {"search", "verify", "time"} <= kinds  # every kind of trial went through the forward
    assert model.paths
    deepest = max(model.paths, key=len)
    assert len(deepest) <= MOST_FRAMES, "\n".join(" -> ".join(p) + f" ({len(p)})" for p in model.paths)


# The runner seam -------------------------------------------------------------------------------
def members(protocol: type) -> list[str]:
    """The members a protocol declares (its dunders `__enter__`/`__exit__` included)."""
    return sorted(n for n in vars(protocol) if not n.startswith("_") or n in {"__enter__", "__exit__"})


def conforms(value: object, hint: object) -> bool:
    """Whether `value` is of the declared type `hint` (unions, literals and generics by their origin)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    return isinstance(value, origin or hint)  # type: ignore[arg-type]


def takes_the_same(function: Any, declared: Any) -> bool:
    """Whether `function` takes every parameter `declared` names, any other with a default."""
    own = {n: p for n, p in inspect.signature(function).parameters.items() if n != "self"}
    wanted = [n for n in inspect.signature(declared).parameters if n != "self"]
    extra = [p for n, p in own.items() if n not in wanted]
    return all(n in own for n in wanted) and all(p.default is not inspect.Parameter.empty for p in extra)


def check_member_by_member(instance: object, protocol: type) -> None:
    """Every member of `protocol` on `instance`: a property's value of the declared type, a method
    callable with the protocol's parameters (isinstance checks only that the names exist)."""
    assert isinstance(instance, protocol)
    for name in members(protocol):
        declared = vars(protocol)[name]
        assert hasattr(instance, name), f"{type(instance).__name__} has no {name}"
        value = getattr(instance, name)
        if isinstance(declared, property):
            hint = typing.get_type_hints(declared.fget)["return"]
            assert conforms(value, hint), f"{type(instance).__name__}.{name} = {value!r} is not {hint}"
        else:
            assert callable(value), f"{type(instance).__name__}.{name} is not callable"
            assert takes_the_same(value, declared), f"{type(instance).__name__}.{name}'s parameters"


def test_every_runner_search_with_takes_is_one_narrow_seam() -> None:
    model, sample = examples.mlp(in_features=64, hidden=16, depth=1)
    options = batchfit.Options(memory_limit="8MiB")
    target = estimate_target("cpu")
    runners = [
        batchfit.Prober(model, sample, memory_limit="8MiB"),
        JobPerTrial(WorkerRequest("trial", "target.py", {}, 2, ""), 2, options),
        FakeProbe(model, sample, options, target, 8 * 2**20),
        ShardedProbe(lambda: (model, sample, None), sample, options, target, 8 * 2**20, 2),
    ]
    assert len(members(Runner)) <= 6  # as narrow as httpx's transport
    for runner in runners:
        check_member_by_member(runner, Runner)
    with opened(runners[0]) as setup:  # what search_with reads, told once the runner is open
        assert isinstance(setup, Setup) and setup.ranks.world_size == 1 and setup.traits.times_warm
    assert opened(runners[0]).runner is runners[0]


def test_the_search_plans_are_search_plans() -> None:
    surface = Surface.fit([(64, 1000.0, 10.0)], unit="allocated")
    line = FromLine(surface.fixed_bytes, surface.per_sample_bytes(64), 0.1, 0.0, True, [])
    plans = [FromInit(make_strategy("binary")), line]
    for plan in plans:
        check_member_by_member(plan, SearchPlan)
    # find's plan is the pure search itself, no frame of its own between find and the model
    assert plans[0].search.func is search

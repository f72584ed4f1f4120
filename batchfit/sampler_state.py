"""The batch samplers' arguments checked, their world size found, and their resumable state.

`batchfit.samplers` forms the batches; this module holds what both samplers share around that:
each argument checked before any work (a `TypeError`/`ValueError` naming it), the world size
and rank taken from ``torch.distributed`` as ``DistributedSampler`` takes them, and the plain
JSON-able state a checkpoint holds, refused by name when it was saved by another sampler.
"""

from __future__ import annotations

import hashlib
import numbers
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from batchfit.units import positive_int

STATE_FORMAT = 1
"""The version of `sampler_state`'s dict; a newer one is refused rather than misread."""


def checked_bool(name: str, value: object) -> bool:
    """``value`` when it is a bool: ``shuffle="no"`` is a mistake, not a truthy flag."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def checked_ints(name: str, values: object, minimum: int) -> tuple[int, ...]:
    """A sequence of ints, each at least ``minimum``, from a list, tuple, 1-d tensor or array.

    The error names the argument and the first bad item's index, so one bad row of a million is
    found without a search.
    """
    if isinstance(values, (str, bytes)) or values is None:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    if isinstance(values, torch.Tensor) or hasattr(values, "__array__"):
        tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
        if tensor.dim() != 1:
            raise ValueError(f"{name} must be 1-d, got shape {tuple(tensor.shape)}")
        if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise TypeError(f"{name} must hold integers, got dtype {tensor.dtype}")
        items: Sequence[Any] = tensor.tolist()
    elif isinstance(values, Sequence):
        items = values
    else:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    if not items:
        raise ValueError(f"{name} is empty")
    out = []
    for i, value in enumerate(items):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int, got {type(value).__name__} {value!r}")
        if value < minimum:
            raise ValueError(f"{name}[{i}] must be >= {minimum}, got {value}")
        out.append(int(value))
    return tuple(out)


def longest(lengths: Sequence[int]) -> tuple[int, int]:
    """``(index, length)`` of the longest row (the first of equals): what a budget must hold."""
    index = max(range(len(lengths)), key=lengths.__getitem__)
    return index, lengths[index]


def world(num_replicas: object, rank: object) -> tuple[int, int]:
    """``(num_replicas, rank)``: each given one checked, a missing one from the process group, else 1 and 0."""
    joined = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if joined else 1
    if rank is None:
        rank = dist.get_rank() if joined else 0
    replicas = positive_int("num_replicas", num_replicas, 1)
    checked = positive_int("rank", rank, 0)
    if checked >= replicas:
        raise ValueError(f"rank must be < num_replicas ({replicas}), got {checked}")
    return replicas, checked


def lengths_fingerprint(lengths: Sequence[int]) -> str:
    """A short hash of the lengths in order: a checkpoint resumed over other data is refused."""
    return hashlib.sha256(array("q", lengths).tobytes()).hexdigest()[:16]


def sampler_state(
    kind: str, seed: int, epoch: int, num_replicas: int, steps: int, lengths: Sequence[int], config: Mapping[str, Any]
) -> dict[str, Any]:
    """The plain dict a checkpoint stores (JSON-able): the same on every rank, so one file serves all."""
    return {
        "kind": kind,
        "format": STATE_FORMAT,
        "seed": seed,
        "epoch": epoch,
        "num_replicas": num_replicas,
        "steps": steps,
        "count": len(lengths),
        "lengths": lengths_fingerprint(lengths),
        "config": dict(config),
    }


def _differs(key: str, saved: object, here: object) -> ValueError:
    return ValueError(f"cannot resume: saved with {key}={saved!r}, this sampler has {here!r}")


def checked_state(state: object, here: Mapping[str, Any]) -> tuple[int, int]:
    """``(epoch, steps)`` of a saved state, after every field that must agree with ``here`` does.

    ``here`` is this sampler's own `sampler_state`; the error names the first field that differs
    (kind, seed, world size, lengths, then each setting), so a resume under another seed or world
    size, which would silently repeat or skip rows, is refused before anything changes.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping from state_dict(), got {type(state).__name__}")
    missing = sorted(set(here) - set(state))
    if missing:
        raise ValueError(f"state lacks {', '.join(missing)}: not a batchfit sampler's state_dict()")
    for key in ("kind", "format", "seed", "num_replicas"):
        if state[key] != here[key]:
            raise _differs(key, state[key], here[key])
    if state["count"] != here["count"]:
        raise ValueError(f"cannot resume: saved with {state['count']} lengths, this sampler has {here['count']}")
    if state["lengths"] != here["lengths"]:
        raise ValueError(
            f"cannot resume: the lengths differ from the saved ones (fingerprint {state['lengths']!r}, "
            f"this sampler's {here['lengths']!r})"
        )
    saved_config = state["config"]
    if not isinstance(saved_config, Mapping):
        raise TypeError(f"state['config'] must be a mapping, got {type(saved_config).__name__}")
    for key in sorted(set(here["config"]) | set(saved_config)):
        if saved_config.get(key) != here["config"].get(key):
            raise _differs(key, saved_config.get(key), here["config"].get(key))
    return positive_int("state['epoch']", state["epoch"], 0), positive_int("state['steps']", state["steps"], 0)

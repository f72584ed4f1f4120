"""The result cache's key: a SHA-256 of everything that changes a probe's answer, and nothing else.

A probe's answer is a function of the device, the model's structure, the batch it sizes on, the
step it runs and the search's settings, and of the torch and batchfit versions that ran it. The
key is the SHA-256 of one canonical JSON document of exactly those (`cache_key`, readable:
the cache entry stores it beside the key, so a reader can see what an entry was keyed on):

* **device**: its type, name, total memory and the configuration ``DeviceInfo`` records (the
  allocator settings on CUDA, torch threads on the CPU). Not its index: ``cuda:0`` and ``cuda:1``
  of one machine are the same kind of device, and answer alike;
* **model**: every module's class (qualified name) in order, with its path and train/eval flag;
  every parameter's and buffer's name, shape, dtype and ``requires_grad``; gradient checkpointing
  (Hugging Face's ``is_activation_checkpointing``, ``is_gradient_checkpointing`` before
  transformers 5, any module whose ``gradient_checkpointing`` is True). A DDP or FSDP wrapper is
  a module class like any other, so a wrapped model keys apart
  from a bare one. **Not the weight values**: memory and speed do not depend on them, so a model
  after training keys as it did before (the gradient noise scale does depend on them, and is
  never stored: ``batchfit.probe.cache``);
* **batch**: the shapes and dtypes of the batch the probe sizes on, with their tree paths, after a
  ``DataLoader``'s worst-batch pick and ``seq_len``; with ``make_batch``, its qualified name and
  the shapes of the batch it builds at the first size (built with the random generators put back);
* **work** and **search**: every option `Options` marks as changing the answer (its field
  metadata: `_changes`), by the section it names: a plain value as the answer sees it
  (`Options.answer_settings`); the code by what it is, never by identity (`CODE`): the optimizer
  by its class and the settings of each param group that can change memory, without the
  parameters (`optimizer_fields`; a factory by its qualified name, so two lambdas on one line key
  alike: pass an optimizer object to key on its settings; the default AdamW says so), a module
  criterion by its repr, any other callable by its qualified name; the memory limit in bytes as
  resolved (a fraction keys on the bytes it comes to now) and the reserve (in bytes, or
  ``"auto"``: what it measures varies from run to run);
* **versions**: torch's and batchfit's (`cache_key` takes them as inputs, so a test can ask
  for another version's key).

**Not the world size.** Batch sizes are per rank, and a rank's memory does not depend on how many
ranks there are (DDP's buckets are the model's size, not the group's): an answer measured on one
kind of device holds when an elastic job restarts with more or fewer ranks, which is what lets a
re-plan reuse it. A hit says which world size measured it (``CacheHit.world_size``), and its rates
stay those of the ranks that measured them. Nor any option `Options` marks as unable to change
the answer (each says why in its metadata: `_keeps`).

Values that JSON cannot say exactly are written as text: a float by its ``repr``, a tensor by its
dtype, shape and values, anything else by its type and ``repr`` (a ``repr`` with an address in it
then keys apart on every run: a miss, never a wrong hit).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from batchfit.probe.cache_files import hash_fields
from batchfit.probe.options import Options
from batchfit.report import DeviceInfo
from batchfit.version import __version__

if TYPE_CHECKING:
    from batchfit.probe.prober import Prober

__all__ = ["CacheKey", "cache_key", "probe_key"]


@dataclass(frozen=True)
class CacheKey:
    """A probe's key: the canonical fields, and the SHA-256 (hex) of their canonical JSON."""

    fields: dict[str, Any]
    hex: str


def probe_key(
    prober: Prober, options: Options, *, torch_version: str | None = None, batchfit_version: str | None = None
) -> CacheKey:
    """The key of the probe ``prober`` is set up for (built, not entered: no trial has run)."""
    if options.make_batch is None:
        batch = prober.sized_sample
    else:  # the shapes it builds, at the first size; the random generators as they were
        cpu, device = torch.get_rng_state(), prober.backend.get_rng_state(prober.device)
        try:
            with torch.no_grad():
                batch = prober.options.batch_maker()(options.first_batch)  # type: ignore[misc]
        finally:
            torch.set_rng_state(cpu)
            if device is not None:
                prober.backend.set_rng_state(prober.device, device)
    limit = None if prober.limit_bytes is None else prober.limit_bytes + prober.reserve_bytes
    reserve: int | str = "auto" if options.reserve == "auto" else prober.reserve_bytes
    return cache_key(
        prober.model_for_key,
        batch,
        options,
        prober.device_info,
        limit,
        reserve,
        torch_version=torch.__version__ if torch_version is None else torch_version,
        batchfit_version=__version__ if batchfit_version is None else batchfit_version,
    )


def cache_key(
    model: nn.Module,
    batch: Any,
    options: Options,
    device: DeviceInfo,
    memory_limit_bytes: int | None,
    reserve: int | str,
    *,
    torch_version: str,
    batchfit_version: str,
) -> CacheKey:
    """The key of a probe of ``model`` on ``batch`` (the batch it sizes on) with ``options`` on
    ``device``, under the limit as resolved (``None``: the device's reachable memory): the
    canonical fields (see the module docs), JSON-ready, and their hash."""
    answer, sections = options.answer_settings(), _sections()
    shown = {part: {name: _value(answer[name]) for name in names if name in answer} for part, names in sections.items()}
    code = {name: CODE[name](getattr(options, name)) for name in CODE}
    fields = {
        "device": {
            "type": device.type,
            "name": device.name,
            "total_bytes": device.total_bytes,
            "config": [list(pair) for pair in device.config],
        },
        "model": model_fields(model),
        "batch": {
            "make_batch": code["make_batch"],
            "leaves": batch_leaves(batch, "sample" if options.make_batch is None else "batch"),
        },
        "work": {**shown["work"], **{name: code[name] for name in sections["work"] if name in code}},
        "search": {"memory_limit_bytes": memory_limit_bytes, "reserve": reserve, **shown["search"]},
        "versions": {"torch": str(torch_version), "batchfit": str(batchfit_version)},
    }
    return CacheKey(fields, hash_fields(fields))


def _sections() -> dict[str, list[str]]:
    """The options that change the answer, by the key's section (`Options`' field metadata)."""
    sections: dict[str, list[str]] = {}
    for option in dataclasses.fields(Options):
        if "section" in option.metadata:
            sections.setdefault(option.metadata["section"], []).append(option.name)
    return sections


def model_fields(model: nn.Module) -> dict[str, Any]:
    """The model's structure: modules, parameters, buffers, gradient checkpointing; no values."""
    # Hugging Face's flag; transformers 5 renamed it and warns on the old name, so the new one first.
    names = ("is_activation_checkpointing", "is_gradient_checkpointing")
    flag = next((name for name in names if hasattr(type(model), name)), "")
    checkpointing = getattr(model, flag, None) if flag else None
    return {
        "modules": [[name, qualified(type(module)), module.training] for name, module in model.named_modules()],
        "parameters": [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()],
        "buffers": [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()],
        "gradient_checkpointing": {
            "is_gradient_checkpointing": checkpointing if isinstance(checkpointing, bool) else None,
            "modules": [name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", 0) is True],
        },
    }


def batch_leaves(batch: Any, path: str) -> list[list[Any]]:
    """``[path, shape, dtype]`` of every tensor of ``batch`` and ``[path, value]`` of every other
    leaf (a flag a model takes changes its step), in the order the tree holds them."""
    if isinstance(batch, torch.Tensor):
        return [[path, list(batch.shape), str(batch.dtype)]]
    if isinstance(batch, Mapping):
        return [leaf for key, value in batch.items() for leaf in batch_leaves(value, f"{path}[{key!r}]")]
    if isinstance(batch, (tuple, list)):
        return [leaf for i, value in enumerate(batch) for leaf in batch_leaves(value, f"{path}[{i}]")]
    return [[path, _value(batch)]]


def optimizer_fields(optimizer: Any) -> dict[str, Any]:
    """The optimizer a trial builds: the default AdamW, an optimizer's class and the settings of
    each param group that can change memory (`memory_setting`; not the parameters), or a
    factory's qualified name."""
    if optimizer is None:
        return {"default": "torch.optim.AdamW with torch's defaults"}
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [{k: memory_setting(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        return {"class": qualified(type(optimizer)), "param_groups": groups}
    return {"factory": qualified(optimizer)}


def memory_setting(value: Any) -> Any:
    """A param group's setting as far as it can change what a step allocates. A float (the
    learning rate, weight decay, betas, eps, a momentum or dampening value) keys only on whether it
    is zero: its value changes the numbers, not the tensors, while zero can (SGD keeps no momentum
    buffer at 0; Adam's coupled weight decay adds a copy of the gradients when it is not 0), so a
    learning-rate change is a hit. Anything else keys as it is: flags that allocate state or
    buffers (``amsgrad``, ``foreach``, ``fused``, ``capturable``, ``maximize``, ``nesterov``) and
    counts (L-BFGS's ``history_size``)."""
    if isinstance(value, float):
        return "float 0" if value == 0 else "float not 0"
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
        return f"tensor {value.dtype} {list(value.shape)} {'0' if value.item() == 0 else 'not 0'}"
    if isinstance(value, (tuple, list)):
        return [memory_setting(item) for item in value]
    return _value(value)


def criterion_fields(criterion: Any) -> str:
    """A module criterion by its class and repr (``CrossEntropyLoss(label_smoothing=0.1)`` says its
    settings), any other callable by its qualified name."""
    if isinstance(criterion, nn.Module):
        return f"{qualified(type(criterion))}: {criterion!r}"
    return qualified(criterion)


def qualified(thing: Any) -> str:
    """``module.QualifiedName`` of a class or function; a ``functools.partial`` with its arguments;
    any other callable object by its class."""
    if isinstance(thing, functools.partial):
        given = [_value(a) for a in thing.args] + [f"{k}={_value(v)}" for k, v in sorted(thing.keywords.items())]
        return f"partial({qualified(thing.func)}, {given})"
    named = thing if hasattr(thing, "__qualname__") else type(thing)
    return f"{getattr(named, '__module__', None)}.{named.__qualname__}"


def _named(thing: Any) -> str | None:
    return None if thing is None else qualified(thing)


#: How code (a callable, an optimizer) is keyed, by the `keyed` its option declares: by what it is, never by identity.
KEYED: dict[str, Callable[[Any], Any]] = {
    "name": _named,
    "criterion": lambda criterion: None if criterion is None else criterion_fields(criterion),
    "optimizer": optimizer_fields,
}

#: How each option that is code is keyed, read off `Options`' field metadata.
CODE: dict[str, Callable[[Any], Any]] = {
    option.name: KEYED[option.metadata["keyed"]]
    for option in dataclasses.fields(Options)
    if option.metadata.get("how") == "code"
}


def _value(value: Any) -> Any:
    """``value`` as JSON says it exactly (see the module docs)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return f"float {value!r}"
    if isinstance(value, torch.Tensor):
        shown = value.tolist() if value.numel() <= 16 else f"{value.numel()} values"
        return f"tensor {value.dtype} {list(value.shape)} {shown}"
    if isinstance(value, (tuple, list)):
        return [_value(item) for item in value]
    if isinstance(value, Mapping):
        return {str(k): _value(v) for k, v in value.items()}
    return f"{qualified(type(value))} {value!r}"

"""Load a probe target named on the command line: ``package.module:attr`` or ``path/file.py:attr``.

A target names a factory (called with no arguments) or an object that gives the model and a
sample: a ``(model, sample)`` pair, or a mapping with ``model`` and ``sample`` that may also
carry ``optimizer``, ``loss_fn``, ``make_batch`` and ``step_fn`` (the [`batchfit.find`][batchfit.find]
keywords of the same names).

One file serves every command: a mapping may hold both a ``sample`` and a
``make_batch(batch_size, seq_len)``. A command that sizes one batch shape (``probe``, ``estimate``,
a trial of ``--nproc-per-trial``) uses the sample and leaves ``make_batch`` out; one that sizes
several lengths (``frontier``, ``estimate --seq-lens``: ``lengths=True``) uses ``make_batch`` and
leaves the sample out. `Target.unused` says which key was left out.

Two kinds of failure are kept apart because the CLI answers them with different exit codes:

* `TargetError`: the target itself is wrong (no such module or attribute, a factory that
  needs arguments, a value of the wrong shape). The user fixes the command line or the
  factory's return value. One line explains it.
* `TargetCallError`: the user's own code raised while importing the module or running
  the factory, or called ``sys.exit()`` there (a script's ``if __name__`` guard forgotten, an
  argument parser run at import). That is a bug in their code, not in how they called batchfit;
  the original exception is kept (``__cause__``) so its traceback can be shown.
  ``KeyboardInterrupt`` passes through untouched.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from batchfit.errors import first_line

#: Keys a target mapping may carry besides ``model`` and ``sample``: keywords of ``find()``.
EXTRA_KEYS: tuple[str, ...] = (
    "optimizer",
    "loss_fn",
    "make_batch",
    "step_fn",
    "criterion",
    "generate_fn",
    "eval_step",
)


class TargetError(ValueError):
    """The target is wrong: a usage error, explained in one line."""


class TargetCallError(RuntimeError):
    """The user's code raised while the target was being loaded (import or factory call)."""


@dataclass(frozen=True)
class Target:
    """What a target gave: the model, its sample, and optional ``find()`` keywords."""

    spec: str
    model: Any
    sample: Any
    extras: Mapping[str, Any] = field(default_factory=dict)
    #: The key the target gave and this command does not use (``"make_batch"`` or ``"sample"``).
    unused: str | None = None

    def unused_note(self, command: str) -> str | None:
        """The header line of a command that sizes on the sample and leaves the target's ``make_batch``
        out (a user may have meant it); ``None`` otherwise. A frontier's sample is left out as its
        docs say: a frontier needs batches of every length."""
        if self.unused != "make_batch":
            return None
        return (
            f"the target's make_batch is not used: batchfit {command} sizes on its sample "
            "(batchfit frontier uses make_batch)"
        )


def exit_call(exc: SystemExit) -> str:
    """How the user's code exited, as they would have written it: ``sys.exit(3)``, ``sys.exit()``."""
    return "sys.exit()" if exc.code is None else f"sys.exit({exc.code!r})"


def split_spec(spec: str) -> tuple[str, str]:
    """``"a.b:c.d"`` -> ``("a.b", "c.d")``; the last colon splits, so ``C:\\x.py:f`` works."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise TargetError(f"target {spec!r} must look like 'package.module:factory' or 'path/to/file.py:factory'")
    return where, attr


def load_target(spec: str, *, add_cwd_to_path: bool = True, lengths: bool = False) -> Target:
    """Import the target's module, resolve the attribute, call it if it is a factory, and check
    the shape of what it gave.

    ``add_cwd_to_path`` puts the working directory on ``sys.path`` for module targets, as
    ``python -m`` does, so ``batchfit probe mymodels:build`` works from a project's root with the
    console script too. ``lengths``: the command sizes several sequence lengths, so of a sample
    and a ``make_batch`` given together it keeps ``make_batch`` (else the sample; module docs).
    """
    where, attr = split_spec(spec)
    module = _import(where, add_cwd_to_path=add_cwd_to_path)
    obj = _resolve(module, where, attr)
    value = _call_if_factory(obj, spec)
    return _one_source(_coerce(value, spec), lengths)


def _one_source(target: Target, lengths: bool) -> Target:
    """``target`` with one source of batches, as ``find()`` and ``frontier()`` take: of a sample and
    a ``make_batch`` given together, the one this kind of command sizes with."""
    if target.sample is None or "make_batch" not in target.extras:
        return target
    if lengths:
        return replace(target, sample=None, unused="sample")
    extras = {key: value for key, value in target.extras.items() if key != "make_batch"}
    return replace(target, extras=extras, unused="make_batch")


def _import(where: str, *, add_cwd_to_path: bool) -> Any:
    if where.endswith(".py") or os.sep in where or (os.altsep and os.altsep in where):
        return _import_file(Path(where))
    if add_cwd_to_path and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        # Only a missing *target* module (or one of its parent packages) is a usage error; a
        # module that the user's code imports and lacks is an error in the user's code.
        if exc.name is not None and (where == exc.name or where.startswith(exc.name + ".")):
            raise TargetError(f"cannot import {where!r}: no module named {exc.name!r}") from None
        raise TargetCallError(f"importing {where!r} failed: {first_line(exc)}") from exc
    except SystemExit as exc:
        raise TargetCallError(f"the target called {exit_call(exc)} while importing {where!r}") from exc
    except Exception as exc:
        raise TargetCallError(f"importing {where!r} failed: {first_line(exc)}") from exc


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise TargetError(f"no such file: {str(path)!r}")
    if path.suffix != ".py":
        raise TargetError(f"{str(path)!r} is not a Python file (.py)")
    name = f"_batchfit_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - .py files always have a loader
        raise TargetError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Like `python file.py`: the file can import its neighbours. Registered in sys.modules
    # before it runs so dataclasses and pickling inside it find their module.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        sys.modules.pop(name, None)
        raise TargetCallError(f"the target called {exit_call(exc)} while running {str(path)!r}") from exc
    except Exception as exc:
        sys.modules.pop(name, None)
        raise TargetCallError(f"running {str(path)!r} failed: {first_line(exc)}") from exc
    return module


def _resolve(module: Any, where: str, attr: str) -> Any:
    obj = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = where if i == 0 else f"{where}:{'.'.join(attr.split('.')[:i])}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TargetError(f"{owner!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _call_if_factory(obj: Any, spec: str) -> Any:
    if isinstance(obj, torch.nn.Module):
        raise TargetError(f"{spec} is a model, not a factory: name a function that returns (model, sample)")
    if isinstance(obj, (Mapping, tuple, list)) or not callable(obj):
        return obj
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature: just try the call
        signature = None
    if signature is not None:
        required = [
            p.name
            for p in signature.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if required:
            raise TargetError(
                f"{spec} needs arguments ({', '.join(required)}); batchfit calls it with none: "
                "give them defaults or wrap it in a function without arguments"
            )
    try:
        return obj()
    except SystemExit as exc:
        raise TargetCallError(f"the target called {exit_call(exc)} in {spec}") from exc
    except Exception as exc:
        raise TargetCallError(f"{spec} raised {first_line(exc)}") from exc


def _coerce(value: Any, spec: str) -> Target:
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in ("model", "sample", *EXTRA_KEYS))
        if unknown:
            raise TargetError(
                f"{spec} gave unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                f"model, sample, {', '.join(EXTRA_KEYS)}"
            )
        if "model" not in value:
            raise TargetError(f"{spec} gave a mapping without 'model'")
        if "sample" not in value and value.get("make_batch") is None:
            raise TargetError(f"{spec} gave a mapping with neither 'sample' nor 'make_batch'")
        model, sample = value["model"], value.get("sample")
        extras = {k: value[k] for k in EXTRA_KEYS if value.get(k) is not None}
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        model, sample = value
        extras = {}
    else:
        shape = (
            f"a {type(value).__name__} of length {len(value)}"
            if isinstance(value, (tuple, list))
            else (f"a {type(value).__name__}")
        )
        raise TargetError(f"{spec} gave {shape}; expected (model, sample) or a mapping with 'model' and 'sample'")
    if not isinstance(model, torch.nn.Module):
        raise TargetError(f"{spec} gave a model of type {type(model).__name__}; expected a torch.nn.Module")
    return Target(spec=spec, model=model, sample=sample, extras=extras)


#: Messages of torch when a target asks for CUDA on a machine without it.
_NO_CUDA = ("Torch not compiled with CUDA", "Found no NVIDIA driver", "No CUDA GPUs are available")


def load_sharded(spec: str, world_size: int) -> Target:
    """The target, loaded in a fake process group of ``world_size`` ranks (a sharded estimate's); a
    mesh the group cannot build, or a target that asks for CUDA where there is none, is a
    ``ValueError`` that says so."""
    try:
        return load_target(spec)
    except TargetCallError as exc:
        cause = exc.__cause__
        if cause is None:
            raise
        frames = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(cause.__traceback__)]
        if any(name.endswith("torch/distributed/device_mesh.py") for name in frames):
            raise ValueError(
                f"{spec} builds a device mesh that the fake process group of {world_size} rank(s) cannot build "
                f"({first_line(cause)}): give --world-size the ranks the mesh spans"
            ) from None
        if any(said in str(cause) for said in _NO_CUDA):
            raise ValueError(
                f"{spec} puts its model on CUDA, which this machine does not have ({first_line(cause)}): a sharded "
                "estimate runs rank 0's program on this CPU on fake tensors. Build the model on the CPU or the meta "
                "device (fully_shard takes the mesh's device from torch.accelerator), and estimate for the card with "
                "--device cuda"
            ) from None
        raise


def sharded_builder(spec: str, world_size: int) -> Callable[[], tuple[Any, Any, Any]]:
    """Builds the target afresh (a fresh job's model): ``(model, sample, optimizer)``, the optimizer
    the target gave (over that model's parameters) or ``None``."""

    def build() -> tuple[Any, Any, Any]:
        target = load_sharded(spec, world_size)
        return target.model, target.sample, target.extras.get("optimizer")

    return build

"""``torch.compile`` awareness: a search runs many batch sizes through one compiled model.

Three traps (torch 2.13; Composer #2214, pytorch #172822):

* dynamo compiles per input shape until it sees a dimension change (``automatic_dynamic_shapes``);
  a probe that marks the batch dimension dynamic up front compiles once for all sizes instead of
  once per size (`mark_batch_dynamic`, ``maybe_mark_dynamic``: a hint, never an error);
* ``torch.compile(model, dynamic=False)`` compiles every new size anew, and after
  ``torch._dynamo.config.recompile_limit`` (8) recompilations of a frame dynamo *silently runs it
  eagerly*: later trials measure a different program (`compile_notes` warns);
* the first step at a new shape pays for the compilation: compile time is taken from dynamo's own
  accounting (`compile_seconds`) and reported apart, and a compiled trial runs at least two
  steps so that the timed one is not the compiling one.

On the CPU the live-tensor meter is a dispatch mode, under which dynamo would skip the model's
frames for good; there a compiled model is probed (and estimated) as its eager module, and the
result says so (``finder.Prober._runnable``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from batchfit.probe.batches import tensor_leaves

__all__ = ["Compiled", "compile_notes", "compile_seconds", "compiled_info", "mark_batch_dynamic", "recompiled"]


@dataclass(frozen=True)
class Compiled:
    """What a ``torch.compile``'d model was compiled with: ``dynamic`` (``None``: automatic), and
    whether inductor wraps it in CUDA graphs (``mode="reduce-overhead"``, ``"max-autotune"``)."""

    dynamic: bool | None
    recompile_limit: int
    cudagraphs: bool = False


def compiled_info(model: nn.Module) -> Compiled | None:
    """The compile settings of ``model`` when it is ``torch.compile``'d (an ``OptimizedModule``)."""
    if not isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return None
    import torch._dynamo

    context = getattr(model, "dynamo_ctx", None)
    dynamic = getattr(context, "_dynamic", None)  # private in 2.13; None when it is not there
    return Compiled(dynamic=dynamic if isinstance(dynamic, bool) else None,
                    recompile_limit=int(torch._dynamo.config.recompile_limit),
                    cudagraphs=_uses_cudagraphs(context))  # fmt: skip


def recompiled(model: nn.Module) -> nn.Module:
    """A fresh ``torch.compile`` of a compiled model's module, with its backend (mode and options
    inside it) and ``dynamic``, whose compiled code is its own: dynamo shares compiled code between
    ``torch.compile`` calls whose backends compare equal (inductor's wrappers do, a backend named
    by a string is one object), so a setting read at compile time (the activation memory budget)
    would never reach it, and the user's compiled code is left as it was."""
    import torch

    chain = list(_backends(getattr(model, "dynamo_ctx", None)))
    if not chain:
        raise ValueError("the model is not torch.compile'd: no compile backend to compile it again with")
    info = compiled_info(model)
    backend = chain[-1]  # the innermost: the user's backend
    return torch.compile(model._orig_mod, backend=_OwnCache(backend), dynamic=None if info is None else info.dynamic)


class _OwnCache:
    """A compile backend that equals no other (object identity), so its compiled code is its own."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._backend(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # compiler_name, get_compiler_config, reset, ...
        if name == "_backend":
            raise AttributeError(name)
        return getattr(self._backend, name)


def _backends(context: Any) -> Iterator[Any]:
    """The compile backend of a dynamo context and the ones it wraps, outermost first
    (``_torchdynamo_orig_backend``; private in 2.13), at most 9 deep."""
    backend = getattr(context, "callback", None)
    for _ in range(9):
        if backend is None:
            return
        yield backend
        backend = getattr(backend, "_torchdynamo_orig_backend", None)


def _uses_cudagraphs(context: Any) -> bool:
    """Whether the compile backend records CUDA graphs: inductor's mode options (the wrapper's
    ``config``, e.g. ``{"triton.cudagraphs": True}`` for ``"reduce-overhead"``), else inductor's
    global setting. The backend is reached through dynamo's wrappers (private in 2.13)."""
    for backend in _backends(context):
        config = getattr(backend, "config", None)
        if isinstance(config, dict):
            if "triton.cudagraphs" in config:
                return bool(config["triton.cudagraphs"])
            break
    try:
        import torch._inductor.config as inductor
    except ImportError:  # pragma: no cover - inductor ships with torch
        return False
    return bool(inductor.triton.cudagraphs)


def mark_batch_dynamic(batch: Any) -> None:
    """Hint dynamo that dim 0 of every tensor in ``batch`` varies (one compile for all sizes)."""
    import torch._dynamo

    for _, tensor in tensor_leaves(batch, "batch"):
        if tensor.dim() >= 1:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


def compile_seconds() -> float:
    """Seconds dynamo spent compiling in this process so far (its own accounting)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def compile_notes(info: Compiled | None, sizes_tried: int, ran_compiled: bool, seconds: float) -> list[str]:
    """What the result must say about a compiled model: a ``dynamic=False`` that recompiles per
    size (and past the limit falls back to eager), and the compile time kept out of step times."""
    if info is None:
        return []
    notes = []
    if info.dynamic is False:
        fell_back = ran_compiled and sizes_tried > info.recompile_limit
        notes.append(
            f"the model was compiled with dynamic=False: every batch size compiles anew, and after "
            f"recompile_limit ({info.recompile_limit}) sizes dynamo runs it eagerly without a word"
            + (
                f"; this probe tried {sizes_tried} sizes, so its later trials may have measured eager code"
                if fell_back
                else ""
            )
            + ". Compile with dynamic=None (the default) or True to probe the program you train"
        )
    if ran_compiled and info.cudagraphs:
        notes.append(
            "the model records CUDA graphs, whose memory pools later trials could not free, so the sizes found are "
            "conservative (see docs/concepts/one-trial.md#compiled-models-and-cuda-graphs)"
        )
    if ran_compiled:
        notes.append(
            f"torch.compile: {seconds:.1f} s of compilation during the probe, kept out of the timed steps (each "
            "trial runs a first, untimed step); the batch dimension was marked dynamic"
        )
    return notes

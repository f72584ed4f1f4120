"""Activation checkpointing a model's repeated blocks: find them, choose k of them, apply and undo exactly.

A block is checkpointed the way its own library would: a Hugging Face block (a module with a
``gradient_checkpointing`` flag, transformers' ``GradientCheckpointingLayer``) gets that flag and
``_gradient_checkpointing_func`` (``torch.utils.checkpoint.checkpoint``, non-reentrant), and so do
the model's other flagged modules (which then stop handing the blocks a KV cache the recompute
would update twice), exactly what ``gradient_checkpointing_enable(every_n_layers=...)`` sets; any
other block gets an instance ``forward`` that runs its class's under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Undoing puts every attribute back as it
was (an attribute that was not there is removed again): the model is bit for bit what it was, its
state untouched, Ctrl-C included (`applied` undoes in ``finally``).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from batchfit.probe.compiled import recompiled
from batchfit.report import Placement, Policy

__all__ = [
    "BUDGET_SOURCE",
    "BUDGET_STEPS",
    "NO_BLOCKS",
    "Blocks",
    "applied",
    "apply_policy",
    "budget_policy",
    "find_blocks",
    "keep_policy",
    "policy_for",
]

NO_BLOCKS = (
    "no repeated blocks to checkpoint: no nn.ModuleList or nn.Sequential holds 2 or more modules of one type; "
    "pass the blocks' names (checkpointing=['encoder.layers.0', ...])"
)
#: The steps between budget 1.0 and 0.0 a compiled model's policies choose from (0.1 apart).
BUDGET_STEPS = 10
#: Where a compiled model's policies come from (`Fit.blocks_from`).
BUDGET_SOURCE = "torch.compile's activation memory budget"
#: Absent, as opposed to an attribute whose value is None.
_MISSING = object()


@dataclass(frozen=True)
class Blocks:
    """A model's repeated blocks, in order; where they were found; those already checkpointed."""

    names: tuple[str, ...]
    found_in: str
    already: tuple[str, ...] = ()

    @property
    def free(self) -> tuple[str, ...]:
        """The blocks a policy may checkpoint: those you had not checkpointed already."""
        return tuple(name for name in self.names if name not in self.already)


def find_blocks(model: nn.Module, names: Sequence[str] | None = None) -> Blocks:
    """The blocks ``names`` gives, or by structure the children of the model's largest (by
    parameters) ``nn.ModuleList``/``nn.Sequential`` of 2 or more modules of one type (Hugging Face's
    ``transformer.h``, ``model.layers``, ``encoder.block``). ``ValueError`` naming what is wrong."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    if names is not None:
        if isinstance(names, (str, bytes)) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"checkpointing must be 'auto' or a list of module names, got {names!r}")
        if not names:
            raise ValueError("checkpointing is an empty list: name at least one block, or pass 'auto'")
        for name in names:
            if name not in modules or name == "":
                near = difflib.get_close_matches(name, [n for n in modules if n], n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"checkpointing names {name!r}, which is no module of the model{hint}")
        if len(set(names)) != len(names):
            raise ValueError("checkpointing names a block more than once")
        chosen, found_in = tuple(names), "given"
    else:
        best: tuple[str, nn.Module] | None = None
        best_size = 0
        for name, module in modules.items():
            children = list(module.children())
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2:
                if len({type(child) for child in children}) == 1:
                    size = sum(p.numel() for p in module.parameters())
                    if size > best_size or best is None:
                        best, best_size = (name, module), size
        if best is None:
            raise ValueError(NO_BLOCKS)
        prefix = f"{best[0]}." if best[0] else ""
        chosen, found_in = tuple(f"{prefix}{child}" for child, _ in best[1].named_children()), best[0] or "the model"
    already = tuple(name for name in chosen if _checkpointed_already(modules[name]))
    return Blocks(chosen, found_in, already)


def policy_for(blocks: Sequence[str], k: int, placement: Placement = "first") -> Policy:
    """``k`` of ``blocks`` checkpointed: the first k, or k spread evenly (block ``floor(i N / k)``)."""
    n = len(blocks)
    if not 0 <= k <= n:
        raise ValueError(f"k must be between 0 and {n} blocks, got {k}")
    picks = range(k) if placement == "first" else sorted({(i * n) // k for i in range(k)})
    return Policy(tuple(blocks[i] for i in picks), n, placement)


def budget_policy(k: int, steps: int = BUDGET_STEPS) -> Policy:
    """A compiled model's policy ``k`` steps below budget 1.0 (0: the model as it was compiled)."""
    if not 0 <= k <= steps:
        raise ValueError(f"k must be between 0 and {steps} budget steps, got {k}")
    return Policy((), steps) if k == 0 else Policy((), steps, budget=round(1 - k / steps, 6))


@contextlib.contextmanager
def applied(model: nn.Module, policy: Policy) -> Iterator[nn.Module]:
    """``policy`` on ``model`` for the block inside, which gets the module to run: ``model`` with
    its blocks checkpointed (every attribute put back on the way out), or for a budget a fresh
    compile of ``model``'s module (`batchfit.probe.compiled.recompiled`) under
    ``torch._functorch.config.activation_memory_budget`` (the setting put back on the way out; the
    user's compiled code untouched)."""
    if policy.budget is not None:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=policy.budget):
            yield recompiled(model)
        return
    undo = apply_policy(model, policy)
    try:
        yield model
    finally:
        undo()


def apply_policy(model: nn.Module, policy: Policy) -> Callable[[], None]:
    """Apply ``policy`` to ``model`` and return what undoes it exactly (the integrations keep it applied)."""
    if policy.budget is not None:
        raise ValueError("a compile budget is applied by compiling again, not to the model: use applied()")
    modules = dict(model.named_modules())
    saved: list[tuple[nn.Module, str, Any]] = []

    def set_attr(module: nn.Module, name: str, value: Any) -> None:
        saved.append((module, name, module.__dict__.get(name, _MISSING)))
        setattr(module, name, value)

    def undo() -> None:
        for module, name, before in reversed(saved):
            if before is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = before
        saved.clear()

    if policy.k == 0:
        return undo
    try:
        flagged = [name for name in policy.checkpointed if _has_flag(modules[name])]
        if flagged:  # transformers' own switch, per block, as gradient_checkpointing_enable sets it
            from torch.utils.checkpoint import checkpoint

            function = functools.partial(checkpoint, use_reentrant=False)
            for name, module in modules.items():
                if _has_flag(module) and (not _is_block_class(module) or name in policy.checkpointed):
                    set_attr(module, "_gradient_checkpointing_func", function)
                    set_attr(module, "gradient_checkpointing", True)
        for name in policy.checkpointed:
            if name not in flagged:
                block = modules[name]
                set_attr(block, "forward", functools.partial(_checkpointed, type(block).forward.__get__(block)))
    except BaseException:
        undo()
        raise
    return undo


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _has_flag(module: nn.Module) -> bool:
    """Whether transformers checkpoints this module by its ``gradient_checkpointing`` flag."""
    return isinstance(getattr(module, "gradient_checkpointing", None), bool)


def _is_block_class(module: nn.Module) -> bool:
    """A repeated layer in transformers' sense (``GradientCheckpointingLayer``), not a model that
    only reads the flag to drop its cache."""
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def _checkpointed_already(module: nn.Module) -> bool:
    """Checkpointed before batchfit came: its flag on, a ``forward`` of its own, or a checkpoint wrapper."""
    if getattr(module, "gradient_checkpointing", False) is True:
        return True
    if "forward" in module.__dict__:
        return True
    return type(module).__name__ == "CheckpointWrapper" or any(
        type(child).__name__ == "CheckpointWrapper" for child in module.children()
    )


def keep_policy(model: nn.Module, policy: Policy) -> str:
    """Apply ``policy`` for training (the integrations), and say what was applied: all blocks of a
    Hugging Face model by its own switch (``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` before transformers 5; non-reentrant), anything else as `apply_policy`."""
    if policy.budget is not None:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = policy.budget
        return (
            f"torch._functorch.config.activation_memory_budget = {policy.budget:g} for what compiles from now on "
            "(code the model compiled before keeps its own)"
        )
    if policy.k == 0:
        return "no activation checkpointing"
    for prefix in ("activation_checkpointing", "gradient_checkpointing"):
        switch = getattr(model, f"{prefix}_enable", None)
        if policy.k == policy.blocks and callable(switch) and getattr(model, "supports_gradient_checkpointing", False):
            switch(**{f"{prefix}_kwargs": {"use_reentrant": False}})
            return f"activation checkpointing of all {policy.blocks} blocks (model.{prefix}_enable())"
    apply_policy(model, policy)
    return f"activation checkpointing of {policy.label}: {', '.join(policy.checkpointed)}"

"""Activation checkpointing a model's repeated blocks: find them, choose k of them, apply and undo exactly.

A block is checkpointed the way its own library would: a Hugging Face block (a module with a
``gradient_checkpointing`` flag, transformers' ``GradientCheckpointingLayer``) gets that flag and
``_gradient_checkpointing_func`` (``torch.utils.checkpoint.checkpoint``, non-reentrant), and so do
the model's other flagged modules (which then stop handing the blocks a KV cache the recompute
would update twice), exactly what ``gradient_checkpointing_enable(every_n_layers=...)`` sets; any
other block gets an instance ``forward`` that runs its class's under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Undoing puts every attribute back as it
was (an attribute that was not there is removed again): the model is bit for bit what it was, its
state untouched, Ctrl-C included (`applied` applies and undoes under the interrupt guard).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from batchfit.interrupts import InterruptGuard, critical_section, installed_guard
from batchfit.probe.compiled import recompiled
from batchfit.report import Placement, Policy
from batchfit.units import format_bytes

__all__ = [
    "BUDGET_SOURCE",
    "BUDGET_STEPS",
    "NO_BLOCKS",
    "Blocks",
    "applied",
    "apply_policy",
    "budget_policy",
    "by_saving",
    "find_blocks",
    "keep_policy",
    "policy_for",
    "saving",
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

    @property
    def groups(self) -> tuple[str, ...]:
        """Where the blocks were found, one name per group (``"transformer.h"``; ``""``: the model)."""
        return tuple(dict.fromkeys(_group(name) for name in self.names)) if self.found_in != "given" else ()


def find_blocks(model: nn.Module, names: Sequence[str] | None = None) -> Blocks:
    """The blocks ``names`` gives, or by structure the children of every ``nn.ModuleList`` /
    ``nn.Sequential`` of 2 or more modules of one type that no other such block holds (Hugging
    Face's ``transformer.h``, ``model.layers``; T5's ``encoder.block`` and ``decoder.block``), in
    the model's order (`by_saving` orders several groups by what they save). ``ValueError`` naming
    what is wrong, a module that is never called (a ``ModuleList`` has no forward) included."""
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
            if type(modules[name]).forward is nn.Module.forward:
                inside = [f"{name}.{child}" for child, _ in modules[name].named_children()][:2]
                raise ValueError(
                    f"checkpointing names {name!r}, a {type(modules[name]).__name__} that is never called (it has "
                    f"no forward), so checkpointing it would recompute nothing: name the blocks inside it "
                    f"({', '.join(inside + ['...'])}), or pass 'auto'"
                )
        if len(set(names)) != len(names):
            raise ValueError("checkpointing names a block more than once")
        chosen, found_in = tuple(names), "given"
    else:
        groups: list[str] = []
        chosen = ()
        for name, module in modules.items():
            children = list(module.children())
            if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(children) < 2:
                continue
            if len({type(child) for child in children}) == 1 and not any(name.startswith(f"{b}.") for b in chosen):
                groups.append(name)
                chosen += tuple(f"{name}.{child}" if name else child for child, _ in module.named_children())
        if not groups:
            raise ValueError(NO_BLOCKS)
        found_in = ", ".join(group or "the model" for group in groups)
    already = tuple(name for name in chosen if _checkpointed_already(modules[name]))
    return Blocks(chosen, found_in, already)


def by_saving(blocks: Blocks, saved: dict[str, int]) -> tuple[Blocks, str]:
    """``blocks`` of several groups, the groups that save most per block first (``saved``: bytes
    each block saved for backward in one step, `saving`), a block that saved nothing passed over
    (never called: checkpointing it recomputes nothing); and a note saying so, with the bytes.
    Nothing measured (the step failed): the blocks as they were, and a note saying so."""
    if not any(saved.get(name, 0) for name in blocks.free):
        return blocks, f"blocks of {len(blocks.groups)} groups in the model's order: one step at batch 1 measured none"
    per_block: dict[str, float] = {}
    for group in blocks.groups:
        used = [saved[name] for name in blocks.free if _group(name) == group and saved.get(name, 0) > 0]
        per_block[group] = sum(used) / len(used) if used else 0.0
    order = sorted((g for g in per_block if per_block[g] > 0), key=lambda g: -per_block[g])
    kept = tuple(name for g in order for name in blocks.free if _group(name) == g and saved.get(name, 0) > 0)
    unused = [name for name in blocks.free if name not in kept]
    shown = ", ".join(f"{g or 'the model'} {format_bytes(per_block[g])}" for g in order)
    note = f"blocks of {len(blocks.groups)} groups, the most saved first (bytes saved for backward per block at "
    note += f"batch 1): {shown}"
    if unused:
        shown = ", ".join(unused[:3]) + (", ..." if len(unused) > 3 else "")
        note += f"; passed over {len(unused)} that saved nothing, never called in a step ({shown})"
    found_in = ", ".join(g or "the model" for g in order)
    return Blocks(kept + blocks.already, found_in, blocks.already), note


@contextlib.contextmanager
def saving(model: nn.Module, names: Sequence[str]) -> Iterator[dict[str, int]]:
    """The bytes each of ``names`` saves for backward in the steps inside (its activations: the
    tensors autograd keeps, parameters left out), for choosing what to checkpoint. Hooks on the
    blocks, registered and removed as critical sections of the interrupt guard in place."""
    import torch

    modules = dict(model.named_modules())
    saved = dict.fromkeys(names, 0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    running: list[str] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if running:
            try:
                weight = tensor.untyped_storage().data_ptr() in params
            except (RuntimeError, NotImplementedError):  # a tensor without one storage (sparse, a subclass)
                weight = False
            if not weight:
                saved[running[0]] += tensor.numel() * tensor.element_size()
        return tensor

    def enter(name: str) -> Callable[..., None]:
        return lambda module, args: running.append(name)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if running:
            running.pop()

    handles = []
    try:
        with critical_section():
            for name in names:
                handles.append(modules[name].register_forward_pre_hook(enter(name)))
                handles.append(modules[name].register_forward_hook(leave))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield saved
    finally:
        with critical_section():
            for handle in handles:
                handle.remove()


def _group(name: str) -> str:
    return name.rpartition(".")[0]


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
    user's compiled code untouched).

    Ctrl-C cannot leave the policy half on or half off: applying and undoing run as critical
    sections of the interrupt guard in place (a probe's, when inside one), and otherwise under a
    guard of this policy's own from before it is applied until it is undone, so a Ctrl-C anywhere
    between surfaces once the model is as it was. A probe inside nests its own guard and gets a
    Ctrl-C at its next safe point; other code inside gets it when the block ends."""
    guard = installed_guard()
    own = guard is None
    if guard is None:
        guard = InterruptGuard(exits=(_applying,))
        guard.__enter__()
    undo: Callable[[], None] = _nothing
    exc: BaseException | None = None
    try:
        with guard.critical():
            undo, runnable = _put_on(model, policy)
        yield runnable
    except BaseException as error:
        exc = error
        raise
    finally:
        if own:
            guard.finish(undo, exc)
        else:
            with guard.critical():
                undo()


_applying = applied.__wrapped__  # type: ignore[attr-defined]


def _put_on(model: nn.Module, policy: Policy) -> tuple[Callable[[], None], nn.Module]:
    """Apply ``policy``: what undoes it, and the module to run."""
    if policy.budget is None:
        return apply_policy(model, policy), model
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = policy.budget
    try:
        return functools.partial(setattr, functorch_config, "activation_memory_budget", before), recompiled(model)
    except BaseException:
        functorch_config.activation_memory_budget = before
        raise


def _nothing() -> None:
    """An undo with nothing to undo."""


def apply_policy(model: nn.Module, policy: Policy) -> Callable[[], None]:
    """Apply ``policy`` to ``model`` and return what undoes it exactly (the integrations keep it applied).
    The undo puts back one attribute at a time, the last set first, each once: run again after it
    was cut short, it goes on from there."""
    if policy.budget is not None:
        raise ValueError("a compile budget is applied by compiling again, not to the model: use applied()")
    modules = dict(model.named_modules())
    saved: list[tuple[nn.Module, str, Any]] = []

    def set_attr(module: nn.Module, name: str, value: Any) -> None:
        saved.append((module, name, module.__dict__.get(name, _MISSING)))
        setattr(module, name, value)

    def undo() -> None:
        while saved:
            module, name, before = saved[-1]
            if before is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = before
            saved.pop()

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
                block = modules[name]  # its forward as it runs now (an Accelerate hook's included)
                set_attr(block, "forward", functools.partial(_checkpointed, block.forward))
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
    """Checkpointed before batchfit came, by what checkpoints it: its ``gradient_checkpointing``
    flag on, a ``CheckpointWrapper`` (itself or its child), ``torch.distributed._composable``'s
    ``checkpoint``, or an instance ``forward`` that runs ``torch.utils.checkpoint`` (looked for
    through ``functools.partial`` and wrappers: an Accelerate hook's forward is not one)."""
    if getattr(module, "gradient_checkpointing", False) is True:
        return True
    if type(module).__name__ == "CheckpointWrapper" or any(
        type(child).__name__ == "CheckpointWrapper" for child in module.children()
    ):
        return True
    if any(key.startswith("__composable_api") and isinstance(value, dict) and "checkpoint" in value
           for key, value in module.__dict__.items()):  # fmt: skip
        return True
    return "forward" in module.__dict__ and _runs_checkpoint(module.__dict__["forward"])


def _runs_checkpoint(forward: Any, depth: int = 8) -> bool:
    """Whether an instance forward calls ``checkpoint``: it is ours, a partial of ``checkpoint``, or
    code that names it, here or in what it wraps (``functools.wraps``, a partial's function)."""
    from torch.utils.checkpoint import checkpoint

    while forward is not None and depth > 0:
        if forward in (checkpoint, _checkpointed):
            return True
        owner = getattr(forward, "__self__", None)
        if isinstance(owner, nn.Module) and getattr(forward, "__func__", None) is type(owner).forward:
            return False  # the block's own forward, as its class runs it
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        if code is not None and "checkpoint" in code.co_names + code.co_freevars:
            return True
        if isinstance(forward, functools.partial):
            if forward.func in (checkpoint, _checkpointed):
                return True
            inner = getattr(forward, "__wrapped__", None)
            forward = inner if inner is not None else forward.func
        else:
            forward = getattr(forward, "__wrapped__", None)
        depth -= 1
    return False


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

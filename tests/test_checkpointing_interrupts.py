"""Ctrl-C while a checkpointing policy is applied or undone (issue 48, item 8): a real SIGINT at
every line of the apply/undo code, and the model comes back exactly, its instance attributes and
``forward`` included."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same_state, state_of
from torch import nn

import batchfit
import batchfit.probe.checkpointing_blocks as recompute
from batchfit.interrupts import InterruptGuard, installed_guard
from batchfit.probe.checkpointing_blocks import applied, find_blocks, policy_for

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals"),
    pytest.mark.skipif(
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler, reason="needs Python's SIGINT handler"
    ),
]

#: The model's own forward, run by the block inside: not the apply/undo code the sweep is about.
_BODY = {recompute._checkpointed.__code__}
#: What runs while the policy is on.
Body = Callable[[nn.Module, Any], None]


def plain_blocks() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)]), torch.randn(2, 8)


def hf_gpt2() -> tuple[nn.Module, Any]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids}


def attributes(model: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """Every module's instance dict (an instance ``forward`` included), its parameters, buffers and
    children by identity: what a policy sets must be gone, and nothing else replaced."""
    return [
        (name, {key: dict(value) if isinstance(value, dict) else value for key, value in module.__dict__.items()})
        for name, module in model.named_modules()
    ]


def same_attributes(before: list[tuple[str, dict[str, Any]]], after: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The modules whose instance dict differs (a key added or gone, a value replaced)."""
    wrong = []
    for (name, was), (_, now) in zip(before, after, strict=True):
        if was.keys() != now.keys() or any(
            (was[k].keys() != now[k].keys() or any(was[k][j] is not now[k][j] for j in was[k]))
            if isinstance(was[k], dict) else was[k] is not now[k]
            for k in was
        ):  # fmt: skip
            wrong.append(name or "the model")
    return wrong


def forward_backward(model: nn.Module, sample: Any) -> None:
    output = model(**sample) if isinstance(sample, dict) else model(sample)
    (output.loss if hasattr(output, "loss") else output.sum()).backward()


def nothing(model: nn.Module, sample: Any) -> None:
    """No step: the sweep is about the apply/undo lines around it."""


def a_probe(model: nn.Module, sample: Any) -> None:
    """What `fit` runs inside a policy: a probe, with its own interrupt guard."""
    with batchfit.Prober(model, sample, memory_limit="64MiB", steps_per_trial=1) as prober:
        prober.trial(1)


def in_a_probe(model: nn.Module, sample: Any, policy: Any) -> None:
    """As `fit` times its candidates: the probe outside, the policy switched inside it."""
    with batchfit.Prober(model, sample, memory_limit="64MiB", steps_per_trial=1) as prober:
        with applied(model, policy):
            prober.trial(1)


def around(model: nn.Module, sample: Any, policy: Any, body: Body) -> None:
    with applied(model, policy):
        body(model, sample)


def interrupt_at(nth: int, model: nn.Module, sample: Any, body: Body | None) -> tuple[int, str]:
    """Apply and undo 2 checkpointed blocks around ``body`` (``None``: inside a probe, around a
    trial), a real SIGINT landing at the ``nth`` line the apply/undo code runs (0: none). The lines
    run, and what went wrong ('' when nothing)."""
    model.zero_grad(set_to_none=True)
    before, kept = state_of(model), attributes(model)
    policy = policy_for(find_blocks(model).names, 2)
    seen = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal seen
        if frame.f_code.co_filename != recompute.__file__ or frame.f_code in _BODY:
            return None
        if event == "line":
            seen += 1
            if seen == nth:
                signal.raise_signal(signal.SIGINT)  # handled at the next bytecode
        return tracer

    interrupted = False
    try:
        sys.settrace(tracer)
        try:
            if body is None:
                in_a_probe(model, sample, policy)
            else:
                around(model, sample, policy, body)
        finally:
            sys.settrace(None)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        handler = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # never leave a broken handler to later tests
    model.zero_grad(set_to_none=True)
    wrong = same_attributes(kept, attributes(model))
    problems = [f"instance attributes changed on {', '.join(wrong)}"] if wrong else []
    if nth and not interrupted:
        problems.append("the Ctrl-C was lost")
    if handler is not signal.default_int_handler:
        problems.append(f"SIGINT handler left as {handler}")
    try:
        assert_same_state(before, state_of(model))
    except AssertionError as error:
        problems.append(f"state: {error}")
    return seen, "; ".join(problems)


def sweep(build: Callable[[], tuple[nn.Module, Any]], body: Body | None) -> tuple[int, list[str]]:
    model, sample = build()
    lines, problem = interrupt_at(0, model, sample, body)
    assert not problem, problem
    wrong = []
    for nth in range(1, lines + 1):
        _, problem = interrupt_at(nth, model, sample, body)
        if problem:
            wrong.append(f"line {nth} of {lines}: {problem}")
    return lines, wrong


def test_a_sigint_at_any_line_of_applying_or_undoing_plain_blocks_leaves_them_as_they_were() -> None:
    """Before the fix a Ctrl-C in the undo (after the `finally` began) left an instance ``forward``
    on the blocks not yet undone."""
    lines, wrong = sweep(plain_blocks, forward_backward)
    assert lines >= 20
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_a_sigint_at_any_line_of_applying_or_undoing_hf_blocks_leaves_them_as_they_were() -> None:
    """Before the fix a Ctrl-C in the undo left ``gradient_checkpointing`` and
    ``_gradient_checkpointing_func`` on GPT-2's blocks."""
    lines, wrong = sweep(hf_gpt2, nothing)
    assert lines >= 50
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_a_sigint_at_any_line_around_a_probe_inside_a_policy_leaves_the_model_as_it_was() -> None:
    """As `fit` runs it: the policy's guard outside, the probe's own nested inside it."""
    lines, wrong = sweep(plain_blocks, a_probe)
    assert lines >= 20
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_a_sigint_at_any_line_of_a_policy_switched_inside_a_probe_leaves_the_model_as_it_was() -> None:
    """As `fit` times its candidates: the probe's guard records the Ctrl-C, the policy is undone,
    and the probe raises it on its way out."""
    lines, wrong = sweep(plain_blocks, None)
    assert lines >= 20
    assert not wrong, "\n".join(wrong)


def test_a_guard_inside_another_takes_over_and_puts_the_outer_one_back() -> None:
    outer, inner = InterruptGuard(), InterruptGuard()
    with outer:
        assert installed_guard() is outer
        with inner:
            assert installed_guard() is inner
            signal.raise_signal(signal.SIGINT)
            assert inner.pending and not outer.pending
            inner.take()
        assert installed_guard() is outer
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # out of order: the inner one stays in place ...
    assert installed_guard() is inner
    inner.__exit__(None, None, None)  # ... and puts Python's back, not the finished outer one's
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.slow
def test_a_real_sigint_in_a_fits_probe_stops_it_at_the_next_safe_point() -> None:
    """The probe inside a policy still gets the Ctrl-C at once (its guard nests in the policy's):
    no further trial starts, and the model is as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(4)])
    sample = torch.randn(2, 128)
    before, kept = state_of(model), attributes(model)
    started: list[int] = []
    sent: list[int] = []

    def interrupt_once_checkpointed(size: int, kind: str) -> None:
        started.append(size)
        if not sent and any("forward" in m.__dict__ for m in model.modules()):
            sent.append(len(started))
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        batchfit.fit(model, sample, target_batch=4000, memory_limit="4MiB", on_trial_start=interrupt_once_checkpointed)
    assert sent and len(started) == sent[0]  # no trial started after the Ctrl-C
    assert not same_attributes(kept, attributes(model))
    assert_same_state(before, state_of(model))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

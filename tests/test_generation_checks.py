"""Issue 48: what `find(mode="generate")` checks and puts back.

* item 4: a ``generate_fn``'s output is checked for every one of ``max_new_tokens``, as the built-in
  path's is, and an output whose length cannot be read is refused (before, a loop that stopped at its
  end-of-sequence token sized a batch far too large, and ``lambda m, b, n: "ok"`` gave 32768);
* item 10: the user's own ``generation_config`` object is on the model afterwards, its contents as
  they were, also under a real SIGINT at each line of the generation's way in and out;
* item 15: a 64-position model takes a 64-token prompt and 1 new token (the last new token is never
  fed back: HF's ``generate`` itself shows it), and a model whose every token is an end-of-sequence
  token is refused naming that, not ``max_length``.

The truths are HF's own ``generate`` run plainly beside the probe.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import namedtuple
from typing import Any

import pytest
import torch
from helpers import assert_same_state, state_of
from torch import nn
from torch.utils._pytree import tree_leaves

import batchfit

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Any:
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def _gpt2(positions: int = 128, vocab: int = 100, eos: int | list[int] = 1) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=positions, bos_token_id=0, eos_token_id=eos
    )
    return transformers.GPT2LMHeadModel(config)


def _prompts(length: int = 8, vocab: int = 100) -> dict[str, torch.Tensor]:
    ids = torch.randint(min(2, vocab - 1), vocab, (1, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _stopping_at_once() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A model whose end-of-sequence token is greedy's first new token: a plain ``generate`` stops there."""
    model, prompts = _gpt2(), _prompts()
    first = model.generate(**prompts, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1]
    model.generation_config.eos_token_id = int(first)
    return model, prompts


def _find(model: nn.Module, prompts: Any, calls: list[int] | None = None, **keywords: Any) -> batchfit.Result:
    keywords.setdefault("max_new_tokens", NEW_TOKENS)
    return batchfit.find(
        model,
        prompts,
        mode="generate",
        memory_limit="2MiB",
        timed_steps=0,
        callback=None if calls is None else (lambda trial: calls.append(trial.batch_size)),
        **keywords,
    )


# item 4: a generate_fn's output is checked --------------------------------------------------------------
def test_a_generate_fn_that_stops_at_its_end_of_sequence_token_is_refused_naming_the_cause() -> None:
    model, prompts = _stopping_at_once()
    plain = model.generate(**prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert plain.shape[-1] == 8 + 1  # the truth: the usual loop stops after one token
    before = state_of(model)
    calls: list[int] = []
    usual = lambda m, b, n: m.generate(**b, max_new_tokens=n, do_sample=False, pad_token_id=0)  # noqa: E731
    with pytest.raises(RuntimeError, match="generate_fn stopped after 1 of max_new_tokens=12") as caught:
        _find(model, prompts, calls, generate_fn=usual)
    said = str(caught.value)
    assert "end-of-sequence token" in said and "min_new_tokens=max_new_tokens" in said
    assert calls == []  # the first trial stops the probe: no size was measured on the short cache
    assert_same_state(before, state_of(model))


@pytest.mark.parametrize(
    "returned",
    ["ok", 3, torch.tensor(1), [torch.zeros(1, 20)], {"ids": torch.zeros(1, 20)}],
    ids=["str", "int", "scalar-tensor", "list", "dict"],
)
def test_a_generate_fn_output_whose_length_cannot_be_read_is_refused(returned: Any) -> None:
    with pytest.raises(TypeError, match="generate_fn returned a .*: return the ids it generated"):
        _find(_gpt2(), _prompts(), generate_fn=lambda m, b, n: returned)


@pytest.mark.slow
def test_a_generate_fn_of_every_token_is_sized_from_its_sequences_like_the_built_in_path() -> None:
    """The check takes an output's ``.sequences`` (what ``return_dict_in_generate`` returns): a loop
    that generates every token is accepted, and sizes what the built-in path sizes."""
    model, prompts = _stopping_at_once()

    def full(m: nn.Module, b: Any, n: int) -> Any:
        return m.generate(**b, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True)  # fmt: skip

    assert _find(model, prompts, generate_fn=full).max_batch == _find(model, prompts).max_batch


# item 10: the user's generation_config object is put back -----------------------------------------------
def test_the_users_generation_config_object_is_on_the_model_afterwards_with_its_contents() -> None:
    model, prompts = _gpt2(), _prompts()
    kept = model.generation_config
    contents = kept.to_dict()
    _find(model, prompts)
    assert model.generation_config is kept and kept.to_dict() == contents


def test_a_generate_fn_that_replaces_or_changes_the_generation_config_leaves_the_users_as_it_was() -> None:
    model, prompts = _gpt2(), _prompts()
    kept = model.generation_config
    contents, eos = kept.to_dict(), kept.eos_token_id

    def meddling(m: nn.Module, b: Any, n: int) -> torch.Tensor:
        m.generation_config.eos_token_id = [7, 8]  # changed in place
        m.generation_config.temperature = 0.3
        out = m.generate(**b, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        m.generation_config = transformers.GenerationConfig(max_length=3)  # and replaced
        return out

    _find(model, prompts, generate_fn=meddling)
    assert model.generation_config is kept and kept.to_dict() == contents and kept.eos_token_id == eos


def _sigint_at_line(nth: int) -> tuple[int, bool, bool, bool]:
    """Run a generation probe with a real SIGINT sent at the ``nth`` line run by the first trial's
    generation (`generate`, `kept_generation_config`, `_put_back` of ``batchfit.probe.generate_step``;
    ``nth=0``: none). Returns the lines that trial ran there, whether ``KeyboardInterrupt`` came out,
    whether the user's own ``generation_config`` is on the model with its contents, whether the
    model's state is as it was."""
    import batchfit.probe.generate_step as generation

    model, prompts = _gpt2(), _prompts()
    kept = model.generation_config
    contents, before = kept.to_dict(), state_of(model)
    names = {"generate", "kept_generation_config", "_put_back"}
    seen, done = 0, False

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal seen, done
        if done or frame.f_code.co_filename != generation.__file__ or frame.f_code.co_name not in names:
            return None
        if event == "line":
            seen += 1
            if seen == nth:
                signal.raise_signal(signal.SIGINT)  # handled at the next bytecode
        if event == "return" and frame.f_code.co_name == "generate":
            done = True  # the first trial's generation is over: later ones are not counted
        return tracer

    interrupted = False
    sys.settrace(tracer)
    try:
        _find(model, prompts, max_new_tokens=4)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # never leave a broken handler to later tests
    same_config = model.generation_config is kept and kept.to_dict() == contents
    try:
        assert_same_state(before, state_of(model))
        restored = True
    except AssertionError:
        restored = False
    return seen, interrupted, same_config, restored


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
@pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler, reason="needs Python's default SIGINT handler"
)
def test_a_sigint_at_any_line_of_the_generation_leaves_the_users_generation_config() -> None:
    lines, interrupted, same_config, _ = _sigint_at_line(0)
    assert lines >= 10 and not interrupted and same_config
    wrong = []
    for nth in range(1, lines + 1):
        _, interrupted, same_config, restored = _sigint_at_line(nth)
        if not (interrupted and same_config and restored):
            wrong.append(f"line {nth} of {lines}: interrupted {interrupted}, config {same_config}, state {restored}")
    assert not wrong, "\n".join(wrong)


# item 15: positions and an end-of-sequence-only model ---------------------------------------------------
def test_a_full_context_of_positions_takes_one_new_token_as_generate_does() -> None:
    model = _gpt2(positions=64)
    prompts = {"input_ids": _prompts(64)["input_ids"]}
    # The truth, HF's own: 64 + 1 runs (the new token is never fed back), 64 + 2 runs out of positions.
    assert model.generate(**prompts, max_new_tokens=1, do_sample=False, pad_token_id=0).shape[-1] == 65
    with pytest.raises(IndexError):
        model.generate(**prompts, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    assert _find(model, prompts, max_new_tokens=1).max_batch >= 1
    calls: list[int] = []
    with pytest.raises(ValueError, match="feed the model 65 positions"):
        _find(model, prompts, calls, max_new_tokens=2)
    assert calls == []


def test_the_frontier_takes_the_longest_prompt_the_positions_allow() -> None:
    from batchfit.probe.lengths import check_lengths

    def make(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long)}

    lengths, ceiling, _ = check_lengths(_gpt2(positions=64), make, [32, 63], None, new_tokens=2)
    assert lengths == (32, 63) and ceiling == 63  # 63 + 2 new feeds 64 positions
    with pytest.raises(ValueError, match="seq_lens 64 exceed"):
        check_lengths(_gpt2(positions=64), make, [32, 64], None, new_tokens=2)


def test_a_model_whose_every_token_ends_the_sequence_is_refused_naming_the_end_of_sequence_token() -> None:
    model = _gpt2(vocab=2, eos=[0, 1])
    prompts = {"input_ids": _prompts(vocab=2)["input_ids"]}
    with pytest.raises(RuntimeError, match="generate\\(\\) stopped after 1 of max_new_tokens=5") as caught:
        _find(model, prompts, max_new_tokens=5)
    said = str(caught.value)
    assert "every token of the model's vocabulary (2) is an end-of-sequence token" in said
    assert "max_length" not in said and "stop_strings" not in said


def test_a_stopping_criterion_of_the_config_is_still_named_as_such() -> None:
    model, prompts = _gpt2(), _prompts()
    model.generation_config.max_time = 1e-9  # ends every generation after its first new token
    with pytest.raises(RuntimeError, match="stopped after 1 of max_new_tokens=12") as caught:
        _find(model, prompts, max_new_tokens=NEW_TOKENS)
    assert "max_time" in str(caught.value) and "end-of-sequence token (eos" not in str(caught.value)


# the CPU meter's fast walk over an operator's arguments is exact ----------------------------------------
def test_the_meters_walk_over_arguments_finds_what_the_pytree_finds() -> None:
    from batchfit.backends.cpu import _tensors_in

    a, b, c = torch.zeros(1), torch.ones(2), torch.empty(0)
    pair = namedtuple("pair", "left right")
    trees = [
        a,
        (a, 1, None, [b, (c, 2.0)], torch.float32),
        [a, [b, [c]]],
        pair(a, b),
        {"x": a, "y": [b, c]},
        (torch.device("cpu"), "s", 3, True),
        ((), [], (a,)),
        nn.Parameter(torch.zeros(3)),
    ]
    for tree in trees:
        found = _tensors_in(tree)
        expected = [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
        assert [id(t) for t in found] == [id(t) for t in expected]

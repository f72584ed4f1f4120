"""Generation as a probe's step: the user's generation loop, run to its full length, its KV cache measured.

A generation that stops early (every row reached its end-of-sequence token) holds a shorter
cache than the worst case, and a size it "fitted" would run out of memory on the prompts that do
not stop. So the probe generates every one of ``max_new_tokens``: ``model.generate`` is called
greedy, with its cache, and with ``min_new_tokens=max_new_tokens`` (which masks the end-of-sequence
token until the last), and its output is checked for the full length. A ``generate_fn`` is the
user's loop, which must not stop early either: what it returns is checked the same way (the ids, a
tensor or an output's ``.sequences``), and an output that cannot be checked is refused, since a
size "fitted" on a generation that stopped at its first token is far too large.

The model's ``generation_config`` is not changed: every setting is passed to the call. Hugging
Face's ``generate`` may still write into it (a default it fills in), or a ``generate_fn`` replace
it, so after each call the user's own object is put back on the model with its contents as they
were (`kept_generation_config`), as a critical section of the interrupt guard; the model's
``config.use_cache`` likewise.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from batchfit.interrupts import critical_section
from batchfit.probe.batches import spread
from batchfit.probe.positions import prompt_length

GenerateFn = Callable[[nn.Module, Any, int], Any]


def check_generation(model: nn.Module, generate_fn: GenerateFn | None) -> None:
    """A model that cannot generate is named before any trial: it needs ``generate`` (a Hugging Face
    model's) or a ``generate_fn``."""
    if generate_fn is None and not callable(getattr(model, "generate", None)):
        raise TypeError(
            f"mode='generate' runs the model's generate(), and {type(model).__name__} has none: pass "
            "generate_fn=(model, batch, max_new_tokens) -> output, the loop you generate with"
        )


def full_length_settings(model: nn.Module, max_new_tokens: int) -> dict[str, Any]:
    """What ``model.generate`` is called with: greedy, with its cache, every token generated."""
    config = getattr(model, "generation_config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:  # else generate() warns and uses the end-of-sequence token: say so quietly instead
        eos = getattr(config, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    settings: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens,
        "do_sample": False,
        "num_beams": 1,
        "use_cache": True,
        "return_dict_in_generate": True,
    }
    if pad is not None:
        settings["pad_token_id"] = pad
    return settings


def generate(model: nn.Module, batch: Any, max_new_tokens: int, generate_fn: GenerateFn | None) -> Any:
    """One generation of ``max_new_tokens`` for every row of ``batch``: ``generate_fn``'s, or
    ``model.generate``'s, checked for its full length."""
    if generate_fn is not None:
        with kept_generation_config(model):
            output = generate_fn(model, batch, max_new_tokens)
        _check_full_length(model, output, prompt_length(batch), max_new_tokens, GENERATE_FN)
        return output
    args, kwargs = spread(batch)
    with kept_generation_config(model):
        output = model.generate(*args, **kwargs, **full_length_settings(model, max_new_tokens))
    _check_full_length(model, output, prompt_length(batch), max_new_tokens, BUILT_IN)
    return output


@contextlib.contextmanager
def kept_generation_config(model: nn.Module) -> Iterator[None]:
    """Put ``model.generation_config`` and ``model.config.use_cache`` back as they were, whatever the call did:
    the user's own object (a reference they kept still reaches the model), its contents as they were (each
    value the object it was, unless the call changed it in place: then a copy of what it held)."""
    config = getattr(model, "generation_config", None)
    kept = dict(vars(config)) if config is not None and hasattr(config, "__dict__") else None
    saved = copy.deepcopy(kept)
    model_config = getattr(model, "config", None)
    use_cache = getattr(model_config, "use_cache", None)
    try:
        yield
    finally:
        with critical_section():  # a second Ctrl-C here is only recorded: the restore finishes
            if kept is not None and saved is not None:
                _put_back(config, kept, saved)
            if config is not None and getattr(model, "generation_config", None) is not config:
                model.generation_config = config
            if model_config is not None and use_cache is not None:
                model_config.use_cache = use_cache


def _put_back(config: Any, kept: dict[str, Any], saved: dict[str, Any]) -> None:
    """``config``'s attributes as ``kept`` (its own values) held them, where ``saved`` (a deep copy taken
    with them) says they are unchanged; the copy where one was changed in place."""
    values = vars(config)
    unchanged = {name: _same(kept[name], saved[name]) for name in kept}
    if all(unchanged.values()) and values.keys() == kept.keys() and all(values[n] is kept[n] for n in kept):
        return  # nothing changed (the usual case): nothing is written
    values.clear()
    values.update({name: kept[name] if unchanged[name] else saved[name] for name in kept})


def _same(value: Any, copied: Any) -> bool:
    """Whether ``value`` still equals the deep copy taken of it (``False`` where they cannot be compared)."""
    try:
        return bool(value == copied)
    except Exception:  # noqa: BLE001 (a value whose == raises or is ambiguous: take the copy)
        return False


#: Who generated, for the errors of `_check_full_length`.
BUILT_IN, GENERATE_FN = "generate()", "generate_fn"


def _check_full_length(model: nn.Module, output: Any, prompt: int | None, wanted: int, source: str) -> None:
    """Refuse a generation that stopped before ``wanted`` new tokens (its cache was not the worst case),
    and a ``generate_fn`` output whose length cannot be read: ids as a tensor, or an output's
    ``.sequences``, the prompt's and every new token's (an encoder-decoder's: its decoder start token's
    and every new token's), as ``model.generate`` returns them."""
    sequences = getattr(output, "sequences", output)
    if not isinstance(sequences, torch.Tensor) or sequences.dim() == 0:
        if source == BUILT_IN:
            return
        shown = "None" if output is None else f"a {type(output).__name__}"
        raise TypeError(
            f"generate_fn returned {shown}: return the ids it generated, as model.generate returns them (a "
            "tensor of the prompt and every new token, or an output with .sequences), so that the probe can "
            "check that every one of max_new_tokens was generated"
        )
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    before = 1 if encoder_decoder else (prompt or 0)  # an unknown prompt: at least max_new_tokens
    made = int(sequences.shape[-1]) - before
    if made >= wanted:
        return
    cause, fix = _why_short(model, sequences, made, source)
    raise RuntimeError(
        f"{source} stopped after {max(made, 0)} of max_new_tokens={wanted} new tokens (its ids are "
        f"{int(sequences.shape[-1])} long{f', the prompt {prompt}' if prompt and not encoder_decoder else ''}): "
        f"{cause}, and a size found on a shorter KV cache runs out of memory on the prompts that generate every "
        f"token. {fix}"
    )


def _why_short(model: nn.Module, sequences: torch.Tensor, made: int, source: str) -> tuple[str, str]:
    """What ended a generation early (an end-of-sequence token where one was generated, else a
    stopping criterion) and what to do about it."""
    eos = _eos_ids(model)
    ended = bool(eos) and made > 0 and any(token in eos for token in _tokens(sequences[..., -made:]))
    said = f"it generated the end-of-sequence token (eos_token_id {_listed(eos)})"
    if source == GENERATE_FN:
        return (
            f"{said} and stopped there"
            if ended
            else "a stopping criterion ended it (an end-of-sequence token, "
            "max_length, max_time, stop_strings, or the loop's own)",
            "Make generate_fn generate every token: pass min_new_tokens=max_new_tokens to model.generate (it masks "
            "the end-of-sequence token until the last) and no max_length, max_time or stop_strings; or leave "
            "generate_fn out, "
            "and the probe runs model.generate so.",
        )
    if not ended:
        return (
            "a stopping criterion of the model's generation config ended it although min_new_tokens was "
            "max_new_tokens (max_time, stop_strings, a custom criterion)",
            "Remove that criterion from model.generation_config.",
        )
    vocabulary = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocabulary, int) and len({e for e in eos if 0 <= e < vocabulary}) == vocabulary:
        return (
            f"{said} although min_new_tokens masks it until the last token, because every token of the model's "
            f"vocabulary ({vocabulary}) is an end-of-sequence token",
            "Set eos_token_id to the model's real end-of-sequence token.",
        )
    return (
        f"{said} although min_new_tokens masks it until the last token: every token it could generate was "
        "masked (the end-of-sequence tokens, and any a logits processor of the generation config removes)",
        "Check eos_token_id and the generation config's logits processors.",
    )


def _eos_ids(model: nn.Module) -> list[int]:
    """The model's end-of-sequence token ids, from its generation config (an int or a list)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else []


def _tokens(ids: torch.Tensor) -> list[int]:
    """The token ids of ``ids`` as numbers, read without an operation the meter would count (none of a
    fake tensor, which has no values)."""
    try:
        rows = ids.tolist()
    except (RuntimeError, NotImplementedError):  # a fake or meta tensor: no values to read
        return []
    flat: list[Any] = []
    for row in rows if isinstance(rows, list) else [rows]:
        flat.extend(row if isinstance(row, list) else [row])
    return [int(token) for token in flat if isinstance(token, (int, float))]


def _listed(ids: list[int]) -> str:
    return str(ids[0]) if len(ids) == 1 else str(ids)


def kv_bytes_per_token(output: Any) -> int | None:
    """The KV cache's bytes per token of one row, read from the cache the generation returned
    (``cache``; ``past_key_values`` before transformers 5 named it so, read only then, since
    transformers 5 warns at that name): its tensors' bytes over rows x cached tokens. ``None`` without one."""
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    if cache is None:
        return None
    tensors = list(_cache_tensors(cache))
    if not tensors:
        return None
    rows, tokens = tensors[0].shape[0], tensors[0].shape[-2]
    if rows == 0 or tokens == 0:
        return None
    total = sum(t.numel() * t.element_size() for t in tensors)
    return total // (rows * tokens)


def _cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """The key and value tensors of a cache: Hugging Face's ``Cache`` (its ``layers``' ``keys`` and
    ``values``) or the legacy tuple of ``(key, value)`` per layer."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                    yield tensor
        return
    if isinstance(cache, (tuple, list)):
        for entry in cache:
            if isinstance(entry, (tuple, list)):
                yield from (t for t in entry if isinstance(t, torch.Tensor) and t.dim() >= 2)

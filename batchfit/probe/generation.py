"""Generation as a probe's step: the user's generation loop, run to its full length, its KV cache measured.

A generation that stops early (every row reached its end-of-sequence token) holds a shorter
cache than the worst case, and a size it "fitted" would run out of memory on the prompts that do
not stop. So the probe generates every one of ``max_new_tokens``: ``model.generate`` is called
greedy, with its cache, and with ``min_new_tokens=max_new_tokens`` (which masks the end-of-sequence
token until the last), and its output is checked for the full length. A ``generate_fn`` is the
user's loop, which must not stop early either (its docs say so); what it returns is checked for
being something.

The model's ``generation_config`` is not changed: every setting is passed to the call. Hugging
Face's ``generate`` may still write into it (a default it fills in), so it is put back after each
call (`kept_generation_config`); the model's ``config.use_cache`` likewise.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

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
        output = generate_fn(model, batch, max_new_tokens)
        if output is None:
            raise TypeError(
                "generate_fn returned None: return what it generated (the ids), so that the probe can see the "
                "generation ran"
            )
        return output
    args, kwargs = spread(batch)
    with kept_generation_config(model):
        output = model.generate(*args, **kwargs, **full_length_settings(model, max_new_tokens))
    _check_full_length(model, output, prompt_length(batch), max_new_tokens)
    return output


@contextlib.contextmanager
def kept_generation_config(model: nn.Module) -> Iterator[None]:
    """Put ``model.generation_config`` and ``model.config.use_cache`` back as they were, whatever the call did."""
    config = getattr(model, "generation_config", None)
    saved = copy.deepcopy(config) if config is not None else None
    model_config = getattr(model, "config", None)
    use_cache = getattr(model_config, "use_cache", None)
    try:
        yield
    finally:
        if saved is not None:
            model.generation_config = saved
        if model_config is not None and use_cache is not None:
            model_config.use_cache = use_cache


def _check_full_length(model: nn.Module, output: Any, prompt: int | None, wanted: int) -> None:
    """Refuse a generation that stopped before ``wanted`` new tokens: its cache was not the worst case."""
    sequences = getattr(output, "sequences", output)
    if not isinstance(sequences, torch.Tensor) or prompt is None:
        return
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    made = sequences.shape[-1] - (1 if encoder_decoder else prompt)
    if made < wanted:
        raise RuntimeError(
            f"generate() stopped after {made} of max_new_tokens={wanted} new tokens although min_new_tokens was "
            f"{wanted}: a stopping criterion of the model's generation config ended it early (max_length, "
            "stop_strings, a custom criterion), and a size sized on a shorter cache is not safe"
        )


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

"""How long a sequence the model can take: its position embeddings' limit.

A model with learned absolute positions (GPT-2's ``wpe``, BERT's ``position_embeddings``) has one
row per position: a longer sequence fails with an index error inside the first trial, which says
nothing about the length asked for. `position_limit` reads the limit without running the
model, so ``seq_len=`` beyond it is refused before any trial, and the frontier can stop there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["CONFIG_NAMES", "check_seq_len", "generation_positions", "position_limit"]

#: The Hugging Face config attributes that hold the longest sequence, in the order they are read.
CONFIG_NAMES = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")

#: The last part of a qualified module name that marks an ``nn.Embedding`` of positions.
_POSITIONAL = re.compile(r"^(wpe|pos|position|pos_?emb\w*|position_?emb\w*|positional\w*)$", re.IGNORECASE)


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """The longest sequence ``model`` takes, and where that was read (``"config.n_positions"``,
    ``"transformer.wpe.num_embeddings"``); ``None`` when the model declares none (relative or
    rotary positions, or no sequence at all).

    A Hugging Face config's own limit comes first (an alias such as GPT-2's
    ``max_position_embeddings`` is named by the attribute it stands for); otherwise the rows of
    the first ``nn.Embedding`` whose name says it embeds positions (``wpe``, ``pos_emb``,
    ``position_embeddings``, ``positional...``, ``position``).
    """
    config = getattr(model, "config", None)
    if config is not None:
        aliases = getattr(config, "attribute_map", None)
        for name in CONFIG_NAMES:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                real = aliases.get(name, name) if isinstance(aliases, dict) else name
                return value, f"config.{real}"
    for qualified, module in model.named_modules():
        if isinstance(module, nn.Embedding) and _POSITIONAL.match(qualified.rsplit(".", 1)[-1]):
            return module.num_embeddings, f"{qualified}.num_embeddings"
    return None


def check_seq_len(model: object, seq_len: int | None) -> None:
    """Refuse ``seq_len`` beyond the model's position limit, before anything runs: the first trial
    would fail with an index error that names neither the length nor the limit."""
    if seq_len is None or not isinstance(model, nn.Module):
        return
    limit = position_limit(model)
    if limit is not None and seq_len > limit[0]:
        raise ValueError(
            f"seq_len={seq_len:,} is longer than the model's position embeddings take ({limit[0]:,}, its "
            f"{limit[1]}): pass seq_len <= {limit[0]:,}"
        )


def generation_positions(prompt: int, max_new_tokens: int) -> int:
    """The positions a generation of ``max_new_tokens`` after a ``prompt`` feeds the model: the
    prompt's and every new token's but the last, which comes out of the logits of the one before and
    is never fed back (a 64-position model generates 1 token after a 64-token prompt, not 2)."""
    return prompt + max_new_tokens - 1


def check_generation_length(model: object, sample: object, seq_len: int | None, max_new_tokens: int) -> None:
    """Refuse a generation that feeds the model more positions (the prompt, ``seq_len`` when given,
    and every new token but the last: `generation_positions`) than its position limit, before
    anything runs."""
    if not isinstance(model, nn.Module):
        return
    limit = position_limit(model)
    prompt = seq_len if seq_len is not None else prompt_length(sample)
    if limit is None or prompt is None or generation_positions(prompt, max_new_tokens) <= limit[0]:
        return
    raise ValueError(
        f"the prompt ({prompt:,} tokens) and max_new_tokens={max_new_tokens:,} feed the model "
        f"{generation_positions(prompt, max_new_tokens):,} positions (every new token but the last is fed back), "
        f"longer than the model's position embeddings take ({limit[0]:,}, its {limit[1]}): shorten the prompt or "
        "generate fewer tokens"
    )


def prompt_length(sample: object) -> int | None:
    """The prompt's length of a batch of token ids: ``input_ids``' last dimension (of a mapping, a
    tokenizer's ``BatchEncoding`` too), or the first tensor's (of a tuple, or the batch itself)."""
    ids = sample.get("input_ids") if isinstance(sample, Mapping) else sample
    if isinstance(ids, (tuple, list)) and ids:
        ids = ids[0]
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None

"""Targets sharded with FSDP2 (``fully_shard`` per block, then the root) for ``sharded_estimate.py`` and the tests.

Each factory runs after the process group is up (a ``torchrun`` rank of ``batchfit probe
--nproc-per-trial``, or the fake group of ``batchfit estimate --world-size``): it builds the model,
shards it over the group's ranks and returns ``(model, sample)``. Sizes are chosen so that the
boundary lies in the tens at a per-rank limit of 128 MiB on the CPU (under ten at 32 MiB, for a test);
``llama_large`` is for an estimate only (built on the meta device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from batchfit import examples


def gpt() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The built-in GPT (vocabulary 512, sequence 64, d 128, 4 blocks), each block a unit, then the root."""
    model, sample = examples.gpt(vocab_size=512, seq_len=64, d_model=128, n_layers=4, n_heads=4)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, sample


def llama() -> tuple[nn.Module, dict[str, Any]]:
    """A small ``LlamaForCausalLM`` from a config (4 layers, d 128, GQA 4/2 heads, vocabulary 1024,
    sequence 64, SDPA), each decoder layer a unit, then the root."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


class _Gate(nn.Module):
    """Reads a value (``.item()``), as a model that checks its input does: fake tensors cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.abs().max().item() >= 0 else -x


def gpt_item() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """`gpt` with a value read in its first block's input: the estimate runs real CPU steps of rank 0 instead."""
    model, sample = examples.gpt(vocab_size=512, seq_len=64, d_model=128, n_layers=4, n_heads=4)
    model.blocks[0] = nn.Sequential(_Gate(), model.blocks[0])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, sample


def llama_large() -> tuple[nn.Module, dict[str, Any]]:
    """A 1.1B ``LlamaForCausalLM`` (16 layers, d 2048, GQA 32/8, vocabulary 32000, sequence 2048) built on the
    meta device, bf16 compute (``MixedPrecisionPolicy``): no weight exists, only an estimate can size it here."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    ids = torch.randint(0, config.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}

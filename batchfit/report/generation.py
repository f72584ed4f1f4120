"""What a generation probe (`mode="generate"`) measured beyond the batch: the context, the KV cache, tokens/s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchfit.report.codec import Batch, Bytes, Rate
from batchfit.report.memory import FittedBytes, MemoryModel
from batchfit.report.records import Trial
from batchfit.report.throughput import Throughput


@dataclass(frozen=True)
class Generation:
    """The generation a probe sized: every row's prompt plus all its new tokens (stopping disabled).

    The memory equation in (batch, context length) is
    ``fixed_bytes + batch * (other_bytes_per_sample + kv_bytes_per_token * context)``
    ([`predict_bytes`][batchfit.report.generation.Generation.predict_bytes]): the KV cache grows with
    every token of every row, the rest of a row's memory (the prompt's activations, the logits) was measured at this
    context and is taken as it is at others; the generation frontier measures each context for real.

    Attributes:
        prompt_tokens: the prompt's length sized on (``None`` when the batch carries no token ids).
        new_tokens: ``max_new_tokens``, each generated.
        kv_bytes_per_token: the KV cache of one row per token, read from the cache the generation
            returned (2 x layers x KV heads x head size x element size); ``None`` without one.
        fixed_bytes: the memory equation's fixed part (the weights).
        other_bytes_per_sample: a row's bytes besides its KV cache, at this context.
        best_tokens_per_s: new tokens per second at the fastest batch (``None`` untimed).
        knee_tokens_per_s: new tokens per second at the throughput knee, the smallest batch within 5% of the best.
    """

    prompt_tokens: Batch | None
    new_tokens: Batch
    kv_bytes_per_token: Bytes | None = None
    fixed_bytes: FittedBytes | None = None
    other_bytes_per_sample: FittedBytes | None = None
    best_tokens_per_s: Rate | None = None
    knee_tokens_per_s: Rate | None = None

    @property
    def context_tokens(self) -> int | None:
        """Prompt plus new tokens: the length the KV cache reaches."""
        return None if self.prompt_tokens is None else self.prompt_tokens + self.new_tokens

    def predict_bytes(self, batch_size: int, context_tokens: int | None = None) -> float | None:
        """The equation's peak for ``batch_size`` rows of ``context_tokens`` (default: the one sized on)."""
        context = self.context_tokens if context_tokens is None else context_tokens
        if None in (context, self.kv_bytes_per_token, self.fixed_bytes, self.other_bytes_per_sample):
            return None
        assert context is not None and self.kv_bytes_per_token is not None
        assert self.fixed_bytes is not None and self.other_bytes_per_sample is not None
        return self.fixed_bytes + batch_size * (self.other_bytes_per_sample + self.kv_bytes_per_token * context)

    @classmethod
    def of(
        cls,
        trials: Sequence[Trial],
        memory: MemoryModel | None,
        throughput: Throughput | None,
        prompt_tokens: int | None,
        new_tokens: int,
    ) -> Generation:
        """The generation record of a `mode="generate"` probe's trials, fitted equation and throughput."""
        kv = max((t.kv_bytes_per_token for t in trials if t.kv_bytes_per_token is not None), default=None)
        context = None if prompt_tokens is None else prompt_tokens + new_tokens
        other = None
        if memory is not None and kv is not None and context is not None:
            other = memory.per_sample_bytes - kv * context
        return cls(
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            kv_bytes_per_token=kv,
            fixed_bytes=None if memory is None else memory.fixed_bytes,
            other_bytes_per_sample=other,
            best_tokens_per_s=None if throughput is None else throughput.best_samples_per_s * new_tokens,
            knee_tokens_per_s=None if throughput is None else throughput.knee_samples_per_s * new_tokens,
        )

"""Built-in models for tests, benchmarks and the CLI's demo targets. Nothing is downloaded.

Each factory returns ``(model, sample)``: a freshly initialised model (seeded, so runs are
repeatable) and one small batch in the form the model takes. Sizes default to something a
2-core CPU trains in milliseconds; pass bigger sizes for a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class MLP(nn.Module):
    """A plain multilayer perceptron: Linear + GELU blocks, a classifier head."""

    def __init__(self, in_features: int, hidden: int, depth: int, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(
    in_features: int = 256, hidden: int = 512, depth: int = 3, classes: int = 10, seed: int = 0
) -> tuple[nn.Module, torch.Tensor]:
    """An MLP and a batch of 4 feature vectors; the default loss is the mean of the logits."""
    torch.manual_seed(seed)
    model = MLP(in_features, hidden, depth, classes)
    return model, torch.randn(4, in_features, generator=_seeded(seed))


class SmallCNN(nn.Module):
    """Conv-BatchNorm-ReLU blocks with pooling and a linear head (BatchNorm has running stats,
    which a probe must restore)."""

    def __init__(self, channels: int, width: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, width * 2, 3, padding=1),
            nn.BatchNorm2d(width * 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(width * 2, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


def cnn(
    image_size: int = 32, channels: int = 3, width: int = 16, classes: int = 10, seed: int = 0
) -> tuple[nn.Module, torch.Tensor]:
    """A small CNN with BatchNorm and a batch of 2 images."""
    torch.manual_seed(seed)
    model = SmallCNN(channels, width, classes)
    return model, torch.randn(2, channels, image_size, image_size, generator=_seeded(seed))


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=2)
        shape = (batch, seq, self.n_heads, dim // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder-only language model. ``forward(input_ids, labels=None)`` returns
    ``{"logits": ..., "loss": ...}`` like a Hugging Face model (loss only when labels are given)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.token.weight  # tied, as in GPT-2
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.token(input_ids) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return out


def gpt(
    vocab_size: int = 512,
    seq_len: int = 64,
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small GPT and a batch of 2 sequences as ``{"input_ids", "labels"}``."""
    torch.manual_seed(seed)
    model = GPT(vocab_size, seq_len, d_model, n_layers, n_heads)
    ids = torch.randint(0, vocab_size, (2, seq_len), generator=_seeded(seed))
    return model, {"input_ids": ids, "labels": ids.clone()}


def gpt2_small(seq_len: int = 1024, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT-2-small sized (124M parameters, 12 layers, d=768, vocab 50257): for a GPU."""
    return gpt(vocab_size=50257, seq_len=seq_len, d_model=768, n_layers=12, n_heads=12, seed=seed)


def text_ids(modules: tuple[str, ...] = ("argparse", "collections", "json", "textwrap")) -> torch.Tensor:
    """Real text, shipped with Python: the source of these standard-library modules, as byte
    token ids (0-255), one after another."""
    import importlib
    import inspect

    text = "".join(inspect.getsource(importlib.import_module(name)) for name in modules)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def text_loader(seq_len: int = 64, batch_size: int = 16, seed: int = 0) -> DataLoader:
    """`text_ids` cut into ``seq_len`` windows as ``{"input_ids", "labels"}`` rows, shuffled by
    a seeded generator. Real data carries real gradient noise, which tiled copies of one sample
    do not (``batchfit.noise_scale``)."""
    ids = text_ids()
    windows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    rows = [{"input_ids": row, "labels": row} for row in windows]
    return DataLoader(rows, batch_size=batch_size, shuffle=True, generator=_seeded(seed))


def gpt_text(seq_len: int = 64, batch_size: int = 16, seed: int = 0) -> dict[str, object]:
    """The built-in GPT (byte vocabulary) with `text_loader` as its sample: a CLI target
    with real data, e.g. ``batchfit probe batchfit.examples:gpt_text --noise-scale``."""
    model, _ = gpt(vocab_size=256, seq_len=seq_len, seed=seed)
    return {"model": model, "sample": text_loader(seq_len, batch_size, seed)}

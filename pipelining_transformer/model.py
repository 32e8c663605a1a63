"""The tutorial's model: ``ModelArgs``, ``Transformer`` and ``tokenwise_loss_fn``; and what it
trains on: ``synthetic_batch`` (the tutorial's dummy data, made learnable) and ``make_optimizer``."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    """The model's sizes; the defaults are the tutorial's."""

    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    vocab_size: int = 10000
    dropout: float = 0.1  # nn.TransformerDecoderLayer's default, which the tutorial uses


class Transformer(nn.Module):
    """A GPT-style stack of decoder layers; a pipeline stage is this class with the parts it does
    not own set to ``None`` or deleted, so its parameter names are the full model's."""

    def __init__(self, model_args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # A ModuleDict keyed "0".."n-1" (not a ModuleList) lets a stage delete the layers
        # it does not own without renumbering the rest: names, and so checkpoints, survive.
        self.layers = nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            # batch_first=True: the schedules cut micro-batches along dim 0, which must be the batch;
            # the tutorial's sequence-first default mixed a batch's samples in attention
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(
                model_args.dim, model_args.n_heads, dropout=model_args.dropout, batch_first=True)
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Handling parts being None at runtime is what makes manual splitting easy
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        return self.output(h).clone() if self.output else h


def tokenwise_loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of a (micro-)batch."""
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))


def synthetic_batch(step: int, batch_size: int, seq_len: int, vocab_size: int,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens (Zipf's law, as words) and targets (each token's successor id: the tutorial's
    model, without position encoding, learns it within a few steps), the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float)
    x = torch.multinomial(zipf, batch_size * seq_len, replacement=True, generator=gen).view(batch_size, seq_len)
    return x, (x + 1) % vocab_size


def make_optimizer(name: str, params: Iterator[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}")

"""``--stage_layers auto``: cut where the measured costs say. The last stage also computes the output
projection and the loss (~1.1 layers), so equal layer counts leave it the slowest; a cut may fall between
a layer's attention (~55 %) and feed-forward block (~45 %): ``--stage_layers 4.5 3.5``.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn

from pipelining_transformer.model import Transformer, tokenwise_loss_fn

log = logging.getLogger(__name__)

ATTENTION, FEED_FORWARD = "attention", "feed_forward"
# the submodules of nn.TransformerDecoderLayer each half owns, under their names: "layers.4.linear1.weight"
PARTS = {ATTENTION: ("self_attn", "norm1", "dropout1", "multihead_attn", "norm2", "dropout2"),
         FEED_FORWARD: ("linear1", "dropout", "linear2", "norm3", "dropout3")}


class HalfLayer(nn.Module):
    """One half of a post-norm ``nn.TransformerDecoderLayer``, called like the layer; the two halves
    in turn compute exactly what the layer does, in its order (so with the same dropout draws)."""

    def __init__(self, layer: nn.TransformerDecoderLayer, part: str) -> None:
        super().__init__()
        if layer.norm_first:
            raise ValueError("HalfLayer follows the post-norm layer (norm_first=False)")
        self.part = part
        for name in PARTS[part]:
            setattr(self, name, getattr(layer, name))
        self.activation = layer.activation  # a function, or a module without parameters

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = tgt
        if self.part == ATTENTION:  # nn.TransformerDecoderLayer's _sa_block and _mha_block
            sa = self.self_attn(x, x, x, need_weights=False)[0]
            x = self.norm1(x + self.dropout1(sa))
            mha = self.multihead_attn(x, memory, memory, need_weights=False)[0]
            return self.norm2(x + self.dropout2(mha))
        ff = self.linear2(self.dropout(self.activation(self.linear1(x))))  # its _ff_block
        return self.norm3(x + self.dropout3(ff))

    def extra_repr(self) -> str:
        return self.part


@dataclass
class Split:
    """A choice: layers per stage (multiples of 0.5) and each stage's predicted cost."""

    stage_layers: list[float]
    predicted_ms: list[float]  # forward + backward of one micro-batch, per stage

    @property
    def balance(self) -> float:
        """Mean stage over slowest stage: the share of p m / (m + p - 1) these stages allow."""
        return statistics.fmean(self.predicted_ms) / max(self.predicted_ms)


def choose_split(piece_ms: Sequence[float], num_stages: int) -> Split:
    """The contiguous split of the pieces (embedding, each half layer, head) whose slowest stage costs
    least, each stage but the last at least one half layer; ties go to the earlier cut."""
    emb, halves, head = piece_ms[0], list(piece_ms[1:-1]), piece_ms[-1]
    n = len(halves)
    if n % 2 or num_stages < 1 or num_stages - 1 > n:
        raise ValueError(f"cannot split {n / 2:g} layers into {num_stages} stages")
    prefix = [0.0, *accumulate(halves)]

    def cost(s: int, a: int, b: int) -> float:  # stage s holding halves a..b-1
        return prefix[b] - prefix[a] + (emb if s == 0 else 0.0) + (head if s == num_stages - 1 else 0.0)

    # best[s][b]: (the least slowest-stage cost of stages 0..s covering halves 0..b-1, cut)
    best = [[(math.inf, -1)] * (n + 1) for _ in range(num_stages)]
    best[0][1:] = [(cost(0, 0, b), 0) for b in range(1, n + 1)]
    for s in range(1, num_stages):
        for b in range(s, n + 1):
            for a in range(s, b + (s == num_stages - 1)):  # the last stage may be empty
                c = max(best[s - 1][a][0], cost(s, a, b))
                if c < best[s][b][0]:
                    best[s][b] = (c, a)
    cuts = [n]
    for s in range(num_stages - 1, 0, -1):  # back from the last stage: where each one starts
        cuts.insert(0, best[s][cuts[0]][1])
    cuts = [0, *cuts]
    return Split([(b - a) / 2 for a, b in zip(cuts, cuts[1:])],
                 [cost(s, a, b) for s, (a, b) in enumerate(zip(cuts, cuts[1:]))])


def _timed(fn, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def measure_pieces(model: Transformer, rows: int, seq_len: int, device: torch.device,
                   repeats: int = 3) -> list[float]:
    """Forward + backward milliseconds (median) of each piece, in ``choose_split``'s order, on one
    micro-batch of random inputs; the gradients are cleared after, the random state left as it was."""
    model = model.to(device)
    vocab, dim = model.tok_embeddings.num_embeddings, model.tok_embeddings.embedding_dim
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (rows, seq_len), generator=gen).to(device)
    h = torch.randn(rows, seq_len, dim, generator=gen).to(device)
    grad = torch.randn(rows, seq_len, dim, generator=gen).to(device)

    def through(module: nn.Module) -> None:
        x = h.detach().requires_grad_()  # as a stage's input: its gradient is sent back
        module(x, x).backward(grad)

    def head() -> None:
        x = h.detach().requires_grad_()
        tokenwise_loss_fn(model.output(model.norm(x)).clone(), tokens).backward()

    pieces = [lambda: model.tok_embeddings(tokens).backward(grad),
              *(lambda layer=layer, part=part: through(HalfLayer(layer, part))
                for layer in model.layers.values() for part in (ATTENTION, FEED_FORWARD)), head]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        # rounds of every piece in turn: a slow spell slows all alike, keeping the ratios the split
        # needs. One untimed round, then ``repeats``, or more (up to 50) until the quickest adds to 50 ms
        first = [_timed(piece, device) for piece in pieces]
        rounds = min(50, max(repeats, math.ceil(0.05 / max(min(first), 1e-6))))
        times = [[_timed(piece, device) for piece in pieces] for _ in range(rounds)]
    model.zero_grad(set_to_none=True)
    return [1e3 * statistics.median(column) for column in zip(*times)]


def auto_split(model: Transformer, rows: int, seq_len: int, num_stages: int, device: torch.device) -> Split:
    """Measure the pieces on this rank, average over all ranks, choose (the same on each)."""
    ms = torch.tensor(measure_pieces(model, rows, seq_len, device), dtype=torch.float64, device=device)
    dist.all_reduce(ms)  # every rank measures, under the same load as the run; one answer
    piece_ms = (ms / dist.get_world_size()).tolist()
    split = choose_split(piece_ms, num_stages)
    per_layer = sum(piece_ms[1:-1]) / ((len(piece_ms) - 2) / 2)  # two halves a layer
    log.info(f"--stage_layers auto: {' '.join(f'{n:g}' for n in split.stage_layers)} (measured per "
             f"micro-batch, forward + backward: embedding {piece_ms[0]:.1f} ms, a layer {per_layer:.1f} ms, "
             f"head and loss {piece_ms[-1]:.1f} ms); predicted stage costs "
             f"{' / '.join(f'{c:.1f}' for c in split.predicted_ms)} ms, mean/slowest {split.balance:.3f}")
    return split

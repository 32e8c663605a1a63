"""``--stage_layers auto``: every measured cost is the cost of the piece it is counted for.

``balance.measure_pieces`` times the embedding, each layer's attention half and its
feed-forward half, and the head, in that order; ``auto_split`` cuts where those costs say.
On the tutorial's model the two halves cost about the same (55 / 45 %): costs counted for
the wrong half change the predicted stage costs a little, and no test of the split
(``choose_split``'s arithmetic, the runs of test_pipelining_transformer.py) fails. Here two
one-process models whose halves differ a hundredfold make a misattribution show:

  - ``wide_ff``: width 16, a feed-forward 8192 wide: its half holds 128 x the attention
    half's matrix products;
  - ``wide_attention``: width 128, a feed-forward 8 wide: the attention holds 64 x the
    feed-forward's.

``test_each_piece_is_measured_for_what_it_computes`` runs ``auto_split`` with a clock that
counts floating-point operations instead of seconds (torch's ``FlopCounterMode``): exact on
any machine, however loaded. Each piece must cost what it computes, worked out from the
sizes and from the whole ``nn.TransformerDecoderLayer`` (not from ``HalfLayer``), and the two
models must be cut differently: the wide feed-forward inside layer 1, before its
feed-forward (1.5 / 0.5), the wide attention between the layers (1 / 1). With the halves'
costs swapped, each model gets the other's cut. ``test_the_clock_tells_the_halves_apart``
then times the same pieces with the real clock: the heavier half is measured heavier.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipelining_transformer import balance
from pipelining_transformer.model import ModelArgs, Transformer

ROWS, SEQ = 4, 16  # one micro-batch: T = 64 tokens
T = ROWS * SEQ
# name: (width, heads, feed-forward width, vocabulary): the head (6 T d V operations) costs
# half the heavy half, so a stage of its own is no answer and the cut falls between halves
MODELS = {"wide_ff": (16, 1, 8192, 8192), "wide_attention": (128, 2, 8, 512)}


def model_with(dim: int, heads: int, ff: int, vocab: int) -> Transformer:
    """The example's Transformer, 2 layers, with feed-forward blocks ``ff`` wide (ModelArgs
    keeps nn.TransformerDecoderLayer's 2048); dropout 0."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim, 2, heads, vocab, dropout=0.0))
    for k in model.layers:
        model.layers[k] = nn.TransformerDecoderLayer(dim, heads, dim_feedforward=ff, dropout=0.0,
                                                     batch_first=True)
    return model


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def counted(dim: int, heads: int, ff: int, vocab: int) -> dict[str, int]:
    """Each piece's operations, forward + backward (3 x forward for a matrix product whose
    input and weight both need a gradient), found without ``balance``."""
    layer = model_with(dim, heads, ff, vocab).layers["0"]
    x = torch.randn(ROWS, SEQ, dim, requires_grad=True)
    whole_layer = flops(lambda: layer(x, x).sum().backward())
    feed_forward = 3 * 2 * (2 * T * dim * ff)  # linear1 and linear2
    return {"embedding": 0, "attention": whole_layer - feed_forward, "feed_forward": feed_forward,
            "head": 3 * 2 * T * dim * vocab}  # the output projection; the loss has no products


@pytest.fixture
def one_rank_group():
    """auto_split averages the ranks' measurements: a group of one, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.fast
def test_each_piece_is_measured_for_what_it_computes(one_rank_group, monkeypatch):
    # the clock: one unit per piece (none costs 0, so the measurement takes its fewest
    # rounds) plus its operations, counted the first time a piece runs (counting is slow;
    # the count is the same every round); measure_pieces reports 1000 x the clock, as ms
    counts = {}

    def clock(fn, device) -> int:
        if fn not in counts:
            counts[fn] = 1 + flops(fn)
        return counts[fn]

    monkeypatch.setattr(balance, "_timed", clock)
    choose_split = balance.choose_split
    seen = []  # the piece costs auto_split chooses from (averaged over the ranks: here one)
    monkeypatch.setattr(balance, "choose_split", lambda ms, n: seen.append(ms) or choose_split(ms, n))
    splits = {}
    for name, sizes in MODELS.items():
        split = balance.auto_split(model_with(*sizes), ROWS, SEQ, 2, torch.device("cpu"))
        c = {k: 1e3 * (1 + v) for k, v in counted(*sizes).items()}
        heavy, light = ("feed_forward", "attention") if name == "wide_ff" else ("attention", "feed_forward")
        assert c[heavy] > 60 * c[light] and c[light] < c["head"] < c[heavy], (name, c)  # as designed
        emb, att, ff, head = c["embedding"], c["attention"], c["feed_forward"], c["head"]
        assert seen.pop() == pytest.approx([emb, att, ff, att, ff, head]), (name, c)
        # and the stage costs it predicts are the sums of what each stage computes
        expected = {(1.5, 0.5): [emb + att + ff + att, ff + head],
                    (1.0, 1.0): [emb + att + ff, att + ff + head],
                    (0.5, 1.5): [emb + att, ff + att + ff + head],
                    (2.0, 0.0): [emb + 2 * (att + ff), head]}
        assert split.predicted_ms == pytest.approx(expected[tuple(split.stage_layers)]), (name, split)
        splits[name] = split.stage_layers
    # the heavy feed-forward of layer 1 and the head share a stage, layer 1's light attention
    # joins stage 0; the heavy attention of layer 1 goes with its light feed-forward and the head
    assert splits == {"wide_ff": [1.5, 0.5], "wide_attention": [1.0, 1.0]}


def test_the_clock_tells_the_halves_apart():
    """The real clock, one thread: the heavier half is measured heavier than the lighter, in
    both layers (they differ 64 to 128 x in operations, less in time: a small half is mostly
    per-call overhead, and a loaded machine's pauses land on any piece)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, sizes in MODELS.items():
            emb, att0, ff0, att1, ff1, head = balance.measure_pieces(model_with(*sizes), ROWS, SEQ,
                                                                     torch.device("cpu"))
            heavy, light = ((ff0, ff1), (att0, att1)) if name == "wide_ff" else ((att0, att1), (ff0, ff1))
            assert min(heavy) > max(light), (name, [emb, att0, ff0, att1, ff1, head])
    finally:
        torch.set_num_threads(threads)

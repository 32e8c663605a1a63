"""Distributed RNN with distributed autograd and the distributed optimizer (the second half of "Getting
Started with Distributed RPC Framework"). Rank 0, "ps", owns the EmbeddingTable (on its GPU if it has one)
and the Decoder, created there by the trainer with rpc.remote; rank 1, "trainer", owns the LSTM and trains
it all to predict the next token of a seeded repeating pattern (the loss falls from ln(ntoken) towards 0).

    python rpc_rnn/main.py --epochs 5 --nhid 64          # mp.spawn starts both processes
    torchrun --nproc_per_node 2 rpc_rnn/main.py --epochs 5  # or torchrun does, one rank each
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import DistributedOptimizer

import distkit
from distkit.args import at_least, positive, probability
from rpc_rnn.record import TrainingRecord
from rpc_rnn.rnn import PS_NAME, TRAINER_NAME, RNNModel

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="RPC distributed RNN example")
    add_train_args(parser)
    distkit.add_launch_args(parser, world_size=2, rpc_timeout=60, hang_timeout=60)
    return parser


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """The model's, the data's and the training's flags, shared with sharded.py."""
    parser.add_argument("--epochs", type=at_least(1), default=10, help="passes over the data")
    parser.add_argument("--batches", type=at_least(1), default=40,
                        help="batches per epoch (consecutive chunks of one token stream)")
    parser.add_argument("--seq_len", type=at_least(1), default=5,
                        help="time steps per batch (the tutorial's `batch`)")
    parser.add_argument("--batch_size", type=at_least(1), default=8,
                        help="sequences per batch (the tutorial's `nindices`)")
    parser.add_argument("--ntoken", type=at_least(2), default=10, help="vocabulary size")
    parser.add_argument("--ninp", type=at_least(1), default=16, help="embedding size")
    parser.add_argument("--nhid", type=at_least(1), default=32, help="LSTM hidden size")
    parser.add_argument("--nlayers", type=at_least(1), default=2, help="LSTM layers")
    parser.add_argument("--dropout", type=probability, default=0.1, help="dropout probability")
    parser.add_argument("--pattern_len", type=at_least(2), default=16,
                        help="length of the repeating token pattern to learn")
    parser.add_argument("--lr", type=positive, default=2.0,
                        help="SGD learning rate (the tutorial's 0.05 barely moves this model)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the data and the weights")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=2, max_world_size=2)
    distkit.check_placements(parser, args, placement)


def placement(rank: int, args: argparse.Namespace) -> distkit.Placement:
    """The parameter server: ``ps_device``. The trainer: the CPU. No process group."""
    return distkit.Placement(ps_device(args) if rank == 0 else torch.device("cpu"))


def ps_device(args: argparse.Namespace) -> torch.device:
    """The embedding table's device: a GPU of the parameter server's machine where it has one (rank 0 is
    its machine's first process). Decided there: the trainer asks by RPC and passes it to ``RNNModel``."""
    return distkit.pick_device(args.device)


def make_stream(ntoken: int, pattern_len: int, batch_size: int, length: int, seed: int) -> torch.Tensor:
    """A (length, batch_size) token stream: each column repeats one fixed random pattern,
    starting at its own random offset. Seeded, so every run sees the same data."""
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.randint(ntoken, (pattern_len,), generator=gen)
    offsets = torch.randint(pattern_len, (batch_size,), generator=gen)
    steps = torch.arange(length).unsqueeze(1)
    return pattern[(offsets + steps) % pattern_len]


def get_next_batch(stream: torch.Tensor, seq_len: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive (data, target) chunks, (seq_len, batch_size) each, a token's target the one after it:
    each chunk continues the last, so the hidden state carried from batch to batch means something."""
    for start in range(0, len(stream) - 1, seq_len):
        data = stream[start:start + seq_len]
        yield data, stream[start + 1:start + 1 + len(data)]


def run_trainer(args: argparse.Namespace) -> dict:
    """The tutorial's training loop (on the trainer), its sizes from the flags; ``record``: beyond it."""
    model = RNNModel(PS_NAME, args.ntoken, args.ninp, args.nhid, args.nlayers,
                     args.dropout, rpc.rpc_sync(PS_NAME, ps_device, args=(args,)), seed=args.seed)
    # one local SGD per parameter owner: one on ps (embedding, decoder), one here (LSTM)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    stream = make_stream(args.ntoken, args.pattern_len, args.batch_size,
                         args.batches * args.seq_len + 1, args.seed)
    shape = (args.nlayers, args.batch_size, args.nhid)
    record = TrainingRecord()  # beyond the tutorial: every loss, each epoch's mean and seconds (record.py)
    for epoch in range(args.epochs):
        # each epoch restarts the stream, so it restarts the LSTM state too
        hidden = (torch.zeros(shape), torch.zeros(shape))
        for data, target in get_next_batch(stream, args.seq_len):
            # create distributed autograd context
            with dist_autograd.context() as context_id:
                # keep the state, cut its graph: backward stops at this batch's start
                hidden = tuple(h.detach() for h in hidden)
                output, hidden = model(data, hidden)
                # a loss over the vocabulary for every (time step, sequence)
                loss = criterion(output.reshape(-1, args.ntoken), target.reshape(-1))
                # run distributed backward pass
                dist_autograd.backward(context_id, [loss])
                # run distributed optimizer
                opt.step(context_id)
                # no zero_grad(): gradients are not accumulated into .grad but into this
                # context, on every worker involved, and each iteration opens a new context.
            record.step(loss)
        log.info(f"Training epoch {epoch}\t{record.end_epoch()}")
    return {"losses": record.losses}


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """Rank 1 trains; rank 0 serves as the parameter server. The trainer leaves its losses for main()."""
    distkit.start_rank(rank, args)  # beyond the tutorial: log prefix, threads, hang bound (distkit/rank.py)
    world_size = args.world_size
    # the ps draws the dropout masks of the embedding and the decoder (their weights come from
    # their own seeds, see rnn._uniform_), the trainer the LSTM's weights and dropout
    torch.manual_seed(args.seed)
    distkit.quiet_distributed_optimizer()  # what DistributedOptimizer prints on every rank, see the README
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.rpc_timeout)
    if rank == 1:
        rpc.init_rpc(TRAINER_NAME, rank=rank, world_size=world_size, rpc_backend_options=options)
        distkit.save_result(rank, run_trainer(args))  # beyond the tutorial: its losses, for main()
    else:
        rpc.init_rpc(PS_NAME, rank=rank, world_size=world_size, rpc_backend_options=options)
        # parameter server does nothing itself (bounded: each answer of the trainer's counts as its progress)
        distkit.wait_on(TRAINER_NAME, timeout=args.rpc_timeout)

    # block until all rpcs finish
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if distkit.under_torchrun():  # torchrun started this process as one rank: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # beyond the tutorial: a free port, a folder for the trainer's losses
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    trainer = distkit.results().get(1)  # None under torchrun in the parameter server's process
    if trainer is not None:
        losses = trainer["losses"]
        print(f"loss {losses[0]:.4f} in epoch 0 -> {losses[-1]:.4f} in epoch {len(losses) - 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

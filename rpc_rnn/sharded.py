"""The same RNN as it is built today: main.py's embedding table, LSTM and decoder, the same token stream,
on N ranks with no parameter server. The vocabulary-sized parts are sharded with DTensor (the embedding
row-wise, the decoder column-wise, the loss over the sharded scores with ``loss_parallel``); the LSTM is
replicated. Every rank runs every batch (tensor parallelism: the ranks split the model, not the data),
and steps a local SGD over its parameters and its shards.

    torchrun --nproc_per_node 2 rpc_rnn/sharded.py      # or: python rpc_rnn/sharded.py --world_size 2
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import distkit
from rpc_rnn.main import add_train_args, get_next_batch, make_stream
from rpc_rnn.record import TrainingRecord
from rpc_rnn.rnn import Decoder, _uniform_

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="The distributed RNN with DTensor-sharded embedding and decoder")
    add_train_args(parser)  # main.py's flags, meaning the same here
    distkit.add_launch_args(parser, world_size=2, hang_timeout=60)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=1)
    if args.world_size > args.ntoken:  # a rank holding no row of the vocabulary fails in its first lookup
        parser.error(f"--world_size {args.world_size} is more ranks than --ntoken {args.ntoken} has rows to share")
    distkit.check_placements(parser, args, placement)


def placement(rank: int, args: argparse.Namespace) -> distkit.Placement:
    """A GPU of its own per rank and NCCL, or every rank on the CPU with gloo."""
    return distkit.group_placement(args.device, distkit.local_rank(rank), distkit.local_world_size(args))


class ShardedRNNModel(nn.Module):
    """main.py's ``RNNModel`` with every part here: ``encoder`` (``EmbeddingTable``'s) split by rows over
    ``mesh``, the LSTM whole on every rank, ``decoder`` (``Decoder``'s ``nn.Linear``) split by its output
    columns, so each rank scores its share of the vocabulary."""

    def __init__(self, args: argparse.Namespace, mesh: DeviceMesh, device: torch.device) -> None:
        super().__init__()
        # the LSTM first, from the seeded generator as main.py's trainer draws it
        self.rnn = nn.LSTM(args.ninp, args.nhid, args.nlayers, dropout=args.dropout if args.nlayers > 1 else 0.0)
        # EmbeddingTable's and Decoder's weights from their own seeds, as main.py's parameter server's
        self.drop = nn.Dropout(args.dropout)
        self.encoder = nn.Embedding(args.ntoken, args.ninp)
        _uniform_(self.encoder.weight, args.seed)
        self.decoder = Decoder(args.ntoken, args.nhid, args.dropout, args.seed + 1)
        self.to(device)
        parallelize_module(self, mesh, {
            # the same tokens on every rank (Replicate, not RowwiseParallel's default of Shard(-1)); each looks
            # up the rows it holds, and the lookups are summed over the ranks (an all-reduce)
            "encoder": RowwiseParallel(input_layouts=Replicate()),
            # each rank computes its columns of the scores, kept sharded (a DTensor) for loss_parallel
            "decoder.decoder": ColwiseParallel(use_local_output=False),
        })

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[DTensor, tuple[torch.Tensor, torch.Tensor]]:
        emb = self.drop(self.encoder(input))  # EmbeddingTable.forward, no RPC
        output, hidden = self.rnn(emb, hidden)
        return self.decoder(output), hidden  # Decoder.forward: (seq_len, batch, ntoken), sharded on ntoken


def run_trainer(model: ShardedRNNModel, args: argparse.Namespace, device: torch.device) -> dict:
    """main.py's ``run_trainer`` loop, with a local backward and a local optimizer."""
    # one local SGD per rank: the LSTM (the same on every rank), its rows and its columns. The LSTM's plain
    # tensors and the DTensors in groups of their own: on CUDA, SGD's default step (foreach) takes a group as
    # one list of tensors, which cannot mix the two kinds ("got mixed torch.Tensor and DTensor")
    params = list(model.parameters())
    opt = optim.SGD([{"params": [p for p in params if not isinstance(p, DTensor)]},
                     {"params": [p for p in params if isinstance(p, DTensor)]}], lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    stream = make_stream(args.ntoken, args.pattern_len, args.batch_size,
                         args.batches * args.seq_len + 1, args.seed)
    shape = (args.nlayers, args.batch_size, args.nhid)
    record = TrainingRecord()  # main.py's: every loss, each epoch's mean and seconds
    for epoch in range(args.epochs):
        hidden = (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
        for data, target in get_next_batch(stream, args.seq_len):
            hidden = tuple(h.detach() for h in hidden)
            opt.zero_grad()
            output, hidden = model(data.to(device), hidden)
            # the cross-entropy over scores sharded by vocabulary: each rank's share of the softmax, the
            # maxima and sums all-reduced, never the whole (seq_len * batch, ntoken) matrix on one rank
            with loss_parallel():
                loss = criterion(output.reshape(-1, args.ntoken), target.reshape(-1).to(device))
                loss.backward()
            opt.step()
            record.step(loss.full_tensor())
        line = record.end_epoch()
        if dist.get_rank() == 0:  # every rank has the same loss: one line, as main.py's one trainer
            log.info(f"Training epoch {epoch}\t{line}")
    return {"losses": record.losses}


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """Every rank: join the group, build its share of the model, train; each leaves its losses."""
    distkit.start_rank(rank, args)  # log prefix, threads, hang bound (distkit/rank.py)
    world_size = args.world_size
    where = placement(rank, args)
    if where.device_id is not None:  # this rank's own GPU, current before NCCL binds the group to it
        torch.accelerator.set_device_index(where.device_id)
    backend = where.backend  # NCCL with a GPU per rank, else gloo
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, device_id=where.device_id)
    mesh = init_device_mesh(where.device.type, (world_size,))
    # the same seed on every rank: the same LSTM, and the same dropout masks wherever the ranks hold copies
    torch.manual_seed(args.seed)
    model = ShardedRNNModel(args, mesh, where.device)
    distkit.save_result(rank, run_trainer(model, args, where.device))  # for main() (rank 0's) and the tests
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # as the other examples: torchrun starts one process per rank; without it, mp.spawn starts --world_size
    if distkit.under_torchrun():  # torchrun started this process as one rank: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # a free port, a folder for the ranks' losses
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    result = distkit.results().get(0)  # None: under torchrun, in another rank's process
    if result is not None:
        losses = result["losses"]
        print(f"loss {losses[0]:.4f} in epoch 0 -> {losses[-1]:.4f} in epoch {len(losses) - 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

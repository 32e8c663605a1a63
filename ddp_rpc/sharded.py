"""The same model as it is built today: the tutorial's ``HybridModel`` with its ``EmbeddingBag`` table
sharded row-wise over every rank with DTensor (``DeviceMesh`` + ``parallelize_module``), ``fc`` under DDP
as in the tutorial, a local ``torch.optim.SGD`` on every rank. Every rank is a trainer and holds 1/N of
the table's rows: no master, no parameter server, no RPC. Rank r trains on trainer r's batches of main.py.

    python ddp_rpc/sharded.py --world_size 2            # mp.spawn starts the processes
    torchrun --nproc_per_node 2 ddp_rpc/sharded.py      # or torchrun does, one rank each
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

import distkit
from ddp_rpc.main import add_train_args
from ddp_rpc.report import TrainerReport, print_summary
from ddp_rpc.trainer import EMBEDDING_DIM, MAX_BAG_SIZE, NUM_CLASSES, NUM_EMBEDDINGS, TrainConfig, get_next_batch

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="DDP + a DTensor-sharded embedding table: every rank a trainer")
    add_train_args(parser)  # main.py's flags, meaning the same here
    distkit.add_launch_args(parser, world_size=2, hang_timeout=60)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=1)
    if args.world_size > NUM_EMBEDDINGS:  # RowwiseParallel gives every rank at least one row of the table
        parser.error(f"--world_size {args.world_size} is more ranks than the table has rows ({NUM_EMBEDDINGS})")
    distkit.check_placements(parser, args, placement)


def placement(rank: int, args: argparse.Namespace) -> distkit.Placement:
    """A GPU of its own per rank and NCCL, or every rank on the CPU with gloo."""
    return distkit.group_placement(args.device, distkit.local_rank(rank), distkit.local_world_size(args))


def pad_bags(indices: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``EmbeddingBag``'s flat ``(indices, offsets)`` as a ``(bags, MAX_BAG_SIZE)`` index matrix and its mask
    (padding looks up row 0 and counts 0). The width is fixed, not this batch's longest bag: RowwiseParallel
    all-gathers every rank's indices, and ranks whose batches had other shapes would disagree."""
    lengths = torch.diff(offsets, append=torch.tensor([len(indices)]))
    mask = torch.arange(MAX_BAG_SIZE) < lengths[:, None]
    padded = torch.zeros(len(offsets), MAX_BAG_SIZE, dtype=indices.dtype)
    padded[mask] = indices  # row by row: bag b's indices fill row b's first lengths[b] slots
    return padded, mask


class ShardedHybridModel(nn.Module):
    """``HybridModel`` with ``emb``, the table, here: its rows spread over ``mesh`` (rank r keeps its block),
    each lookup answered by the collectives inside ``RowwiseParallel``. ``fc``: the tutorial's, under DDP."""

    def __init__(self, emb: nn.Embedding, mesh: DeviceMesh, device: torch.device) -> None:
        super().__init__()
        # input_layouts=Shard(0): each rank's indices are its own bags; output_layouts=Shard(0): each rank
        # gets its own bags' rows back. The weight becomes a DTensor, Shard(0), scattered from rank 0.
        self.emb = parallelize_module(emb.to(device), mesh,
                                      RowwiseParallel(input_layouts=Shard(0), output_layouts=Shard(0)))
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        padded, mask = pad_bags(indices, offsets)
        rows = self.emb(padded.to(self.device))  # (bags, MAX_BAG_SIZE, EMBEDDING_DIM)
        # EmbeddingBag(mode="sum"), which has no parallel style: the bag's rows summed, the padding masked
        emb_lookup = (rows * mask.to(self.device).unsqueeze(-1)).sum(1)
        return self.fc(emb_lookup)


def train(model: ShardedHybridModel, rank: int, config: TrainConfig) -> TrainerReport:
    """trainer.py's ``_run_trainer`` loop, with a local backward and a local optimizer."""
    # one local SGD over every parameter: fc's plain tensors, and this rank's rows of the table (a DTensor),
    # in groups of their own: on CUDA, SGD's default step (foreach) takes a group as one list of tensors,
    # which cannot mix the two kinds ("got mixed torch.Tensor and DTensor")
    params = list(model.parameters())
    opt = torch.optim.SGD([{"params": [p for p in params if not isinstance(p, DTensor)]},
                           {"params": [p for p in params if isinstance(p, DTensor)]}], lr=config.lr)
    criterion = torch.nn.CrossEntropyLoss()
    report = TrainerReport.start(rank, model)  # as trainer.py's
    for epoch in range(config.epochs):
        for indices, offsets, target in get_next_batch(rank, config):
            opt.zero_grad()
            output = model(indices, offsets)
            loss = criterion(output, target.to(model.device))
            report.record(epoch, loss)
            # DDP averages fc's gradients over the ranks; the table's rows get the sum of every rank's
            # gradient, as the tutorial's table gets one SGD step per trainer (SGD: the same update)
            loss.backward()
            opt.step()
        log.info(f"Training done for epoch {epoch}: loss {report.epoch_loss(epoch):.4f}")
    return report.finish(model)


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """Every rank: join the group, build its share of the model, train; rank 0 leaves the summary for main()."""
    distkit.start_rank(rank, args)  # beyond the tutorial: log prefix, threads, hang bound (distkit/rank.py)
    world_size = args.world_size
    where = placement(rank, args)
    if where.device_id is not None:  # this rank's GPU, made current
        torch.accelerator.set_device_index(where.device_id)
    backend = where.backend
    # env:// rendezvous: MASTER_ADDR and MASTER_PORT, the store of mp.spawn's launcher or of torchrun's agent
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, device_id=where.device_id)
    mesh = init_device_mesh(where.device.type, (world_size,))
    config = TrainConfig(args.epochs, args.batches_per_epoch, args.batch_size, args.lr, args.seed)
    # the weights main.py draws with as many trainers: the table as its parameter server (rank N+1), fc
    # as its trainer `rank` (DDP then gives every rank rank 0's, as there)
    torch.manual_seed(args.seed * 1000 + world_size + 1)
    emb = nn.Embedding(NUM_EMBEDDINGS, EMBEDDING_DIM)
    torch.manual_seed(args.seed * 1000 + rank)
    model = ShardedHybridModel(emb, mesh, where.device)
    emb_before = model.emb.weight.full_tensor().cpu()  # every rank takes part in the gather
    start = time.perf_counter()
    report = train(model, rank, config)
    seconds = time.perf_counter() - start
    emb_after = model.emb.weight.full_tensor().cpu()
    reports = [None] * world_size if rank == 0 else None
    dist.gather_object(report, reports, dst=0)
    dist.destroy_process_group()
    if rank == 0:
        # the keys of main.py's summary: print_summary prints it the same way
        distkit.save_result(rank, {"trainers": reports, "emb_before": emb_before, "emb_after": emb_after,
                                   "seconds": seconds, "config": config})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if distkit.under_torchrun():  # torchrun started this process as one rank: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # a free port, a folder for rank 0's summary
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    summary = distkit.results().get(0)  # None: under torchrun, not rank 0
    return 0 if summary is None or print_summary(summary) else 1


if __name__ == "__main__":
    sys.exit(main())

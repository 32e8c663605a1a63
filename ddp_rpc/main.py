"""DistributedDataParallel and the Distributed RPC framework in one model ("Combining Distributed DataParallel
with Distributed RPC Framework"): ranks 0..N-3 train (trainer.py), N-2 is the master, N-1 the parameter
server; beyond the tutorial: report.py.

    python ddp_rpc/main.py                        # mp.spawn starts the 4 processes
    torchrun --nproc_per_node 4 ddp_rpc/main.py   # or torchrun does, one rank each
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.nn import RemoteModule
from torch.distributed.rpc import TensorPipeRpcBackendOptions

import distkit
from distkit.args import at_least, positive
from ddp_rpc.report import MasterReport, print_summary, wait_for_trainers
from ddp_rpc.trainer import EMBEDDING_DIM, NUM_EMBEDDINGS, TrainConfig, _run_trainer

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="DDP + RPC: embedding on a parameter server, "
                                                "DDP-replicated linear layer on the trainers")
    add_train_args(parser)
    distkit.add_launch_args(parser, world_size=4, rpc_timeout=60, hang_timeout=60)
    return parser


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """The training flags, shared with sharded.py."""
    parser.add_argument("--epochs", type=at_least(1), default=10, metavar="E",
                        help="passes over each trainer's batches")
    parser.add_argument("--batches_per_epoch", type=at_least(1), default=10, metavar="B",
                        help="batches per trainer per epoch")
    parser.add_argument("--batch_size", type=at_least(1), default=16, metavar="N", help="bags (samples) per batch")
    parser.add_argument("--lr", type=positive, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=at_least(0), default=0, metavar="S",
                        help="seeds the weights and every trainer's batches")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=3)
    distkit.check_placements(parser, args, placement)


def num_trainers(world_size: int) -> int:
    return world_size - 2


def placement(rank: int, args: argparse.Namespace) -> distkit.Placement:
    """A trainer: a GPU of its own and NCCL where its machine has one per trainer, else the CPU and
    gloo. The master and the parameter server: the CPU, in no process group."""
    trainers = num_trainers(args.world_size)
    if rank >= trainers:
        return distkit.Placement(torch.device("cpu"))
    # a machine's ranks are consecutive and trainers come first: local_rank numbers this machine's
    local_rank = distkit.local_rank(rank)
    first_here = rank - local_rank
    local_trainers = min(trainers, first_here + distkit.local_world_size(args)) - first_here
    return distkit.group_placement(args.device, local_rank, local_trainers)


def run_master(args: argparse.Namespace) -> dict:
    """The master: create the table on the parameter server, train on every trainer."""
    trainers = num_trainers(args.world_size)
    config = TrainConfig(args.epochs, args.batches_per_epoch, args.batch_size, args.lr, args.seed)
    # The embedding table lives on "ps"; the master and the trainers only hold a reference to it.
    remote_emb_module = RemoteModule("ps", torch.nn.EmbeddingBag,
                                     args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
    # beyond the tutorial: logs the start, keeps the table before training and starts the clock
    report = MasterReport(remote_emb_module, config, trainers)

    # Run the training loop on trainers. timeout=0: a whole training run may outlast --rpc_timeout
    futs = []
    for trainer_rank in range(trainers):
        trainer_name = f"trainer{trainer_rank}"
        fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, config),
                            timeout=0)
        futs.append(fut)

    # Wait for all training to finish (not the tutorial's fut.wait(): a trainer that fails or hangs ends it)
    reports = wait_for_trainers(futs, [f"trainer{r}" for r in range(trainers)], args.rpc_timeout)
    return report.finish(reports)


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """Initialise each role as the tutorial does; the master leaves what training did for main()."""
    distkit.start_rank(rank, args)  # beyond the tutorial: log prefix, threads, hang bound (distkit/rank.py)
    world_size = args.world_size
    trainers = num_trainers(world_size)
    master_rank, ps_rank = trainers, trainers + 1
    # RPC meets through env:// (MASTER_ADDR, MASTER_PORT), not the tutorial's tcp://localhost:29501
    rpc_backend_options = TensorPipeRpcBackendOptions(rpc_timeout=args.rpc_timeout)
    # each process its own seed: DDP must (and does) make all trainers start from rank 0's fc
    torch.manual_seed(args.seed * 1000 + rank)
    distkit.quiet_distributed_optimizer()  # its advice to use a functional optimizer: that is the racy one
    # Ranks 0..N-3 are trainers, N-2 is the master and N-1 the parameter server (the tutorial's 0 and 1, 2, 3)
    if rank == master_rank:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
        distkit.save_result(rank, run_master(args))  # beyond the tutorial: the summary main() prints
    elif rank < trainers:
        # Initialize process group for Distributed DataParallel on trainers, through a rendezvous of its
        # own beside RPC's, as the tutorial's two ports (29500, 29501) are. Not its tcp://localhost:29500,
        # a fixed port that another job may hold: the store the launcher hosts at MASTER_ADDR:MASTER_PORT
        # (mp.spawn's: distkit.prepare_spawn; torchrun's agent's), under a key prefix of its own
        job_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        store = dist.PrefixStore("trainers", job_store)
        where = placement(rank, args)  # a GPU of its own and NCCL, or the CPU and gloo
        if where.device_id is not None:  # the tutorial's .cuda(rank): this trainer's GPU, made current
            torch.accelerator.set_device_index(where.device_id)
        backend = where.backend
        # device_id binds the group to the trainer's GPU (_run_trainer reads it back). The timeout bounds
        # DDP's allreduce: a trainer whose peer hangs fails after --rpc_timeout s, not 30 minutes
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=trainers,
            store=store,
            device_id=where.device_id,
            timeout=timedelta(seconds=args.rpc_timeout),
        )

        # Initialize RPC.
        trainer_name = f"trainer{rank}"
        rpc.init_rpc(trainer_name, rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)

        # Trainer just waits for RPCs from master.
    else:
        assert rank == ps_rank
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)
        # parameter server does nothing but answer RPCs (bounded: each of the master's answers is progress)
        distkit.wait_on("master", timeout=args.rpc_timeout)
    # block until all rpcs finish
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if distkit.under_torchrun():  # torchrun started this process as one rank: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # beyond the tutorial: a free port, a folder for the master's summary
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    summary = distkit.results().get(num_trainers(args.world_size))  # None: under torchrun, not the master
    return 0 if summary is None or print_summary(summary) else 1  # print_summary: whether fc stayed identical


if __name__ == "__main__":
    sys.exit(main())

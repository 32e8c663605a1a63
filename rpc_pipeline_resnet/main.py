"""Distributed pipeline parallelism with RPC ("Distributed Pipeline Parallelism Using RPC"): rank 0, the
master, holds DistResNet50 (model.py), makes the data, computes the loss and steps; worker1 and worker2 own
its shards. A fresh model (same weights) per N in --splits trains on batches of N micro-batches, timed.

    python rpc_pipeline_resnet/main.py --splits 1 2 4                           # mp.spawn starts 3 processes
    torchrun --nproc_per_node 3 rpc_pipeline_resnet/main.py --splits 1 2 4   # or torchrun does, one rank each
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import DistributedOptimizer

import distkit
from distkit.args import at_least, path, positive
from rpc_pipeline_resnet.model import NUM_CLASSES, DistResNet50

log = logging.getLogger(__name__)

WORKERS = ["worker1", "worker2"]


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the pipeline itself, shared with pipelining.py (the same meaning in both)."""
    parser.add_argument("--splits", type=at_least(1), nargs="+", default=[1, 2, 4, 8], metavar="N",
                        help="numbers of micro-batches per batch to train and time, one run each")
    parser.add_argument("--batch_size", type=at_least(1), default=16, help="images per batch")
    parser.add_argument("--image_size", type=at_least(1), default=128, help="image width and height")
    parser.add_argument("--num_batches", type=at_least(1), default=3, help="batches per run")
    parser.add_argument("--num_classes", type=at_least(1), default=NUM_CLASSES, help="classes (fc outputs)")
    parser.add_argument("--lr", type=positive, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--trace", type=path("out_dir"), default=None, metavar="DIR",
                        help="each rank's torch.profiler trace, DIR/rankN.json (Perfetto)")


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline-parallel ResNet50 over RPC")
    add_batch_args(parser)
    distkit.add_launch_args(parser, world_size=3, rpc_timeout=120,  # check_args: default_hang_timeout
                            hang_timeout="60, or 300 for batches of more pixels than 16 images of 128x128")
    return parser


def feature_size(image_size: int, halvings: int) -> int:
    """Height (= width) after ``halvings`` of conv1, maxpool, layer2, layer3, layer4: each rounds up."""
    return -(-image_size // 2 ** halvings)


def check_batch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if max(args.splits) > args.batch_size:
        parser.error(f"--splits values must be in 1..{args.batch_size} (--batch_size), got {max(args.splits)}")
    smallest = args.batch_size // max(args.splits)
    in_layer3 = smallest * feature_size(args.image_size, 4) ** 2
    in_layer4 = smallest * feature_size(args.image_size, 5) ** 2
    if in_layer3 < 4 or in_layer4 < 2:
        # training BatchNorm normalises each channel over the micro-batch's values: one has no variance, and
        # two in layer3 and in layer4 blow the gradients up (batch 16, 8x8 images, 8 splits: nan)
        parser.error(f"micro-batches of {smallest} image(s) of {args.image_size}x{args.image_size} "
                     f"give BatchNorm {in_layer3} value(s) per channel in layer3 and {in_layer4} in "
                     f"layer4 (training needs 4 and 2); use a larger --image_size or fewer splits")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.hang_timeout is None:
        # the longest time without progress (a forward) on a loaded 2-core machine: 12 s in the default run,
        # 16 images of 128 px; 30 s with the tutorial's 120. A stalled quick start ends within a minute
        args.hang_timeout = 60.0 if args.batch_size * args.image_size ** 2 <= 16 * 128 ** 2 else 300.0
    distkit.check_launch_args(parser, args, min_world_size=3, max_world_size=3)
    check_batch_args(parser, args)
    distkit.check_placements(parser, args, placement)
    if args.threads is None:  # the master only computes the loss: the two shards share the cores
        args.threads = distkit.threads_per_process(min(2, distkit.local_world_size(args)))


def placement(rank: int, args: argparse.Namespace) -> distkit.Placement:
    """The master: the CPU. Shard i (rank i + 1): cuda:i with two GPUs, both cuda:0 with one, else the CPU."""
    if rank == 0:
        return distkit.Placement(torch.device("cpu"))
    return distkit.Placement(distkit.pick_device(args.device, rank - 1))


def run_master(num_split: int, args: argparse.Namespace, devices: list[torch.device]) -> list[float]:
    """The tutorial's training loop, ``num_split`` micro-batches a batch; returns the losses."""
    # put the two model parts on worker1 and worker2 respectively (from --seed: the same weights every time)
    model = DistResNet50(num_split, WORKERS, devices, num_classes=args.num_classes, seed=args.seed)
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(
        optim.SGD,
        model.parameter_rrefs(),
        lr=args.lr,
    )

    # the same seeded data for every num_split, so the runs differ only in pipelining
    gen = torch.Generator().manual_seed(args.seed)
    one_hot_indices = torch.randint(0, args.num_classes, (args.batch_size, 1), generator=gen)
    losses = []
    for i in range(args.num_batches):
        log.info(f"Processing batch {i}")
        # generate random inputs and labels
        inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
        labels = torch.zeros(args.batch_size, args.num_classes).scatter_(1, one_hot_indices, 1)
        # the context collects the gradients on every worker the forward touched: fresh each batch, no zero_grad
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)  # its own line: the run reports the loss
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(distkit.check_finite(loss.item(), f"batch {i} with {num_split} splits"))
    return losses


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """Rank 0, the master, leaves one run per --splits value (its seconds and losses) for main(); ranks 1 and 2
    host the shards."""
    distkit.start_rank(rank, args)  # beyond the tutorial: log prefix, threads, hang bound, --trace (distkit/rank.py)
    world_size = args.world_size
    torch.manual_seed(args.seed + rank)
    distkit.quiet_distributed_optimizer()  # what DistributedOptimizer prints on every rank, see the README
    # TCP ("uv") only, as between machines: the shared-memory transport busy-polls (15 % of a core idle)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=128, rpc_timeout=args.rpc_timeout,
                                              _transports=["uv"])
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        # the master mostly waits on the shards: their answers count as its progress (--hang_timeout)
        distkit.wait_on(*WORKERS, timeout=args.rpc_timeout)
        # each worker picks its shard's device, knowing its own GPUs, as ``placement`` did before launch
        devices = [rpc.rpc_sync(name, distkit.pick_device, args=(args.device, i)) for i, name in enumerate(WORKERS)]
        log.info(f"shards on {' and '.join(map(str, devices))}")
        runs = []
        for num_split in args.splits:
            tik = time.time()
            losses = run_master(num_split, args, devices)
            tok = time.time()
            log.info(f"number of splits = {num_split}, execution time = {tok - tik}")
            log.info(f"losses with {num_split} split(s): {' '.join(f'{x:.4f}' for x in losses)}")
            runs.append({"num_split": num_split, "time": tok - tik, "losses": losses})
        distkit.save_result(rank, runs)  # beyond the tutorial: for the tests and the benchmark
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
        # the workers passively wait for the master's RPCs: each shard's forwards are its progress
    # block until all rpcs finish
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if distkit.under_torchrun():  # torchrun started this process as one rank: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # beyond the tutorial: a free port
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

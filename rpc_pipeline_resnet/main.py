"""Distributed pipeline parallelism with RPC: ResNet50 in two shards on two workers.

Mirrors "Distributed Pipeline Parallelism Using RPC" (upstream: pytorch/examples
rpc/pipeline/main.py). Three processes, roles by rank:
  rank 0  "master": holds DistResNet50 (RRefs to the shards), makes the data, computes the
          loss, runs dist_autograd.backward and the DistributedOptimizer step
  rank 1  "worker1": owns ResNetShard1 (conv1 .. layer2)
  rank 2  "worker2": owns ResNetShard2 (layer3 .. fc)
Each batch is cut into N micro-batches ("splits") that flow through the two shards as a
pipeline; the master trains a fresh model for every N in --splits and times it.

Run on one machine (spawns the three processes; CPU + gloo unless GPUs are visible: with
two GPUs the shards use cuda:0 and cuda:1, with one they share cuda:0):
    python rpc_pipeline_resnet/main.py
    python rpc_pipeline_resnet/main.py --batch_size 120 --image_size 128 --splits 1 2 4 8
One rank per process under torchrun works too:
    torchrun --nproc_per_node 3 rpc_pipeline_resnet/main.py
Prints "number of splits = N, execution time = T" for each N, then a speed-up table.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

import distkit
from rpc_pipeline_resnet.model import NUM_CLASSES, DistResNet50

log = logging.getLogger(__name__)

WORKERS = ["worker1", "worker2"]


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline-parallel ResNet50 over RPC")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8], metavar="N",
                        help="numbers of micro-batches per batch to train and time, one run each")
    parser.add_argument("--batch_size", type=int, default=16, help="images per batch")
    parser.add_argument("--image_size", type=int, default=128, help="image width and height")
    parser.add_argument("--num_batches", type=int, default=3, help="timed batches per run")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed batches first (memory and oneDNN set-up would otherwise "
                             "slow down whichever run comes first)")
    parser.add_argument("--num_classes", type=int, default=NUM_CLASSES, help="classes (fc outputs)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    distkit.add_launch_args(parser, world_size=3, rpc_timeout=120)
    return parser


def final_feature_size(image_size: int) -> int:
    """Height (= width) of layer4's output: conv1, maxpool and layers 2-4 each halve, rounding up."""
    size = image_size
    for _ in range(5):
        size = (size - 1) // 2 + 1
    return size


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=3, max_world_size=3)
    for name in ("batch_size", "image_size", "num_batches", "num_classes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    distkit.require_positive(parser, "--lr", args.lr)
    for n in args.splits:
        if not 1 <= n <= args.batch_size:
            parser.error(f"--splits values must be in 1..{args.batch_size} (--batch_size), got {n}")
    smallest = args.batch_size // max(args.splits)
    side = final_feature_size(args.image_size)
    if smallest * side * side < 2:
        # BatchNorm in training mode needs two values per channel to compute a variance
        parser.error(f"micro-batches of {smallest} image(s) of {args.image_size}x{args.image_size} "
                     f"give BatchNorm one value per channel; use --image_size >= 33 or fewer splits")
    distkit.check_placements(parser, args, placement)


def placement(worker: distkit.Worker, args: argparse.Namespace) -> distkit.Placement:
    """The master: the CPU. Shard i (rank i + 1): cuda:i with two GPUs on its machine, both
    shards on cuda:0 with one, the CPU with none (what ``run_master`` asks each worker)."""
    if worker.rank == 0:
        return distkit.Placement(torch.device("cpu"))
    return distkit.Placement(distkit.pick_device(args.device, worker.rank - 1))


def worker_cpu_times() -> list[float]:
    """CPU seconds each shard's process has used so far (all its threads)."""
    return [rpc.rpc_sync(name, time.process_time) for name in WORKERS]


def run_master(num_split: int, args: argparse.Namespace) -> dict:
    """Train a fresh DistResNet50 for --num_batches batches cut into ``num_split`` micro-batches."""
    # each worker picks its shard's device itself: it knows its own GPUs (shard i gets
    # cuda:i with two GPUs, both share cuda:0 with one, CPU with none or --device cpu)
    devices = [rpc.rpc_sync(name, distkit.pick_device, args=(args.device, i))
               for i, name in enumerate(WORKERS)]
    # put the two model parts on worker1 and worker2 respectively
    model = DistResNet50(num_split, WORKERS, devices, num_classes=args.num_classes)
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=args.lr)

    # the same seeded data for every num_split, so the runs differ only in pipelining
    gen = torch.Generator().manual_seed(args.seed)
    one_hot_indices = torch.randint(0, args.num_classes, (args.batch_size, 1), generator=gen)
    losses, batch_times, cpu_times = [], [], [0.0, 0.0]
    for i in range(args.warmup + args.num_batches):
        timed = i >= args.warmup
        log.info(f"Processing batch {i}" + ("" if timed else " (warm-up, not timed)"))
        # generate random inputs and labels
        inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
        labels = torch.zeros(args.batch_size, args.num_classes).scatter_(1, one_hot_indices, 1)
        cpu_before = worker_cpu_times()
        tik = time.perf_counter()
        # the context collects the gradients on every worker the forward pass touched; there
        # is no zero_grad because each batch gets a fresh context (and fresh gradients)
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        if timed:
            batch_times.append(time.perf_counter() - tik)
            cpu_times = [t + b - a for t, a, b in zip(cpu_times, cpu_before, worker_cpu_times())]
        losses.append(loss.item())
    log.info(f"number of splits = {num_split}, execution time = {sum(batch_times)}")
    return {"num_split": num_split, "time": sum(batch_times), "losses": losses,
            "batch_times": batch_times, "cpu_times": cpu_times, "devices": [str(d) for d in devices]}


def rpc_backend_options(args: argparse.Namespace) -> rpc.TensorPipeRpcBackendOptions:
    # TensorPipe's shared-memory transport busy-polls, about 15% of a core per process even
    # when idle (measured): on 2 cores that is time stolen from the shards. TCP over loopback
    # ("uv") does not, and it is what runs between machines anyway.
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=128, rpc_timeout=args.rpc_timeout,
                                           _transports=["uv"])


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> list[dict] | None:
    """Rank 0 is the master and trains; ranks 1 and 2 host the shards and wait for its RPCs."""
    torch.manual_seed(args.seed + worker.rank)
    distkit.silence_torchscript_optimizer_warning()  # DistributedOptimizer's, see the README
    options = rpc_backend_options(args)
    if worker.rank == 0:
        rpc.init_rpc("master", rank=0, world_size=worker.world_size, rpc_backend_options=options)
        results = [run_master(num_split, args) for num_split in args.splits]
    else:
        if args.threads is None:
            # the master only computes the loss: the two shards share this machine's cores
            # (one thread each on 2 cores), so both can run at the same time
            torch.set_num_threads(distkit.threads_per_process(min(2, worker.local_world_size)))
        rpc.init_rpc(WORKERS[worker.rank - 1], rank=worker.rank, world_size=worker.world_size,
                     rpc_backend_options=options)
        results = None
    # block until all rpcs finish
    rpc.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    runs = distkit.launch(run_worker, args).get(0)
    if runs is None:  # a torchrun rank other than 0
        return 0
    print(f"devices: worker1 {runs[0]['devices'][0]}, worker2 {runs[0]['devices'][1]}; batches of "
          f"{args.batch_size} x 3 x {args.image_size} x {args.image_size}; {args.num_batches} timed "
          f"after {args.warmup} warm-up")
    # busy = (CPU seconds of both shard processes) / wall seconds: about 1 when the shards
    # take turns, up to 2 when they really run side by side (CPU runs only)
    print("splits  time (s)  speed-up  shard CPU (s)  busy  loss of each batch")
    for run in runs:
        cpu1, cpu2 = run["cpu_times"]
        print(f"{run['num_split']:6d}  {run['time']:8.2f}  {runs[0]['time'] / run['time']:7.2f}x  "
              f"{cpu1:6.2f} {cpu2:6.2f}  {(cpu1 + cpu2) / run['time']:4.2f}  "
              f"{' '.join(f'{x:.4f}' for x in run['losses'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DistributedDataParallel and the Distributed RPC framework in one model.

Mirrors "Combining Distributed DataParallel with Distributed RPC Framework". A
``HybridModel`` looks up an ``nn.EmbeddingBag`` held on a parameter server (over RPC, through
a ``RemoteModule``) and feeds it to an ``nn.Linear`` replicated on the trainers with DDP;
distributed autograd and a ``DistributedOptimizer`` train both parts. Roles (4 processes):
  ranks 0, 1  trainers: their own process group for DDP, then RPC (ddp_rpc/trainer.py)
  rank 2      master: creates the embedding table on the parameter server, starts
              ``_run_trainer`` on every trainer with ``rpc_async`` and waits for them
  rank 3      parameter server: holds the table and answers RPCs
With --world_size N: ranks 0..N-3 train, N-2 is the master, N-1 the parameter server.

Run on one machine (spawns the processes; CPU + gloo, or CUDA + NCCL for the trainers
where there is a GPU per trainer):
    python ddp_rpc/main.py
    python ddp_rpc/main.py --epochs 20 --batch_size 32 --seed 1
One rank per process under torchrun works too:
    torchrun --nproc_per_node 4 ddp_rpc/main.py
Each trainer logs its loss per epoch; the master prints a summary at the end.
"""
from __future__ import annotations

import argparse
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.nn import RemoteModule
from torch.distributed.rpc import TensorPipeRpcBackendOptions

import distkit
from ddp_rpc import trainer
from ddp_rpc.trainer import EMBEDDING_DIM, NUM_EMBEDDINGS, TrainConfig, _embedding_weight, _run_trainer

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="DDP + RPC: embedding on a parameter server, "
                                                "DDP-replicated linear layer on the trainers")
    parser.add_argument("--epochs", type=int, default=10, metavar="E",
                        help="passes over each trainer's batches")
    parser.add_argument("--batches_per_epoch", type=int, default=10, metavar="B",
                        help="batches per trainer per epoch")
    parser.add_argument("--batch_size", type=int, default=16, metavar="N",
                        help="bags (samples) per batch")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seeds the weights and every trainer's batches")
    distkit.add_launch_args(parser, world_size=4, rpc_timeout=60)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=3)
    for flag in ("epochs", "batches_per_epoch", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    distkit.require_positive(parser, "--lr", args.lr)
    if args.seed < 0:
        parser.error(f"--seed must be non-negative, got {args.seed}")
    distkit.check_placements(parser, args, placement)


def num_trainers(world_size: int) -> int:
    return world_size - 2


def placement(worker: distkit.Worker, args: argparse.Namespace) -> distkit.Placement:
    """A trainer: a GPU of its own and NCCL where its machine has one per trainer, else the
    CPU and gloo. The master and the parameter server: the CPU, in no process group."""
    trainers = num_trainers(worker.world_size)
    if worker.rank >= trainers:
        return distkit.Placement(torch.device("cpu"))
    # the ranks of one machine are consecutive and trainers come first: this machine's
    # trainers are its first ones, and local_rank numbers them
    first_here = worker.rank - worker.local_rank
    local_trainers = min(trainers, first_here + worker.local_world_size) - first_here
    return distkit.group_placement(args.device, worker.local_rank, local_trainers)


def run_master(args: argparse.Namespace) -> dict:
    """The master: create the table on the parameter server, train on every trainer."""
    trainers = num_trainers(args.world_size)
    config = TrainConfig(args.epochs, args.batches_per_epoch, args.batch_size, args.lr, args.seed)
    # The embedding table lives on "ps"; the master, and every trainer it hands this
    # RemoteModule to, only hold a reference to it.
    remote_emb_module = RemoteModule("ps", torch.nn.EmbeddingBag,
                                     args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
    table = remote_emb_module.get_module_rref()
    emb_before = rpc.rpc_sync("ps", _embedding_weight, args=(table,))
    log.info(f"Training on {trainers} trainers: {config}")
    start = time.perf_counter()
    # Run the training loop on trainers. timeout=0: a whole training run may take longer
    # than --rpc_timeout; wait_for_trainers bounds the wait for a trainer that hangs instead.
    names = [f"trainer{r}" for r in range(trainers)]
    futs = [rpc.rpc_async(name, _run_trainer, args=(remote_emb_module, r, config), timeout=0)
            for r, name in enumerate(names)]
    # Wait for all training to finish.
    reports = wait_for_trainers(futs, names, args.rpc_timeout)
    seconds = time.perf_counter() - start
    emb_after = rpc.rpc_sync("ps", _embedding_weight, args=(table,))
    return {"trainers": reports, "emb_before": emb_before, "emb_after": emb_after,
            "seconds": seconds, "config": config}


def wait_for_trainers(futs: list[torch.futures.Future], names: list[str],
                      timeout: float) -> list:
    """What every trainer's ``_run_trainer`` returned; raise as soon as one fails or hangs.

    A trainer's error ends the wait at once (not once the trainers before it finish). A
    trainer that stops answering (hung, not dead: the launcher cannot see it) would leave a
    ``timeout=0`` RPC waiting forever, so each trainer still training must answer a no-op
    RPC every second, which fails after ``timeout`` seconds.
    """
    changed = threading.Event()
    for fut in futs:
        fut.add_done_callback(lambda _: changed.set())
    while not all(fut.done() for fut in futs):
        changed.wait(timeout=1.0)
        changed.clear()
        for name, fut in zip(names, futs):
            if fut.done():
                fut.wait()  # raises that trainer's error, if it had one
            else:
                rpc.rpc_sync(name, time.monotonic, timeout=timeout)
    return [fut.wait() for fut in futs]


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> dict | None:
    """Initialise each role as the tutorial does; the master returns what training did."""
    trainers = num_trainers(worker.world_size)
    master_rank, ps_rank = trainers, trainers + 1
    distkit.silence_torchscript_optimizer_warning()  # DistributedOptimizer's, see the README
    options = TensorPipeRpcBackendOptions(rpc_timeout=args.rpc_timeout)
    # each process its own seed: the table is initialised on the parameter server, fc on
    # every trainer, and DDP must (and does) make all trainers start from rank 0's fc
    torch.manual_seed(args.seed * 1000 + worker.rank)
    result = None
    if worker.rank == master_rank:
        rpc.init_rpc("master", rank=worker.rank, world_size=worker.world_size,
                     rpc_backend_options=options)
        result = run_master(args)
    elif worker.rank < trainers:
        where = placement(worker, args)
        # trainers on several machines: all NCCL or all gloo, or one line saying who sees what
        distkit.agree_on_backend("trainers", worker.rank, trainers, where)
        if where.device.type == "cuda":
            torch.cuda.set_device(where.device)
        trainer.set_device(where.device)
        # The trainers' own process group for DDP (world size = number of trainers). It
        # rendezvouses under its own key prefix in the job's store, not on RPC's keys and
        # not on a second hard-coded port. Its timeout bounds DDP's allreduce: a trainer whose
        # peer hangs fails after --rpc_timeout seconds, not after the default 30 minutes.
        store = distkit.job_store("trainers")
        # That timeout also bounds the group's rendezvous, and on a busy machine one trainer
        # may start long after another: wait for all of them first, under the store's timeout.
        store.set(f"started{worker.rank}", "1")
        store.wait([f"started{r}" for r in range(trainers)])
        dist.init_process_group(where.backend, store=store, rank=worker.rank,
                                world_size=trainers, timeout=timedelta(seconds=args.rpc_timeout))
        rpc.init_rpc(f"trainer{worker.rank}", rank=worker.rank, world_size=worker.world_size,
                     rpc_backend_options=options)
        # Trainer just waits for the _run_trainer RPC from the master.
    else:
        assert worker.rank == ps_rank
        rpc.init_rpc("ps", rank=worker.rank, world_size=worker.world_size,
                     rpc_backend_options=options)
        # the parameter server does nothing but answer RPCs
    # block until all RPCs finish
    rpc.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    results = distkit.launch(run_worker, args)
    summary = results.get(num_trainers(args.world_size))
    if summary is None:  # this machine or process did not run the master
        return 0
    reports = summary["trainers"]
    first = [sum(r.losses[0]) / len(r.losses[0]) for r in reports]
    last = [sum(r.losses[-1]) / len(r.losses[-1]) for r in reports]
    in_sync = all(torch.equal(reports[0].fc_after[k], r.fc_after[k])
                  for r in reports for k in reports[0].fc_after)
    print(f"Trained {args.epochs} epochs x {args.batches_per_epoch} batches on "
          f"{len(reports)} trainers ({reports[0].device}) in {summary['seconds']:.1f} s")
    for r, a, b in zip(reports, first, last):
        print(f"  trainer{r.rank}: loss {a:.4f} (epoch 0) -> {b:.4f} (epoch {args.epochs - 1})")
    print(f"  fc identical on all trainers: {in_sync}")
    return 0 if in_sync else 1


if __name__ == "__main__":
    distkit.exit_process(main())

"""The same ResNet50 pipeline (main.py's halves, seeds, data, micro-batches) with torch.distributed.pipelining,
as "Introduction to Distributed Pipeline Parallelism" does it: two ranks, no master. Rank 0 runs stage 0
(ResNetShard1's layers) and feeds the images, rank 1 stage 1 (ResNetShard2's) and computes each micro-batch's
MSELoss; each steps its own SGD. ``ScheduleGPipe`` or ``--schedule 1F1B``.

    python rpc_pipeline_resnet/pipelining.py                             # mp.spawn starts 2 processes
    torchrun --nproc_per_node 2 rpc_pipeline_resnet/pipelining.py        # or torchrun does, one rank each
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
import torch.optim as optim
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import distkit
from distkit.schedules import schedule_problem  # builds the schedule around stand-in stages
from rpc_pipeline_resnet.main import add_batch_args, check_batch_args
from rpc_pipeline_resnet.model import ResNetBase, ResNetShard1, ResNetShard2

log = logging.getLogger(__name__)

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}  # the ones that fit 2 stages, 2 ranks


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline-parallel ResNet50 with torch.distributed.pipelining")
    add_batch_args(parser)  # main.py's flags, meaning the same here
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="GPipe",
                        help="pipeline schedule (both run one stage per rank)")
    # --hang_timeout 60: the longest time without progress in the README's default run was 4.4 s on a loaded 2-core
    # machine, and a stalled quick start should end with every rank's stack within a minute
    distkit.add_launch_args(parser, world_size=2, hang_timeout=60)
    # no --splits: check_args takes main.py's list, less what this PyTorch's schedule refuses
    parser.set_defaults(splits=None, default_splits=parser.get_default("splits"))
    return parser


def runnable_splits(default: list[int], schedule: str) -> list[int]:
    """The ``--splits`` values of ``default`` this PyTorch's schedule can run on two stages; the others are
    left out, one line each (1F1B wants a micro-batch per stage: ``--schedule 1F1B`` runs 2, 4 and 8)."""
    problems = {n: schedule_problem(schedule, 2, n) for n in default}
    for n, problem in problems.items():
        if problem and os.environ.get("RANK", "0") == "0":  # under torchrun: once
            print(f"skipping --splits {n}: {schedule} on 2 stages: {problem} "
                  f"(torch {torch.__version__.split('+')[0]})")
    return [n for n in default if not problems[n]]


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=2, max_world_size=2)
    given = args.splits is not None  # else main.py's list, less what the schedule refuses (checked there)
    if not given:
        args.splits = runnable_splits(args.default_splits, args.schedule)
    check_batch_args(parser, args)
    for n in args.splits:
        if args.batch_size % n:
            # the schedule gives every micro-batch the first's shape (main.py's tensor_split: one image off)
            parser.error(f"--splits values must divide --batch_size {args.batch_size} "
                         f"(torch.distributed.pipelining's micro-batches are equal), got {n}")
        # PyTorch's own answer, before launch (1F1B wants a micro-batch per stage)
        if given and (problem := schedule_problem(args.schedule, 2, n)):
            parser.error(f"--schedule {args.schedule} --splits {n}: {problem} "
                         f"(torch {torch.__version__.split('+')[0]})")
    distkit.check_placements(parser, args, placement)


def placement(rank: int, args: argparse.Namespace) -> distkit.Placement:
    """A GPU of its own per rank and NCCL, or both ranks on the CPU with gloo (never two ranks on one GPU)."""
    return distkit.group_placement(args.device, distkit.local_rank(rank), distkit.local_world_size(args))


def init_distributed(rank: int, args: argparse.Namespace) -> torch.device:
    """Join the process group as ``rank``, on ``placement``'s device; returns it. The rendezvous is
    ``env://``: the MASTER_ADDR and MASTER_PORT that mp.spawn's launcher or torchrun set."""
    where = placement(rank, args)
    if where.device_id is not None:
        torch.accelerator.set_device_index(where.device)  # this rank's GPU, the current one (NCCL's)
    backend = where.backend  # NCCL on a GPU each, else gloo
    # the tutorial's bare call with its arguments written out (mp.spawn sets no RANK or WORLD_SIZE for env:// to
    # read); device_id binds NCCL to the GPU at once
    dist.init_process_group(backend=backend, rank=rank, world_size=args.world_size, device_id=where.device_id)
    return where.device


class ShardStage(nn.Module):
    """One shard's layers (same weights and state_dict keys) as a stage: ``forward`` takes the tensor, no RRef,
    lock or copy to the CPU (the schedule hands it one micro-batch at a time and sends the output on)."""

    def __init__(self, shard: ResNetBase) -> None:
        super().__init__()
        self.seq = shard.seq
        self.fc = getattr(shard, "fc", None)  # shard 2's head; shard 1 has none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.seq(x)
        # ResNetShard2.forward: fc over the flattened pooled features
        return self.fc(torch.flatten(out, 1)) if self.fc is not None else out


def manual_model_split(stage_index: int, num_stages: int, device: torch.device,
                       args: argparse.Namespace) -> PipelineStage:
    """Stage 0 holds shard 1's layers, stage 1 shard 2's; seeds as ``DistResNet50``'s."""
    if stage_index == 0:
        shard = ResNetShard1(device, num_classes=args.num_classes, seed=args.seed)
    else:
        shard = ResNetShard2(device, num_classes=args.num_classes, seed=args.seed + 1)
    stage = PipelineStage(
        ShardStage(shard),
        stage_index,
        num_stages,
        device,
    )
    return stage


def run_pipeline(num_split: int, args: argparse.Namespace, rank: int, device: torch.device) -> list[float]:
    """main.py's ``run_master`` on one rank, pipelined by a schedule; returns the losses (rank 1; rank 0 none)."""
    stage_index, num_stages = rank, 2  # one stage per rank
    stage = manual_model_split(stage_index, num_stages, device, args)
    loss_fn = nn.MSELoss()
    # the tutorial's ScheduleGPipe, or Schedule1F1B (--schedule), built the same way
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=num_split, loss_fn=loss_fn)
    opt = optim.SGD(stage.submod.parameters(), lr=args.lr)

    # the data main.py's run_master draws, from the same seed: rank 0 needs the images, rank 1 the labels
    gen = torch.Generator().manual_seed(args.seed)
    one_hot_indices = torch.randint(0, args.num_classes, (args.batch_size, 1), generator=gen)
    labels = torch.zeros(args.batch_size, args.num_classes).scatter_(1, one_hot_indices, 1)
    losses = []
    for i in range(args.num_batches):
        if stage.is_first:
            log.info(f"Processing batch {i}")
            inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
        # step() sums the micro-batches' gradients in .grad and divides by num_split (scale_grads): their
        # mean loss's gradient = main.py's batch MSE's (test_both_pipelines_train_what_one_process_trains)
        opt.zero_grad()
        if stage.is_first:
            # cuts the batch, runs stage 0 on each micro-batch, sends its output to rank 1; receives the
            # gradient of that output back, runs stage 0's backward
            schedule.step(inputs.to(device))
        else:
            mb_losses = []
            # receives stage 0's outputs, runs stage 1 and loss_fn on each micro-batch, the backward, sends
            # the gradient of stage 1's input back to rank 0; returns the batch's logits (not needed here)
            schedule.step(target=labels.to(device), losses=mb_losses)
        opt.step()
        if stage.is_last:
            # only reported: equal micro-batches, so the mean of their MSEs is the batch's, main.py's loss
            loss = torch.stack(mb_losses).mean().item()
            losses.append(distkit.check_finite(loss, f"batch {i} with {num_split} splits"))
    return losses


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """Both ranks: one fresh pair of stages per --splits value, one run each (rank 0 times, rank 1 losses), left
    for main()."""
    distkit.start_rank(rank, args)  # beyond the tutorial: log prefix, threads, hang bound, --trace (distkit/rank.py)
    device = init_distributed(rank, args)
    log.info(f"stage {rank} on {device}")  # what --device chose
    runs = []
    for num_split in args.splits:
        tik = time.time()  # as main.py times run_master
        losses = run_pipeline(num_split, args, rank, device)
        tok = time.time()
        runs.append({"num_split": num_split, "time": tok - tik, "losses": losses})
        if rank == 0:
            log.info(f"number of splits = {num_split}, execution time = {tok - tik}")
        else:
            log.info(f"losses with {num_split} split(s): {' '.join(f'{x:.4f}' for x in losses)}")
    distkit.save_result(rank, runs)  # beyond the tutorial: for the tests and the benchmark
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # as in the tutorial, torchrun starts one process per rank; without it, mp.spawn starts --world_size here
    if distkit.under_torchrun():
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # beyond the tutorial: a free port (env://)
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

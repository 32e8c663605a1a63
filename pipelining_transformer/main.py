"""Pipeline-parallel training of a GPT-style transformer with torch.distributed.pipelining.

The tutorial "Introduction to Distributed Pipeline Parallelism", top to bottom (its model in model.py):
``init_distributed``, the model cut into one stage per rank (``manual_model_split`` or
``tracer_model_split``), ``ScheduleGPipe``, and the step by role in ``train``, --steps times; exit
status 0 if the loss fell. Roles: rank 0 holds the first stage and feeds the tokens
(``schedule.step(x)``); the last rank holds the last stage, feeds the targets and prints the batch's loss
(``schedule.step(target=y, losses=losses)``); a rank in between relays activations and gradients.
    .venv/bin/torchrun --nproc_per_node 2 pipelining_transformer/main.py   # as the tutorial launches it
    .venv/bin/python pipelining_transformer/main.py --world_size 2         # the processes spawned here
Multi-stage schedules, data parallelism, checkpoints and traces: train.py, the program beside this one.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

import distkit
from distkit.args import at_least, positive, probability
from distkit.schedules import schedule_problem
from pipelining_transformer.model import (ModelArgs, Transformer, make_optimizer, synthetic_batch,
                                          tokenwise_loss_fn)

log = logging.getLogger(__name__)
# the single-stage-per-rank schedules the tutorial names, by --schedule
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


@dataclass
class Pipeline:
    """The tutorial's globals, one value: this rank, its device, the group and its stage."""

    rank: int
    device: torch.device
    pp_group: dist.ProcessGroup
    stage_index: int
    num_stages: int


def init_distributed(rank: int, args: argparse.Namespace) -> Pipeline:
    """Join the process group of the job torchrun or mp.spawn started (``env://``: MASTER_ADDR and
    MASTER_PORT); ``rank`` is torchrun's RANK, or this process's index in mp.spawn."""
    world_size = args.world_size  # torchrun's WORLD_SIZE, or --world_size
    where = placement(rank, args)  # cuda:LOCAL_RANK where every rank here has a GPU, else the CPU
    device = where.device
    if device.type == "cuda":
        torch.accelerator.set_device_index(device)  # this rank's GPU, the current one: NCCL's default
    backend, device_id = where.backend, where.device_id  # NCCL bound to that GPU, or gloo on the CPU
    # the tutorial's bare call reads RANK and WORLD_SIZE, which only torchrun sets: here they are passed
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, device_id=device_id)
    # This group can be a sub-group in the N-D parallel case
    pp_group = dist.new_group()
    return Pipeline(rank, device, pp_group, stage_index=rank, num_stages=world_size)


def stage_layers(n_layers: int, stage_index: int, num_stages: int) -> range:
    """The layers of stage ``stage_index``: the tutorial's ``range(4)`` and ``range(4, 8)`` for any count."""
    return range(stage_index * n_layers // num_stages, (stage_index + 1) * n_layers // num_stages)


def manual_model_split(model: Transformer, stage_index: int, num_stages: int, layers: range,
                       device: torch.device, pp_group: dist.ProcessGroup | None = None) -> PipelineStage:
    """Option 1: stage ``stage_index`` is ``model`` itself, without the parts other stages own."""
    for i in list(model.layers):
        if int(i) not in layers:
            del model.layers[i]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != num_stages - 1:
        model.norm = None
        model.output = None
    model.to(device)
    stage = PipelineStage(
        model,
        stage_index,
        num_stages,
        device,
        group=pp_group,
    )
    return stage


def tracer_model_split(model: Transformer, example_input_microbatch: torch.Tensor, split_points: list[str],
                       stage_index: int, device: torch.device, pp_group: dist.ProcessGroup) -> PipelineStage:
    """Option 2: trace ``model``, cut before each of ``split_points`` ("layers.4"), build this rank's stage."""
    pipe = pipeline(
        module=model,
        mb_args=(example_input_microbatch,),
        split_spec={name: SplitPoint.BEGINNING for name in split_points},
    )
    stage = pipe.build_stage(stage_index, device, pp_group)
    return stage


def send_contiguous_input_grads(stage: PipelineStage) -> None:
    """Make the gradient a stage sends back contiguous: attention (batch_first) leaves it a transposed
    view, which a manual ``PipelineStage`` sends as it is and gloo refuses ("input tensor has to be
    contiguous"); torch 2.14.1. A traced stage's is contiguous already, but not in train.py's
    zero-bubble schedules' input-only backward."""
    def hook(module: torch.nn.Module, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                a.register_hook(torch.Tensor.contiguous)

    stage.submod.register_forward_pre_hook(hook)


def train_step(schedule, optimizers: list[torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor,
               is_first: bool, is_last: bool) -> list[torch.Tensor]:
    """One optimizer step of the whole batch: the tutorial's ``schedule.step`` by role, between
    ``zero_grad`` (the schedule adds each micro-batch's gradient to ``.grad``) and the optimizer's step.
    Returns the micro-batch losses on the last stage, else ``[]``."""
    for opt in optimizers:
        opt.zero_grad()
    losses: list[torch.Tensor] = []
    target, kept = (y, losses) if is_last else (None, None)  # the last stage computes the loss
    if is_first:  # the tutorial's rank 0 (and a "V" schedule's rank holding the last stage too)
        schedule.step(x, target=target, losses=kept, return_outputs=False)
    else:  # the merged logits are not read: return_outputs=False keeps them from being merged
        schedule.step(target=target, losses=kept, return_outputs=False)
    for opt in optimizers:
        opt.step()
    return losses


def train(args: argparse.Namespace, pp: Pipeline) -> list[float]:
    """The tutorial's ``__main__`` after ``init_distributed``, its step --steps times: the batch's loss
    per step on the last stage (what it prints), else ``[]``."""
    torch.manual_seed(args.seed)  # every rank builds the same model and keeps its stage of it
    model_args = ModelArgs(args.dim, args.n_layers, args.n_heads, args.vocab_size, args.dropout)
    model = Transformer(model_args)
    if args.split == "manual":  # Option 1: manual model splitting
        layers = stage_layers(args.n_layers, pp.stage_index, pp.num_stages)
        stage = manual_model_split(model, pp.stage_index, pp.num_stages, layers, pp.device, pp.pp_group)
        send_contiguous_input_grads(stage)
    else:  # Option 2: tracer model splitting, before the first layer of each later stage
        example_input_microbatch = torch.zeros(args.batch_size // args.n_microbatches, args.seq_len,
                                               dtype=torch.long)  # only its shape and dtype are read
        split_points = [f"layers.{stage_layers(args.n_layers, s, pp.num_stages).start}"
                        for s in range(1, pp.num_stages)]
        stage = tracer_model_split(model, example_input_microbatch, split_points, pp.stage_index,
                                   pp.device, pp.pp_group)
    log.info(f"stage {pp.stage_index} of {pp.num_stages} on {pp.device} ({args.split} split)")
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.n_microbatches, loss_fn=tokenwise_loss_fn)
    optimizer = make_optimizer(args.optimizer, stage.submod.parameters(), args.lr)
    batch_losses = []
    for step in range(args.steps):
        x, y = synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, args.seed)
        x, y = x.to(pp.device), y.to(pp.device)
        losses = train_step(schedule, [optimizer], x, y, stage.is_first, stage.is_last)
        if stage.is_last:  # the batch's loss: the mean of its micro-batches'
            loss = distkit.check_finite(torch.stack(losses).mean().item(), f"step {step + 1}")
            log.info(f"step {step + 1}/{args.steps}  loss {loss:.4f}")
            batch_losses.append(loss)
    return batch_losses


def run_worker(rank: int, args: argparse.Namespace) -> None:
    distkit.start_rank(rank, args)  # beyond the tutorial: log prefix, threads, hang bound (distkit/rank.py)
    pp = init_distributed(rank, args)
    losses = train(args, pp)
    distkit.save_result(rank, losses)  # beyond the tutorial: the last stage's losses decide main()'s exit status
    dist.destroy_process_group()


def placement(rank: int, args: argparse.Namespace) -> distkit.Placement:
    """A GPU of its own and NCCL for every rank of this machine, or all on the CPU with gloo."""
    return distkit.group_placement(args.device, distkit.local_rank(rank), distkit.local_world_size(args))


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the tutorial's constants: its split, micro-batches, data and model."""
    parser.add_argument("--split", choices=("manual", "tracer"), default="manual",
                        help="cut the model by deleting parts (manual) or by tracing it (tracer)")
    parser.add_argument("--n_microbatches", type=at_least(1), default=4, metavar="M",
                        help="micro-batches each batch is cut into")
    parser.add_argument("--batch_size", type=at_least(1), default=8, metavar="B",
                        help="sequences per batch (per optimizer step)")
    parser.add_argument("--seq_len", type=at_least(1), default=16, metavar="T", help="tokens per sequence")
    parser.add_argument("--steps", type=at_least(1), default=10, metavar="N", help="optimizer steps")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="one per stage; sgd (momentum 0.9) makes a step a linear function "
                             "of the gradient, for bit-for-bit comparisons")
    parser.add_argument("--lr", type=positive, default=1e-3, help="learning rate")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seeds the weights and the data")
    model = parser.add_argument_group("model (defaults: the tutorial's ModelArgs)")
    defaults = ModelArgs()
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "dropout"):
        model.add_argument(f"--{name}", type=probability if name == "dropout" else at_least(1),
                           default=getattr(defaults, name))


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline parallelism with torch.distributed.pipelining")
    parser.add_argument("--schedule", choices=SCHEDULES, default="GPipe",
                        help="one stage per rank; the multi-stage schedules: train.py")
    add_training_args(parser)
    # the longest time without progress in the README's runs was 1.5 s on a loaded 2-core machine
    distkit.add_launch_args(parser, world_size=2, hang_timeout=60)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the ranks would fail on, refused before any starts (one line, exit 2)."""
    distkit.check_launch_args(parser, args)
    num_stages = args.world_size  # one stage per rank
    if args.batch_size % args.n_microbatches:
        parser.error(f"--batch_size {args.batch_size} is not divisible by --n_microbatches {args.n_microbatches}")
    if args.dim % args.n_heads:
        parser.error(f"--dim {args.dim} is not divisible by --n_heads {args.n_heads}")
    if num_stages > args.n_layers:
        parser.error(f"{num_stages} stages need at least one of --n_layers {args.n_layers} layers each")
    if problem := schedule_problem(args.schedule, num_stages, args.n_microbatches):
        parser.error(f"{args.schedule} cannot run --n_microbatches {args.n_microbatches} on {num_stages} "
                     f"ranks: {problem}")
    distkit.check_placements(parser, args, placement)  # --device cuda without a GPU a rank


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if distkit.under_torchrun():  # torchrun started this process as one rank, as in the tutorial: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # beyond the tutorial: a free port, a folder for the ranks' losses
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    losses = next((r for r in distkit.results().values() if r), [])  # the last stage's (torchrun: if here)
    if len(losses) > 1 and not losses[-1] < losses[0]:
        print(f"The loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

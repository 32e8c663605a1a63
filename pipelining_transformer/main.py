"""Pipeline-parallel training of a GPT-style transformer with torch.distributed.pipelining.

Mirrors "Introduction to Distributed Pipeline Parallelism". The model's layers are divided
among pipeline stages, one stage per rank (GPipe, 1F1B) or two (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: whatever this PyTorch offers). Roles:
  the rank holding stage 0      reads the tokens of each batch and embeds them
  the rank holding the last     reads the targets, computes the loss, prints it each step
                                (and appends it, full precision, to --loss_log as JSON lines)
  every rank                    runs its stages' forwards/backwards in the schedule's order
                                and steps one optimizer per stage

Run on one machine (spawns the processes, CPU + gloo unless a GPU per process is visible):
    python pipelining_transformer/main.py --world_size 2
    python pipelining_transformer/main.py --world_size 4 --schedule Interleaved1F1B --split tracer
One rank per process under torchrun, as the tutorial launches it:
    torchrun --nproc_per_node 2 pipelining_transformer/main.py
    torchrun --nproc_per_node 2 pipelining_transformer/main.py --schedule ZBVZeroBubble
See each rank's forwards, backwards and waits (DIR/timeline.png; DIR/trace.json for Perfetto):
    python pipelining_transformer/main.py --schedule 1F1B --n_microbatches 8 --trace trace_1f1b
The model is the tutorial's (dim 512, 8 layers, 8 heads, vocabulary 10000); the batch is
CPU-sized (8 x 16 tokens, not the tutorial's 32 x 500). Exit status 0 if the loss fell
(judged on a run from step 0, not on a resumed one).
The last stage also computes the 10000-word output projection and the loss: give it fewer
layers to balance the stages (--stage_layers 5 3).

Checkpoint every 5 steps; after a crash, go on from the newest complete checkpoint (with
any number of stages: checkpoints hold the full model's names, not the split; but the same
data flags, --seed --batch_size --seq_len --vocab_size, or the resume is refused):
    python pipelining_transformer/main.py --steps 20 --checkpoint_dir ckpt --checkpoint_every 5
    python pipelining_transformer/main.py --steps 20 --checkpoint_dir ckpt --resume
    python pipelining_transformer/main.py --steps 20 --world_size 4 --resume ckpt/step_10
A resume in the same layout restores every rank's random state (dropout masks) too. Restarted
by torchrun, without a person, when a worker dies:
    torchrun --standalone --nproc_per_node 2 --max-restarts 3 pipelining_transformer/main.py \
        --steps 20 --checkpoint_dir ckpt --checkpoint_every 5 --resume

Pipeline x data parallelism: --dp_size D runs D pipeline replicas of world_size / D ranks
each, on a ("dp", "pp") device mesh (rank = dp_rank * pp_size + pp_rank); replica k trains on
the k-th contiguous slice of every batch, and each stage's gradients are averaged over the
D ranks holding it (FSDP2). The first replica's last-stage rank prints the batch's loss:
    python pipelining_transformer/main.py --world_size 4 --dp_size 2 --batch_size 16
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

import distkit
from pipelining_transformer import checkpoint
from pipelining_transformer.model import ModelArgs, Transformer
from pipelining_transformer.parallel import (
    SCHEDULES,
    DistEnv,
    PipelineRank,
    init_distributed,
    layer_ranges,
    num_stages_for,
    schedule_problem,
    synthetic_batch,
)
from pipelining_transformer.timeline import PipelineTracer

log = logging.getLogger(__name__)


def schedule_name(text: str) -> str:
    """Accept a schedule's short name in any case ("gpipe", "ScheduleGPipe")."""
    by_lower = {name.lower(): name for name in SCHEDULES}
    name = by_lower.get(text.lower().removeprefix("schedule"))
    if name is None:
        raise argparse.ArgumentTypeError(
            f"unknown schedule {text!r} (this PyTorch offers {', '.join(SCHEDULES)})")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline parallelism with torch.distributed.pipelining")
    parser.add_argument("--schedule", type=schedule_name, default="GPipe", metavar="NAME",
                        help=f"pipeline schedule, one of: {', '.join(SCHEDULES)}")
    parser.add_argument("--split", choices=("manual", "tracer"), default="manual",
                        help="cut the model by deleting parts (manual) or by tracing it (tracer)")
    parser.add_argument("--stage_layers", type=int, nargs="+", default=None, metavar="N",
                        help="layers of each stage, in stage order (default: as even as can be); "
                             "the last stage also computes the output projection and the loss")
    parser.add_argument("--n_microbatches", type=int, default=4, metavar="M",
                        help="micro-batches each batch is cut into")
    parser.add_argument("--batch_size", type=int, default=8, metavar="B",
                        help="sequences per batch (per optimizer step)")
    parser.add_argument("--seq_len", type=int, default=16, metavar="T", help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, metavar="N", help="optimizer steps")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="one per stage; sgd (momentum 0.9) makes a step a linear function "
                             "of the gradient, for bit-for-bit comparisons")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--dp_size", type=int, default=1, metavar="D",
                        help="pipeline replicas (data parallelism): world_size / D ranks each, "
                             "every replica trains on 1/D of each batch")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    parser.add_argument("--loss_log", default=None, metavar="PATH",
                        help='append {"step": N, "loss": L} per step to PATH, one JSON line each, '
                             "the loss at full precision (a resumed run continues the file)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="record every forward/backward/weight-gradient and P2P wait per rank: "
                             "DIR/rank<r>.json, merged DIR/trace.json (Perfetto), DIR/timeline.png "
                             "(last step, measured beside PyTorch's plan)")
    ckpt = parser.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    ckpt.add_argument("--checkpoint_dir", default=None, metavar="DIR",
                      help="save into DIR/step_<N>/ every --checkpoint_every steps and at the end")
    ckpt.add_argument("--checkpoint_every", type=int, default=0, metavar="K",
                      help="steps between checkpoints (0: only at the end)")
    ckpt.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                      help="go on from checkpoint PATH, or (no PATH) from the newest complete "
                           "one in --checkpoint_dir; a fresh start if there is none")
    model = parser.add_argument_group("model (defaults: the tutorial's ModelArgs)")
    defaults = ModelArgs()
    model.add_argument("--dim", type=int, default=defaults.dim)
    model.add_argument("--n_layers", type=int, default=defaults.n_layers)
    model.add_argument("--n_heads", type=int, default=defaults.n_heads)
    model.add_argument("--vocab_size", type=int, default=defaults.vocab_size)
    model.add_argument("--dropout", type=float, default=defaults.dropout)
    distkit.add_launch_args(parser, world_size=2)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    distkit.check_launch_args(parser, args, min_world_size=1)
    for flag in ("n_microbatches", "batch_size", "seq_len", "steps", "dim", "n_layers",
                 "n_heads", "vocab_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.dp_size < 1:
        parser.error(f"--dp_size must be at least 1, got {args.dp_size}")
    if args.world_size % args.dp_size:
        parser.error(f"--world_size {args.world_size} is not divisible by --dp_size {args.dp_size}")
    if args.batch_size % (args.dp_size * args.n_microbatches):  # each replica: equal micro-batches
        dp = f"--dp_size {args.dp_size} x " if args.dp_size > 1 else ""
        parser.error(f"--batch_size {args.batch_size} is not divisible by "
                     f"{dp}--n_microbatches {args.n_microbatches}")
    if args.dim % args.n_heads:
        parser.error(f"--dim {args.dim} is not divisible by --n_heads {args.n_heads}")
    if not 0 <= args.dropout < 1:  # also false for nan
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    distkit.require_positive(parser, "--lr", args.lr)
    if args.loss_log is not None:
        folder = os.path.dirname(args.loss_log) or "."
        if not os.path.isdir(folder):
            parser.error(f"--loss_log {args.loss_log}: no such directory {folder}")
        if os.path.isdir(args.loss_log):
            parser.error(f"--loss_log {args.loss_log} is a directory")
    pp_size = args.world_size // args.dp_size  # ranks per pipeline replica
    on = f"on {pp_size} ranks" + (f" per replica (--dp_size {args.dp_size})" if args.dp_size > 1 else "")
    n_stages = num_stages_for(args.schedule, pp_size)
    if n_stages > args.n_layers:
        parser.error(f"{args.schedule} {on} makes {n_stages} stages, "
                     f"more than --n_layers {args.n_layers}: each stage needs a layer")
    if args.stage_layers is not None:
        try:  # the division the ranks will make, made once here
            layer_ranges(args.n_layers, n_stages, args.stage_layers)
        except ValueError:
            parser.error(f"--stage_layers {' '.join(map(str, args.stage_layers))}: {args.schedule} "
                         f"{on} makes {n_stages} stages; give {n_stages} counts of at least 1 "
                         f"adding up to --n_layers {args.n_layers}")
    problem = schedule_problem(args.schedule, pp_size, args.n_microbatches)
    if problem:
        parser.error(f"{args.schedule} cannot run --n_microbatches {args.n_microbatches} "
                     f"{on}: {problem}")
    if args.trace is not None and os.path.exists(args.trace) and not os.path.isdir(args.trace):
        parser.error(f"--trace {args.trace} is a file, not a directory")
    check_checkpoint_args(parser, args)
    distkit.check_placements(parser, args, placement)


def placement(worker: distkit.Worker, args: argparse.Namespace) -> distkit.Placement:
    """Every rank a GPU of its own and NCCL, or every rank of the machine on the CPU with
    gloo (what ``parallel.init_distributed`` picks in the worker)."""
    return distkit.group_placement(args.device, worker.local_rank, worker.local_world_size)


def check_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve --resume to one complete, compatible checkpoint (args.resume_path) or None."""
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint_every must be at least 0, got {args.checkpoint_every}")
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint_every needs --checkpoint_dir")
    if args.resume == "latest" and not args.checkpoint_dir:
        parser.error("--resume without a PATH needs --checkpoint_dir")
    try:
        args.resume_path = checkpoint.resume_path(args.resume, args.checkpoint_dir,
                                                  model_args_from(args), args.optimizer,
                                                  data_settings_from(args))
    except ValueError as e:
        parser.error(str(e))


def model_args_from(args: argparse.Namespace) -> ModelArgs:
    return ModelArgs(args.dim, args.n_layers, args.n_heads, args.vocab_size, args.dropout)


def data_settings_from(args: argparse.Namespace) -> dict[str, int]:
    """The flags that, with the step, fix which batch comes next: saved in every checkpoint."""
    return {flag: getattr(args, flag) for flag in checkpoint.DATA_FLAGS}


def layout_from(args: argparse.Namespace, device: torch.device) -> str:
    """What fixes each rank's random draws (its stages, micro-batches, device): a resume in
    the same layout gets every rank's random state back, so its dropout masks too."""
    layers = f" stage_layers={','.join(map(str, args.stage_layers))}" if args.stage_layers else ""
    return (f"world_size={args.world_size} dp_size={args.dp_size} "
            f"schedule={args.schedule} split={args.split}{layers} "
            f"n_microbatches={args.n_microbatches} device={device.type}")


def build_rank(args: argparse.Namespace, env: DistEnv) -> PipelineRank:
    """This rank's stages, cut from the same seeded full model that every rank builds."""
    model_args = model_args_from(args)
    torch.manual_seed(args.seed)
    model = Transformer(model_args)
    if env.dp_rank:
        # the replicas' own dropout masks (they are equal on every rank of a replica, as
        # before; replica 0 keeps the masks a run without --dp_size draws)
        torch.manual_seed(args.seed + 1_000_003 * env.dp_rank)
    microbatch = (args.batch_size // (env.dp_size * args.n_microbatches), args.seq_len)
    return PipelineRank(model, model_args, env, args.schedule, args.split, args.n_microbatches,
                        microbatch, args.lr, args.optimizer, args.stage_layers)


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> dict:
    """Every rank trains its stages; the one with the last stage reports the losses."""
    pp = build_rank(args, init_distributed(args.device, args.dp_size))
    replica = f", replica {pp.dp_rank} of {pp.dp_size}" if pp.dp_size > 1 else ""
    log.info(f"stages {[s.stage_index for s in pp.stages]} of {pp.num_stages} "
             f"({args.schedule}, {args.split} split{replica}) on {pp.device}")
    parts = [(s.submod, opt) for s, opt in zip(pp.stages, pp.optimizers)]
    layout = layout_from(args, pp.device)
    first = 0
    # each rank (each restarted torchrun worker too) chose for itself: the same one?
    if checkpoint.same_on_every_rank(args.resume_path):
        # the step saved is also the data position: batch ``step`` is the next one to read
        first = checkpoint.load(args.resume_path, parts, layout)
        log.info(f"resumed from {args.resume_path} after step {first}")
    losses: list[float] = []
    # appended to, so that a resumed run goes on with the file of the run it resumes
    reports = pp.has_last and pp.dp_rank == 0  # one rank prints the batch's loss
    loss_log = open(args.loss_log, "a") if args.loss_log and reports else None
    tracer = PipelineTracer(dist.get_rank()) if args.trace else None
    start = time.perf_counter()
    for step in range(first, args.steps):
        x, y = synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, args.seed)
        with tracer.step(step) if tracer else contextlib.nullcontext():
            mb_losses = pp.forward_backward(x, y)
        pp.optimizer_step()
        if mb_losses is not None:
            # equal micro-batches: the mean of their mean losses (over the replicas, too)
            # is the batch's mean loss
            loss = distkit.check_finite(pp.batch_loss(mb_losses), f"step {step + 1}")
        if mb_losses is not None and reports:
            losses.append(loss)
            log.info(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}")
            if loss_log is not None:
                # one write of a whole line, flushed: a killed run leaves only whole lines
                loss_log.write(json.dumps({"step": step + 1, "loss": losses[-1]}) + "\n")
                loss_log.flush()
        done = step + 1
        if args.checkpoint_dir and (done == args.steps or
                                    args.checkpoint_every and done % args.checkpoint_every == 0):
            path = checkpoint.save(args.checkpoint_dir, done, parts, data_settings_from(args), layout)
            log.info(f"checkpoint {path} complete")
    seconds = time.perf_counter() - start
    if loss_log is not None:
        loss_log.close()
    # peak resident memory of this process (Linux reports KiB)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if tracer:
        tracer.finish(args.trace, args.schedule, args.n_microbatches)
    dist.destroy_process_group()
    summary = f"{args.steps - first} steps in {seconds:.1f} s, peak memory {peak_mb:.0f} MB"
    if losses:
        summary += f"; loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    log.info(summary)
    return {"losses": losses or None, "seconds": seconds, "peak_mb": peak_mb, "first_step": first}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    results = distkit.launch(run_worker, args)
    # judged on runs from step 0 only: what is left after a resume (a torchrun restart late in
    # the run) may be too few steps to fall, and a non-zero exit would make torchrun restart
    losses = [r["losses"] for r in results.values() if r and r["losses"] and r["first_step"] == 0]
    if losses and len(losses[0]) > 1 and not losses[0][-1] < losses[0][0]:
        print(f"The loss did not fall: {losses[0][0]:.4f} -> {losses[0][-1]:.4f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    distkit.exit_process(main())

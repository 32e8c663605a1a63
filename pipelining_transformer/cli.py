"""The extras' flags (``add_extra_args``); ``check_args``: one line and exit 2, before any process
starts, for what the ranks would fail on later; what the flags decide in a rank.
"""
from __future__ import annotations

import argparse

import torch

import distkit
from distkit.args import at_least, path
from distkit.schedules import SCHEDULES, num_stages_for, schedule_problem
from pipelining_transformer import checkpoint
from pipelining_transformer.layout import StageLayout, stage_bounds
from pipelining_transformer.main import placement
from pipelining_transformer.model import ModelArgs


def schedule_name(text: str) -> str:
    """Accept a schedule's short name in any case ("gpipe", "ScheduleGPipe")."""
    name = {n.lower(): n for n in SCHEDULES}.get(text.lower().removeprefix("schedule"))
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown schedule {text!r} (this PyTorch offers "
                                         f"{', '.join(SCHEDULES)})")
    return name


def layer_count(text: str) -> float | str:
    """One --stage_layers value: a count of layers in halves (5, 4.5, 0), or ``auto``."""
    if text == "auto":
        return text
    try:
        if (n := float(text)) >= 0 and (2 * n) % 1 == 0:  # not nan, nor inf
            return n
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"a layer count is a whole or half number (5, 4.5) or 'auto', "
                                     f"got {text!r}")


def resume_from(text: str) -> str:
    """--resume's value: ``latest`` (no PATH given: argparse hands its const through here too), or a
    directory that exists (what is in it, ``check_args`` checks)."""
    return text if text == "latest" else path("in_dir")(text)


def add_extra_args(parser: argparse.ArgumentParser) -> None:
    """The extras' flags, none of them on by default."""
    parser.add_argument("--stage_layers", type=layer_count, nargs="+", default=None, metavar="N",
                        help="layers of each stage (default: as even as can be); 4.5 3.5 cuts "
                             "layer 4 between its attention and feed-forward; 'auto' measures "
                             "and picks the split whose slowest stage is fastest (balance.py)")
    parser.add_argument("--dp_size", type=at_least(1), default=1, metavar="D",
                        help="pipeline replicas of world_size / D ranks, each training on 1/D "
                             "of every batch")
    parser.add_argument("--loss_log", type=path("out_file"), default=None, metavar="PATH",
                        help='append {"step": N, "loss": L} to PATH each step (full precision)')
    parser.add_argument("--trace", type=path("out_dir"), default=None, metavar="DIR",
                        help="write each rank's torch.profiler trace here, rank<r>.json (Chrome "
                             "trace events with the schedule's own spans; opens in Perfetto)")
    ckpt = parser.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    ckpt.add_argument("--checkpoint_dir", type=path("out_dir"), default=None, metavar="DIR",
                      help="save into DIR/step_<N>/ every --checkpoint_every steps and at the end")
    ckpt.add_argument("--checkpoint_every", type=at_least(0), default=0, metavar="K",
                      help="steps between checkpoints (0: only at the end)")
    ckpt.add_argument("--resume", type=resume_from, nargs="?", const="latest", default=None, metavar="PATH",
                      help="go on from checkpoint PATH, or (no PATH) from the newest complete "
                           "one in --checkpoint_dir; a fresh start if there is none")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check before launch; ``args.resume_path``: the checkpoint --resume resolves to, or None."""
    distkit.check_launch_args(parser, args, min_world_size=1)
    if args.world_size % args.dp_size:
        parser.error(f"--world_size {args.world_size} is not divisible by --dp_size {args.dp_size}")
    if args.batch_size % (args.dp_size * args.n_microbatches):  # each replica: equal micro-batches
        dp = f"--dp_size {args.dp_size} x " if args.dp_size > 1 else ""
        parser.error(f"--batch_size {args.batch_size} is not divisible by "
                     f"{dp}--n_microbatches {args.n_microbatches}")
    if args.dim % args.n_heads:
        parser.error(f"--dim {args.dim} is not divisible by --n_heads {args.n_heads}")
    pp_size = args.world_size // args.dp_size  # ranks per pipeline replica
    on = f"on {pp_size} ranks" + (f" per replica (--dp_size {args.dp_size})" if args.dp_size > 1 else "")
    n_stages = num_stages_for(args.schedule, pp_size)
    if n_stages > args.n_layers:
        parser.error(f"{args.schedule} {on} makes {n_stages} stages, "
                     f"more than --n_layers {args.n_layers}: each stage needs a layer")
    if args.stage_layers is not None and "auto" in args.stage_layers:
        if len(args.stage_layers) > 1:
            parser.error("--stage_layers auto takes no counts beside it")
        args.stage_layers = "auto"  # layout.stage_layout measures and chooses (balance.py)
    elif args.stage_layers is not None:
        try:  # the division the ranks will make, made once here
            stage_bounds(args.n_layers, n_stages, args.stage_layers)
        except ValueError:
            parser.error(f"--stage_layers {' '.join(f'{n:g}' for n in args.stage_layers)}: {args.schedule} "
                         f"{on} makes {n_stages} stages; give {n_stages} counts adding up to --n_layers "
                         f"{args.n_layers} (halves allowed), each at least 0.5, the last at least 0")
    if problem := schedule_problem(args.schedule, pp_size, args.n_microbatches):
        parser.error(f"{args.schedule} cannot run --n_microbatches {args.n_microbatches} {on}: {problem}")
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint_every needs --checkpoint_dir")
    if args.resume == "latest" and not args.checkpoint_dir:
        parser.error("--resume without a PATH needs --checkpoint_dir")
    # --resume: a complete checkpoint (latest_complete checks the newest) this run can go on from, or None
    latest = args.resume == "latest"
    path = checkpoint.latest_complete(args.checkpoint_dir) if latest else args.resume
    if path is not None:
        why = (None if latest else checkpoint.problem(path)) or checkpoint.incompatibility(
            path, model_args_from(args), args.optimizer, data_settings_from(args))
        if why:
            parser.error(f"cannot resume from {path}: {why}")
    args.resume_path = None if path is None else str(path)
    distkit.check_placements(parser, args, placement)


def model_args_from(args: argparse.Namespace) -> ModelArgs:
    return ModelArgs(args.dim, args.n_layers, args.n_heads, args.vocab_size, args.dropout)


def data_settings_from(args: argparse.Namespace) -> dict[str, int]:
    """The flags that, with the step, fix which batch comes next: saved in every checkpoint."""
    return {flag: getattr(args, flag) for flag in checkpoint.DATA_FLAGS}


def layout_from(args: argparse.Namespace, layout: StageLayout, device: torch.device) -> str:
    """What fixes each rank's random draws: a resume in the same layout gets its random state back."""
    layers = f" stage_layers={','.join(f'{n:g}' for n in layout.chosen)}" if layout.chosen else ""
    return (f"world_size={args.world_size} dp_size={args.dp_size} schedule={args.schedule} "
            f"split={args.split}{layers} n_microbatches={args.n_microbatches} device={device.type}")

"""The flags every example shares, and one-line refusals (exit 2) of bad input before launch: argparse
``type``s refuse a bad value at parse time, a path that cannot serve too, not after an hour of training."""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from .device import DEVICE_CHOICES, DeviceError, Placement
from .rank import under_torchrun


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except the unset ones (their help says what happens instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump) and exit with status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"formatter_class": _HelpFormatter, **kwargs})

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_launch_args(parser: argparse.ArgumentParser, world_size: int | None, rpc_timeout: float | None = None,
                    device: bool = True, hang_timeout: float | str = 120) -> None:
    """The launch flags. ``world_size=None``: torchrun or --world_size decides; ``rpc_timeout`` (RPC
    examples): no RPC waits longer for a gone peer; ``device=False``: CPU only, no --device flag;
    ``hang_timeout`` a text: the default is None, and the text says how the example's check_args sets it."""
    g = parser.add_argument_group("launch")
    derived = isinstance(hang_timeout, str)
    g.add_argument("--hang_timeout", type=seconds, default=None if derived else hang_timeout, metavar="S",
                   help="end the job, with its stacks, when a rank has made no progress "
                        "(a module's forward, an optimizer step) for S seconds; 0: never"
                        + (f" (default: {hang_timeout})" if derived else ""))
    if rpc_timeout is not None:
        g.add_argument("--rpc_timeout", type=positive, default=rpc_timeout,
                       help="seconds an RPC may take before it fails")
    g.add_argument("--world_size", type=int, default=None,
                   help=f"number of processes in the job (default: {world_size or 'required'}; "
                        "under torchrun: torchrun's)")
    parser.set_defaults(default_world_size=world_size)  # torchrun's WORLD_SIZE wins over it, not the flag
    if device:
        g.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                       help="auto uses CUDA where enough GPUs are visible, else the CPU; a process group, "
                            "where the example forms one, uses NCCL on CUDA and gloo on the CPU")
    else:
        parser.set_defaults(device="cpu")
    g.add_argument("--threads", type=at_least(1), default=None,
                   help="intra-op threads per process (default: this machine's cores / its processes)")


def check_launch_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      min_world_size: int = 1, max_world_size: int | None = None) -> None:
    """Reject bad launch flags with a one-line error before any process starts."""
    if problem := srun_problem(os.path.relpath(sys.argv[0])):
        parser.error(problem)
    if under_torchrun():
        env_size = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, env_size):
            parser.error(f"--world_size {args.world_size} disagrees with torchrun's WORLD_SIZE={env_size}")
        args.world_size = env_size
    if args.world_size is None:
        args.world_size = getattr(args, "default_world_size", None)
    if args.world_size is None:
        parser.error("--world_size is required")
    if args.world_size < min_world_size:
        parser.error(f"--world_size must be at least {min_world_size}, got {args.world_size}")
    if max_world_size is not None and args.world_size > max_world_size:
        parser.error(f"--world_size must be at most {max_world_size}, got {args.world_size}")


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)``, refused if not ``ok`` ("argument --lr: must be a positive ...")."""
    def parse(text: str) -> Any:
        if not ok(value := convert(text)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = convert.__name__  # what argparse's "invalid ... value" names
    return parse


def at_least(low: int) -> Callable[[str], int]:
    return _checked(int, lambda v: v >= low, f"at least {low}")


def up_to(high: float) -> Callable[[str], float]:
    return _checked(float, lambda v: 0 < v <= high, f"in (0, {high:g}]")


positive = _checked(float, lambda v: 0 < v < math.inf, "a positive number")  # nan or inf: an unbounded wait
probability = _checked(float, lambda v: 0 <= v < 1, "in [0, 1)")
seconds = _checked(float, lambda v: 0 <= v < math.inf, "0 (never) or a positive number")


def path(kind: str) -> Callable[[str], str]:
    """A path flag's ``type``: refused unless the path can serve as ``kind`` (``path_problem``)."""
    def parse(text: str) -> str:
        if problem := path_problem(text, kind):
            raise argparse.ArgumentTypeError(f"{text}: {problem}")
        return text

    parse.__name__ = "path"
    return parse


def check_finite(loss: float, where: str) -> float:
    """``loss`` if finite, else FloatingPointError: training on from a nan loss prints nan and exits 0."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} at {where}: training diverged "
                                 "(try a lower --lr or other sizes)")
    return loss


def check_placements(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     placement: Callable[[int, argparse.Namespace], Placement]) -> None:
    """``placement(rank, args)`` of every rank this process starts (under torchrun: its own), before
    any starts: a device this machine cannot give is one line and exit 2, as a bad flag is."""
    ranks = [int(os.environ["RANK"])] if under_torchrun() else range(args.world_size)
    for rank in ranks:
        try:
            placement(rank, args)
        except DeviceError as e:
            parser.error(str(e))


def srun_problem(script: str) -> str | None:
    """Why this process, one of an ``srun`` step's several tasks outside torchrun, cannot run ``script``
    (each would be a whole job of its own), with the command that works; None elsewhere (``srun -n 1``,
    an sbatch script's own shell: its SLURM_NTASKS is no step's)."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if under_torchrun() or tasks == "1":
        return None
    return (f"srun started {tasks} tasks of {script} (SLURM_STEP_NUM_TASKS={tasks}), and each would run a job of its "
            f"own: start one torchrun per node instead, `srun --ntasks-per-node 1 .venv/bin/torchrun --nnodes "
            f"$SLURM_NNODES --nproc_per_node N --rdzv_backend c10d --rdzv_endpoint FIRST_NODE:PORT {script}`, "
            f"as scripts/slurm/train.sbatch does (docs/multi_host.md)")


def path_problem(path: str, kind: str) -> str | None:
    """Why ``path`` cannot serve as ``kind``, or None: read (``in_file``, ``in_dir``), or made and written
    (``out_dir``, ``out_file``), which the nearest directory that exists must allow: a file is made and
    removed there (root passes ``os.access``; a read-only mount shows only then)."""
    want_dir = kind.endswith("dir")
    if os.path.exists(path) and os.path.isdir(path) != want_dir:
        return "is a file, not a directory" if want_dir else "is a directory, not a file"
    if kind.startswith("in"):
        if not os.path.exists(path):
            return "no such " + ("directory" if want_dir else "file")
        return None if os.access(path, os.R_OK) else "cannot be read"
    nearest = os.path.abspath(path if want_dir else os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        return f"{nearest} is a file, not a directory"
    try:  # an existing file is opened to append (a device too: /dev/full), a new one made in its directory
        if not want_dir and os.path.exists(path):
            open(path, "a").close()
        else:
            tempfile.NamedTemporaryFile(dir=nearest, prefix=".write-check-").close()
    except OSError as e:
        return f"cannot write in {nearest} ({e.strerror})"
    return None

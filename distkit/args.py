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
from .launch import local_workers, parse_ranks
from .worker import Worker
from .rendezvous import is_loopback, srun_problem, under_torchrun


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
                   help="end the job, with every rank's stack, when no rank has made progress "
                        "(a module's forward, an optimizer step) for S seconds; 0: never"
                        + (f" (default: {hang_timeout})" if derived else ""))
    if rpc_timeout is not None:
        g.add_argument("--rpc_timeout", type=positive, default=rpc_timeout,
                       help="seconds an RPC may take before it fails")
    g.add_argument("--world_size", type=int, default=None,
                   help=f"number of processes in the job (default: {world_size or 'required'}; "
                        "under torchrun: torchrun's)")
    parser.set_defaults(default_world_size=world_size)  # torchrun's WORLD_SIZE wins over it, not the flag
    g.add_argument("--master_addr", default=None,
                   help="address of the machine running rank 0 (default: 127.0.0.1, this machine)")
    g.add_argument("--master_port", type=port, default=None,
                   help="rendezvous port on the master (default: a free one chosen by the OS)")
    g.add_argument("--ranks", default=None, metavar="A-B",
                   help="ranks this machine runs, for a run over several machines (default: all)")
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
    try:
        ranks = parse_ranks(args.ranks, args.world_size)
    except ValueError as e:
        parser.error(str(e))
    if len(ranks) < args.world_size:  # ranks on other machines
        if args.master_addr is None or (0 not in ranks and args.master_port is None):
            parser.error("a job over several machines (--ranks) needs --master_addr, the address of the "
                         "machine that runs rank 0, and on the other machines --master_port")
        if is_loopback(args.master_addr):  # Debian names its own host 127.0.1.1 in /etc/hosts
            parser.error(f"--master_addr {args.master_addr} resolves to a loopback address, which the other "
                         f"machines cannot reach: give rank 0's machine's address on the network")


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
port = _checked(int, lambda v: 0 < v < 65536, "in 1..65535")
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
                     placement: Callable[[Worker, argparse.Namespace], Placement]) -> None:
    """``placement(worker, args)`` of every local process before any starts: a refusal is exit 2."""
    for worker in local_workers(args):
        try:
            placement(worker, args)
        except DeviceError as e:
            parser.error(str(e))


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

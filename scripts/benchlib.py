"""What every benchmark script shares: its flags, a machine header, a table, a plot, the check of its counts.

Every benchmark imports it first: it puts the repo root (distkit, the examples) on ``sys.path``.
Benchmarks print; tests never time anything: ``main(argv)`` returns the table rows for the
tests to check. Bad input is refused in one line before anything runs, as the examples do
(``distkit.ArgumentParser``, ``check_at_least``, the example's own ``check_args``).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402
from distkit.args import at_least, path  # noqa: E402


def bench_parser(doc: str, plot: str, seed: int = 0,
                 quick: str = "a smaller run: about a minute on 2 cores") -> argparse.ArgumentParser:
    """The flags every benchmark has; its description: the first line of its docstring ``doc``."""
    p = distkit.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--seed", type=at_least(0), default=seed)
    p.add_argument("--plot", type=path("out_file"), default=None, metavar="PATH", help=f"write {plot} here (PNG)")
    return p


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed (a --plot that cannot be written and a negative --seed are refused by their types)."""
    return parser.parse_args(argv)


def example_args(parser: argparse.ArgumentParser, example: ModuleType, argv: list[str]) -> argparse.Namespace:
    """One run's flags for ``example``, checked by its own ``check_args`` (its one line under ``parser``)."""
    args = example.build_parser().parse_args(argv)
    example.check_args(parser, args)
    return args


def check_at_least(parser: argparse.ArgumentParser, minimum: int,
                   values: dict[str, int | Sequence[int] | None]) -> None:
    """``parser.error`` unless every value of each flag is at least ``minimum`` (None: not given)."""
    for flag, value in values.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v < minimum:
                parser.error(f"{flag} must be at least {minimum}, got {v}")


def wrap_schedule_steps(wrap) -> None:
    """``cls.step = wrap(cls.step)`` on each class that defines the ``step`` of a pipelining schedule, once."""
    from distkit.schedules import SCHEDULES

    for cls in {next(c for c in cls.__mro__ if "step" in vars(c)) for cls in SCHEDULES.values()}:
        cls.step = wrap(cls.step)


def describe_machine(processes: int, threads: int | None = None) -> str:
    """One paragraph on what the numbers below were measured on."""
    threads = threads or distkit.threads_per_process(processes)
    gpus = distkit.gpu_count()
    gpu = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "no GPU"
    return (f"# machine: {platform.machine()}, {os.cpu_count()} CPU cores, {gpu}; "
            f"torch {torch.__version__}, Python {platform.python_version()}\n"
            f"# {processes} processes, {threads} intra-op thread(s) each")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def format_table(header: Sequence[str], rows: Sequence[dict]) -> str:
    """A plain-text table with the columns of ``header``, floats to 3 significant digits."""
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    body = [[cell(r.get(h, "")) for h in header] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def save_plot(path: str | None, draw, ncols: int = 1, figsize: tuple[float, float] = (7, 4.5)) -> None:
    """Call ``draw(ax)`` (the axes if ``ncols`` > 1) on a fresh figure and write it to ``path`` as PNG."""
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, ncols, figsize=figsize)
    draw(ax)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# plot written to {path}")

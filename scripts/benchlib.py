"""What every benchmark script shares: a machine header, a table, a plot, the check of its counts.

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
from collections.abc import Sequence
from pathlib import Path

import torch

import distkit


def check_at_least(parser: argparse.ArgumentParser, minimum: int,
                   values: dict[str, int | Sequence[int] | None]) -> None:
    """``parser.error`` unless every value of each flag is at least ``minimum`` (None: not given)."""
    for flag, value in values.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v < minimum:
                parser.error(f"{flag} must be at least {minimum}, got {v}")


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

"""What every benchmark script shares: a machine header, a table, an optional plot, and
the check of its counts.

Benchmarks print; tests never time anything. Each script's ``main(argv)`` returns its
table rows so the test suite can run it once on a tiny configuration and check the table.

Every benchmark refuses bad input as the examples do, and before anything runs: its parser
is ``distkit.ArgumentParser`` (one line, exit status 2), ``check_at_least`` checks its own
counts, and every configuration it will run is parsed and checked up front by the example's
own ``build_parser`` and ``check_args`` (tests/test_bench_flags.py).
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
    """``parser.error`` (one line, exit 2) unless each flag's value, or every one of its
    values, is at least ``minimum``; None: the flag was not given and its default holds."""
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


def save_plot(path: str | None, draw) -> None:
    """Call ``draw(ax)`` on a fresh matplotlib figure and write it to ``path`` as PNG."""
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# plot written to {path}")

"""``--trace DIR``: torch.profiler's Chrome trace of each rank (opens in Perfetto). RPC shards compute
on the agent's threads, which it records only with a private option, named only here (torch 2.10 to
2.14): ``test_the_profiler_records_every_thread`` fails when torch renames it."""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def profiled(directory: str | None, name: str) -> Iterator[None]:
    """Profile this process, every thread, inside; then write ``DIRECTORY/NAME.json`` (None: nothing)."""
    if directory is None:
        yield
        return
    from torch.profiler import _ExperimentalConfig  # private: see above
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, experimental_config=every_thread) as prof:
        yield
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    logging.getLogger("distkit").info(f"torch.profiler trace written to {path}")


def traced(fn: Callable[[Any, argparse.Namespace], Any], directory: str | None) -> Callable[..., Any]:
    """``fn(worker, args)``, a rank's function, profiled whole from outside it (``Job(args, trace=DIR)``)."""
    return fn if directory is None else functools.partial(_traced, fn, directory)


def _traced(fn: Callable[[Any, argparse.Namespace], Any], directory: str, worker: Any,
            args: argparse.Namespace) -> Any:
    with profiled(directory, f"rank{worker.rank}"):
        return fn(worker, args)

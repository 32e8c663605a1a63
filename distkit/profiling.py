"""``--trace DIR``: torch.profiler's Chrome trace of each rank (opens in Perfetto), from ``start_rank``
to the rank's end. RPC shards compute on the agent's threads, which it records only with a private
option, named only here (torch 2.10 to 2.14): ``test_the_profiler_records_every_thread`` fails when
torch renames it."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def _profiler() -> profile:
    from torch.profiler import _ExperimentalConfig  # private: see above
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities, experimental_config=every_thread)


def start_trace(directory: str, name: str) -> Callable[[], None]:
    """Profile this process, every thread, from now; the function returned stops it and writes
    ``DIRECTORY/NAME.json``."""
    prof = _profiler()
    prof.start()

    def stop() -> None:
        prof.stop()
        path = Path(directory) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        logging.getLogger("distkit").info(f"torch.profiler trace written to {path}")

    return stop


@contextlib.contextmanager
def profiled(directory: str | None, name: str) -> Iterator[None]:
    """Profile this process, every thread, inside; then write ``DIRECTORY/NAME.json`` (None: nothing)."""
    if directory is None:
        yield
        return
    stop = start_trace(directory, name)
    try:
        yield
    finally:
        stop()

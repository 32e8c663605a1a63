"""``--trace DIR``: torch.profiler's Chrome trace of each rank (opens in Perfetto).

What a schedule of torch.distributed.pipelining does appears under the spans it records
(``Forward i``/``Backward i`` in ``ScheduleGPipe``, one per action in the action-list
schedules); RPC shards compute on the RPC agent's threads. The profiler records only the
thread that starts it unless asked for every thread, and that option is private:
``_ExperimentalConfig(profile_all_threads=True)`` (torch 2.10 to 2.14). This module is the one
place it is named; ``test_the_profiler_records_every_thread`` fails when torch renames it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def every_thread() -> object:
    """The profiler's option to record every thread of the process (private: see above)."""
    from torch.profiler import _ExperimentalConfig

    return _ExperimentalConfig(profile_all_threads=True)


@contextlib.contextmanager
def profiled(directory: str | None, name: str) -> Iterator[None]:
    """Profile this process, every thread, inside; then write ``DIRECTORY/NAME.json``.
    Nothing at all when ``directory`` is None (no --trace)."""
    if directory is None:
        yield
        return
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, experimental_config=every_thread()) as prof:
        yield
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))

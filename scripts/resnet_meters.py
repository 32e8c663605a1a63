"""The benchmark's meters for rpc_pipeline_resnet, attached to the examples from outside.

``Meter`` (main.py) and ``StageMeter`` (pipelining.py) join the examples' ``on_batch``: wall
and CPU seconds per batch, peak memory. ``steady_malloc``: else glibc returns freed tensors to
the kernel and the next batch page-faults again (docs/rpc_pipeline_resnet_benchmark.md, "Why the first run was slow").
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.distributed.rpc as rpc

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def steady_malloc() -> bool:
    """Early in every process: glibc keeps freed memory (one arena, no mmap, no trim); False: not glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


def peak_memory_mb() -> float:
    """Peak resident MB so far: VmHWM, since ``ru_maxrss`` carries over the forking launcher's."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_stats() -> dict:
    """This process's CPU seconds (all threads) and peak memory (MB) so far."""
    return {"cpu": time.process_time(), "peak_mb": peak_memory_mb()}


@dataclass
class BatchLog:
    """Per batch: seconds, CPU seconds (all processes, and the last two: the shards), peak memory."""

    warmup: int
    batch_times: list[float] = field(default_factory=list)
    batch_cpu: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=lambda: [0.0, 0.0])
    peak_mb: list[float] = field(default_factory=list)

    def add(self, i: int, seconds: float, before: list[dict], after: list[dict]) -> None:
        self.peak_mb = [a["peak_mb"] for a in after]
        if i < self.warmup:
            return
        self.batch_times.append(seconds)
        self.batch_cpu.append(sum(a["cpu"] - b["cpu"] for b, a in zip(before, after)))
        self.cpu_times = [t + a["cpu"] - b["cpu"]
                          for t, b, a in zip(self.cpu_times, before[-2:], after[-2:])]

    def result(self, losses: list[float]) -> dict:
        return {"losses": losses, "batch_times": self.batch_times, "batch_cpu": self.batch_cpu,
                "cpu_times": self.cpu_times, "peak_mb": self.peak_mb}


class Meter(BatchLog):
    """main.py's ``on_batch`` on the master: all three processes' CPU seconds, read over RPC."""

    @staticmethod
    def _all_stats(model) -> list[dict]:
        futures = [rpc.rpc_async(r.owner(), process_stats) for r in (model.p1_rref, model.p2_rref)]
        return [process_stats(), *(f.wait() for f in futures)]

    @contextlib.contextmanager
    def __call__(self, model, i: int) -> Iterator[None]:
        # the wall clock encloses both CPU readings: every CPU second counted falls inside it
        tik = time.perf_counter()
        before = self._all_stats(model)
        yield
        after = self._all_stats(model)
        self.add(i, time.perf_counter() - tik, before, after)


def _gather(value: object) -> list:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class StageMeter(BatchLog):
    """pipelining.py's ``on_batch`` on every rank: barriers keep both ranks' CPU readings inside the wall clock."""

    @contextlib.contextmanager
    def __call__(self, stage, i: int) -> Iterator[None]:
        dist.barrier()  # the other rank has finished the previous batch's bookkeeping
        tik = time.perf_counter()
        dist.barrier()
        before = process_stats()
        yield
        after = process_stats()
        dist.barrier()
        seconds = time.perf_counter() - tik
        stats = _gather((before, after))  # outside the window
        self.add(i, seconds, [b for b, _ in stats], [a for _, a in stats])  # rank 0, rank 1

    def result(self, losses: list[float]) -> dict:
        """On every rank: the last stage's losses beside what was measured."""
        return super().result(next((x for x in _gather(losses) if x), []))

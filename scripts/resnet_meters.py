"""The benchmark's meters for rpc_pipeline_resnet, attached to the examples from outside.

bench_rpc_pipeline_resnet.py hands ``Meter`` to main.py's ``run_master`` and ``StageMeter`` to
pipelining.py's ``run_pipeline`` as part of their ``on_batch``. Around every batch after the
warm-up both read the wall clock and every process's CPU seconds; after the run, each
process's peak memory.

Steady memory makes the timings trustworthy. Measured on the 2-core reference machine
(docs/rpc_pipeline_resnet.md, "Why the first run was slow"): glibc's malloc hands the memory
of large freed tensors back to the kernel (``munmap`` of big blocks, trimming of the heap top)
and gives every new thread its own arena. The next batch then takes a page fault on every
4 KiB page it touches again, about 2 us each, and the RPC agent runs each request on one of
many pool threads, each with its own arena to fill. How much that costs depends on what ran
before. ``steady_malloc`` keeps the memory (one arena, no mmap, no trim).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.distributed.rpc as rpc

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def steady_malloc() -> bool:
    """Make glibc keep freed memory for reuse. Call early in every process; False elsewhere.

    One arena for all threads (memory freed by one RPC thread is reused by the next), no
    mmap for large blocks (they would be unmapped on free) and no trimming of the heap: after
    the first batch of the largest size no page is faulted in again.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


def cores() -> frozenset[int]:
    """The CPUs this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def peak_memory_mb() -> float:
    """This process's peak resident memory so far, MB (Linux's VmHWM: ``ru_maxrss`` would
    carry over the launcher's peak, since a spawned process is forked from it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_stats() -> dict:
    """This process's CPU seconds (all threads) and peak memory (MB) so far, and its host."""
    return {"cpu": time.process_time(), "peak_mb": peak_memory_mb(), "host": socket.gethostname()}


def classic_bound(m: int, stages: int = 2) -> float:
    """Speed-up of ``stages`` equal, strictly serial stages over m micro-batches: p m / (m + p - 1)."""
    return stages * m / (m + stages - 1)


@dataclass
class BatchLog:
    """What a meter keeps of every batch: its seconds and CPU seconds (all processes), each
    shard's CPU seconds (the last two processes hold the shards), every process's peak memory."""

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


class Meter:
    """main.py's ``run_master``'s ``on_batch`` (the master): the master's and both shard
    workers' CPU seconds, read over RPC as close to the batch's ends as RPC allows."""

    def __init__(self, warmup: int) -> None:
        self.log = BatchLog(warmup)

    @staticmethod
    def _all_stats(model) -> list[dict]:
        futures = [rpc.rpc_async(r.owner(), process_stats) for r in (model.p1_rref, model.p2_rref)]
        return [process_stats(), *(f.wait() for f in futures)]

    @contextlib.contextmanager
    def __call__(self, model, i: int) -> Iterator[None]:
        # the wall clock runs from before the CPU clocks are read to after they are read
        # again: every CPU second they count falls inside it
        tik = time.perf_counter()
        before = self._all_stats(model)
        yield
        after = self._all_stats(model)
        self.log.add(i, time.perf_counter() - tik, before, after)

    def result(self, losses: list[float]) -> dict:
        return self.log.result(losses)


def _gather(value: object) -> list:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class StageMeter:
    """pipelining.py's ``run_pipeline``'s ``on_batch``, on every rank: a batch's wall clock
    runs from before a barrier both ranks pass before reading their CPU clocks to after one
    both reach after reading them again (CPU seconds / cores <= wall holds, as for ``Meter``)."""

    def __init__(self, warmup: int) -> None:
        self.log = BatchLog(warmup)

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
        self.log.add(i, seconds, [b for b, _ in stats], [a for _, a in stats])  # rank 0, rank 1

    def result(self, losses: list[float]) -> dict:
        """On every rank: the last stage's losses beside what was measured."""
        return self.log.result(next((x for x in _gather(losses) if x), []))

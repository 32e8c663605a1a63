"""The benchmark's meters for rpc_pipeline_resnet, attached to the examples from outside.

``batch_windows`` patches names in an example's module for the length of one run, so that each of
its batches opens and closes a window: main.py's ``DistResNet50.forward`` opens it and its
``DistributedOptimizer.step`` closes it; pipelining.py's ``optim.SGD``, ``zero_grad`` opens it and
``step`` closes it. The example's functions stay the tutorial's. ``Meter`` (main.py) and
``StageMeter`` (pipelining.py) are such windows: wall and CPU seconds per batch, peak memory; the
pictures' batch marks (scripts/make_pictures.py) are another. ``steady_malloc``: else glibc
returns freed tensors to the kernel and the next batch page-faults again
(docs/rpc_pipeline_resnet_benchmark.md, "Benchmark").
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol
from unittest import mock

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


class Window(Protocol):
    """What ``batch_windows`` calls: ``start(model)`` as a batch begins (main.py's ``DistResNet50``;
    pipelining.py's SGD), ``end()`` once its optimizer has stepped."""

    def start(self, model: Any) -> None: ...

    def end(self) -> None: ...


@contextlib.contextmanager
def batch_windows(example: ModuleType, window: Window) -> Iterator[None]:
    """Inside: every batch of ``example``'s loop (main.py's ``run_master``, pipelining.py's
    ``run_pipeline``) is a window, from its forward (main.py; pipelining.py: ``opt.zero_grad()``)
    to the end of its ``opt.step``. In the process that runs the loop (pipelining.py: both ranks)."""
    if hasattr(example, "DistResNet50"):  # main.py: forward .. DistributedOptimizer.step(context_id)
        class WindowedDistResNet50(example.DistResNet50):
            def forward(self, xs):
                window.start(self)  # the model: a Meter reads the shards' processes through its RRefs
                return super().forward(xs)

        class WindowedDistributedOptimizer(example.DistributedOptimizer):
            def step(self, context_id: int) -> None:
                super().step(context_id)
                window.end()

        with mock.patch.multiple(example, DistResNet50=WindowedDistResNet50,
                                 DistributedOptimizer=WindowedDistributedOptimizer):
            yield
        return

    # pipelining.py: zero_grad .. step. StageMeter's barriers must come before schedule.step (inside a
    # stage's forward the other rank waits in its send or receive: a deadlock)
    class WindowedSGD(example.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            window.start(self)
            super().zero_grad(set_to_none)

        def step(self, closure=None):
            loss = super().step(closure)
            window.end()
            return loss

    with mock.patch.object(example.optim, "SGD", WindowedSGD):  # pipelining.py calls optim.SGD(...)
        yield


@dataclass
class BatchLog:
    """Per batch: seconds, CPU seconds (all processes, and the last two: the shards), peak memory; the
    first ``warmup`` batches are left out of all but the peak."""

    warmup: int
    batches: int = 0  # batches seen, the warm-up ones too
    batch_times: list[float] = field(default_factory=list)
    batch_cpu: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=lambda: [0.0, 0.0])
    peak_mb: list[float] = field(default_factory=list)

    def add(self, seconds: float, before: list[dict], after: list[dict]) -> None:
        self.batches += 1
        self.peak_mb = [a["peak_mb"] for a in after]
        if self.batches <= self.warmup:
            return
        self.batch_times.append(seconds)
        self.batch_cpu.append(sum(a["cpu"] - b["cpu"] for b, a in zip(before, after)))
        self.cpu_times = [t + a["cpu"] - b["cpu"]
                          for t, b, a in zip(self.cpu_times, before[-2:], after[-2:])]

    def result(self, losses: list[float]) -> dict:
        return {"losses": losses, "batch_times": self.batch_times, "batch_cpu": self.batch_cpu,
                "cpu_times": self.cpu_times, "peak_mb": self.peak_mb}


class Meter(BatchLog):
    """main.py's window on the master: all three processes' CPU seconds, read over RPC."""

    @staticmethod
    def _all_stats(model) -> list[dict]:
        futures = [rpc.rpc_async(r.owner(), process_stats) for r in (model.p1_rref, model.p2_rref)]
        return [process_stats(), *(f.wait() for f in futures)]

    def start(self, model) -> None:
        # the wall clock encloses both CPU readings: every CPU second counted falls inside it
        self._model, self._tik = model, time.perf_counter()
        self._before = self._all_stats(model)

    def end(self) -> None:
        after = self._all_stats(self._model)
        self.add(time.perf_counter() - self._tik, self._before, after)


def _gather(value: object) -> list:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class StageMeter(BatchLog):
    """pipelining.py's window on every rank: barriers keep both ranks' CPU readings inside the wall clock."""

    def start(self, _optimizer) -> None:
        dist.barrier()  # the other rank has finished the previous batch's bookkeeping
        self._tik = time.perf_counter()
        dist.barrier()
        self._before = process_stats()

    def end(self) -> None:
        after = process_stats()
        dist.barrier()
        seconds = time.perf_counter() - self._tik
        stats = _gather((self._before, after))  # outside the window
        self.add(seconds, [b for b, _ in stats], [a for _, a in stats])  # rank 0, rank 1

    def result(self, losses: list[float]) -> dict:
        """On every rank: the last stage's losses beside what was measured."""
        return super().result(next((x for x in _gather(losses) if x), []))

"""Measurement around the tutorial's loop: timings, CPU work, page faults, the machine's bound.

``Meter`` is what ``main.measured`` hands to ``run_master`` as ``on_batch``: it wraps every batch
with clocks and every process's CPU time and page faults (and, with ``--trace``, a
``trace.Tracer``), and ``Meter.result`` gathers them with the losses into one run's dict.
``print_report`` prints the table ``main`` shows.

Steady memory makes the timings trustworthy. Measured on the 2-core reference machine
(docs/rpc_pipeline_resnet.md, "Why the first run was slow"): glibc's malloc hands the memory of large freed tensors back to the kernel (``munmap`` of
big blocks, trimming of the heap top) and gives every new thread its own arena. The next
batch then takes a page fault on every 4 KiB page it touches again, about 2 us each, and
the RPC agent runs each request on one of many pool threads, each with its own arena to
fill. How much that costs depends on what ran before, which made the first run of a
``--splits`` list slow. ``steady_malloc`` keeps the memory (one arena, no mmap, no trim).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import hashlib
import logging
import os
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef

from distkit.timeline import clock

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def steady_malloc() -> bool:
    """Make glibc keep freed memory for reuse. Call early in every process; False elsewhere.

    One arena for all threads (memory freed by one RPC thread is reused by the next),
    no mmap for large blocks (they would be unmapped on free) and no trimming of the heap:
    after the first batch of the largest size no page is faulted in again. Memory stays
    at the peak the process has reached, which is what a training loop needs anyway.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
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
    """This process's peak resident memory so far, MB.

    Linux's VmHWM: ``ru_maxrss`` would carry over the launcher's peak, since a spawned
    process is forked from it before it executes Python anew (execve keeps ru_maxrss).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS


def process_stats() -> dict:
    """This process's CPU seconds (all threads), page faults and peak memory (MB) so far,
    and where it runs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu": time.process_time(), "faults": usage.ru_minflt + usage.ru_majflt,
            "peak_mb": peak_memory_mb(), "host": socket.gethostname(), "cores": sorted(cores())}


def batch_floor(before: list[dict], after: list[dict]) -> tuple[float, float, int]:
    """(CPU seconds, lower bound on wall seconds, page faults) between two process_stats lists.

    The processes of one host cannot use more CPU seconds than it has usable cores times
    the wall time, so the wall time was at least (their CPU seconds) / (their cores), per
    host; the bound is the largest over hosts. CPU time is all the bound sees: on a GPU it
    is true but loose.
    """
    per_host: dict[str, list] = {}
    cpu = faults = 0
    for b, a in zip(before, after):
        host = per_host.setdefault(a["host"], [0.0, set()])
        host[0] += a["cpu"] - b["cpu"]
        host[1] |= set(a["cores"])
        cpu += a["cpu"] - b["cpu"]
        faults += a["faults"] - b["faults"]
    return cpu, max(work / len(cpus) for work, cpus in per_host.values()), faults


def classic_bound(m: int, stages: int = 2) -> float:
    """Speed-up of ``stages`` equal, strictly serial stages over m micro-batches: p m / (m + p - 1)."""
    return stages * m / (m + stages - 1)


def state_digest(module: torch.nn.Module) -> str:
    """SHA-256 of a module's state (names and exact bytes): equal digests, equal weights."""
    h = hashlib.sha256()
    for name, value in module.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def report(runs: list[dict]) -> list[dict]:
    """Every speed-up beside its bounds; one row per run."""
    # the base: the run with the fewest splits (whatever the order of --splits)
    base = min(runs, key=lambda r: r["num_split"])
    # the machine's limit: no run can be faster than the base's CPU work spread over all
    # the cores (per host), T_base / floor_base. True as long as no run needs less CPU work
    # than the base; "work" shows it, and a speed-up above this bound says the base did
    # avoidable work (that is what the page faults of the first run did)
    bound = base["time"] / base["floor"]
    rows = []
    for run in runs:
        m, t, cpu = run["num_split"], run["time"], sum(run["batch_cpu"])
        speedup = base["time"] / t
        flags = []
        if speedup > bound:
            flags.append("ERROR: above bound")
        if run["floor"] > t:  # CPU seconds / cores > wall seconds: a clock is wrong
            flags.append("ERROR: busier than the cores")
        rows.append({"splits": m, "time": t, "speed-up": speedup, "bound": bound,
                     "classic": classic_bound(m) / classic_bound(base["num_split"]),
                     "busy": cpu / t, "work": cpu / sum(base["batch_cpu"]),
                     "cpu": run["cpu_times"], "faults": sum(run["faults"]) / len(run["faults"]),
                     "losses": run["losses"], "flag": " ".join(flags)})
    return rows


def _on_owner(model: nn.Module, fn, *args) -> list:
    """``fn(shard_rref, *args)`` run on each shard's worker, results in shard order."""
    futures = [rpc.rpc_async(r.owner(), fn, args=(r, *args)) for r in (model.p1_rref, model.p2_rref)]
    return [f.wait() for f in futures]


def _digest(shard_rref: RRef) -> str:
    return state_digest(shard_rref.local_value())


def _device(shard_rref: RRef) -> str:
    return str(shard_rref.local_value().device)


def _state_copy(shard_rref: RRef) -> dict[str, torch.Tensor]:
    """A CPU copy of the shard's weights and BatchNorm statistics."""
    return {k: v.detach().cpu().clone() for k, v in shard_rref.local_value().state_dict().items()}


def all_stats(model: nn.Module) -> list[dict]:
    """process_stats of the master and both shards' workers, read as close together as RPC allows."""
    futures = [rpc.rpc_async(r.owner(), process_stats) for r in (model.p1_rref, model.p2_rref)]
    return [process_stats(), *(f.wait() for f in futures)]


@dataclass
class BatchLog:
    """What a meter keeps of every batch (both engines': ``Meter``, ``stage_meter.StageMeter``).

    ``add`` takes the batch's window on the wall clock and ``process_stats`` of every process
    before and after it; the last two processes hold the shards. Batches before ``warmup``
    keep only their window and the peak memory.
    """

    warmup: int
    windows: list[tuple[float, float]] = field(default_factory=list)
    batch_times: list[float] = field(default_factory=list)
    batch_cpu: list[float] = field(default_factory=list)  # CPU seconds of every process
    floor_times: list[float] = field(default_factory=list)  # ... over the cores, per host
    faults: list[int] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=lambda: [0.0, 0.0])  # each shard's process
    peak_mb: list[float] = field(default_factory=list)  # every process's, so far

    def add(self, i: int, tik: float, tok: float, before: list[dict], after: list[dict]) -> None:
        self.windows.append((tik, tok))
        self.peak_mb = [a["peak_mb"] for a in after]
        if i < self.warmup:
            return
        self.batch_times.append(tok - tik)
        cpu, floor, n_faults = batch_floor(before, after)
        self.batch_cpu.append(cpu)
        self.floor_times.append(floor)
        self.faults.append(n_faults)
        self.cpu_times = [t + a["cpu"] - b["cpu"]
                          for t, b, a in zip(self.cpu_times, before[-2:], after[-2:])]

    def result(self, num_split: int, losses: list[float]) -> dict:
        """One run's losses beside its measurements (what ``print_report`` reads)."""
        return {"num_split": num_split, "time": sum(self.batch_times), "losses": losses,
                "batch_times": self.batch_times, "cpu_times": self.cpu_times,
                # measured CPU work and the wall time it needs at least
                "batch_cpu": self.batch_cpu, "floor": sum(self.floor_times), "faults": self.faults,
                "peak_mb": self.peak_mb, "windows": self.windows[self.warmup:]}


class Meter:
    """``run_master``'s ``on_batch``: measures every batch from outside the tutorial's loop.

    Before the first batch it reads the shards' devices and weight digests (``states``:
    also CPU copies of their weights, for the parity tests). Around every batch it reads
    the wall clock and all three processes' CPU seconds and page faults; batches before
    ``--warmup`` are run but not counted. ``tracer`` (a ``trace.Tracer``) records spans.
    """

    def __init__(self, args: argparse.Namespace, tracer=None, states: bool = False) -> None:
        self.warmup = args.warmup
        self.tracer, self.states = tracer, states
        self.model: nn.Module | None = None
        self.first: dict = {}
        self.log = BatchLog(args.warmup)

    @contextlib.contextmanager
    def __call__(self, model: nn.Module, i: int) -> Iterator[None]:
        if self.model is None:
            self.model = model
            self.first = {"devices": _on_owner(model, _device), "init_digests": _on_owner(model, _digest)}
            if self.states:
                self.first["before"] = _on_owner(model, _state_copy)
        timed = i >= self.warmup
        if not timed:
            log.info(f"batch {i} is a warm-up batch, not timed")
        # the wall clock runs from before the CPU clocks are read to after they are read
        # again: every CPU second they count falls inside it, so CPU / cores <= wall holds
        tik = clock()
        before = all_stats(model)
        with self.tracer.batch(model) if self.tracer else contextlib.nullcontext():
            yield
        after = all_stats(model)
        tok = clock()
        self.log.add(i, tik, tok, before, after)  # master, shard 1, shard 2

    def result(self, num_split: int, losses: list[float]) -> dict:
        """One run: its losses beside everything measured (what ``print_report`` reads)."""
        result = (self.log.result(num_split, losses)
                  | {"spans": self.tracer.spans(num_split) if self.tracer else []} | self.first)
        if self.states:
            result["after"] = _on_owner(self.model, _state_copy)
        return result


def print_report(args: argparse.Namespace, runs: list[dict],
                 holders: tuple[str, str] = ("worker1", "worker2")) -> None:
    """The table ``main`` prints: every run's speed-up beside its bounds, and its losses.
    ``holders``: who holds shard 1 and shard 2 (pipelining.py: rank 0 and rank 1)."""
    print(f"devices: {holders[0]} {runs[0]['devices'][0]}, {holders[1]} {runs[0]['devices'][1]}; batches of "
          f"{args.batch_size} x 3 x {args.image_size} x {args.image_size}; {args.num_batches} timed "
          f"after {args.warmup} warm-up")
    # speed-up over the fewest splits; bound: the machine's (the base's CPU work over the
    # cores); 2m/(m+1): two equal serial stages, which these shards are not (docs/);
    # busy = CPU seconds of every process / wall seconds (at most the cores);
    # work = CPU seconds / the base's; faults: page faults per batch, all processes
    print("splits  time (s)  speed-up  bound  2m/(m+1)  busy  work  shard CPU (s)  faults  "
          "loss of each batch")
    for r in report(runs):
        print(f"{r['splits']:6d}  {r['time']:8.2f}  {r['speed-up']:7.2f}x {r['bound']:5.2f}x "
              f"{r['classic']:8.2f}x  {r['busy']:4.2f}  {r['work']:4.2f}  "
              f"{r['cpu'][0]:6.2f} {r['cpu'][1]:6.2f}  {r['faults']:6.0f}  "
              f"{' '.join(f'{x:.4f}' for x in r['losses'])}{'  ' + r['flag'] if r['flag'] else ''}")

"""What makes the example's timings trustworthy: steady memory, CPU work, the machine's bound.

Measured on the 2-core reference machine (see the README, "Why the first run was slow"):
glibc's malloc hands the memory of large freed tensors back to the kernel (``munmap`` of
big blocks, trimming of the heap top) and gives every new thread its own arena. The next
batch then takes a page fault on every 4 KiB page it touches again, about 2 us each, and
the RPC agent runs each request on one of many pool threads, each with its own arena to
fill. How much that costs depends on what ran before, which made the first run of a
``--splits`` list slow. ``steady_malloc`` keeps the memory (one arena, no mmap, no trim).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import resource
import socket
import time

import torch

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


def process_stats() -> dict:
    """This process's CPU seconds (all threads) and page faults so far, and where it runs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu": time.process_time(), "faults": usage.ru_minflt + usage.ru_majflt,
            "host": socket.gethostname(), "cores": sorted(cores())}


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

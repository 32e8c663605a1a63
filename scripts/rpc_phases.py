"""What the RPC benchmarks share: phase clocks (bench_rpc_rnn, bench_ddp_rpc), the round trip (all three),
and the RPC version timed beside sharded.py (``--versus``).

``PhaseClock``: the same clock in the workers and around the local loop; ``summarize``, ``print_tables``
and ``plot`` compare the two runs.
"""
from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer
from torch.optim.optimizer import register_optimizer_step_post_hook

import distkit
from benchlib import format_table, median, save_plot

PHASES = ("forward", "backward", "step")


@dataclass
class PhaseClock:
    """Timestamps of one training loop: (backward start, end, step start, end) per iteration."""

    marks: list[tuple[float, float, float, float]] = field(default_factory=list)
    _backward: tuple[float, float] = (math.nan, math.nan)

    @contextmanager
    def backward(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._backward = (start, time.perf_counter())

    @contextmanager
    def step(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.marks.append((*self._backward, start, time.perf_counter()))

    def wrap_distributed(self) -> None:
        """Time ``dist_autograd.backward`` and ``DistributedOptimizer.step`` here; no example line changes."""
        backward, step = dist_autograd.backward, DistributedOptimizer.step

        def timed_backward(*args: Any, **kwargs: Any) -> None:
            with self.backward():
                backward(*args, **kwargs)

        def timed_step(opt: DistributedOptimizer, *args: Any, **kwargs: Any) -> None:
            with self.step():
                step(opt, *args, **kwargs)

        dist_autograd.backward = timed_backward
        DistributedOptimizer.step = timed_step  # type: ignore[method-assign]


def phase_seconds(marks: list[tuple[float, float, float, float]], warmup: int) -> dict[str, list[float]]:
    """Per-iteration seconds of each phase, for the iterations after the first ``warmup``."""
    out: dict[str, list[float]] = {p: [] for p in (*PHASES, "iteration")}
    for i in range(max(1, warmup), len(marks)):
        b0, b1, s0, s1 = marks[i]
        total = s1 - marks[i - 1][3]
        out["iteration"].append(total)
        out["backward"].append(b1 - b0)
        out["step"].append(s1 - s0)
        out["forward"].append(total - (b1 - b0) - (s1 - s0))
    return out


def saved_by(run: Callable[[int, argparse.Namespace], Any], rank: int, args: argparse.Namespace) -> Any:
    """In a rank: ``run(rank, args)`` (an example's ``run_worker``, which returns None), and what it left
    with ``distkit.save_result``, kept here: the caller's result for this rank holds it, not replaces it."""
    saved = []
    save = distkit.save_result
    distkit.save_result = lambda _, value: saved.append(value)
    try:
        returned = run(rank, args)
    finally:
        distkit.save_result = save
    return saved[-1] if saved else returned


def timed_run(run: Callable, rank: int, args: argparse.Namespace) -> dict:
    """Runs in every process of the job: the example's own ``run_worker``, with a clock on."""
    clock = PhaseClock()
    clock.wrap_distributed()
    return {"result": saved_by(run, rank, args), "marks": clock.marks}


def launch_timed(run: Callable, args: argparse.Namespace, warmup: int) -> list[dict[str, list[float]]]:
    """Run the example once; the phase times of every process that trained (one per trainer)."""
    out = distkit.launch(functools.partial(timed_run, run), args)
    return [phase_seconds(r["marks"], warmup) for _, r in sorted(out.items()) if r["marks"]]


def _noop() -> None:
    return None


def rtt_worker(rank: int, args: argparse.Namespace) -> list[float]:
    """Rank 0 times ``rpc_sync`` calls of a no-op on rank 1, over TCP only as rpc_rl does."""
    options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    times = []
    if rank == 0:
        for _ in range(20 + args.rtt_calls):  # the first 20 warm up: connections, thread pool
            start = time.perf_counter()
            rpc.rpc_sync("w1", _noop)
            times.append(time.perf_counter() - start)
    rpc.shutdown()
    return times[20:]


def rpc_round_trip(calls: int, end: str = "\n") -> float:
    """Median seconds of a no-op ``rpc_sync`` between two processes of this machine, printed."""
    args = argparse.Namespace(world_size=2, device="cpu", threads=None, rtt_calls=calls)
    rtt = median(distkit.launch(rtt_worker, args)[0])
    print(f"# RPC round trip (median of {calls} no-op rpc_sync): {rtt * 1e3:.3f} ms", end=end)
    return rtt


@contextmanager
def threads(n: int) -> Iterator[None]:
    """The local reference gets the intra-op threads each distributed process got."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def summarize(name: str, dist: list[dict[str, list[float]]], local: dict[str, list[float]],
              rtt: float, share: str = "rpc share") -> dict:
    """One table row: medians (pooled over trainers) beside the local reference's."""
    row: dict[str, Any] = {"config": name}
    for key in (*PHASES, "iteration"):
        row[f"{key} ms"] = 1e3 * median([t for d in dist for t in d[key]])
        row[f"local {key} ms"] = 1e3 * median(local[key])
    d, loc = row.pop("iteration ms"), row.pop("local iteration ms")
    row.update({"ms/it": d, "local ms/it": loc, "it/s": 1e3 / d, "local it/s": 1e3 / loc,
                share: (d - loc) / d, "RTTs/it": (d - loc) / (1e3 * rtt)})
    return row


def print_tables(rows: list[dict], extra: list[str], share: str) -> None:
    print(format_table(["config", *extra, "it/s", "local it/s", "ms/it", "local ms/it", share,
                        "RTTs/it"], rows))
    print("\n# median ms per phase, distributed (local): where the extra time goes")
    phase_rows = [{"config": r["config"], **{p: f"{r[f'{p} ms']:.3g} ({r[f'local {p} ms']:.3g})"
                                             for p in PHASES}} for r in rows]
    print(format_table(["config", *PHASES], phase_rows))


def plot(path: str | None, rows: list[dict], title: str, rest: str = "rpc") -> None:
    """One bar per configuration: each phase's local arithmetic (solid) and rest (hatched), in %."""
    def draw(ax):
        colors = dict(zip(PHASES, ("tab:blue", "tab:orange", "tab:green")))
        x = range(len(rows))
        bottom = [0.0] * len(rows)
        for p in PHASES:
            for part in ("compute", rest):
                heights = []
                for r in rows:
                    compute = min(r[f"local {p} ms"], r[f"{p} ms"])
                    heights.append(100 * (compute if part == "compute" else r[f"{p} ms"] - compute)
                                   / sum(r[f"{q} ms"] for q in PHASES))
                ax.bar(x, heights, bottom=bottom, color=colors[p], label=f"{p}: {part}",
                       alpha=1.0 if part == "compute" else 0.35,
                       hatch=None if part == "compute" else "//")
                bottom = [b + h for b, h in zip(bottom, heights)]
        for i, r in enumerate(rows):
            ax.text(i, 101, f"{r['it/s']:.3g} it/s", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), [r["config"] for r in rows])
        ax.set(ylim=(0, 112), ylabel="% of a distributed iteration", title=title)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))

    save_plot(path, draw)


# ---------------------------------------- --versus: the RPC version beside sharded.py, the same work

def rpc_step_ms(run: Callable, args: argparse.Namespace, warmup: int) -> tuple[float, dict]:
    """Median ms between ``DistributedOptimizer.step`` ends, all trainers; what each rank's ``run`` returned."""
    out = distkit.launch(functools.partial(timed_run, run), args)
    times = [t for r in out.values() if r["marks"] for t in phase_seconds(r["marks"], warmup)["iteration"]]
    return 1e3 * median(times), {rank: r["result"] for rank, r in out.items()}


def _step_ends(run: Callable, rank: int, args: argparse.Namespace) -> dict:
    """In every rank: ``run(rank, args)``, the end of each local optimizer step timed (a global hook)."""
    ends: list[float] = []
    handle = register_optimizer_step_post_hook(lambda *_: ends.append(time.perf_counter()))
    try:
        return {"result": saved_by(run, rank, args), "ends": ends}
    finally:
        handle.remove()


def step_ms(run: Callable, args: argparse.Namespace, warmup: int) -> tuple[float, dict]:
    """Median ms between optimizer step ends, every rank (each trains); what each rank's ``run`` returned."""
    out = distkit.launch(functools.partial(_step_ends, run), args)
    times = [b - a for r in out.values() for a, b in zip(r["ends"][warmup:], r["ends"][warmup + 1:])]
    return 1e3 * median(times), {rank: r["result"] for rank, r in out.items()}


def versus_row(config: str, version: str, ranks: int, ms: float, local_ms: float, bound: float) -> dict:
    """One version's row: ms per step beside one process doing the same work; a note above the speed-up's bound."""
    speedup = local_ms / ms
    return {"config": config, "version": version, "ranks": ranks, "ms/step": ms, "1 process ms/step": local_ms,
            "speed-up": speedup, "bound": bound, "note": "ABOVE ITS BOUND: a measurement bug" if speedup > bound else ""}


def print_versus(rows: list[dict], what: str) -> list[dict]:
    """The --versus table; its rows, each one's times checked finite."""
    print(f"# ms per step (median); 1 process: {what}; every process one thread")
    print(format_table(["config", "version", "ranks", "ms/step", "1 process ms/step", "speed-up", "bound", "note"],
                       rows))
    assert all(math.isfinite(r[k]) for r in rows for k in ("ms/step", "1 process ms/step"))
    return rows

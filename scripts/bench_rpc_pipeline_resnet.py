"""Benchmark rpc_pipeline_resnet's two engines: where pipelining pays, against true bounds.

Engines: ``rpc`` (main.py, 3 processes) and ``pipelining`` (pipelining.py, 2 ranks, per
schedule). Same seed everywhere, and every process keeps its freed memory (``steady_malloc``),
so no measurement depends on what ran before it. Usage, columns: docs/rpc_pipeline_resnet_benchmark.md#benchmark.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import time
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn as nn
import torch.optim as optim

from benchlib import (bench_parser, check_at_least, describe_machine, example_args, format_table, median, parse,
                      save_plot)
import distkit
import rpc_pipeline_resnet.pipelining as pp_example
from distkit.schedules import schedule_problem
from rpc_pipeline_resnet.model import ResNetShard1, ResNetShard2
from resnet_meters import Meter, StageMeter, batch_windows, steady_malloc

HEADER = ["engine", "procs", "image", "m", "GFLOP/mb", "s/batch", "floor", "x 1 split", "bound 1",
          "eff.", "model", "vs rpc", "user s", "x user", "bound", "seq s", "x seq", "bound ",
          "2m/(m+1)", "busy", "work", "CPU s/shard", "peak MB", "flag"]
NUMERIC = [h for h in HEADER if h not in ("engine", "procs", "CPU s/shard", "peak MB", "flag",
                                          "x 1 split", "bound 1", "vs rpc")]
ENGINES = {"rpc": ("rpc_pipeline_resnet.main", "run_master"),
           "pipelining": ("rpc_pipeline_resnet.pipelining", "run_pipeline")}


@dataclass
class Here:
    """Stands in for an RRef in one process: the shards' forward calls ``to_here()``."""

    value: torch.Tensor

    def to_here(self) -> torch.Tensor:
        return self.value


def reference(args: argparse.Namespace, size: int, m: int, threads: int, reps: int) -> dict:
    """Median wall and CPU seconds of a training step of both shards in this process."""
    torch.set_num_threads(threads)
    s1 = ResNetShard1("cpu", num_classes=args.num_classes, seed=args.seed)
    s2 = ResNetShard2("cpu", num_classes=args.num_classes, seed=args.seed + 1)
    opt = optim.SGD([*s1.parameters(), *s2.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(args.seed)
    labels = torch.zeros(args.batch_size, args.num_classes).scatter_(
        1, torch.randint(0, args.num_classes, (args.batch_size, 1), generator=gen), 1)
    walls, cpus = [], []
    for i in range(reps + 1):  # the first warms up (memory, oneDNN primitives)
        inputs = torch.randn(args.batch_size, 3, size, size, generator=gen)
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = torch.cat([s2(Here(s1(Here(x)))) for x in inputs.tensor_split(m)])
        nn.MSELoss()(outputs, labels).backward()
        opt.step()
        opt.zero_grad()
        if i:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return {"wall": median(walls), "cpu": median(cpus)}


def gflop_per_image(size: int, num_classes: int) -> float:
    """GFLOP of one image through both shards: convolutions and fc, 2 x MACs forward, twice that back."""
    flops = []

    def count(module: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
        else:
            k = module.in_features
        flops.append(2 * out.numel() * k)

    s1, s2 = ResNetShard1("cpu", num_classes=num_classes), ResNetShard2("cpu", num_classes=num_classes)
    hooks = [m.register_forward_hook(count) for s in (s1, s2) for m in s.modules()
             if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        s2(Here(s1(Here(torch.randn(2, 3, size, size)))))  # 2 images: BatchNorm needs two values
    for h in hooks:
        h.remove()
    return 3 * sum(flops) / 2 / 1e9


def bench_worker(engine: str, configs: list[tuple[int, int]], warmup: int, rank: int,
                 args: argparse.Namespace) -> list[dict]:
    """Every rank: the engine's ``run_worker``, run i on configuration i, our meter on each batch (its
    model and optimizer, patched in: ``batch_windows``), the first ``warmup`` batches of a run left out.
    What it returns replaces, in ``distkit.launch``'s answer, the runs ``run_worker`` saved."""
    steady_malloc()  # every process of the job keeps its memory: see resnet_meters.py
    module_name, loop_name = ENGINES[engine]
    module = importlib.import_module(module_name)
    loop = getattr(module, loop_name)
    runs, measured = iter(configs), []

    def run_config(num_split: int, args: argparse.Namespace, *rest) -> list[float]:
        size, m = next(runs)
        assert m == num_split, (m, num_split)
        meter = (Meter if engine == "rpc" else StageMeter)(warmup)
        with batch_windows(module, meter):
            losses = loop(m, argparse.Namespace(**{**vars(args), "image_size": size}), *rest)
        measured.append(meter.result(losses))
        return losses

    setattr(module, loop_name, run_config)
    module.run_worker(rank, args)
    return measured


def summarize(jobs: list[tuple[str, int, list, list]], refs: dict, users: dict, gflops: dict,
              args: argparse.Namespace) -> list[dict]:
    """One row per (job, configuration); ``jobs``: (engine label, processes, configs, runs)."""
    rows = []
    n_cores = distkit.threads_per_process(1)  # the cores this process may run on
    times = {(label, c): median(run["batch_times"]) for label, _, cfgs, runs in jobs
             for c, run in zip(cfgs, runs)}
    for label, procs, cfgs, runs in jobs:
        for (size, m), run in zip(cfgs, runs):
            ref = refs[size, m]
            t = times[label, (size, m)]
            w = median(run["batch_cpu"])
            user, floor = users[size]["wall"], ref["cpu"] / n_cores
            # 1F1B cannot run one micro-batch: its base is GPipe's (one micro-batch, the same order)
            base = times.get((label.replace("1F1B", "GPipe"), (size, 1)))
            rpc = times.get(("rpc", (size, m)))
            shard_cpu = [c / args.num_batches for c in run["cpu_times"][-2:]]
            row = {"engine": label, "procs": procs, "image": size, "m": m,
                   "GFLOP/mb": gflops[size] * math.ceil(args.batch_size / m), "s/batch": t,
                   "floor": floor, "user s": user, "x user": user / t, "bound": user / floor,
                   "seq s": ref["wall"], "x seq": ref["wall"] / t, "bound ": ref["wall"] / floor,
                   "2m/(m+1)": 2 * m / (m + 1), "eff.": floor / t, "busy": w / t,
                   "work": w / ref["cpu"], "losses": run["losses"], "batch_times": run["batch_times"],
                   "CPU s/shard": "/".join(f"{c:.2f}" for c in shard_cpu), "shard cpu": shard_cpu,
                   "peak MB": "/".join(f"{p:.0f}" for p in run["peak_mb"]),
                   # two one-core stages, shard CPU seconds A <= B: B plus one micro-batch of A (fill, drain)
                   "model": floor / (max(shard_cpu) + min(shard_cpu) / m)}
            if base is not None:
                row["x 1 split"], row["bound 1"] = base / t, base / floor
            if rpc is not None and label != "rpc":
                row["vs rpc"] = rpc / t
            row["flag"] = " ".join(f"ERROR: {k} above its bound" for k, b in
                                   (("x user", "bound"), ("x seq", "bound "), ("x 1 split", "bound 1"))
                                   if k in row and row[k] > row[b])
            rows.append(row)
    return rows


def plot(path: str | None, rows: list[dict], sweep_m: int, table_size: int) -> None:
    def draw(axes):
        import matplotlib.pyplot as plt
        ax1, ax2, ax3 = axes
        for i, engine in enumerate(dict.fromkeys(r["engine"] for r in rows)):
            c = plt.get_cmap("tab10")(i)
            sweep = sorted((r for r in rows if r["engine"] == engine and r["m"] == sweep_m),
                           key=lambda r: r["GFLOP/mb"])
            ax1.plot([r["GFLOP/mb"] for r in sweep], [100 * r["eff."] for r in sweep], "o-", color=c,
                     label=engine)
            for r in sweep:
                ax1.annotate(f"{r['image']}px", (r["GFLOP/mb"], 100 * r["eff."]), textcoords="offset points",
                             xytext=(0, 6), ha="center", fontsize=6, color=c)
            every = sorted((r for r in rows if r["engine"] == engine and r["image"] == table_size),
                           key=lambda r: r["m"])
            table = [r for r in every if "x 1 split" in r]
            ms = [r["m"] for r in table]
            ax2.plot(ms, [r["x 1 split"] for r in table], "o-", color=c, label=f"{engine}: speed-up")
            ax2.plot(ms, [r["bound 1"] for r in table], "s--", color=c, alpha=0.6,
                     label=f"{engine}: its bound")
            ax3.plot([r["m"] for r in every], [r["s/batch"] for r in every], "o-", color=c, label=engine)
        ax1.set(ylim=(0, 105), xscale="log", xlabel="work per micro-batch (GFLOP, forward + backward)",
                ylabel="% of the machine's bound (floor / s per batch)")
        ax1.set_title(f"{sweep_m} micro-batches: share of the bound reached", fontsize=9)
        for ax in (ax2, ax3):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"micro-batches ({table_size}x{table_size} images)")
        ax2.set(ylim=(0, None), ylabel="speed-up over 1 split")
        ax2.set_title("speed-up over 1 split beside its bound (1-split s / floor)", fontsize=9)
        ax3.set(ylim=(0, None), ylabel="seconds per batch")
        ax3.set_title("seconds per batch, both engines", fontsize=9)
        for ax in (ax1, ax2, ax3):
            ax.legend(fontsize=7)
        ax1.figure.suptitle("rpc_pipeline_resnet: RPC (3 processes) and torch.distributed.pipelining "
                            "(2 processes) on this machine", fontsize=10)

    save_plot(path, draw, ncols=3, figsize=(16, 4.8))


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, "the sweep and the split table", quick="a tiny smoke run (the test suite's)")
    p.add_argument("--sizes", type=int, nargs="+", default=None, metavar="PX",
                   help="image sizes of the sweep (default 32 64 96 128 160; quick 32 40)")
    p.add_argument("--sweep_splits", type=int, default=None,
                   help="micro-batches in the sweep (default 8; quick 2)")
    p.add_argument("--splits", type=int, nargs="+", default=None, metavar="N",
                   help="split table's micro-batch counts (default 1 2 4 8; quick 1 2)")
    p.add_argument("--table_size", type=int, default=None,
                   help="image size of the split table (default 128; quick 40)")
    p.add_argument("--batch_size", type=int, default=None, help="images per batch (default 16; quick 4)")
    p.add_argument("--num_batches", type=int, default=None, help="timed batches per run (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=1,
                   help="batches first in every run, which the meters leave out (set-up slows them)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed steps of each single-process reference (default 3; quick 1)")
    p.add_argument("--num_classes", type=int, default=None, help="default 1000 (quick 10)")
    p.add_argument("--user_threads", type=int, default=None,
                   help="threads of the 'user' reference (default: all cores)")
    p.add_argument("--engine", nargs="+", choices=tuple(ENGINES), default=list(ENGINES),
                   help="main.py's RPC pipeline, pipelining.py's torch.distributed.pipelining one, or both")
    p.add_argument("--schedules", nargs="+", choices=tuple(pp_example.SCHEDULES),
                   default=list(pp_example.SCHEDULES), help="the pipelining engine's schedules")
    p.add_argument("--pp_threads", type=int, nargs="+", default=None, metavar="T",
                   help="intra-op threads per pipelining rank, one job per value (default 1 2; "
                        "quick 1); above 1 the job runs with OMP_WAIT_POLICY=PASSIVE, so a rank "
                        "waiting for its neighbour leaves its core to it instead of spinning")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parse(parser, argv)
    for flag, quick, full in (("sizes", [32, 40], [32, 64, 96, 128, 160]), ("sweep_splits", 2, 8),
                              ("splits", [1, 2], [1, 2, 4, 8]), ("table_size", 40, 128),
                              ("batch_size", 4, 16), ("num_batches", 1, 3), ("reps", 1, 3),
                              ("num_classes", 10, 1000), ("pp_threads", [1], [1, 2])):
        if getattr(args, flag) is None:  # a flag the user gave wins over either default
            setattr(args, flag, quick if args.quick else full)
    # under this script's flag names (the example's check_args below would name its own)
    check_at_least(parser, 1, {f"--{flag}": getattr(args, flag) for flag in (
        "sizes", "sweep_splits", "table_size", "batch_size", "num_batches", "warmup", "reps", "num_classes",
        "user_threads", "pp_threads")})
    # smallest images first: a row's peak memory is its own unless a smaller one needed more
    configs = sorted({(s, args.sweep_splits) for s in args.sizes}
                     | {(args.table_size, m) for m in args.splits})
    # each run trains --warmup + --num_batches batches; the meters leave the first --warmup out
    base = ["--batch_size", str(args.batch_size), "--num_batches", str(args.warmup + args.num_batches),
            "--seed", str(args.seed), "--num_classes", str(args.num_classes), "--device", "cpu"]
    # every engine's job and the configurations it can run, checked by the example's check_args
    plans = []  # (label, engine, processes, extra flags, configs)
    if "rpc" in args.engine:
        plans.append(("rpc", "rpc", 3, [], configs))
    if "pipelining" in args.engine:
        for threads in args.pp_threads:
            for name in args.schedules:
                runnable = [c for c in configs if schedule_problem(name, 2, c[1]) is None]
                if not runnable:
                    parser.error(f"--schedules {name} can run none of the configurations "
                                 f"(micro-batches {sorted({m for _, m in configs})})")
                label = f"pp {name}" + (f" {threads}t" if threads > 1 else "")
                plans.append((label, "pipelining", 2, ["--world_size", "2", "--schedule", name,
                                                        "--threads", str(threads)], runnable))
    jobs = []
    for label, engine, procs, extra, cfgs in plans:
        module = importlib.import_module(ENGINES[engine][0])
        for size, m in cfgs:
            example_args(parser, module, [*base, *extra, "--image_size", str(size), "--splits", str(m)])
        job_args = example_args(parser, module, [*base, *extra, "--splits", str(cfgs[0][1])])
        job_args.splits = [m for _, m in cfgs]  # run i of the job is cfgs[i]
        jobs.append((label, engine, procs, cfgs, job_args))

    steady_malloc()  # the references too keep their memory: see resnet_meters.py
    user_threads = args.user_threads or distkit.threads_per_process(1)  # all cores
    print(describe_machine(3, distkit.threads_per_process(2)))
    print(f"# engines: {', '.join(f'{label} ({procs} processes)' for label, _, procs, _, _ in jobs)}; "
          f"references: 1 process with 1 thread (seq) and with {user_threads} threads (user); "
          f"batches of {args.batch_size} images, {args.num_classes} classes; {args.num_batches} "
          f"timed batches per run after {args.warmup} warm-up, {args.reps} timed steps per reference after 1")
    start = time.perf_counter()
    threads = torch.get_num_threads()
    sizes = sorted({s for s, _ in configs})
    gflops = {s: gflop_per_image(s, args.num_classes) for s in sizes}
    refs = {(s, m): reference(args, s, m, 1, args.reps) for s, m in configs}
    users = {s: reference(args, s, 1, user_threads, args.reps) for s in sizes}
    torch.set_num_threads(threads)
    # the jobs run after the references, one at a time: nothing of this benchmark runs beside one
    done = []
    for label, engine, procs, cfgs, job_args in jobs:
        # several threads per rank: passive OpenMP waits (read as torch loads, so set before the
        # spawn), or a waiting rank's threads spin on the shared cores
        passive = job_args.threads is not None and job_args.threads > 1
        with mock.patch.dict(os.environ, {"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}):
            runs = distkit.launch(functools.partial(bench_worker, engine, cfgs, args.warmup), job_args)[0]
        done.append((label, procs, cfgs, runs))
    rows = summarize(done, refs, users, gflops, args)
    print(format_table(HEADER, rows))
    print(f"# {time.perf_counter() - start:.0f} s")
    plot(args.plot, rows, args.sweep_splits, args.table_size)
    assert all(math.isfinite(r[k]) for r in rows for k in NUMERIC)
    return rows

if __name__ == "__main__":
    main()

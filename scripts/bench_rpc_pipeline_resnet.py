"""Benchmark rpc_pipeline_resnet: where pipelining pays on this machine, against true bounds.

    python scripts/bench_rpc_pipeline_resnet.py --quick                       # seconds: a smoke run
    python scripts/bench_rpc_pipeline_resnet.py --plot docs/results/rpc_pipeline_resnet.png
                                    # 8 min on the loaded 2-core machine; idle under 5 (estimate)

Configurations: a sweep over work per micro-batch (``--sizes``: image sizes at ``--sweep_splits``
micro-batches) and a split table (``--splits`` at ``--table_size``), batches of ``--batch_size``.
For each one:

  - s/batch   median wall seconds of one training batch of the example's own job
              (``rpc_pipeline_resnet.main.run_master``: master + two shard workers), after a
              warm-up batch; CPU work W (CPU seconds of all three processes) over the same batch
  - seq s     reference for the bound: the same micro-batches one after another through the
              same two shards in one process with one thread (forward, loss, backward, SGD);
              its CPU seconds W_seq are the arithmetic the batch needs
  - user s    what a user would otherwise run: one process, all cores, the whole batch at once
  - floor     the machine's limit, W_seq / cores: no schedule can finish the batch's arithmetic
              sooner on this machine (true while the pipeline needs at least W_seq of CPU:
              ``work`` = W / W_seq shows it)
  - x user, x seq   speed-ups over the two references; each is printed beside its bound,
              (reference seconds) / floor; one above its bound is flagged as an ERROR
  - 2m/(m+1)  the classic bound of two equal, strictly serial stages; not a bound here (a
              shard back-propagates several micro-batches at once), printed for comparison
  - eff.      floor / s/batch = (x seq) / (its bound): how close the pipeline gets to the machine
  - busy      W / s/batch, cores in use on average

Every model (pipeline and references) is built from the same seed; every process keeps its
freed memory (``steady_malloc``), so no measurement depends on what ran before it.
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.optim as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402
import rpc_pipeline_resnet.main as example  # noqa: E402
from benchlib import describe_machine, format_table, median  # noqa: E402
from rpc_pipeline_resnet.measure import classic_bound, cores, steady_malloc  # noqa: E402
from rpc_pipeline_resnet.model import ResNetShard1, ResNetShard2  # noqa: E402

HEADER = ["image", "m", "GFLOP/mb", "s/batch", "floor", "user s", "x user", "bound",
          "seq s", "x seq", "bound ", "2m/(m+1)", "eff.", "busy", "work", "flag"]


class Here:
    """Stands in for an RRef in one process: the shards' forward calls ``to_here()``."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

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
    """Forward + backward arithmetic of one image through both shards, in GFLOP.

    Convolutions and fc (all but a few % of ResNet50's arithmetic), counted with forward
    hooks: 2 x multiply-adds forward, twice that backward (input and weight gradients).
    """
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


def bench_worker(configs: list[tuple[int, int]], worker: distkit.Worker, args: argparse.Namespace):
    """Every rank: the example's ``run_worker``; the master's i-th run is configuration i
    (its ``run_master``, measured by its ``Meter``, with configuration i's image size;
    ``--splits`` already lists the configurations' micro-batch counts in order)."""
    run_master = example.run_master
    runs = iter(configs)

    def run_config(num_split: int, args: argparse.Namespace, on_batch) -> list[float]:
        size, m = next(runs)
        assert m == num_split, (m, num_split)
        return run_master(m, argparse.Namespace(**{**vars(args), "image_size": size}),
                          on_batch=on_batch)

    example.run_master = run_config
    return example.run_worker(worker, args)


def summarize(configs, runs, refs, users, gflops, batch_size: int) -> list[dict]:
    rows = []
    n_cores = len(cores())
    for (size, m), run, ref in zip(configs, runs, refs):
        t = median(run["batch_times"])
        w = median(run["batch_cpu"])
        user, floor = users[size]["wall"], ref["cpu"] / n_cores
        row = {"image": size, "m": m, "GFLOP/mb": gflops[size] * math.ceil(batch_size / m),
               "s/batch": t, "floor": floor, "user s": user, "x user": user / t,
               "bound": user / floor, "seq s": ref["wall"], "x seq": ref["wall"] / t,
               "bound ": ref["wall"] / floor, "2m/(m+1)": classic_bound(m), "eff.": floor / t,
               "busy": w / t, "work": w / ref["cpu"], "losses": run["losses"]}
        row["flag"] = "ERROR: above bound" if row["x seq"] > row["bound "] else ""
        rows.append(row)
    return rows


def plot(path: str | None, rows: list[dict], sweep_m: int, table_size: int) -> None:
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    sweep = sorted((r for r in rows if r["m"] == sweep_m), key=lambda r: r["GFLOP/mb"])
    x = [r["GFLOP/mb"] for r in sweep]
    ax1.plot(x, [r["x user"] for r in sweep], "o-", label="speed-up over 1 process, all cores")
    ax1.plot(x, [r["bound"] for r in sweep], "s--", label="its bound (user s / floor)")
    ax1.axhline(1, color="0.5", lw=0.8)
    ax1.set_title(f"{sweep_m} micro-batches: against what a user would run", fontsize=9)
    ax1.set_ylabel("speed-up")
    ax2.plot(x, [100 * r["eff."] for r in sweep], "o-", label="efficiency (floor / s per batch)")
    ax2.axhline(85, color="tab:red", ls=":", label="target 85 %")
    ax2.set_ylim(0, 105)
    ax2.set_title(f"{sweep_m} micro-batches: against the machine bound", fontsize=9)
    ax2.set_ylabel("% of the bound")
    for ax, r_key in ((ax1, "x user"), (ax2, "eff.")):
        for r in sweep:
            ax.annotate(f"{r['image']}px", (r["GFLOP/mb"], r[r_key] * (100 if r_key == "eff." else 1)),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("work per micro-batch (GFLOP, forward + backward)")
        ax.legend(fontsize=7)
    table = sorted((r for r in rows if r["image"] == table_size), key=lambda r: r["m"])
    ms = [r["m"] for r in table]
    ax3.plot(ms, [r["x seq"] for r in table], "o-", label="speed-up over the same micro-batches, 1 thread")
    ax3.plot(ms, [r["bound "] for r in table], "s--", label="machine bound (seq s / floor)")
    ax3.plot(ms, [r["2m/(m+1)"] for r in table], "^:", label="2m/(m+1) (serial stages)")
    ax3.plot(ms, [r["x user"] for r in table], "d-", label="speed-up over 1 process, all cores")
    ax3.set_xscale("log", base=2)
    ax3.set_xticks(ms, [str(m) for m in ms])
    ax3.set_ylim(bottom=0)
    ax3.set_xlabel(f"micro-batches ({table_size}x{table_size} images)")
    ax3.set_title("speed-ups beside their bounds", fontsize=9)
    ax3.legend(fontsize=7)
    fig.suptitle("rpc_pipeline_resnet on this machine", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# plot written to {path}")


def build_parser() -> argparse.ArgumentParser:
    p = distkit.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (the test suite's)")
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
    p.add_argument("--reps", type=int, default=None,
                   help="timed steps of each single-process reference (default 3; quick 1)")
    p.add_argument("--num_classes", type=int, default=None, help="default 1000 (quick 10)")
    p.add_argument("--user_threads", type=int, default=None,
                   help="threads of the 'user' reference (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the sweep and the split table here (PNG)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    distkit.check_path(parser, "--plot", args.plot, "out_file")

    def pick(value, quick, full):  # a flag the user gave wins over either default
        return value if value is not None else (quick if args.quick else full)

    args.sizes = pick(args.sizes, [32, 40], [32, 64, 96, 128, 160])
    args.sweep_splits = pick(args.sweep_splits, 2, 8)
    args.splits = pick(args.splits, [1, 2], [1, 2, 4, 8])
    args.table_size = pick(args.table_size, 40, 128)
    args.batch_size = pick(args.batch_size, 4, 16)
    args.num_batches = pick(args.num_batches, 1, 3)
    args.reps = pick(args.reps, 1, 3)
    args.num_classes = pick(args.num_classes, 10, 1000)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.user_threads is not None and args.user_threads < 1:
        parser.error("--user_threads must be at least 1")
    configs = sorted({(s, args.sweep_splits) for s in args.sizes}
                     | {(args.table_size, m) for m in args.splits}, reverse=True)
    base = ["--batch_size", str(args.batch_size), "--num_batches", str(args.num_batches),
            "--warmup", "1", "--seed", str(args.seed), "--num_classes", str(args.num_classes),
            "--device", "cpu"]
    for size, m in configs:  # the example's one-line errors, under this script's name
        example.check_args(parser, example.build_parser().parse_args(
            [*base, "--image_size", str(size), "--splits", str(m)]))
    ex_args = example.build_parser().parse_args([*base, "--splits", "1"])
    example.check_args(parser, ex_args)
    ex_args.splits = [m for _, m in configs]  # run i of the job is configs[i]

    steady_malloc()  # the references too keep their memory: see rpc_pipeline_resnet/measure.py
    n_cores = len(cores())
    user_threads = args.user_threads or n_cores
    print(describe_machine(3, distkit.threads_per_process(2)))
    print(f"# pipeline: master + 2 shard processes; references: 1 process with 1 thread (seq) "
          f"and with {user_threads} threads (user); batches of {args.batch_size} images, "
          f"{args.num_classes} classes; {args.num_batches} timed batches per run after 1 warm-up, "
          f"{args.reps} timed steps per reference after 1")
    start = time.perf_counter()
    threads = torch.get_num_threads()
    gflops = {s: gflop_per_image(s, args.num_classes) for s in sorted({s for s, _ in configs})}
    refs = [reference(args, s, m, 1, args.reps) for s, m in configs]
    users = {s: reference(args, s, 1, user_threads, args.reps) for s in sorted({s for s, _ in configs})}
    torch.set_num_threads(threads)
    # the job starts after the references: nothing else of this benchmark runs beside it
    runs = distkit.launch(functools.partial(bench_worker, configs), ex_args)[0]
    rows = summarize(configs, runs, refs, users, gflops, args.batch_size)
    print(format_table(HEADER, rows))
    print(f"# {time.perf_counter() - start:.0f} s")
    plot(args.plot, rows, args.sweep_splits, args.table_size)
    assert all(math.isfinite(r[k]) for r in rows for k in HEADER if k != "flag")
    return rows


if __name__ == "__main__":
    main()

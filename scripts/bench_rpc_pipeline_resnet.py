"""Benchmark rpc_pipeline_resnet: time per batch per split count against the two-stage bound.

    python scripts/bench_rpc_pipeline_resnet.py --quick                    # about a minute on 2 cores
    python scripts/bench_rpc_pipeline_resnet.py --plot results/rpc_pipeline_resnet.png

It runs the example's own job (``rpc_pipeline_resnet.main.run_worker``: master, worker1 with
ResNetShard1, worker2 with ResNetShard2) once; for every split count m the master trains a
fresh DistResNet50 (``run_master``, unchanged). The only hook: ``run_master`` is wrapped so
that right after each split count's batches the master asks each worker to time its own
shard alone (a fresh ``ResNetShard1``/``ResNetShard2`` built there, forward + backward of
one micro-batch, same threads as in the pipeline): a and b, measured in the same run.

  - s/batch   median over the timed batches (after --warmup) of one training batch
              (forward, loss, distributed backward, optimizer step)
  - speed-up  s/batch with 1 split / s/batch with m
  - bound     a + b + (m - 1) * max(a, b): a perfect two-stage pipeline of m micro-batches
              (fill, then the slower stage back to back, then drain); it leaves out the
              loss, the optimizer step and the RPC messages, so even m = 1 is below 100 %
  - eff.      bound / s/batch
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402
import rpc_pipeline_resnet.main as example  # noqa: E402
from benchlib import describe_machine, format_table, median, save_plot  # noqa: E402
from rpc_pipeline_resnet.model import ResNetShard1, ResNetShard2  # noqa: E402

HEADER = ["splits", "micro-batch", "s/batch", "speed-up", "a (s)", "b (s)", "bound (s)", "eff."]


def time_shard(which: int, device: str, shape: tuple[int, ...], reps: int, num_classes: int,
               seed: int) -> tuple[float, tuple[int, ...]]:
    """Runs on a shard's worker: median seconds of forward + backward of one micro-batch."""
    shard = (ResNetShard1, ResNetShard2)[which](device, num_classes=num_classes)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    # shard 2's input is shard 1's output: in the pipeline its gradient is computed too
    x.requires_grad_(which == 1)
    times, out = [], None
    for _ in range(reps + 1):  # the first one warms up (memory, oneDNN primitives)
        start = time.perf_counter()
        out = shard(RRef(x))
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
    return median(times[1:]), tuple(out.shape)


def timed_run_master(run_master, shard_reps: int, num_split: int, args: argparse.Namespace) -> dict:
    """The example's ``run_master``, then a and b for this split count's micro-batch."""
    result = run_master(num_split, args)
    size = math.ceil(args.batch_size / num_split)  # tensor_split's largest micro-batch
    dev1, dev2 = result["devices"]
    a, shape = rpc.rpc_sync(example.WORKERS[0], time_shard,
                            args=(0, dev1, (size, 3, args.image_size, args.image_size), shard_reps,
                                  args.num_classes, args.seed))
    b, _ = rpc.rpc_sync(example.WORKERS[1], time_shard,
                        args=(1, dev2, shape, shard_reps, args.num_classes, args.seed))
    return {**result, "micro_batch": size, "a": a, "b": b}


def bench_worker(shard_reps: int, worker: distkit.Worker, args: argparse.Namespace):
    """Every rank: the example's ``run_worker`` with the master's ``run_master`` wrapped."""
    example.run_master = functools.partial(timed_run_master, example.run_master, shard_reps)
    return example.run_worker(worker, args)


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    base = median(runs[0]["batch_times"])
    for r in runs:
        m, a, b = r["num_split"], r["a"], r["b"]
        measured = median(r["batch_times"])
        bound = a + b + (m - 1) * max(a, b)
        rows.append({"splits": m, "micro-batch": r["micro_batch"], "s/batch": measured,
                     "speed-up": base / measured, "a (s)": a, "b (s)": b, "bound (s)": bound,
                     "eff.": bound / measured, "losses": r["losses"]})
    return rows


def plot(path: str | None, rows: list[dict]) -> None:
    def draw(ax):
        m = [r["splits"] for r in rows]
        ax.plot(m, [r["s/batch"] for r in rows], "o-", label="measured (median s/batch)")
        ax.plot(m, [r["bound (s)"] for r in rows], "s--", label="bound a + b + (m-1) max(a, b)")
        for r in rows:
            ax.annotate(f"{100 * r['eff.']:.0f}%", (r["splits"], r["s/batch"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(m, [str(x) for x in m])
        ax.set_xlabel("splits (micro-batches per batch)")
        ax.set_ylabel("seconds per batch")
        ax.set_ylim(bottom=0)
        ax.set_title("rpc_pipeline_resnet: time per batch vs the two-stage bound")
        ax.legend()

    save_plot(path, draw)


def build_parser() -> argparse.ArgumentParser:
    p = distkit.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller run: about a minute on 2 cores")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8], metavar="N",
                   help="split counts (1 is always added: the speed-up's base)")
    p.add_argument("--batch_size", type=int, default=None, help="images per batch (default 16)")
    p.add_argument("--image_size", type=int, default=None, help="image width and height (default 128)")
    p.add_argument("--num_batches", type=int, default=None, help="timed batches (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches first")
    p.add_argument("--shard_reps", type=int, default=None,
                   help="timed passes of each shard alone per split count (default 3; quick 2)")
    p.add_argument("--num_classes", type=int, default=None, help="default 1000 (the example's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write time per batch vs the bound here (PNG)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.shard_reps is not None and args.shard_reps < 1) or args.warmup < 1:
        parser.error("--shard_reps and --warmup must be at least 1")
    splits = sorted({1, *args.splits})
    ex_argv = ["--splits", *map(str, splits), "--warmup", str(args.warmup), "--seed", str(args.seed),
               "--batch_size", str(args.batch_size or 16),
               "--image_size", str(args.image_size or 128),
               "--num_batches", str(args.num_batches or (2 if args.quick else 5)), "--device", "cpu"]
    if args.num_classes is not None:
        ex_argv += ["--num_classes", str(args.num_classes)]
    ex_args = example.build_parser().parse_args(ex_argv)
    example.check_args(parser, ex_args)  # its one-line errors, under this script's name
    shard_reps = args.shard_reps or (2 if args.quick else 3)

    # the master only computes the loss; each shard gets its share of the cores
    print(describe_machine(2, distkit.threads_per_process(2)))
    print("# (the two shard processes; a third, the master, only computes the loss)")
    print(f"# batches of {ex_args.batch_size} x 3 x {ex_args.image_size} x {ex_args.image_size}, "
          f"{ex_args.num_classes} classes; {ex_args.num_batches} timed after {ex_args.warmup} "
          f"warm-up per split count; a, b: median of {shard_reps} passes of one shard alone")
    runs = distkit.launch(functools.partial(bench_worker, shard_reps), ex_args)[0]
    rows = summarize(runs)
    print(format_table(HEADER, rows))
    plot(args.plot, rows)
    assert all(math.isfinite(r[k]) for r in rows for k in HEADER)
    return rows


if __name__ == "__main__":
    main()

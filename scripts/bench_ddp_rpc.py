"""Benchmark ddp_rpc: iterations per second and the share of each iteration spent communicating.

The example's ``run_worker`` unchanged, against one trainer's arithmetic alone in this process: comm
share is the rest. On the CPU, so both sides use the same device. Usage, columns: docs/ddp_rpc.md, "Benchmark".
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.optim as optim

from benchlib import bench_parser, check_at_least, describe_machine, example_args, median, parse
import distkit
from ddp_rpc import main as ddp_main, sharded, trainer
from ddp_rpc.main import run_worker
from ddp_rpc.trainer import EMBEDDING_DIM, NUM_CLASSES, NUM_EMBEDDINGS, TrainConfig, get_next_batch
from rpc_phases import (PhaseClock, launch_timed, phase_seconds, plot, print_tables, print_versus, rpc_round_trip,
                        rpc_step_ms, step_ms, summarize, threads, versus_row)

# --versus: the tutorial's table, and one whose updates make the parameter server the bottleneck
TABLES = {"tiny": (100, 4), "default": (NUM_EMBEDDINGS, EMBEDDING_DIM), "large": (1_000_000, 64)}


def time_local(config: TrainConfig, warmup: int) -> dict[str, list[float]]:
    """Trainer 0's iterations in one process: ``HybridModel`` without RPC, DDP or dist autograd."""
    torch.manual_seed(config.seed)
    emb = nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="sum")
    fc = nn.Linear(EMBEDDING_DIM, NUM_CLASSES)
    opt = optim.SGD([*emb.parameters(), *fc.parameters()], lr=config.lr)
    criterion = nn.CrossEntropyLoss()
    clock = PhaseClock()
    for indices, offsets, target in get_next_batch(0, config):
        loss = criterion(fc(emb(indices, offsets)), target)
        opt.zero_grad()
        with clock.backward():
            loss.backward()
        with clock.step():
            opt.step()
        loss.item()  # the example reads every loss too
    return phase_seconds(clock.marks, warmup)


def set_table(rows: int, dim: int) -> None:
    """The table's size in this process: both versions read it from these module constants."""
    for module in (ddp_main, trainer, sharded):
        module.NUM_EMBEDDINGS, module.EMBEDDING_DIM = rows, dim


def sized(run: Callable, rows: int, dim: int, rank: int, args: argparse.Namespace) -> None:
    """In every rank: ``run`` on a table of ``rows`` x ``dim``."""
    set_table(rows, dim)
    run(rank, args)


def time_same_work(config: TrainConfig, ranks: int, warmup: int) -> float:
    """ms per step of one process doing every rank's work: each rank's batch through one table and fc."""
    emb = nn.EmbeddingBag(trainer.NUM_EMBEDDINGS, trainer.EMBEDDING_DIM, mode="sum")
    fc = nn.Linear(trainer.EMBEDDING_DIM, NUM_CLASSES)
    opt = optim.SGD([*emb.parameters(), *fc.parameters()], lr=config.lr)
    criterion = nn.CrossEntropyLoss()
    ends = []
    for batches in zip(*(get_next_batch(r, config) for r in range(ranks))):
        opt.zero_grad()
        sum(criterion(fc(emb(indices, offsets)), target) for indices, offsets, target in batches).backward()
        opt.step()
        ends.append(time.perf_counter())
    return 1e3 * median([b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])])


def versus(parser: argparse.ArgumentParser, args: argparse.Namespace, iters: int) -> list[dict]:
    """main.py (N trainers, a master, a parameter server) beside sharded.py (N ranks) on the same batches."""
    tables = args.tables or (["default"] if args.quick else ["default", "large"])
    rank_counts = args.trainers or ([2] if args.quick else [2, 4])
    batch = (args.batch_sizes or [16])[0]
    flags = ["--epochs", "1", "--batches_per_epoch", str(args.warmup + iters), "--batch_size", str(batch),
             "--seed", str(args.seed), "--device", "cpu", "--threads", "1"]
    runs = []  # every run's flags, checked by the examples' own check_args before anything runs
    for n in rank_counts:
        runs.append((n, example_args(parser, ddp_main, [*flags, "--world_size", str(n + 2)]),
                     example_args(parser, sharded, [*flags, "--world_size", str(n)])))
    print(describe_machine(max(rank_counts) + 2, 1))
    try:
        rows = _versus_rows(args, iters, tables, runs, batch)
    finally:  # the table's size back to the example's: another run in this process (the pages' next table)
        set_table(*TABLES["default"])
    return print_versus(rows, "every rank's batch through one table and fc, one SGD step")


def _versus_rows(args: argparse.Namespace, iters: int, tables: list[str], runs: list[tuple], batch: int) -> list[dict]:
    rows = []
    for table in tables:
        rows_dim = TABLES[table]
        set_table(*rows_dim)
        name = f"{table} {rows_dim[0]}x{rows_dim[1]}"
        for n, rpc_args, sharded_args in runs:
            with threads(1):
                local = time_same_work(TrainConfig(1, args.warmup + iters, batch, rpc_args.lr, args.seed), n,
                                       args.warmup)
            bound = min(n, os.cpu_count() or 1)  # N single-threaded trainers at most N (or every core) at once
            rpc_ms, rpc_out = rpc_step_ms(functools.partial(sized, run_worker, *rows_dim), rpc_args, args.warmup)
            rows.append(versus_row(name, "RPC (main.py)", n, rpc_ms, local, bound))
            sharded_ms, sharded_out = step_ms(functools.partial(sized, sharded.run_worker, *rows_dim), sharded_args,
                                              args.warmup)
            rows.append(versus_row(name, "DTensor (sharded.py)", n, sharded_ms, local, bound))
            # the ranks trained the table asked for (the master's summary, rank 0's)
            assert rpc_out[n]["emb_after"].shape == sharded_out[0]["emb_after"].shape == rows_dim
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, "the time split per configuration")
    p.add_argument("--trainers", type=int, nargs="+", default=None,
                   help="trainers per run, plus a master and a parameter server (default 1 2; quick 2)")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=None,
                   help="bags per batch (default 16 256 4096; quick 16 1024)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 200; quick 50)")
    p.add_argument("--warmup", type=int, default=5, help="iterations dropped before timing")
    p.add_argument("--rtt_calls", type=int, default=200, help="timed no-op RPC round trips")
    p.add_argument("--versus", action="store_true",
                   help="time main.py beside sharded.py (--trainers: ranks of each, default 2 4; the first of "
                        "--batch_sizes, default 16; --tables)")
    p.add_argument("--tables", nargs="+", choices=list(TABLES), default=None,
                   help="--versus: table sizes (default: default large; quick: default)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parse(parser, argv)
    trainer_counts = args.trainers or ([2] if args.quick else [1, 2])
    batch_sizes = args.batch_sizes or ([16, 1024] if args.quick else [16, 256, 4096])
    iters = (50 if args.quick else 200) if args.iters is None else args.iters
    check_at_least(parser, 1, {"--trainers": trainer_counts, "--batch_sizes": batch_sizes,
                               "--iters": iters, "--warmup": args.warmup, "--rtt_calls": args.rtt_calls})
    if args.tables and not args.versus:  # without --versus it would be ignored
        parser.error("--tables needs --versus")
    if args.versus:  # fewer steps: a large table's take a second
        return versus(parser, args, args.iters or (10 if args.quick else 30))
    # every run's flags, checked by the example's own check_args before anything runs
    runs = []
    for trainers in trainer_counts:
        for batch in batch_sizes:
            runs.append((trainers, batch, example_args(parser, ddp_main, [
                "--world_size", str(trainers + 2), "--epochs", "1",
                "--batches_per_epoch", str(args.warmup + iters), "--batch_size", str(batch),
                "--seed", str(args.seed), "--device", "cpu"])))
    print(describe_machine(max(trainer_counts) + 2))
    rtt = rpc_round_trip(args.rtt_calls)
    print("# local: one trainer's batches through the same EmbeddingBag + Linear in one process,"
          " no RPC, no DDP\n")

    rows = []
    for trainers, batch, ddp_args in runs:
        dist = launch_timed(run_worker, ddp_args, args.warmup)
        assert len(dist) == trainers, f"{len(dist)} of {trainers} trainers reported times"
        config = TrainConfig(1, args.warmup + iters, batch, ddp_args.lr, args.seed)
        with threads(distkit.threads_per_process(trainers + 2)):
            local = time_local(config, args.warmup)
        row = summarize(f"{trainers}x{batch}", dist, local, rtt, share="comm share")
        rows.append({**row, "trainers": trainers, "batch": batch,
                     "samples/s": round(trainers * batch * row["it/s"]),
                     "local samples/s": round(batch * row["local it/s"])})
    print_tables(rows, ["trainers", "batch", "samples/s", "local samples/s"], "comm share")
    plot(args.plot, rows, "ddp_rpc: where a trainer's iteration goes (trainers x batch)", rest="comm")
    assert all(math.isfinite(r[k]) for r in rows for k in ("it/s", "local it/s", "comm share"))
    return rows


if __name__ == "__main__":
    main()

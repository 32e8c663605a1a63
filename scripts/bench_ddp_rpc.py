"""Benchmark ddp_rpc: iterations per second and the share of each iteration spent communicating.

    python scripts/bench_ddp_rpc.py --quick                        # about a minute on 2 cores
    python scripts/bench_ddp_rpc.py --plot docs/results/ddp_rpc.png   # 1 and 2 trainers, 3 batch sizes

The example's ``run_worker`` unchanged, against one trainer's arithmetic alone in this process
(same modules and batches, plain SGD): comm share is the rest, everything beyond a trainer's own
arithmetic. On the CPU, so both sides use the same device. Columns: docs/ddp_rpc.md, "Benchmark".
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.optim as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402
from rpc_phases import PhaseClock, launch_timed, phase_seconds, plot, print_tables  # noqa: E402
from rpc_phases import rpc_round_trip, summarize, threads  # noqa: E402
from benchlib import check_at_least, describe_machine  # noqa: E402
from ddp_rpc.main import build_parser as ddp_parser, check_args as ddp_check, run_worker  # noqa: E402
from ddp_rpc.trainer import EMBEDDING_DIM, NUM_CLASSES, NUM_EMBEDDINGS, TrainConfig, get_next_batch  # noqa: E402


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


def build_parser() -> argparse.ArgumentParser:
    p = distkit.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller run: about a minute on 2 cores")
    p.add_argument("--trainers", type=int, nargs="+", default=None,
                   help="trainers per run, plus a master and a parameter server (default 1 2; quick 2)")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=None,
                   help="bags per batch (default 16 256 4096; quick 16 1024)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 200; quick 50)")
    p.add_argument("--warmup", type=int, default=5, help="iterations dropped before timing")
    p.add_argument("--rtt_calls", type=int, default=200, help="timed no-op RPC round trips")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the time split per configuration here (PNG)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    distkit.check_path(parser, "--plot", args.plot, "out_file")
    trainer_counts = args.trainers or ([2] if args.quick else [1, 2])
    batch_sizes = args.batch_sizes or ([16, 1024] if args.quick else [16, 256, 4096])
    iters = (50 if args.quick else 200) if args.iters is None else args.iters
    check_at_least(parser, 1, {"--trainers": trainer_counts, "--batch_sizes": batch_sizes,
                               "--iters": iters, "--warmup": args.warmup, "--rtt_calls": args.rtt_calls})
    check_at_least(parser, 0, {"--seed": args.seed})
    # every run's flags, checked by the example's own check_args before anything runs
    runs = []
    for trainers in trainer_counts:
        for batch in batch_sizes:
            ddp_args = ddp_parser().parse_args([
                "--world_size", str(trainers + 2), "--epochs", "1",
                "--batches_per_epoch", str(args.warmup + iters), "--batch_size", str(batch),
                "--seed", str(args.seed), "--device", "cpu"])
            ddp_check(parser, ddp_args)
            runs.append((trainers, batch, ddp_args))
    print(describe_machine(max(trainer_counts) + 2))
    rtt = rpc_round_trip(args.rtt_calls)
    print(f"# RPC round trip (median of {args.rtt_calls} no-op rpc_sync): {rtt * 1e3:.3f} ms")
    print("# local: one trainer's batches through the same EmbeddingBag + Linear in one process,"
          " no RPC, no DDP\n")

    rows = []
    for trainers, batch, ddp_args in runs:
        dist = launch_timed(run_worker, ddp_args, args.warmup)
        assert len(dist) == trainers, f"{len(dist)} of {trainers} trainers reported times"
        config = TrainConfig(1, args.warmup + iters, batch, ddp_args.lr, args.seed)
        with threads(distkit.threads_per_process(trainers + 2)):
            local = time_local(config, args.warmup)
        row = summarize(f"{trainers}x{batch}", dist, local, rtt)
        row["comm share"] = row.pop("rpc share")
        rows.append({**row, "trainers": trainers, "batch": batch,
                     "samples/s": round(trainers * batch * row["it/s"]),
                     "local samples/s": round(batch * row["local it/s"])})
    print_tables(rows, ["trainers", "batch", "samples/s", "local samples/s"], "comm share")
    plot(args.plot, rows, "ddp_rpc: where a trainer's iteration goes (trainers x batch)", rest="comm")
    assert all(math.isfinite(r[k]) for r in rows for k in ("it/s", "local it/s", "comm share"))
    return rows


if __name__ == "__main__":
    main()

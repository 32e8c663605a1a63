"""Benchmark rpc_rnn: iterations per second and the share of each iteration spent in RPC.

The example's ``run_worker`` unchanged, against the same modules and batches in this process
(plain SGD, no RPC, the same threads): rpc share is the rest. On the CPU, so both sides use the
same device. Usage, columns: docs/rpc_rnn.md, "Benchmark".
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn
import torch.optim as optim

from benchlib import bench_parser, check_at_least, describe_machine, example_args, format_table, median, parse
import distkit
from rpc_phases import (PhaseClock, launch_timed, phase_seconds, plot, print_tables, print_versus, rpc_round_trip,
                        rpc_step_ms, step_ms, summarize, threads, versus_row)
from rpc_rnn import main as rnn_main, sharded
from rpc_rnn.main import get_next_batch, make_stream, run_worker
from rpc_rnn.rnn import Decoder, EmbeddingTable

# the example's defaults and two larger ones ("large": about the word language model's small one)
CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(ntoken=7, ninp=4, nhid=5, nlayers=1, seq_len=3, batch_size=2),
    "default": dict(ntoken=10, ninp=16, nhid=32, nlayers=2, seq_len=5, batch_size=8),
    "medium": dict(ntoken=1000, ninp=64, nhid=128, nlayers=2, seq_len=20, batch_size=32),
    "large": dict(ntoken=10000, ninp=200, nhid=200, nlayers=2, seq_len=35, batch_size=20),
    # --versus: the default model with a vocabulary whose tables and scores outgrow the parameter server
    "vocab": dict(ntoken=1_000_000, ninp=64, nhid=64, nlayers=2, seq_len=5, batch_size=8),
}


class LocalRNN(nn.Module):
    """The reference: the example's remote modules and its LSTM, all in this process."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.emb = EmbeddingTable(ntoken, ninp, dropout, "cpu")
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.dec = Decoder(ntoken, nhid, dropout)

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        output, hidden = self.rnn(self.emb(input), hidden)
        return self.dec(output), hidden


def time_local(args: argparse.Namespace, warmup: int) -> dict[str, list[float]]:
    """``run_trainer``'s loop, one process, ``torch.optim.SGD``: what the arithmetic costs."""
    torch.manual_seed(args.seed)
    model = LocalRNN(args.ntoken, args.ninp, args.nhid, args.nlayers, args.dropout)
    opt = optim.SGD(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    stream = make_stream(args.ntoken, args.pattern_len, args.batch_size,
                         args.batches * args.seq_len + 1, args.seed)
    shape = (args.nlayers, args.batch_size, args.nhid)
    hidden = (torch.zeros(shape), torch.zeros(shape))
    clock = PhaseClock()
    for data, target in get_next_batch(stream, args.seq_len):
        hidden = tuple(h.detach() for h in hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output.reshape(-1, args.ntoken), target.reshape(-1))
        opt.zero_grad()
        with clock.backward():
            loss.backward()
        with clock.step():
            opt.step()
        loss.item()  # the example reads every loss too
    return phase_seconds(clock.marks, warmup)


def versus(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict]:
    """main.py (a parameter server and a trainer) beside sharded.py (N ranks, each every batch)."""
    configs = args.configs or (["default"] if args.quick else ["default", "vocab"])
    rank_counts = args.ranks or ([2] if args.quick else [2, 4])
    iters = args.iters or (10 if args.quick else 30)
    runs = []  # every run's flags, checked by the examples' own check_args before anything runs
    for name in configs:
        flags = [*(x for k, v in CONFIGS[name].items() for x in (f"--{k}", str(v))), "--epochs", "1", "--batches",
                 str(args.warmup + iters), "--seed", str(args.seed), "--device", "cpu", "--threads", "1"]
        runs.append((name, example_args(parser, rnn_main, flags),
                     [(n, example_args(parser, sharded, [*flags, "--world_size", str(n)])) for n in rank_counts]))
    print(describe_machine(max(2, *rank_counts), 1))
    rows = []
    for name, rpc_args, sharded_runs in runs:
        with threads(1):
            local = 1e3 * median(time_local(rpc_args, args.warmup)["iteration"])
        # the trainer and the parameter server take turns (every RPC is synchronous): never faster than one
        rows.append(versus_row(name, "RPC (main.py)", 2, rpc_step_ms(run_worker, rpc_args, args.warmup)[0], local, 1))
        for n, sharded_args in sharded_runs:
            ms = step_ms(sharded.run_worker, sharded_args, args.warmup)[0]
            rows.append(versus_row(name, "DTensor (sharded.py)", n, ms, local, min(n, os.cpu_count() or 1)))
    return print_versus(rows, "the whole model, every batch")


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, "the time split per configuration", seed=1)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                   help="model sizes (default: default medium large; quick: default medium)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 100; quick 30)")
    p.add_argument("--warmup", type=int, default=5, help="iterations dropped before timing")
    p.add_argument("--rtt_calls", type=int, default=200, help="timed no-op RPC round trips")
    p.add_argument("--versus", action="store_true",
                   help="time main.py beside sharded.py (--configs default: default vocab; quick: default)")
    p.add_argument("--ranks", type=int, nargs="+", default=None,
                   help="--versus: sharded.py's ranks (default 2 4; quick 2)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parse(parser, argv)
    configs = args.configs or (["default", "medium"] if args.quick else ["default", "medium", "large"])
    iters = (30 if args.quick else 100) if args.iters is None else args.iters
    check_at_least(parser, 1, {"--iters": iters, "--warmup": args.warmup, "--rtt_calls": args.rtt_calls,
                               "--ranks": args.ranks})
    if args.ranks and not args.versus:  # sharded.py's ranks: without --versus it would be ignored
        parser.error("--ranks needs --versus")
    if args.versus:
        return versus(parser, args)
    runs = []  # every run's flags, checked by the example's own check_args before anything runs
    for name in configs:
        sizes = [x for k, v in CONFIGS[name].items() for x in (f"--{k}", str(v))]
        runs.append((name, example_args(parser, rnn_main, [*sizes, "--epochs", "1", "--batches",
                                                           str(args.warmup + iters), "--seed", str(args.seed),
                                                           "--device", "cpu"])))
    n_threads = distkit.threads_per_process(2)
    print(describe_machine(2, n_threads))
    rtt = rpc_round_trip(args.rtt_calls)
    print(f"# local: the same modules and batches in one process, {n_threads} thread(s), no RPC\n")

    rows = []
    for name, rnn_args in runs:
        dist = launch_timed(run_worker, rnn_args, args.warmup)
        with threads(n_threads):
            local = time_local(rnn_args, args.warmup)
        rows.append({**summarize(name, dist, local, rtt), **CONFIGS[name]})
    print("# model sizes (--ntoken ... --batch_size of rpc_rnn/main.py)")
    print(format_table(["config", *CONFIGS["default"]], rows))
    print()
    print_tables(rows, [], "rpc share")
    plot(args.plot, rows, "rpc_rnn: where a distributed iteration goes")
    assert all(math.isfinite(r[k]) for r in rows for k in ("it/s", "local it/s", "rpc share"))
    return rows


if __name__ == "__main__":
    main()

"""Jobs of two ranks that fail, hang or almost, for tests/test_hangs.py and tests/test_faults.py.

Launched as an example is (``python tests/hang_worker.py MODE``: the tutorial's ``mp.spawn``; under
torchrun, ``run_worker`` under ``@record``), or in a test's process by ``distkit.launch(run_worker, args)``:
    torchrun --standalone --nproc_per_node 2 tests/hang_worker.py deadlock --hang_timeout 3
  deadlock    every rank does some work, then waits on a ``recv`` that nobody sends (in C)
  python      rank 1 loops in Python for ever, rank 0 waits on it in a ``recv``
  gil         rank 1 is stuck in one C call that holds the GIL, rank 0 waits on it in a ``recv``
  raise       rank 1 raises; what would follow the raise blocks for ever (a thread it started, an
              ``atexit`` function), and rank 0 waits on it in a ``recv``
  slow        every rank does one forward a second for --seconds, never stuck
  checkpoint  forwards further apart than --hang_timeout, a checkpoint's save between two of them
              (``distkit.progress`` on each side), for --seconds
  waits       rank 0 does a forward a second for --seconds; rank 1, after one forward, only waits on
              rank 0 over RPC (``distkit.wait_on``), as the examples' observers and servers do
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402

MODES = ("deadlock", "python", "gil", "raise", "slow", "checkpoint", "waits")


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser()
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--seconds", type=float, default=6)
    distkit.add_launch_args(parser, world_size=2, rpc_timeout=60, hang_timeout=3)
    return parser


def run_worker(rank: int, args: argparse.Namespace) -> None:
    distkit.start_rank(rank, args)
    layer = torch.nn.Linear(4, 4)
    if args.mode == "waits":
        waits(rank, args, layer)
        return
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    layer(torch.ones(1, 4))  # progress, on every rank at once: the bound is now --hang_timeout, not the start-up's
    start = time.monotonic()
    if args.mode in ("slow", "checkpoint"):
        gap = 1.0 if args.mode == "slow" else 0.6 * args.hang_timeout
        while time.monotonic() - start < args.seconds:
            layer(torch.ones(1, 4))
            print(f"rank {rank} made progress", flush=True)
            time.sleep(gap)
            if args.mode == "checkpoint":  # a save as long as the rest: progress on each side of it
                distkit.progress()
                time.sleep(gap)
                distkit.progress()
                time.sleep(gap)
        dist.destroy_process_group()
        return
    print(f"rank {rank} waits", flush=True)
    if rank == 0 or args.mode == "deadlock":
        dist.recv(torch.zeros(1), src=(rank + 1) % args.world_size)  # nobody sends
    elif args.mode == "python":
        spin_in_python()
    elif args.mode == "gil":
        re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: one C call, the GIL held throughout
    else:
        threading.Thread(target=threading.Event().wait, name="never ends").start()  # joined at exit
        atexit.register(time.sleep, 3600)
        print(f"rank {rank} raises", flush=True)
        raise ValueError(f"boom from rank {rank}, with what follows it blocked")


def spin_in_python() -> None:
    while True:
        sum(range(1000))


def waits(rank: int, args: argparse.Namespace, layer: torch.nn.Module) -> None:
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.rpc_timeout, _transports=["uv"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=args.world_size, rpc_backend_options=options)
    layer(torch.ones(1, 4))
    if rank == 0:
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            layer(torch.ones(1, 4))
            time.sleep(1)
    else:
        distkit.wait_on("w0", timeout=args.rpc_timeout)
    rpc.shutdown()  # rank 1 waits here until rank 0 is done


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    distkit.check_launch_args(parser, args)
    if distkit.under_torchrun():
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

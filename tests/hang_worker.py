"""Jobs that stop making progress, or almost, for the watchdog's tests (tests/test_hangs.py).

Run by ``distkit.launch`` in the tests, or as a script under torchrun:
    torchrun --standalone --nproc_per_node 2 tests/hang_worker.py deadlock --hang_timeout 3
  deadlock  every rank does some work, then waits on a ``recv`` that nobody sends
  slow      every rank does one forward a second for --seconds, never stuck
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser()
    parser.add_argument("mode", choices=("deadlock", "slow"))
    parser.add_argument("--seconds", type=float, default=6)
    distkit.add_launch_args(parser, world_size=2, hang_timeout=3)
    return parser


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> float:
    dist.init_process_group("gloo", store=distkit.process_group_store(), rank=worker.rank,
                            world_size=worker.world_size)
    layer = torch.nn.Linear(4, 4)
    start = time.monotonic()
    if args.mode == "slow":
        while time.monotonic() - start < args.seconds:
            layer(torch.ones(1, 4))  # progress, once a second
            print(f"rank {worker.rank} made progress", flush=True)
            time.sleep(1)
    else:
        layer(torch.ones(1, 4))
        buffer = torch.zeros(1)
        print(f"rank {worker.rank} waits", flush=True)
        dist.recv(buffer, src=(worker.rank + 1) % worker.world_size)  # nobody sends
    dist.destroy_process_group()
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    distkit.check_launch_args(parser, args)
    distkit.launch(run_worker, args)
    return 0


if __name__ == "__main__":
    distkit.exit_process(main())

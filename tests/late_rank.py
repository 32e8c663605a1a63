"""A job of two ranks whose rank 1 still needs the job's store after rank 0 is done.

``tests/test_distkit.py`` runs it spawned and under torchrun, launched as every example is: rank 0
returns at once; rank 1 holds a client of the store, waits 5 s (as a rank still in ``rpc.shutdown()``
does, which reads the store), then writes to it. The store must outlive rank 0: under mp.spawn the
launcher hosts it (``distkit.prepare_spawn``) until every rank has ended, as torchrun's agent hosts its
own; with the store on rank 0, rank 1's write would meet a closed store and rank 1 fail.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402

LATE = 5.0  # seconds rank 1 still works after rank 0 is done


def run_worker(rank: int, args: argparse.Namespace) -> None:
    distkit.start_rank(rank, args)
    if rank == 1:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        time.sleep(LATE)
        store.set("late/still here", "1")  # the store's host must still be up
        print(f"rank 1 used the job's store {LATE:g} s after rank 0 was done", flush=True)


def main() -> int:
    parser = distkit.ArgumentParser()
    distkit.add_launch_args(parser, world_size=2, hang_timeout=0)
    args = parser.parse_args()
    distkit.check_launch_args(parser, args)
    if distkit.under_torchrun():
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A job of two ranks on two machines whose rank 1 still needs the job's store after rank 0 is done.

``tests/test_multihost.py`` runs it with ``--ranks 0`` on one host (its launcher hosts the store) and
``--ranks 1`` on another: rank 0 returns at once; rank 1 holds a client of the store, waits 5 s (as a
rank still in ``rpc.shutdown()`` does, which reads the store), then writes to it. The launcher of rank 0
must keep the store until rank 1 says it needs it no more (``Job.__exit__``, as torchrun's agents wait at
their exit barrier); without that wait, rank 1's write meets a closed store and rank 1 fails.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402

LATE = 5.0  # seconds rank 1 still works after rank 0 is done


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> None:
    if worker.rank == 1:
        store = distkit.job_store("late/")  # connected now, as RPC's agent is
        time.sleep(LATE)
        store.set("still here", "1")  # the store's host must still be up
        print(f"rank 1 used the job's store {LATE:g} s after rank 0 was done", flush=True)


def main() -> int:
    parser = distkit.ArgumentParser()
    distkit.add_launch_args(parser, world_size=2, hang_timeout=0)
    args = parser.parse_args()
    distkit.check_launch_args(parser, args)
    with distkit.Job(args) as job:
        job.join(mp.spawn(job.wrap(run_worker), args=(args,), nprocs=job.nprocs, join=False))
    return 0


if __name__ == "__main__":
    distkit.exit_process(main())

"""A job whose rank 0 returns while a gloo collective it started is still running.

``tests/test_distkit.py`` runs it spawned and under torchrun, launched as every example is, and every
rank must exit 0, as a finished example must. Rank 1 joins the collective 2 s late, while rank 0's
interpreter would be tearing itself down (made to take 4 s here, as freeing a big model's
state can). Gloo's thread then finishes the collective and asks for the GIL of an
interpreter that is finalizing, and is ended inside a destructor: std::terminate, SIGABRT.
pipelining_transformer --dp_size 2 died so about 1 exit in 10, its gloo thread dropping the
all-reduced loss (with torch 2.14, dropping a C++ reference to a tensor that Python has seen
takes the GIL); a callback on the collective's future needs the GIL on that thread as well,
and makes it happen every time. A rank's end, set up by ``distkit.start_rank`` (``distkit.exit_now``),
skips the teardown.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distkit  # noqa: E402


class SlowToFree:
    """Garbage that only the teardown's collection frees, making it last 4 s."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        time.sleep(4)


# the group, kept past destroy_process_group as FSDP's and DTensor's state keep
# pipelining_transformer's groups (freed there, gloo would wait for the collective with the
# interpreter alive, and all would be well)
KEPT: list[dist.ProcessGroup] = []


def run_worker(rank: int, args: argparse.Namespace) -> None:
    distkit.start_rank(rank, args)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    # gloo connects its pairs one rank after the other: rank 0, through first, must not leave while rank 1
    # still connects (once, under load: rank 1's init failed with "Connection closed by peer")
    dist.barrier()
    if rank == 0:
        KEPT.append(dist.group.WORLD)
        gc.set_threshold(1_000_000_000)  # no collection before the teardown's own
        SlowToFree()
    else:
        time.sleep(2)  # rank 0 has returned and is exiting by now
    # not waited for: gloo's thread finishes it (on rank 0, once rank 1 joins), then runs
    # the callback, which takes the GIL
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.get_future().then(lambda fut: None)


def main(argv: list[str] | None = None) -> int:
    parser = distkit.ArgumentParser()
    distkit.add_launch_args(parser, world_size=2)
    args = parser.parse_args(argv)
    distkit.check_launch_args(parser, args, min_world_size=2)
    if distkit.under_torchrun():
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    print("job finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())

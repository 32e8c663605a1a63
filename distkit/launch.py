"""Around the tutorial's ``mp.spawn(run_worker, args=(args,), nprocs=N, join=True)`` on one machine:
what the ranks need before it (``prepare_spawn``), what they left after it (``results``); and the
in-process launcher of the tests and scripts (``launch``), which returns ``{rank: result}``.

Several machines, restarts and SLURM are torchrun's (docs/multi_host.md); a failure's report is
mp.spawn's (``ProcessRaisedException``, the other ranks ended) or torchrun's summary.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing import resource_tracker
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record

from .rank import start_rank, under_torchrun

RESULTS = "DISTKIT_RESULTS"  # the environment's name for the folder the ranks leave their results in
ENDING = {signal.SIGINT, signal.SIGTERM}  # Ctrl+C, and a launcher stopped from outside
spawn = mp.spawn  # what ``launch`` calls (the tests' is tests/forkserver.py)
_kept: dict[str, Any] = {}  # the store this launcher hosts, this process's own results under torchrun


def prepare_spawn() -> None:
    """Before ``mp.spawn``, in the launcher:
    - a store on 127.0.0.1 and a port the OS picks, hosted here for as long as the ranks run, every
      rank its client (``env://``), as torchrun's agent hosts one: no port to collide, no rank whose
      end takes the store from a peer still in ``rpc.shutdown()``;
    - a folder for the ranks' results (``save_result``; mp.spawn returns none);
    - Ctrl+C and SIGTERM end every rank, then the launcher, exit 130 or 143 and no traceback
      (``_end_on_signal``). An interrupted ``mp.spawn`` would leave its ranks running.
    """
    _end_on_signal()  # first: the store's threads, as the ranks, inherit this thread's signal mask
    listener = socket.create_server(("127.0.0.1", 0))  # loopback only: c10d's own listens on every interface
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True,
                          master_listen_fd=listener.detach(), wait_for_workers=False)
    _kept["store"] = store
    results = tempfile.mkdtemp(prefix="distkit-results-")
    atexit.register(shutil.rmtree, results, ignore_errors=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                      **{RESULTS: results})


def _end_on_signal() -> None:
    """Ctrl+C and SIGTERM end the ranks (SIGKILL), then this process by the same signal. Why not SIG_DFL
    alone: a rank still importing torch has no parent-death signal yet, and outlived a SIGTERMed
    launcher by 28 s (measured: ``rpc_rl/main.py --world_size 4`` on 2 cores); and Ctrl+C, which
    reaches every process of the terminal's group, made each such rank print a KeyboardInterrupt
    traceback. So this thread holds SIGINT back, and the ranks it spawns keep it held (a signal mask
    survives fork and exec): a rank that took Ctrl+C began its shutdown, and a peer's RPC in flight
    logged a traceback before the kill arrived. SIGINT then lands on another thread,
    which leaves the main one in ``mp.spawn``'s wait: Python's wakeup fd tells ``_end_ranks``, whose
    kills end that wait, and the main thread's handler then ends the process."""
    if "wakeup" not in _kept:  # one a process (a test's launches share it), made before SIGINT is held
        read, _kept["wakeup"] = os.pipe()
        os.set_blocking(_kept["wakeup"], False)
        threading.Thread(target=_end_ranks, args=(read,), name="distkit-signals", daemon=True).start()
    signal.set_wakeup_fd(_kept["wakeup"])
    signal.signal(signal.SIGINT, _end_launcher)
    signal.signal(signal.SIGTERM, _end_launcher)
    # multiprocessing's resource tracker, started with the first rank, lets SIGINT through in this thread
    # again (its start blocks it, then unblocks it): started now, before SIGINT is held, it is left alone
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _end_ranks(wakeup: int) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ENDING)  # this thread takes what the main one holds back
    while byte := os.read(wakeup, 1):  # the number of a signal Python handles, on any thread
        if byte[0] in ENDING:  # Ctrl+C or SIGTERM (the handlers set here), not another handler's signal
            for rank in multiprocessing.active_children():  # mp.spawn's (one forked just now: die_with_parent)
                rank.kill()


def _end_launcher(sig: int, frame: object) -> None:
    for rank in multiprocessing.active_children():
        rank.kill()
    signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    signal.raise_signal(sig)  # ended by it: exit status 128 + sig as a shell reports it, no traceback


def save_result(rank: int, value: Any) -> None:
    """In a rank: leave ``value`` for the launcher's ``results()`` (under torchrun: this process's)."""
    folder = _results_folder()
    if folder is None:
        _kept.setdefault("results", {})[rank] = value
        return
    path = os.path.join(folder, f"{rank}.pt")
    torch.save(value, path + ".part")
    os.replace(path + ".part", path)  # whole or not there


def results() -> dict[int, Any]:
    """After ``mp.spawn``: ``{rank: value}`` of what the ranks saved; under torchrun, this rank's."""
    folder = _results_folder()
    if folder is None:
        return _kept.pop("results", {})
    found = {int(name[:-3]): torch.load(os.path.join(folder, name), weights_only=False)
             for name in os.listdir(folder) if name.endswith(".pt")}
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    return found


def _results_folder() -> str | None:
    """The spawning launcher's folder; None under torchrun, whatever the environment it inherited holds."""
    return None if under_torchrun() else os.environ.get(RESULTS)


def launch(fn: Callable[[int, argparse.Namespace], Any], args: argparse.Namespace) -> dict[int, Any]:
    """For tests and scripts: ``{rank: fn(rank, args)}`` (a None kept out), each rank set up by
    ``start_rank`` (``fn`` may call it again); a failure raises mp.spawn's exception. ``fn``:
    module-level."""
    if under_torchrun():
        rank = int(os.environ["RANK"])
        value = record(_returning)(fn, rank, args, end=False)
        return {**results(), **({} if value is None else {rank: value})}
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    mask, wakeup = signal.pthread_sigmask(signal.SIG_BLOCK, set()), signal.set_wakeup_fd(-1)
    env = dict(os.environ)
    try:
        prepare_spawn()
        spawn(functools.partial(_returning, fn), args=(args,), nprocs=args.world_size, join=True)
        return results()
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.set_wakeup_fd(wakeup)
        os.environ.clear()
        os.environ.update(env)
        _kept.pop("store", None)


def _returning(fn: Callable[[int, argparse.Namespace], Any], rank: int, args: argparse.Namespace,
               end: bool = True) -> Any:
    start_rank(rank, args)
    value = fn(rank, args)
    if not end:
        return value
    if value is not None:
        save_result(rank, value)
    sys.exit(0)  # the rank's end (start_rank's): its trace written, no teardown; a forked rank skips it

"""Run one function on every rank: spawned locally, or one rank per process under torchrun.

``python X/main.py --world_size N`` spawns N processes here. The launching process hosts
the job's rendezvous store itself (on 127.0.0.1 and an OS-chosen port unless told
otherwise) and tells the workers to use it exactly as torchrun's agent does
(``TORCHELASTIC_USE_AGENT_STORE``), so ``init_rpc``/``init_process_group`` with
``env://`` behave the same under both launchers, every RPC group and process group of the
job shares one port under its own key prefix, and nothing collides with another job.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) the
function simply runs for this process's rank.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Container
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from multiprocessing import connection as mp_connection

from torch.distributed.elastic.timer import FileTimerServer

from .rendezvous import STORE_TIMEOUT, host_store, under_torchrun
from .watchdog import TIMER_FILE, TIMER_MARGIN
from .worker import Worker, die_with_parent, exit_now, run_rank

log = logging.getLogger("distkit")


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """``None`` -> all ranks; ``"2"`` -> [2]; ``"1-3"`` -> [1, 2, 3]."""
    if spec is None:
        return list(range(world_size))
    try:
        lo, _, hi = spec.partition("-")
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--ranks must look like 2 or 1-3, got {spec!r}") from None
    if not 0 <= first <= last < world_size:
        raise ValueError(f"--ranks {spec} is not within 0..{world_size - 1}")
    return list(range(first, last + 1))


def local_workers(args: argparse.Namespace) -> list[Worker]:
    """The ``Worker`` of every process this command will run on this machine (before launch).

    Under torchrun that is this process alone; spawned, one per rank of ``--ranks``. Ports
    are not known yet (0): enough to decide devices, not to connect.
    """
    if under_torchrun():
        return [_torchrun_worker(args)]
    ranks = parse_ranks(args.ranks, args.world_size)
    return [Worker(rank, args.world_size, i, len(ranks), args.master_addr or "127.0.0.1",
                   args.master_port or 0, args.device) for i, rank in enumerate(ranks)]


def _torchrun_worker(args: argparse.Namespace) -> Worker:
    env = os.environ
    return Worker(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                  int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                  env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 0)), args.device)


def launch(fn: Callable[[Worker, argparse.Namespace], Any], args: argparse.Namespace) -> dict[int, Any]:
    """Run ``fn(worker, args)`` on every rank; return ``{rank: what fn returned}``.

    ``fn`` must be a module-level function (it is pickled to spawned processes). If any rank
    raises or dies, the others are stopped and this process exits with status 1 after
    printing the failed rank's traceback once.
    """
    if under_torchrun():
        # torchrun starts each worker in a session of its own, so a SIGKILLed torchrun (no
        # cleanup runs) would leave its workers training on: they die with it, as spawned ones do
        die_with_parent()
        worker = _torchrun_worker(args)
        return {worker.rank: run_rank(fn, worker, args)}  # torchrun reports a failure itself
    return _spawn(fn, args)


def _spawn(fn: Callable, args: argparse.Namespace) -> dict[int, Any]:
    ranks = parse_ranks(args.ranks, args.world_size)
    addr = args.master_addr or "127.0.0.1"
    store = None
    if 0 in ranks:
        # This process hosts the store, bound to ``addr`` only: a single-machine run is
        # reachable from loopback alone (c10d's own TCPStore server listens on every interface).
        try:
            store = host_store(addr, args.master_port or 0, STORE_TIMEOUT)
        except OSError as e:  # an address not on this machine, a port in use: bad input
            _die(f"cannot listen on {addr}:{args.master_port or 0} for the rendezvous: "
                 f"{e.strerror or e}", status=2)
        port = store.port
    else:
        port = args.master_port
    result_dir = Path(tempfile.mkdtemp(prefix="distkit-"))
    # torchrun's worker timer (TORCHELASTIC_ENABLE_FILE_TIMER=1), here always on: each rank's
    # watchdog keeps a timer going, so a rank frozen whole (SIGSTOP) is ended on its own
    # machine, also when the rank that reports the hang runs on another one
    timed_out: set[int] = set()  # pids this launch's timer killed (one set per launch: pids get reused)
    timer = FileTimerServer(str(result_dir / "timer"), run_id="distkit", max_interval=0.1,
                            log_event=partial(_timer_event, timed_out))
    timer.start()
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_spawned, args=(i, fn, args, ranks, addr, port, str(result_dir)),
                           name=f"rank{rank}") for i, rank in enumerate(ranks)]
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for p in procs:
            p.start()
        _wait(procs, ranks, result_dir, timed_out)
        return {int(p.stem): torch.load(p, weights_only=False) for p in sorted(result_dir.glob("*.pt"))}
    except KeyboardInterrupt:
        _die("interrupted; all workers stopped", status=130)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        _stop(procs)
        timer.stop()
        del store
        shutil.rmtree(result_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def _wait(procs: list, ranks: list[int], result_dir: Path, timed_out: set[int]) -> None:
    """Return once every worker has exited 0; at the first failure stop them all and exit 1."""
    while True:
        failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            failed = _settle(procs, failed)
            _stop(procs)
            refusals = sorted(result_dir.glob("*.refused"))
            if refusals:  # a device the job cannot run with: its one line, as for bad flags
                _die(refusals[0].read_text(), status=2)
            _die(_root_cause(failed, procs, ranks, result_dir, timed_out))
        if all(p.exitcode == 0 for p in procs):
            return
        mp_connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=1)


def _timer_event(timed_out: set[int], name: str, request: Any) -> None:
    if name == "timer expired" and request is not None:
        timed_out.add(request.worker_pid)


KILLED_GRACE = 1.0  # seconds a failure waits for a rank killed by a signal to be reaped


def _settle(procs: list, failed: list[int]) -> list[int]:
    """The failed ranks once a rank killed by a signal, if there is one, has been reaped.

    A killed process with many threads (RPC's pools) takes a while to become a zombie, and
    meanwhile a peer it broke can raise and exit first: seen on a loaded machine, the SIGKILLed
    parameter server of ddp_rpc reported as the master's RPC error. A failure that is a signal
    is reported at once; any other waits up to ``KILLED_GRACE`` for one before it is blamed.
    """
    deadline = time.monotonic() + KILLED_GRACE
    while not any(procs[i].exitcode < 0 for i in failed) and (left := deadline - time.monotonic()) > 0:
        running = [p.sentinel for p in procs if p.exitcode is None]
        if not running:
            break
        ready = mp_connection.wait(running, timeout=left)
        if ready and all(p.exitcode is None for p in procs if p.sentinel in ready):
            time.sleep(0.01)  # a pipe closes a moment before its process is reapable: no spinning
        failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
    return failed


def _root_cause(failed: list[int], procs: list, ranks: list[int], result_dir: Path,
                timed_out: Container[int] = frozenset()) -> str:
    """The failure that came first; the others are mostly its echoes (a peer's socket closing).

    Exit order says little: a rank that raises can take longer to exit than the peer whose
    connection it closed on the way out. So workers record when they raised, and a rank
    killed by a signal (it could record nothing) counts as first.
    """
    for i in failed:
        if procs[i].exitcode < 0 and procs[i].pid in timed_out:
            return (f"rank {ranks[i]} was frozen (no heartbeat for --hang_timeout + "
                    f"{TIMER_MARGIN:g} s) and was killed by its watchdog's timer; the job is stopped")
        if procs[i].exitcode < 0:
            name = signal.Signals(-procs[i].exitcode).name
            return f"rank {ranks[i]} died (signal {name}); the job is stopped"
    records = []
    for path in result_dir.glob("*.failed"):
        when, _, trace = path.read_text().partition("\n")
        records.append((float(when), int(path.stem), trace))
    if records:
        _, rank, trace = min(records)
        return f"rank {rank} failed:\n{trace}"
    i = failed[0]
    return f"rank {ranks[i]} died (exit status {procs[i].exitcode}); the job is stopped"


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _die(message: str, status: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def _stop(processes: list) -> None:
    """Terminate, then kill, whatever is still running."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def _spawned(index: int, fn: Callable, args: argparse.Namespace, ranks: list[int],
             addr: str, port: int, result_dir: str) -> None:
    """Entry point of a spawned worker: the environment torchrun would have given it."""
    die_with_parent(mp.parent_process().pid)
    rank = ranks[index]
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(index),
                      LOCAL_WORLD_SIZE=str(len(ranks)), TORCHELASTIC_USE_AGENT_STORE="True",
                      **{TIMER_FILE: os.path.join(result_dir, "timer")})
    worker = Worker(rank, args.world_size, index, len(ranks), addr, port, args.device)
    try:
        result = run_rank(fn, worker, args, failure_file=os.path.join(result_dir, f"{rank}.failed"))
    except BaseException:
        exit_now(1)  # the launcher prints the traceback, once
    if result is not None:
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    exit_now(0)



"""Start the ranks: ``mp.spawn`` on this machine, or this one rank under torchrun (``job.run``).

Every example's ``main()`` writes the tutorial's launch itself::

    with distkit.Job(args) as job:
        mp.spawn(job.wrap(run_worker), args=(args,), nprocs=job.nprocs, join=True)

``Job`` adds, each piece for the reason beside it:
- the store, on 127.0.0.1 and a port the OS picks: c10d's listens on every interface, on a set port;
- torchrun's file timer server: it kills a rank frozen whole (SIGSTOP), which no peer can end;
- each rank's result, in a file: ``mp.spawn`` returns nothing;
- the first failure's report (a device refused: exit 2): ``mp.spawn`` reports the first exit it sees;
- Ctrl+C and SIGTERM: an interrupted ``mp.spawn`` leaves its ranks running;
- ``_watch_stopped``: ``mp.spawn`` gives a stopped rank 30 s to take a SIGTERM it cannot take.

``launch`` is that launch as a function, for tests and benchmarks. After ``fork_from_server`` (the
tests) it forks the ranks from a server that has imported torch once: spawn's fresh interpreter
imports it again, about 3 CPU-seconds a rank and most of a small job's time.
"""
from __future__ import annotations

import argparse
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from torch.distributed.elastic.timer import FileTimerServer

from .rendezvous import STORE_TIMEOUT, agent_hosts_store, connect, host_store, under_torchrun
from .watchdog import TIMER_FILE, TIMER_MARGIN
from .worker import Worker, die_with_parent, exit_now, run_rank

# a raising rank waits before it exits: a peer killed by a signal (with RPC's many threads) is slow to
# be reaped, and mp.spawn blames the first exit it sees (seen in CI: ddp_rpc's parameter server)
PEER_GRACE = 1.0
STOPPED_POLL = 0.5  # seconds between the job's looks at its ranks' states
_start_method = "spawn"  # launch's: mp.spawn's, as in every example's main(); see fork_from_server


def fork_from_server(preload: list[str]) -> None:
    """From now on ``launch`` starts each rank with ``mp.start_processes(..., start_method="forkserver")``:
    forked from one server process that imported the modules ``preload`` when it started, and given
    the launcher's environment and stdio of the moment. The examples' own launch (``mp.spawn``) is
    unchanged."""
    global _start_method
    multiprocessing.set_forkserver_preload(preload)
    _start_method = "forkserver"


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
    """Before launch, the ``Worker`` of each process run here (ports 0: enough to decide devices)."""
    if under_torchrun():
        return [_env_worker(args)]
    ranks = parse_ranks(args.ranks, args.world_size)
    return [Worker(rank, args.world_size, i, len(ranks), args.master_addr or "127.0.0.1",
                   args.master_port or 0, args.device) for i, rank in enumerate(ranks)]


def _env_worker(args: argparse.Namespace) -> Worker:
    env = os.environ
    return Worker(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                  int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                  env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 0)), args.device)


class _Surroundings:
    """What a rank forked from the server (``fork_from_server``) takes from the launcher as it unpickles
    this, as a spawned rank does: the environment and stdout/stderr of the moment, not the server's."""

    def __reduce__(self) -> tuple:
        return _adopt, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2))


def _adopt(environ: dict[str, str], out: Any, err: Any) -> bool:
    os.environ.clear()
    os.environ.update(environ)
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)
    return True


def _spawned(fn: Callable[[Worker, argparse.Namespace], Any], ranks: tuple[int, ...], addr: str, port: int,
             job_dir: str, forked: _Surroundings | bool, index: int, args: argparse.Namespace) -> None:
    """``fn`` as ``mp.spawn`` calls it (``Job.wrap``): rank ``ranks[index]``, in torchrun's environment."""
    # mp.spawn's SIGINT when the launcher dies waits for Python's next bytecode, never in a collective.
    # Forked from the server, that server is the parent: it exits when the launcher does.
    die_with_parent(None if forked else multiprocessing.parent_process().pid)
    rank = ranks[index]
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world_size),
                      LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(len(ranks)),
                      TORCHELASTIC_USE_AGENT_STORE="True", **{TIMER_FILE: os.path.join(job_dir, "timer")})
    Path(job_dir, f"{rank}.pid").write_text(f"{os.getpid()} {os.getppid()}")  # for _watch_stopped
    try:
        result = run_rank(fn, _env_worker(args), args, failure_file=os.path.join(job_dir, f"{rank}.failed"))
    except BaseException:
        time.sleep(PEER_GRACE)
        exit_now(1)  # the launcher prints the traceback, once
    if result is not None:
        torch.save(result, os.path.join(job_dir, f"{rank}.pt"))
    exit_now(0)


class Job:
    """One launch; ``job.results``: ``{rank: run_worker's result}`` here; a failure: its report, exit 1."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.torchrun = under_torchrun()
        self.ranks = [] if self.torchrun else parse_ranks(args.ranks, args.world_size)
        self.nprocs = len(self.ranks)
        self.addr, self.port = args.master_addr or "127.0.0.1", args.master_port or 0
        self.results: dict[int, Any] = {}
        self.timed_out: set[int] = set()  # pids this job's timer killed (pids get reused)
        self.hang_timeout = getattr(args, "hang_timeout", 0)  # 0: no watchdog, no timer

    def __enter__(self) -> Job:
        if self.torchrun:
            die_with_parent()  # torchrun's workers have sessions of their own: a SIGKILLed torchrun leaves them
            if not agent_hosts_store() and os.environ["RANK"] == "0":
                connect(STORE_TIMEOUT)  # hosted before any rank's env:// rendezvous waits on it (srun)
            return self
        self.store = None
        if 0 in self.ranks:
            try:
                self.store = host_store(self.addr, self.port, STORE_TIMEOUT)
            except OSError as e:  # an address not on this machine, a port in use: bad input
                _die(f"cannot listen on {self.addr}:{self.port} for the rendezvous: {e.strerror or e}",
                     status=2)
            self.port = self.store.port
        self.dir = Path(tempfile.mkdtemp(prefix="distkit-"))
        self.timer = FileTimerServer(str(self.dir / "timer"), run_id="distkit", max_interval=0.1,
                                     log_event=self._timer_event)
        self.timer.start()
        self._old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a KeyboardInterrupt
        # mp.spawn logs a warning for each rank it stops after a failure: the report says so once
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        self._done = threading.Event()
        threading.Thread(target=self._watch_stopped, daemon=True, name="distkit-job").start()
        return self

    def wrap(self, fn: Callable[[Worker, argparse.Namespace], Any]) -> functools.partial[None]:
        """``fn(worker, args)`` as ``mp.spawn``'s ``fn(i, args)``; fn must be module-level."""
        forked = _Surroundings() if _start_method == "forkserver" else False
        return functools.partial(_spawned, fn, tuple(self.ranks), self.addr, self.port, str(self.dir), forked)

    def run(self, fn: Callable[[Worker, argparse.Namespace], Any], args: argparse.Namespace) -> None:
        """Under torchrun: run this process's rank (torchrun reports a failure itself)."""
        worker = _env_worker(args)
        result = run_rank(fn, worker, args)
        if result is not None:
            self.results[worker.rank] = result

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> bool:
        if self.torchrun:
            return False
        try:
            if exc is None:
                self.results = {int(p.stem): torch.load(p, weights_only=False)
                                for p in sorted(self.dir.glob("*.pt"))}
            elif isinstance(exc, KeyboardInterrupt):
                _die("interrupted; all workers stopped", status=130)
            elif isinstance(exc, ProcessException):
                refusals = sorted(self.dir.glob("*.refused"))
                if refusals:  # a device the job cannot run with: its one line, as for bad flags
                    _die(refusals[0].read_text(), status=2)
                _die(self._root_cause(exc))
        finally:
            self._done.set()
            signal.signal(signal.SIGTERM, self._old_term)
            children = multiprocessing.active_children()  # after an interrupt they still run
            for p in children:
                if p.is_alive():
                    p.terminate()
            for p in children:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            self.timer.stop()
            self.store = None
            shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def _watch_stopped(self) -> None:
        """Once a rank has exited, SIGCONT the stopped ones for mp.spawn's SIGTERM. Before, SIGKILL one
        stopped past its file timer (a rank stopped writing to the timer's FIFO blocks its server)."""
        polls: dict[int, int] = {}  # pid -> polls in a row found it stopped (a Ctrl+Z here counts none)
        while not self._done.wait(STOPPED_POLL):
            parents = {}  # pid -> its parent as it started (a .pid file half written is skipped)
            for path in self.dir.glob("*.pid"):
                pid, _, parent = path.read_text().partition(" ")
                if pid.isdigit() and parent.isdigit():
                    parents[int(pid)] = int(parent)
            states = {pid: _state(pid) for pid in parents}
            stopped = [pid for pid, (state, parent) in states.items()  # not a reused pid: its parent too
                       if state in ("T", "t") and parent == parents[pid]]
            polls = {pid: polls.get(pid, 0) + 1 for pid in stopped}
            if any(state in ("Z", "X", None) for state, _ in states.values()):
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            elif self.hang_timeout:
                limit = self.hang_timeout + TIMER_MARGIN + 5  # the timer's, and then some
                for pid in [p for p, n in polls.items() if n * STOPPED_POLL > limit]:
                    self.timed_out.add(pid)
                    os.kill(pid, signal.SIGKILL)

    def _timer_event(self, name: str, request: Any) -> None:
        if name == "timer expired" and request is not None:
            self.timed_out.add(request.worker_pid)

    def _root_cause(self, exc: ProcessException) -> str:
        """The failure that came first (exit order says little: ranks record when they raised); a rank
        killed by a signal counts as first, unless the watchdog reported a hang (it ends the stopped)."""
        if hang := _first_record(self.dir, "hang"):
            return hang
        rank = self.ranks[exc.error_index]
        code = getattr(exc, "exit_code", 1)
        if code < 0 and exc.error_pid in self.timed_out:
            return (f"rank {rank} was frozen (no heartbeat for --hang_timeout + "
                    f"{TIMER_MARGIN:g} s) and was killed by its watchdog's timer; the job is stopped")
        if code < 0:
            return f"rank {rank} died (signal {signal.Signals(-code).name}); the job is stopped"
        if failed := _first_record(self.dir, "failed"):
            return failed
        return f"rank {rank} died (exit status {code}); the job is stopped"


def launch(fn: Callable[[Worker, argparse.Namespace], Any], args: argparse.Namespace) -> dict[int, Any]:
    """What every example's ``main()`` writes, for tests and benchmarks: ``{rank: fn(worker, args)}``."""
    with Job(args) as job:
        if job.torchrun:
            job.run(fn, args)
        else:  # mp.spawn(...) is mp.start_processes(..., start_method="spawn")
            mp.start_processes(job.wrap(fn), args=(args,), nprocs=job.nprocs, join=True, start_method=_start_method)
    return job.results


def _state(pid: int) -> tuple[str | None, int | None]:
    """A process's state in /proc (T: stopped, Z: exited) and its parent's pid, or Nones."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None, None
    return fields[0], int(fields[1])


def _first_record(job_dir: Path, kind: str) -> str | None:
    """``rank N failed:`` and the text of the earliest ``<rank>.<kind>`` record, or None."""
    first = min(((float(when), int(path.stem), text) for path in job_dir.glob(f"*.{kind}")
                 for when, _, text in [path.read_text().partition("\n")]), default=None)
    return f"rank {first[1]} failed:\n{first[2]}" if first else None


def _die(message: str, status: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)

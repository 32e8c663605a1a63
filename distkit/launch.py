"""Start the ranks: PyTorch's ``mp.spawn`` on this machine, or this one rank under torchrun.

Every example's ``main()`` writes the tutorial's launch itself::

    with distkit.Job(args) as job:
        mp.spawn(job.wrap(run_worker), args=(args,), nprocs=job.nprocs, join=True)

``torch.multiprocessing.spawn`` starts the processes, waits for them and ends the others
when one fails. ``Job`` adds what it does not give, each piece for the reason beside it:
- the rendezvous store on 127.0.0.1 and an OS-chosen port (c10d's own listens on every
  interface, on a port chosen in advance), used as torchrun's agent's store, so ``env://``
  behaves the same under both launchers;
- torchrun's file timer server: it kills a rank frozen whole (SIGSTOP), which no peer can
  end; ``_watch_stopped`` backs it up (a rank stopped while writing to the timer's FIFO
  blocks the server's ``readline`` for good);
- each rank's result, in a file: ``mp.spawn`` returns nothing;
- the report of the failure that came first (``mp.spawn`` reports the first exit it sees);
  a device the job cannot run with is one line and exit 2, as for a bad flag;
- Ctrl+C and SIGTERM: an interrupted ``mp.spawn`` leaves its ranks running;
- a stopped rank once another has exited: ``mp.spawn`` gives it 30 s to take a SIGTERM it
  cannot take until continued, so the job continues it (``_watch_stopped``).

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) ``job.torchrun``
is true and ``job.run`` runs this process's rank.
"""
from __future__ import annotations

import argparse
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from torch.distributed.elastic.timer import FileTimerServer

from .rendezvous import STORE_TIMEOUT, host_store, under_torchrun
from .watchdog import TIMER_FILE, TIMER_MARGIN
from .worker import Worker, die_with_parent, exit_now, run_rank


# A rank that raises waits this long before it exits: a peer killed by a signal (one it may
# have broken) takes a while to become reapable when it has many threads (RPC's pools), and
# mp.spawn blames the first exit it sees (seen in CI: ddp_rpc's SIGKILLed parameter server
# reported as the master's RPC error). test_a_rank_killed_as_its_peer_fails_is_the_root_cause
PEER_GRACE = 1.0
STOPPED_POLL = 0.5  # seconds between the job's looks at its ranks' states


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
    """The ``Worker`` of every process this command runs on this machine (torchrun: this one),
    before launch: ports are not known yet (0), enough to decide devices, not to connect."""
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


@dataclass(frozen=True)
class Rank:
    """``run_worker`` as ``mp.spawn`` calls it, ``fn(i, *args)``: the i-th rank of ``--ranks``,
    in the environment torchrun would have given it (``Job.wrap`` makes it)."""

    fn: Callable[[Worker, argparse.Namespace], Any]
    ranks: tuple[int, ...]
    addr: str
    port: int
    job_dir: str

    def __call__(self, index: int, args: argparse.Namespace) -> None:
        # mp.spawn asks for SIGINT when the launcher dies, which Python handles only between
        # bytecodes: a rank blocked in a collective would outlive a SIGKILLed launcher
        die_with_parent(multiprocessing.parent_process().pid)
        rank = self.ranks[index]
        os.environ.update(MASTER_ADDR=self.addr, MASTER_PORT=str(self.port), RANK=str(rank),
                          WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(index),
                          LOCAL_WORLD_SIZE=str(len(self.ranks)), TORCHELASTIC_USE_AGENT_STORE="True",
                          **{TIMER_FILE: os.path.join(self.job_dir, "timer")})
        worker = Worker(rank, args.world_size, index, len(self.ranks), self.addr, self.port, args.device)
        Path(self.job_dir, f"{rank}.pid").write_text(str(os.getpid()))  # for _watch_stopped
        try:
            result = run_rank(self.fn, worker, args,
                              failure_file=os.path.join(self.job_dir, f"{rank}.failed"))
        except BaseException:
            time.sleep(PEER_GRACE)
            exit_now(1)  # the launcher prints the traceback, once
        if result is not None:
            torch.save(result, os.path.join(self.job_dir, f"{rank}.pt"))
        exit_now(0)


class Job:
    """One launch: ``with Job(args) as job: mp.spawn(job.wrap(run_worker), ...)``.

    Afterwards ``job.results`` is ``{rank: what run_worker returned}`` for the ranks run here
    (None is left out). If a rank raises or dies, the job exits with status 1 after printing
    the failed rank's report once.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.torchrun = under_torchrun()
        self.ranks = [] if self.torchrun else parse_ranks(args.ranks, args.world_size)
        self.nprocs = len(self.ranks)
        self.addr = args.master_addr or "127.0.0.1"
        self.port = args.master_port or 0
        self.results: dict[int, Any] = {}
        self.timed_out: set[int] = set()  # pids this job's timer killed (pids get reused)
        self.hang_timeout = getattr(args, "hang_timeout", 0)  # 0: no watchdog, no timer

    def __enter__(self) -> Job:
        if self.torchrun:
            # torchrun starts each worker in a session of its own, so a SIGKILLed torchrun (no
            # cleanup runs) would leave its workers training on: they die with it, as spawned ones do
            die_with_parent()
            return self
        self.store = None
        if 0 in self.ranks:
            try:
                self.store = host_store(self.addr, self.port, STORE_TIMEOUT)
            except OSError as e:  # an address not on this machine, a port in use: bad input
                _die(f"cannot listen on {self.addr}:{self.port} for the rendezvous: "
                     f"{e.strerror or e}", status=2)
            self.port = self.store.port
        self.dir = Path(tempfile.mkdtemp(prefix="distkit-"))
        self.timer = FileTimerServer(str(self.dir / "timer"), run_id="distkit", max_interval=0.1,
                                     log_event=self._timer_event)
        self.timer.start()
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        # mp.spawn logs a warning for each rank it stops after a failure: the report says so once
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        self._done = threading.Event()
        threading.Thread(target=self._watch_stopped, daemon=True, name="distkit-job").start()
        return self

    def wrap(self, fn: Callable[[Worker, argparse.Namespace], Any]) -> Rank:
        """``fn(worker, args)`` as ``mp.spawn``'s ``fn(i, args)``; fn must be module-level."""
        return Rank(fn, tuple(self.ranks), self.addr, self.port, str(self.dir))

    def run(self, fn: Callable[[Worker, argparse.Namespace], Any], args: argparse.Namespace) -> None:
        """Under torchrun: run this process's rank (torchrun reports a failure itself)."""
        worker = _torchrun_worker(args)
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
            _stop(multiprocessing.active_children())  # after an interrupt they still run
            self.timer.stop()
            self.store = None
            shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def _watch_stopped(self) -> None:
        """Once a rank has exited, SIGCONT the stopped ones, so that mp.spawn's SIGTERM ends
        them at once. Before that, SIGKILL a rank stopped for longer than its file timer
        allows (counted in polls: time this launcher is stopped itself, Ctrl+Z, is not)."""
        polls: dict[int, int] = {}  # pid -> polls in a row that found it stopped
        while not self._done.wait(STOPPED_POLL):
            states = {}
            for path in self.dir.glob("*.pid"):
                try:
                    states[int(path.read_text())] = _state(int(path.read_text()))
                except ValueError:  # half written
                    continue
            stopped = [pid for pid, (state, parent) in states.items()
                       if state in ("T", "t") and parent == os.getpid()]
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
        """The failure that came first; the others are mostly its echoes (a peer's socket closing).

        Exit order says little: a rank that raises can take longer to exit than the peer whose
        connection it closed on the way out. So ranks record when they raised, and a rank
        killed by a signal (it could record nothing) counts as first, unless the hang watchdog
        reported a hang: its report names the stopped ranks, which it ends here itself.
        """
        hangs = sorted(_records(self.dir, "hang"))
        if hangs:
            return f"rank {hangs[0][1]} failed:\n{hangs[0][2]}"
        rank = self.ranks[exc.error_index]
        code = getattr(exc, "exit_code", 1)
        if code < 0 and exc.error_pid in self.timed_out:
            return (f"rank {rank} was frozen (no heartbeat for --hang_timeout + "
                    f"{TIMER_MARGIN:g} s) and was killed by its watchdog's timer; the job is stopped")
        if code < 0:
            return f"rank {rank} died (signal {signal.Signals(-code).name}); the job is stopped"
        records = sorted(_records(self.dir, "failed"))
        if records:
            return f"rank {records[0][1]} failed:\n{records[0][2]}"
        return f"rank {rank} died (exit status {code}); the job is stopped"


def launch(fn: Callable[[Worker, argparse.Namespace], Any], args: argparse.Namespace) -> dict[int, Any]:
    """What every example's ``main()`` writes, for tests and benchmarks: ``{rank: fn(worker, args)}``."""
    with Job(args) as job:
        if job.torchrun:
            job.run(fn, args)
        else:
            mp.spawn(job.wrap(fn), args=(args,), nprocs=job.nprocs, join=True)
    return job.results


def _state(pid: int) -> tuple[str | None, int | None]:
    """A process's state in /proc (T: stopped, Z: exited) and its parent's pid, or Nones."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None, None
    return fields[0], int(fields[1])


def _records(job_dir: Path, kind: str) -> list[tuple[float, int, str]]:
    """(when, rank, text) of each ``<rank>.<kind>`` record the ranks wrote."""
    records = []
    for path in job_dir.glob(f"*.{kind}"):
        when, _, text = path.read_text().partition("\n")
        records.append((float(when), int(path.stem), text))
    return records


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

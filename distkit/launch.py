"""Start the ranks: ``mp.spawn`` on this machine, or this one rank under torchrun (``job.run``).

Every example's ``main()`` writes the tutorial's launch, and hands the job what it started::

    with distkit.Job(args) as job:
        job.join(mp.spawn(job.wrap(run_worker), args=(args,), nprocs=job.nprocs, join=False))

``join=False`` rather than ``elastic_launch``: the tutorial's ``mp.spawn`` stays in sight, and the
``ProcessContext`` it returns holds the job's processes and joins them as ``join=True`` would.
``Job`` adds, each piece for the reason beside it:
- the store, on 127.0.0.1 and a port the OS picks: c10d's listens on every interface, on a set port;
- a file per record, as torchelastic's error files: the ranks' results (``mp.spawn`` returns nothing) and
  failures, for the first failure's report (``mp.spawn`` reports the first exit it sees; a refused device:
  exit 2); written whole and renamed, so a rank killed half-way through one leaves none, and nothing is
  read before the ranks are gone;
- Ctrl+C and SIGTERM (exit 130 and 143): an interrupted ``mp.spawn`` leaves its ranks running;
- ``GRACE``: ``mp.spawn`` gives a stopped rank 30 s to take a SIGTERM it cannot take.
Under torchrun, ``run`` is PyTorch's ``@record``: a rank's exception reaches torchrun's own summary.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.multiprocessing.spawn import ProcessContext, ProcessException, ProcessRaisedException

from .rendezvous import DONE, STORE_TIMEOUT, agent_hosts_store, connect, host_store, under_torchrun
from .profiling import traced
from .worker import Worker, die_with_parent, exit_now, run_rank

# a raising rank waits before it exits: a peer killed by a signal (with RPC's many threads) is slow to
# be reaped, and mp.spawn blames the first exit it sees (seen in CI: ddp_rpc's parameter server)
PEER_GRACE = 1.0
GRACE = 2.0  # after a failure, seconds for the other ranks to end, then to take SIGTERM, before SIGKILL
POLL = 0.5  # seconds between the job's looks at its ranks (a signal's KeyboardInterrupt lands between them)
spawn = mp.spawn  # what ``launch`` calls: mp.spawn, as every main() does (the tests' is tests/forkserver.py)


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


def _spawned(fn: Callable[[Worker, argparse.Namespace], Any], ranks: tuple[int, ...], addr: str, port: int,
             record_dir: str, index: int, args: argparse.Namespace) -> None:
    """``fn`` as ``mp.spawn`` calls it (``Job.wrap``): rank ``ranks[index]``, in torchrun's environment."""
    # mp.spawn's SIGINT when the launcher dies waits for Python's next bytecode, never in a collective
    die_with_parent(multiprocessing.parent_process().pid)
    rank = ranks[index]
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world_size),
                      LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(len(ranks)),
                      TORCHELASTIC_USE_AGENT_STORE="True")

    def post(kind: str, payload: Any) -> None:
        """A record for the launcher, the first of its kind (a failure posted again after the cleanup would
        come later than the peer it broke): whole or not there."""
        path = os.path.join(record_dir, f"{kind}.{rank}")
        if not os.path.exists(path):
            torch.save((time.time(), payload), path + ".part")
            os.replace(path + ".part", path)

    try:
        result = run_rank(fn, _env_worker(args), args, post)
        if result is not None:
            post("result", result)
    except BaseException:
        # its reason, also for what failed after fn (the cleanup, the store's release, the result's record);
        # the launcher prints the first record's traceback, once
        with contextlib.suppress(Exception):
            post("failed", traceback.format_exc())
        time.sleep(PEER_GRACE)
        exit_now(1)
    exit_now(0)


class Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher: ended as Ctrl+C is, with a SIGTERM's exit status."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated


class Job:
    """One launch; ``job.results``: ``{rank: run_worker's result}`` here; a failure: its report, exit 1.
    With ``trace`` (a directory), each rank's function runs under torch.profiler, written there."""

    def __init__(self, args: argparse.Namespace, trace: str | None = None) -> None:
        self.torchrun = under_torchrun()
        self.ranks = [] if self.torchrun else parse_ranks(args.ranks, args.world_size)
        self.world_size = args.world_size
        self.nprocs = len(self.ranks)
        self.addr, self.port = args.master_addr or "127.0.0.1", args.master_port or 0
        self.results: dict[int, Any] = {}
        self.records: list[tuple[str, int, float, Any]] = []  # (kind, rank, time, payload), each rank's post
        self._record_dir = ""  # where the ranks write them
        self.trace = trace
        self.context: ProcessContext | None = None

    def __enter__(self) -> Job:
        if self.torchrun:
            die_with_parent()  # torchrun's workers have sessions of their own: a SIGKILLed torchrun leaves them
            if not agent_hosts_store() and os.environ["RANK"] == "0":
                connect(STORE_TIMEOUT)  # hosted before any rank's env:// rendezvous waits on it (no shared store)
            return self
        self.store = None
        if 0 in self.ranks:
            try:
                self.store = host_store(self.addr, self.port, STORE_TIMEOUT)
            except OSError as e:  # an address not on this machine, a port in use: bad input
                _die(f"cannot listen on {self.addr}:{self.port} for the rendezvous: {e.strerror or e}",
                     status=2)
            self.port = self.store.port
        self._record_dir = tempfile.mkdtemp(prefix="distkit-records-")
        self._old_term = signal.signal(signal.SIGTERM, _terminated)  # a KeyboardInterrupt
        # mp.spawn logs a warning for each rank it stops after a failure: the report says so once
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        return self

    def wrap(self, fn: Callable[[Worker, argparse.Namespace], Any]) -> functools.partial[None]:
        """``fn(worker, args)`` as ``mp.spawn``'s ``fn(i, args)``; fn must be module-level."""
        return functools.partial(_spawned, traced(fn, self.trace), tuple(self.ranks), self.addr, self.port,
                                 self._record_dir)

    def join(self, context: ProcessContext) -> None:
        """Joins the ranks ``mp.spawn(..., join=False)`` started; a failure raises mp.spawn's exception. A
        rank stopped by SIGSTOP or a debugger is yours to resume or kill: its peers name it and leave."""
        self.context = context
        while not context.join(POLL, grace_period=GRACE):
            pass

    def run(self, fn: Callable[[Worker, argparse.Namespace], Any], args: argparse.Namespace) -> None:
        """Under torchrun: run this process's rank. ``@record`` writes a failure to torchrun's error file,
        which its summary shows; this rank's stderr has it too."""
        worker = _env_worker(args)
        result = record(run_rank)(traced(fn, self.trace), worker, args)
        if result is not None:
            self.results[worker.rank] = result

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> bool:
        if self.torchrun:
            return False
        try:  # only this job's ranks: after an interrupt they still run (a failure's join ended them)
            running = [p for p in (self.context.processes if self.context else []) if p.is_alive()]
            for p in running:
                p.terminate()
            for p in running:
                p.join(5)  # a SIGTERM handler of its own (extras' checkpoint) gets 5 s
                if p.is_alive():
                    p.kill()
                    p.join(5)
            self._read()  # every rank is gone: the records are in
            if exc is None and self.store is not None and len(self.ranks) < self.world_size:
                # the store's host stays, as torchrun's agents at their exit barrier, until the ranks on
                # other machines need it no more (rpc.shutdown reads it): a crashed one costs a wait
                with contextlib.suppress(dist.DistError):
                    dist.PrefixStore(DONE, self.store).wait([str(r) for r in range(self.world_size)])
        finally:
            signal.signal(signal.SIGTERM, self._old_term)
            shutil.rmtree(self._record_dir, ignore_errors=True)
            self.store = None
        if exc is None:
            self.results = {rank: value for kind, rank, _, value in self.records if kind == "result"}
        elif isinstance(exc, Terminated):  # as a shell reports a process that SIGTERM ended: 128 + 15
            _die("terminated (SIGTERM); all workers stopped", status=128 + signal.SIGTERM)
        elif isinstance(exc, KeyboardInterrupt):
            _die("interrupted; all workers stopped", status=130)
        elif isinstance(exc, ProcessException):
            if refused := self._first("refused"):  # a device the job cannot run with: one line, as for bad flags
                _die(refused[3], status=2)
            _die(self._root_cause(exc))
        return False

    def _read(self) -> None:
        """The ranks' records, ``kind.rank`` files (``.part``: one a killed rank left half written)."""
        for name in os.listdir(self._record_dir):
            if not name.endswith(".part"):
                kind, rank = name.split(".")
                self.records.append((kind, int(rank), *torch.load(os.path.join(self._record_dir, name),
                                                                   weights_only=False)))

    def _first(self, kind: str) -> tuple[str, int, float, Any] | None:
        return min((r for r in self.records if r[0] == kind), key=lambda r: r[2], default=None)

    def _root_cause(self, exc: ProcessException) -> str:
        """The failure that came first (exit order says little: ranks record when they raised); a rank
        killed by a signal counts as first, unless the watchdog reported a hang (a stopped rank is ended
        after its peers named it). A failure and a hang both recorded: both, the earlier first."""
        reports = sorted((r for r in (self._first("failed"), self._first("hang")) if r), key=lambda r: r[2])
        if any(kind == "hang" for kind, *_ in reports):
            return "\n".join(f"rank {rank} failed:\n{text}" for _, rank, _, text in reports)
        rank, code = self.ranks[exc.error_index], getattr(exc, "exit_code", 1)
        if code < 0:
            return f"rank {rank} died (signal {signal.Signals(-code).name}); the job is stopped"
        if failed := self._first("failed"):
            return f"rank {failed[1]} failed:\n{failed[3]}"
        if isinstance(exc, ProcessRaisedException):  # raised outside run_rank: mp.spawn kept its traceback
            return f"rank {rank} failed:\n{str(exc).split(' terminated with the following error:', 1)[-1].strip()}"
        return f"rank {rank} died (exit status {code}); the job is stopped"


def launch(fn: Callable[[Worker, argparse.Namespace], Any], args: argparse.Namespace) -> dict[int, Any]:
    """What every example's ``main()`` writes, for tests and benchmarks: ``{rank: fn(worker, args)}``."""
    with Job(args) as job:
        if job.torchrun:
            job.run(fn, args)
        else:
            job.join(spawn(job.wrap(fn), args=(args,), nprocs=job.nprocs, join=False))
    return job.results


def _die(message: str, status: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)

"""What every rank sets up for itself: ``distkit.start_rank(rank, args)``, the first line of each
example's ``run_worker``, spawned by ``mp.spawn`` or started by torchrun. Each piece, for its case:

- a SIGKILL when the launcher dies (``die_with_parent``): mp.spawn's own SIGINT waits for Python's
  next bytecode, so a rank blocked in C outlived its launcher by minutes;
- a ``[rank N]`` prefix on its log lines, its share of the cores (N ranks on 2 cores would preempt
  each other), and loopback-only sockets for a job on 127.0.0.1 (gloo and TensorPipe listen on the
  network otherwise);
- the hang bound of ``--hang_timeout`` (``HangBound``), which PyTorch bounds per call only;
- ``--trace``: torch.profiler around the whole rank;
- ``quiet_distributed_optimizer``: DistributedOptimizer's noise, hidden on every rank that calls it;
- its end (``_end``): the rank's output flushed, then ``os._exit``, past the interpreter's teardown,
  which can block (a peer gone) or abort (a gloo thread, pytorch/pytorch#190489). mp.spawn ends a
  rank with ``sys.exit(status)``, once its error file holds a raise; the examples' ``__main__``
  guards too (under torchrun, whose ``sys.exit(main())`` looks ``sys.exit`` up before ``main()``
  runs ``start_rank``, from distkit's import on); an exception under torchrun reaches
  ``sys.excepthook`` once ``@record`` has written torchrun's error file. A rank that raises is so
  reported within seconds, whatever would follow. A rank that fails waits ``LAST_WORDS`` s before
  it exits: a peer that fails because it is gone ("Connection closed by peer") fails that much
  later, and mp.spawn's report and torchrun's root cause name the rank that failed first (both
  took the peer's failure, seen at the same poll, for the first).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import ipaddress
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed.rpc as rpc
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from .device import threads_per_process
from .profiling import start_trace

START_BOUND = 120.0  # seconds a rank may take to its first progress (start-up, rendezvous), at least
MARGIN = 3.0  # faulthandler's own timer fires this long after the bound: only if the GIL is held
# a rank that saw the hang waits this long before it exits (its end ends the job): its peers print their
# stacks, one whose GIL is held too (faulthandler's timer, MARGIN s after the bound)
PEER_GRACE = MARGIN + 1.0
LAST_WORDS = 1.0  # a failing rank's wait before it exits: over a second, torchrun's error files' resolution
_state: dict[str, Any] = {}  # this process's rank, its hang bound and its trace: set by start_rank


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def local_rank(rank: int) -> int:
    """This rank's index among the processes on its machine: torchrun's LOCAL_RANK, else the rank."""
    return int(os.environ.get("LOCAL_RANK", rank))


def local_world_size(args: argparse.Namespace) -> int:
    """The processes on this machine: torchrun's LOCAL_WORLD_SIZE, else every rank of the job."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))


def start_rank(rank: int, args: argparse.Namespace) -> None:
    """Set this process up as ``rank`` (see the module's docstring); once per process."""
    if _state:
        return
    spawned = multiprocessing.parent_process()
    die_with_parent(spawned.pid if spawned else os.getppid())
    _state["rank"] = rank
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if is_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1")) and "lo" in {n for _, n in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore", message="You are using a Backend")  # rpc.shutdown's own deprecation
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stdout, force=True)
    torch.set_num_threads(getattr(args, "threads", None) or threads_per_process(local_world_size(args)))
    if getattr(args, "trace", None):
        _state["trace"] = start_trace(args.trace, f"rank{rank}")
    if getattr(args, "hang_timeout", None):  # 0 or None: no bound
        _state["bound"] = HangBound(rank, args.hang_timeout)
    sys.exit = _end  # type: ignore[assignment]
    sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    sys.__excepthook__(kind, value, tb)
    _end(1)


def _end(status: object = None) -> NoReturn:
    """``sys.exit`` in a rank: write the trace, flush, and leave (see the module's docstring)."""
    if stop := _state.pop("trace", None):
        with contextlib.suppress(Exception):
            stop()
    code = status if isinstance(status, int) else 0 if status is None else 1
    if code:  # a failure: first in the launcher's eyes (see the module's docstring)
        time.sleep(LAST_WORDS)
    exit_now(code)


def exit_now(status: int) -> NoReturn:
    """End this process without the interpreter's teardown: a gloo thread taking the GIL as the
    interpreter finalizes is std::terminate, SIGABRT for a finished run (pytorch/pytorch#190489)."""
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


if under_torchrun():  # this process is one rank: its ``sys.exit(main())`` takes sys.exit before start_rank
    sys.exit = _end  # type: ignore[assignment]


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL when the launcher (``parent``) dies, even by SIGKILL; at once if it already has."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # libc's; none off Linux, nor a parent's signal there
    if prctl is None:
        return
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (linux/prctl.h), as mp.spawn's ranks have it with SIGINT
    if os.getppid() != parent:  # it died before the call: no signal will come for it now
        os.kill(os.getpid(), signal.SIGKILL)


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


class HangBound:
    """``--hang_timeout``: a rank that makes no progress for that long prints why and every thread's
    stack, and exits 1, which ends the job (mp.spawn or torchrun stops the others).

    Progress: a module's forward or an optimizer step (PyTorch's global hooks), an answer to
    ``ping`` (a role that waits on others: ``wait_on``), a checkpoint's save (``progress``). Why ours:
    PyTorch bounds one call (the process group's ``timeout=``, ``rpc_timeout``), not a rank stuck
    between calls or in its own code. A thread checks each second; ``faulthandler``'s timer, re-armed
    by it, ends a rank whose interpreter is frozen (the GIL held), ``MARGIN`` s later."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self.last, self.seen = time.monotonic(), False  # the last progress; any yet
        self.interval = min(1.0, max(0.05, timeout / 10))
        register_module_forward_hook(self.progress)
        register_optimizer_step_post_hook(self.progress)
        threading.Thread(target=self._watch, name="distkit-hang-bound", daemon=True).start()

    def progress(self, *_: Any) -> None:
        if torch.compiler.is_compiling():  # the tracer split exports the model
            return
        self.last = time.monotonic()
        if not self.seen:  # the bound drops to --hang_timeout: faulthandler's timer too, now (a GIL held
            self.seen = True  # from here on would keep the thread below from re-arming it, for START_BOUND)
            faulthandler.dump_traceback_later(self.timeout + MARGIN, exit=True, file=sys.__stderr__)

    def _watch(self) -> None:
        armed = None
        while True:
            time.sleep(self.interval)
            last, seen = self.last, self.seen
            bound = self.timeout if seen else max(self.timeout, START_BOUND)
            idle = time.monotonic() - last
            if idle > bound:
                self._end(idle)
            if armed != (last, seen):  # each call starts a C thread: once per interval at most
                armed = (last, seen)
                faulthandler.dump_traceback_later(bound - idle + MARGIN, exit=True, file=sys.__stderr__)

    def _end(self, idle: float) -> NoReturn:
        faulthandler.cancel_dump_traceback_later()
        message = (f"no progress (a forward, an optimizer step, a checkpoint, a peer's answer) for {idle:.0f} s, "
                   f"over --hang_timeout {self.timeout:g}: a hang; rank {self.rank} ends the job, its threads' "
                   "stacks follow")
        with contextlib.suppress(Exception):  # stderr on a full disk: the exit below comes regardless
            print(f"[rank {self.rank}] {message}", file=sys.stderr, end="")
            try:  # the stacks in one write: the peers that end at once do not interleave theirs with them
                with tempfile.TemporaryFile() as stacks:
                    faulthandler.dump_traceback(file=stacks, all_threads=True)
                    stacks.seek(0)
                    print("\n" + stacks.read().decode(), file=sys.stderr, end="", flush=True)
            except OSError:  # no room for the file
                print(file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if under_torchrun():  # its error file, for torchrun's summary
            with contextlib.suppress(Exception):
                from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
                try:
                    raise TimeoutError(message)
                except TimeoutError as e:
                    ErrorHandler().record_exception(e)
        time.sleep(PEER_GRACE)  # a deadlock's peers reach their bound about now: their stacks first
        os._exit(1)


def progress() -> None:
    """Count a step that is no forward or optimizer step (a checkpoint's save) as progress."""
    if bound := _state.get("bound"):
        bound.progress()


def ping(name: str, timeout: float) -> None:
    """Worker ``name`` answers an RPC within ``timeout`` s, or this raises; an answer is progress."""
    rpc.rpc_sync(name, time.monotonic, timeout=timeout)
    progress()


def wait_on(*names: str, timeout: float) -> None:
    """A role that waits on others (an observer, a parameter server): a thread pings ``names`` each
    second, and their answers are its progress, so its hang bound measures theirs. An unanswered
    ping is no progress; RPC shut down here ends the thread."""
    def pinging() -> None:
        while True:
            for name in names:
                try:
                    ping(name, timeout)
                except RuntimeError:
                    try:
                        rpc.get_worker_info()
                    except RuntimeError:  # RPC is shut down here
                        return
            time.sleep(1.0)

    threading.Thread(target=pinging, name="distkit-wait-on", daemon=True).start()


def quiet_distributed_optimizer() -> None:
    """What ``DistributedOptimizer`` prints on every rank whatever the user does, hidden: the TorchScript
    functional optimizers' DeprecationWarning (optim.SGD), raised under ``simplefilter("always")``, which
    beats any filter, and its advice to use a functional optimizer (any other class). Call it on every rank."""
    if getattr(warnings.showwarning, "quiet", False):
        return
    show = warnings.showwarning

    def showwarning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if not (issubclass(category, DeprecationWarning) and str(message).startswith(
                "`TorchScript` support for functional optimizers is deprecated")):
            show(message, category, *args, **kwargs)

    showwarning.quiet = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
    logging.getLogger("torch.distributed.optim.optimizer").addFilter(
        lambda record: "without a functional optimizer" not in record.getMessage())

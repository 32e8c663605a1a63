"""What runs inside every rank, spawned or under torchrun: ``run_rank`` wraps ``run_worker`` with
logging, threads, loopback-only sockets, the watchdog and a cleanup that always runs."""
from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import watchdog
from .device import DeviceError, pick_device, threads_per_process
from .rendezvous import is_loopback, release_store, under_torchrun


@dataclass(frozen=True)
class Worker:
    """What one process knows about its place in the job."""

    rank: int
    world_size: int
    local_rank: int  # index among the processes on this machine
    local_world_size: int
    master_addr: str
    master_port: int
    device_preference: str = "auto"

    def device(self, min_gpus: int = 1) -> torch.device:
        return pick_device(self.device_preference, self.local_rank, min_gpus)


def exit_process(status: int) -> NoReturn:
    """End the program (every example's ``__main__`` guard); under torchrun as spawned ranks end."""
    if under_torchrun():
        exit_now(status)
    sys.exit(status)


def exit_now(status: int) -> NoReturn:
    """End a rank's process without the interpreter's teardown: a gloo thread taking the GIL as the
    interpreter finalizes is std::terminate, SIGABRT for a finished run (pytorch/pytorch#190489)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_rank(fn: Callable, worker: Worker, args: argparse.Namespace,
             post: Callable[[str, Any], None] | None = None) -> Any:
    """``fn(worker, args)``. Spawned, its failure, hang or refused device goes to ``post(kind, text)``
    for the launcher's report; under torchrun (``post`` None) a hang or refusal is printed here."""
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if is_loopback(worker.master_addr) and "lo" in {name for _, name in socket.if_nameindex()}:
        # a job on loopback runs here alone: gloo and TensorPipe would listen on the network too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore", message="You are using a Backend")  # rpc.shutdown's own deprecation
    logging.basicConfig(level=logging.INFO, format=f"[rank {worker.rank}] %(message)s",
                        stream=sys.stdout, force=True)
    torch.set_num_threads(args.threads or threads_per_process(worker.local_world_size))
    report = post or (lambda kind, message: print(f"error: {message}", file=sys.stderr, flush=True))
    timeout = getattr(args, "hang_timeout", None)  # 0 or None: no watchdog
    hang = functools.partial(report, "hang")
    watch = watchdog.Watchdog(worker.rank, worker.world_size, timeout, hang).start() if timeout else None
    try:
        result = fn(worker, args)
    except DeviceError as e:  # machines that disagree on the device: one line, exit 2 as for a bad flag
        report("refused", str(e))
        cleanup(graceful=False)
        if post:
            raise
        raise SystemExit(2) from None
    except BaseException:
        if post:  # before cleanup: cleaning up is what makes the peers fail next
            post("failed", traceback.format_exc())
        cleanup(graceful=False)
        raise
    cleanup(graceful=True)  # watched too: a graceful shutdown waits for every peer
    if watch:  # before the store may go: a watchdog left reading it would report its loss
        watch.stop()
    release_store(worker.rank, worker.world_size)  # this rank needs the job's store no more
    return result


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


def cleanup(graceful: bool = True) -> None:
    """Shut down RPC and the process group; after an error not gracefully (the peers may never answer)."""
    try:
        rpc.get_worker_info()
    except RuntimeError:
        pass  # no RPC agent
    else:
        rpc.shutdown(graceful=graceful)
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent(parent: int | None = None) -> None:
    """Linux: SIGKILL when the launcher (``parent``, default: the parent now) dies, even by SIGKILL."""
    parent = parent or os.getppid()
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # libc's; none off Linux, nor a parent's signal there
    if prctl is None:
        return
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (linux/prctl.h), as mp.spawn's ranks have it with SIGINT
    if os.getppid() != parent:  # it died before the call: no signal will come for it now
        os.kill(os.getpid(), signal.SIGKILL)

"""What runs inside every rank, spawned or under torchrun: set-up, cleanup and exit.

``run_rank`` wraps an example's ``run_worker``: logging with the rank in front, thread
limits, loopback-only sockets for a one-machine job, and a cleanup that always shuts the
RPC agent and the process group down. ``exit_process`` ends a rank without the
interpreter's teardown, ``die_with_parent`` makes sure no rank outlives its launcher.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import watchdog
from .device import DeviceError, pick_device, threads_per_process
from .rendezvous import is_loopback, under_torchrun


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
    """End the program with ``status``: every example's ``__main__`` guard calls it.

    Under torchrun this process was a rank, and ends as spawned ranks do (``exit_now``).
    """
    if under_torchrun():
        exit_now(status)
    sys.exit(status)


def exit_now(status: int) -> NoReturn:
    """End a rank's process without the interpreter's teardown.

    Its process group is destroyed by now, but the group's objects can outlive that call
    (FSDP's and DTensor's state hold them), and so can gloo's worker threads, one of which
    may still be letting go of the tensor of a collective that has just finished (the loss
    a rank all-reduced). With torch 2.14 dropping a C++ reference to a tensor that Python
    has seen takes the GIL, and a thread that asks for the GIL while the interpreter
    finalizes is ended inside a destructor: std::terminate, and a run that finished is
    reported as killed by SIGABRT (1 exit in 10 of ``pipelining_transformer --dp_size 2``
    on 2 cores; pytorch/pytorch#190489, and the upstream fix #179291 was abandoned).
    Nothing is left to do here: the results are on disk, and the output is flushed below.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_rank(fn: Callable, worker: Worker, args: argparse.Namespace, failure_file: str | None = None) -> Any:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if is_loopback(worker.master_addr) and "lo" in {name for _, name in socket.if_nameindex()}:
        # A job whose rendezvous is on loopback (spawned here, or torchrun --standalone)
        # runs on this machine alone; gloo and TensorPipe would otherwise listen on the
        # interface the hostname resolves to, reachable from the network.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    # torch.distributed.rpc's own shutdown trips this deprecation; nothing a user can act on
    warnings.filterwarnings("ignore", message="You are using a Backend")
    logging.basicConfig(level=logging.INFO, format=f"[rank {worker.rank}] %(message)s",
                        stream=sys.stdout, force=True)
    torch.set_num_threads(args.threads or threads_per_process(worker.local_world_size))
    watch = watchdog.start(worker.rank, worker.world_size, getattr(args, "hang_timeout", None),
                           functools.partial(_report_hang, failure_file))
    try:
        result = fn(worker, args)
    except DeviceError as e:
        # a device choice this job cannot run with (machines that disagree): one line, no
        # traceback, exit 2 as for a bad flag; spawned, the launcher prints it
        if failure_file:
            Path(failure_file).with_suffix(".refused").write_text(str(e))
        cleanup(graceful=False)
        if failure_file:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except BaseException:
        if failure_file:  # before cleanup: cleaning up is what makes the peers fail next
            Path(failure_file).write_text(f"{time.time()}\n{traceback.format_exc()}")
        cleanup(graceful=False)
        raise
    cleanup(graceful=True)  # watched too: a graceful shutdown waits for every peer
    if watch:
        watch.stop()
    return result


def _report_hang(failure_file: str | None, message: str) -> None:
    """The hang report: for the launcher to print (spawned), or printed here (torchrun).

    Spawned, it is a ``.hang`` record, not a ``.failed`` one: the job's cause, whichever
    rank's exit the launcher sees first (the stopped ranks the claimant kills included)."""
    if failure_file:
        Path(failure_file).with_suffix(".hang").write_text(f"{time.time()}\n{message}")
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)


_TORCHSCRIPT_OPTIMIZER_WARNING = "`TorchScript` support for functional optimizers is deprecated"


def silence_torchscript_optimizer_warning() -> None:
    """Hide PyTorch's DeprecationWarning for TorchScript functional optimizers, that one only.

    ``DistributedOptimizer`` (which the RPC tutorials teach) builds a TorchScript
    functional optimizer on every process that owns parameters, and each prints that
    warning: ``torch.distributed.rpc`` is in maintenance mode and nothing the user can
    change avoids it. Call it on every rank of a job that uses ``DistributedOptimizer``:
    the owners (the remote side included) are where it is raised.
    """
    if getattr(warnings.showwarning, "quiet_torchscript_optimizer", False):
        return
    # PyTorch raises it under catch_warnings() + simplefilter("always"), which overrides
    # any filter set here; what it shows still goes through warnings.showwarning
    show = warnings.showwarning

    def showwarning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, DeprecationWarning) and str(message).startswith(_TORCHSCRIPT_OPTIMIZER_WARNING):
            return
        show(message, category, *args, **kwargs)

    showwarning.quiet_torchscript_optimizer = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def cleanup(graceful: bool = True) -> None:
    """Shut down whatever RPC agent or process group is still up.

    After an error the RPC shutdown is not graceful: a graceful one waits for every peer,
    and a failed job's peers may never answer.
    """
    try:
        rpc.get_worker_info()
        rpc_up = True
    except RuntimeError:
        rpc_up = False
    if rpc_up:
        rpc.shutdown(graceful=graceful)
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent(parent: int | None = None) -> None:
    """Linux: get SIGKILL when the launcher dies, even by SIGKILL, so no worker is orphaned.

    ``parent``: the launcher's pid, if known (else the parent this process has now).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = parent or os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # it died before the call: no signal will come for it now
        os.kill(os.getpid(), signal.SIGKILL)

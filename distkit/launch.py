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
import ctypes
import ipaddress
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout
from multiprocessing import connection as mp_connection

from .device import DEVICE_CHOICES, DeviceError, Placement, pick_device, threads_per_process

log = logging.getLogger("distkit")

STORE_TIMEOUT = timedelta(seconds=120)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except the unset ones (their help says what happens instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump) and exit with status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def add_launch_args(parser: argparse.ArgumentParser, world_size: int | None,
                    rpc_timeout: float | None = None, device: bool = True) -> None:
    """The flags every example shares. ``world_size=None``: torchrun or --world_size decides.

    ``rpc_timeout`` (seconds), for the RPC examples, becomes the ``--rpc_timeout`` default:
    no RPC waits longer for a peer that is gone. ``device=False``: no ``--device`` flag, for
    an example that runs on the CPU whatever is there (it would be a flag that does nothing).
    """
    g = parser.add_argument_group("launch")
    if rpc_timeout is not None:
        g.add_argument("--rpc_timeout", type=float, default=rpc_timeout,
                       help="seconds an RPC may take before it fails")
    g.add_argument("--world_size", type=int, default=None,
                   help=f"number of processes in the job (default: {world_size or 'required'}; "
                        "under torchrun: torchrun's)")
    # kept apart from --world_size's own default, so that torchrun's WORLD_SIZE can win
    # over the example's default but not over a --world_size the user typed
    parser.set_defaults(default_world_size=world_size)
    g.add_argument("--master_addr", default=None,
                   help="address of the machine running rank 0 (default: 127.0.0.1, this machine)")
    g.add_argument("--master_port", type=int, default=None,
                   help="rendezvous port on the master (default: a free one chosen by the OS)")
    g.add_argument("--ranks", default=None, metavar="A-B",
                   help="ranks this machine runs, for a run over several machines (default: all)")
    if device:
        g.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                       help="auto uses CUDA (and NCCL) where enough GPUs are visible, else CPU (and gloo)")
    else:
        parser.set_defaults(device="cpu")
    g.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per process (default: this machine's cores / its processes)")


def check_launch_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      min_world_size: int = 1, max_world_size: int | None = None) -> None:
    """Reject bad launch flags with a one-line error before any process starts."""
    if under_torchrun():
        env_size = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, env_size):
            parser.error(f"--world_size {args.world_size} disagrees with torchrun's WORLD_SIZE={env_size}")
        args.world_size = env_size
    if args.world_size is None:
        args.world_size = getattr(args, "default_world_size", None)
    if args.world_size is None:
        parser.error("--world_size is required")
    if args.world_size < min_world_size:
        parser.error(f"--world_size must be at least {min_world_size}, got {args.world_size}")
    if max_world_size is not None and args.world_size > max_world_size:
        parser.error(f"--world_size must be at most {max_world_size}, got {args.world_size}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if hasattr(args, "rpc_timeout"):  # nan or inf would leave every RPC unbounded
        require_positive(parser, "--rpc_timeout", args.rpc_timeout)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    try:
        ranks = parse_ranks(args.ranks, args.world_size)
    except ValueError as e:
        parser.error(str(e))
    if 0 not in ranks and (args.master_addr is None or args.master_port is None):
        parser.error("a machine that does not run rank 0 needs --master_addr and --master_port")


def require_positive(parser: argparse.ArgumentParser, flag: str, value: float) -> None:
    """A one-line error unless ``value`` is a positive, finite number.

    argparse's ``float`` accepts "nan" and "inf", and ``nan <= 0`` is False, so a plain
    ``value <= 0`` check lets both through.
    """
    if not (math.isfinite(value) and value > 0):
        parser.error(f"{flag} must be a positive number, got {value}")


def check_finite(loss: float, where: str) -> float:
    """``loss`` if it is a finite number, else FloatingPointError naming ``where``.

    A nan or inf loss poisons every parameter at the next step, and training on from there
    prints nan and exits 0: stop the job instead (the launcher reports it, exit status 1).
    """
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} at {where}: training diverged "
                                 "(try a lower --lr or other sizes)")
    return loss


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


def check_placements(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     placement: Callable[[Worker, argparse.Namespace], Placement]) -> None:
    """Ask an example's ``placement(worker, args)`` for every local process before any starts:
    a device this machine cannot provide is a one-line error (exit 2), not a worker's crash."""
    for worker in local_workers(args):
        try:
            placement(worker, args)
        except DeviceError as e:
            parser.error(str(e))


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
        _die_with_parent()
        worker = _torchrun_worker(args)
        return {worker.rank: _run(fn, worker, args)}  # torchrun reports a failure itself
    return _spawn(fn, args)


def _spawn(fn: Callable, args: argparse.Namespace) -> dict[int, Any]:
    ranks = parse_ranks(args.ranks, args.world_size)
    addr = args.master_addr or "127.0.0.1"
    store = None
    if 0 in ranks:
        # This process hosts the store, bound to ``addr`` only: a single-machine run is
        # reachable from loopback alone (c10d's own TCPStore server listens on every interface).
        try:
            store = _host_store(addr, args.master_port or 0, STORE_TIMEOUT)
        except OSError as e:  # an address not on this machine, a port in use: bad input
            _die(f"cannot listen on {addr}:{args.master_port or 0} for the rendezvous: "
                 f"{e.strerror or e}", status=2)
        port = store.port
    else:
        port = args.master_port
    result_dir = Path(tempfile.mkdtemp(prefix="distkit-"))
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_spawned, args=(i, fn, args, ranks, addr, port, str(result_dir)),
                           name=f"rank{rank}") for i, rank in enumerate(ranks)]
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for p in procs:
            p.start()
        _wait(procs, ranks, result_dir)
        return {int(p.stem): torch.load(p, weights_only=False) for p in sorted(result_dir.glob("*.pt"))}
    except KeyboardInterrupt:
        _die("interrupted; all workers stopped", status=130)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        _stop(procs)
        del store
        shutil.rmtree(result_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def _wait(procs: list, ranks: list[int], result_dir: Path) -> None:
    """Return once every worker has exited 0; at the first failure stop them all and exit 1."""
    while True:
        failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            _stop(procs)
            refusals = sorted(result_dir.glob("*.refused"))
            if refusals:  # a device the job cannot run with: its one line, as for bad flags
                _die(refusals[0].read_text(), status=2)
            _die(_root_cause(failed, procs, ranks, result_dir))
        if all(p.exitcode == 0 for p in procs):
            return
        mp_connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=1)


def _root_cause(failed: list[int], procs: list, ranks: list[int], result_dir: Path) -> str:
    """The failure that came first; the others are mostly its echoes (a peer's socket closing).

    Exit order says little: a rank that raises can take longer to exit than the peer whose
    connection it closed on the way out. So workers record when they raised, and a rank
    killed by a signal (it could record nothing) counts as first.
    """
    for i in failed:
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
    _die_with_parent(mp.parent_process().pid)
    rank = ranks[index]
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(index),
                      LOCAL_WORLD_SIZE=str(len(ranks)), TORCHELASTIC_USE_AGENT_STORE="True")
    worker = Worker(rank, args.world_size, index, len(ranks), addr, port, args.device)
    try:
        result = _run(fn, worker, args, failure_file=os.path.join(result_dir, f"{rank}.failed"))
    except BaseException:
        _exit_now(1)  # the launcher prints the traceback, once
    if result is not None:
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    _exit_now(0)


def exit_process(status: int) -> NoReturn:
    """End the program with ``status``: every example's ``__main__`` guard calls it.

    Under torchrun this process was a rank, and ends as spawned ranks do (``_exit_now``).
    """
    if under_torchrun():
        _exit_now(status)
    sys.exit(status)


def _exit_now(status: int) -> NoReturn:
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


def _run(fn: Callable, worker: Worker, args: argparse.Namespace, failure_file: str | None = None) -> Any:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if _is_loopback(worker.master_addr) and "lo" in {name for _, name in socket.if_nameindex()}:
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
    cleanup(graceful=True)
    return result


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


def _host_store(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A store server listening on ``addr`` only (c10d's own listens on every interface)."""
    listener = socket.create_server((addr, port))
    # the store takes ownership of the socket and closes it when it goes
    return dist.TCPStore(addr, listener.getsockname()[1], is_master=True,
                         master_listen_fd=listener.detach(), wait_for_workers=False, timeout=timeout)


def _agent_hosts_store() -> bool:
    """Whether a launcher hosts the job's store: distkit's, or torchrun's agent by default.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` given to torchrun (the multi-machine restart
    command of docs/multi_host.md) means no agent does: torchrun picks a port on rank 0's
    machine each round and rank 0's worker must host the store there.
    """
    return not under_torchrun() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_hosted: dist.TCPStore | None = None  # the store this process hosts, if it is that rank 0


def _connect(timeout: timedelta) -> dist.Store:
    """This process's connection to the job's store at ``MASTER_ADDR:MASTER_PORT``;
    rank 0 starts the store there on its first call if no launcher hosts it."""
    global _hosted
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if _hosted is None and not _agent_hosts_store() and os.environ["RANK"] == "0":
        _hosted = _host_store(addr, port, timeout)
        return _hosted
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)


def restart_key() -> str:
    """A key prefix that keeps this torchrun restart's keys apart from those of the groups
    before it, in a store that outlives them (torchrun's agent's, shared by every restart);
    "" where each restart has a store of its own, since machines may count restarts
    differently (pytorch/pytorch#135712)."""
    if under_torchrun() and _agent_hosts_store():
        return f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return ""


def job_store(prefix: str) -> dist.Store:
    """A client of the job's rendezvous store, with its own key prefix.

    A second process group (DDP among a subset of an RPC job's ranks) rendezvouses here
    instead of on a second port: one port per job, no collisions, loopback-only locally.
    """
    return dist.PrefixStore(prefix, _connect(STORE_TIMEOUT))


def process_group_store() -> dist.Store | None:
    """The store for ``init_process_group(store=...)``: None (use ``env://``) except under
    torchrun, where it is the job's store under a prefix per restart.

    Why: torchrun (PyTorch 2.14) hosts the workers' store in its agent and keeps that one
    server for every restart of the group (``_shared_tcp_store_server`` in
    dynamic_rendezvous.py), while ``env://`` connects to it with no per-attempt prefix (its
    comment still says each retry gets a new store). Every key the killed group wrote is
    there when the restarted group rendezvouses: gloo's full-mesh connect of a new rank can
    read the address a dead rank published, and the new group fails ("Connection refused")
    or waits forever in ``_create_gloo_process_group``, depending on which side of each pair
    dials. The more the ranks' start-up times differ, the likelier (pytorch/pytorch#135712).
    ``TORCHELASTIC_RESTART_COUNT`` counts the restarts of this machine's worker group; all
    ranks agree on it under ``--standalone`` and whenever every machine's group failed.
    With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` given to torchrun there is no shared store:
    rank 0 hosts a new one each round (``_connect``; ``env://`` would start a second server
    on its port when ``agree_on_backend`` already started it) and no prefix is needed.
    """
    if not under_torchrun():
        return None
    return dist.PrefixStore(f"process_group/{restart_key()}", _connect(default_pg_timeout))


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def _die_with_parent(parent: int | None = None) -> None:
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

"""The job's rendezvous store: who hosts it (the launcher, torchrun's agent, or rank 0), how every
rank connects, and the key prefixes that let every group of a job share it: one port per job."""
from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

STORE_TIMEOUT = timedelta(seconds=120)
DONE = "distkit/done/"  # the keys of the ranks that need the job's store no more


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def srun_problem(script: str) -> str | None:
    """Why this process, one of an ``srun`` step's several tasks outside torchrun, cannot run ``script``
    (each would be a whole job of its own), with the command that works; None elsewhere (``srun -n 1``,
    an sbatch script's own shell: its SLURM_NTASKS is no step's)."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if under_torchrun() or tasks == "1":
        return None
    return (f"srun started {tasks} tasks of {script} (SLURM_STEP_NUM_TASKS={tasks}), and each would run a job of its "
            f"own: start one torchrun per node instead, `srun --ntasks-per-node 1 .venv/bin/torchrun --nnodes "
            f"$SLURM_NNODES --nproc_per_node N --rdzv_backend c10d --rdzv_endpoint FIRST_NODE:PORT {script}`, "
            f"as scripts/slurm/train.sbatch does (docs/multi_host.md)")


def host_store(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A store server listening on ``addr`` only (c10d's own listens on every interface)."""
    listener = socket.create_server((addr, port))  # the store owns it then, and closes it
    return dist.TCPStore(addr, listener.getsockname()[1], is_master=True,
                         master_listen_fd=listener.detach(), wait_for_workers=False, timeout=timeout)


def agent_hosts_store() -> bool:
    """distkit's launcher or torchrun's agent hosts the store; rank 0 does, each round, with torchrun's
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/multi_host.md)."""
    return not under_torchrun() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_hosted: dist.TCPStore | None = None  # the store this process hosts, if it is that rank 0


def connect(timeout: timedelta) -> dist.Store:
    """A client of the job's store; rank 0 starts the store on its first call if no launcher hosts it."""
    global _hosted
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if _hosted is None and not agent_hosts_store() and os.environ["RANK"] == "0":
        _hosted = host_store(addr, port, timeout)
        return _hosted
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)


def release_store(rank: int, world_size: int) -> None:
    """At a rank's end, once it needs the job's store no more: it says so, and the rank 0 that hosts the
    store (torchrun without a shared store) returns once every rank has, as torchrun's agents wait at
    their exit barrier. A rank elsewhere may still be in ``rpc.shutdown()``, which reads the store (over
    two nodes rank 0 once left first, and a peer's shutdown failed with "Connection reset by peer").
    distkit's launcher waits the same way when it hosts the store for ranks on other machines (``Job``)."""
    store = job_store(DONE)
    store.set(str(rank), "1")
    if _hosted is not None:
        store.wait([str(r) for r in range(world_size)])


def restart_key() -> str:
    """A key prefix per torchrun restart where one store serves them all (the agent's); "" where each
    has its own, as machines may count restarts differently (pytorch/pytorch#135712)."""
    if under_torchrun() and agent_hosts_store():
        return f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return ""


def job_store(prefix: str) -> dist.Store:
    """The job's store under a key prefix of its own: a second process group needs no second port."""
    return dist.PrefixStore(prefix, connect(STORE_TIMEOUT))


def process_group_store() -> dist.Store | None:
    """For ``init_process_group(store=...)``: None (``env://``) except under torchrun, where it is the
    job's store under a prefix per restart. torchrun keeps its agent's store for every restart and
    ``env://`` adds no prefix: a restarted rank's gloo can read a dead rank's address and fail or wait
    forever (pytorch/pytorch#135712); with no agent store, ``env://`` would start a second server."""
    if not under_torchrun():
        return None
    return dist.PrefixStore(f"process_group/{restart_key()}", connect(default_pg_timeout))


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False

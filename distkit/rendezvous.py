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


def adopt_srun_task(master_addr: str | None, master_port: int | None) -> int | None:
    """Under ``srun -n N python X/main.py`` (N > 1, no torchrun): this task becomes rank SLURM_PROCID of
    the step's N, in torchrun's variables, rank 0 hosting the store on the step's first host (without
    this, each task ran a whole job of its own). The port: --master_port, else from the job id's last four
    digits, as Lightning. Returns N, or None outside such a step (an sbatch script's own shell included)."""
    env = os.environ
    # srun's step; not SLURM_NTASKS, which sbatch's shell has
    tasks = slurm_int("SLURM_STEP_NUM_TASKS", env.get("SLURM_STEP_NUM_TASKS", "1"))
    if under_torchrun() or tasks < 2:
        return None
    try:  # "2(x3),1": 2 tasks on each of three nodes, then 1
        per_node = [int(n) for count in slurm_var("SLURM_STEP_TASKS_PER_NODE").split(",")
                    for n, _, times in [count.rstrip(")").partition("(x")] for _ in range(int(times or 1))]
    except ValueError:
        raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r} is not a task count "
                         f"per node (like 2(x3),1)") from None
    node = slurm_int("SLURM_NODEID", below=len(per_node))
    # TORCHELASTIC_USE_AGENT_STORE: torch's env:// (RPC's rendezvous) joins the store rank 0 hosts here
    env.update(RANK=str(slurm_int("SLURM_PROCID", below=tasks)), WORLD_SIZE=str(tasks),
               LOCAL_RANK=str(slurm_int("SLURM_LOCALID", below=per_node[node])),
               TORCHELASTIC_USE_AGENT_STORE="True", DISTKIT_SRUN="1", LOCAL_WORLD_SIZE=str(per_node[node]),
               MASTER_ADDR=master_addr or first_host(slurm_var("SLURM_STEP_NODELIST")),
               MASTER_PORT=str(master_port or 10000 + slurm_int("SLURM_JOB_ID") % 10000))
    return tasks


def slurm_var(name: str) -> str:
    """SLURM's variable ``name``, or a ValueError naming it (check_launch_args: one line, exit 2)."""
    if not os.environ.get(name):
        raise ValueError(f"{name} is not set, though SLURM_STEP_NUM_TASKS says this is a task of an srun step")
    return os.environ[name]


def slurm_int(name: str, value: str | None = None, below: int | None = None) -> int:
    """SLURM's variable ``name`` (or ``value``) as a count or index (< ``below``), or a ValueError naming it."""
    value = slurm_var(name) if value is None else value
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a whole number")
    if below is not None and int(value) >= below:
        raise ValueError(f"{name}={value} is not within 0..{below - 1}")
    return int(value)


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist.split("]")[0]
    prefix, _, ranges = head.partition("[")
    return prefix + ranges.split(",")[0].split("-")[0]


def host_store(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A store server listening on ``addr`` only (c10d's own listens on every interface)."""
    listener = socket.create_server((addr, port))  # the store owns it then, and closes it
    return dist.TCPStore(addr, listener.getsockname()[1], is_master=True,
                         master_listen_fd=listener.detach(), wait_for_workers=False, timeout=timeout)


def agent_hosts_store() -> bool:
    """distkit's launcher or torchrun's agent hosts the store; rank 0 does, each round, with torchrun's
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/multi_host.md)."""
    return not under_torchrun() or (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                                    and "DISTKIT_SRUN" not in os.environ)  # srun: rank 0, as its agent


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
    store (under srun) returns once every rank has, as torchrun's agents wait at their exit barrier. A
    rank elsewhere may still be in ``rpc.shutdown()``, which reads the store (over two nodes rank 0 once
    left first, and a peer's shutdown failed with "Connection reset by peer"). distkit's launcher waits
    the same way when it hosts the store for ranks on other machines (``Job``)."""
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

"""The job's rendezvous store: who hosts it, how every rank connects, and its key prefixes.

Spawned jobs use a store the launching process hosts (``launch.py``); under torchrun, the
agent's, or (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) one that rank 0 hosts itself. Every
group of a job (a DDP group inside an RPC job, the backend check before a process group)
keeps its keys apart under a prefix of its own, so a job needs one port.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

STORE_TIMEOUT = timedelta(seconds=120)


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def host_store(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A store server listening on ``addr`` only (c10d's own listens on every interface)."""
    listener = socket.create_server((addr, port))
    # the store takes ownership of the socket and closes it when it goes
    return dist.TCPStore(addr, listener.getsockname()[1], is_master=True,
                         master_listen_fd=listener.detach(), wait_for_workers=False, timeout=timeout)


def agent_hosts_store() -> bool:
    """Whether a launcher hosts the job's store: distkit's, or torchrun's agent by default.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` given to torchrun (the multi-machine restart
    command of docs/multi_host.md) means no agent does: torchrun picks a port on rank 0's
    machine each round and rank 0's worker must host the store there.
    """
    return not under_torchrun() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


_hosted: dist.TCPStore | None = None  # the store this process hosts, if it is that rank 0


def connect(timeout: timedelta) -> dist.Store:
    """This process's connection to the job's store at ``MASTER_ADDR:MASTER_PORT``;
    rank 0 starts the store there on its first call if no launcher hosts it."""
    global _hosted
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if _hosted is None and not agent_hosts_store() and os.environ["RANK"] == "0":
        _hosted = host_store(addr, port, timeout)
        return _hosted
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)


def restart_key() -> str:
    """A key prefix that keeps this torchrun restart's keys apart from those of the groups
    before it, in a store that outlives them (torchrun's agent's, shared by every restart);
    "" where each restart has a store of its own, since machines may count restarts
    differently (pytorch/pytorch#135712)."""
    if under_torchrun() and agent_hosts_store():
        return f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return ""


def job_store(prefix: str) -> dist.Store:
    """A client of the job's rendezvous store, with its own key prefix.

    A second process group (DDP among a subset of an RPC job's ranks) rendezvouses here
    instead of on a second port: one port per job, no collisions, loopback-only locally.
    """
    return dist.PrefixStore(prefix, connect(STORE_TIMEOUT))


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
    rank 0 hosts a new one each round (``connect``; ``env://`` would start a second server
    on its port when ``agree_on_backend`` already started it) and no prefix is needed.
    """
    if not under_torchrun():
        return None
    return dist.PrefixStore(f"process_group/{restart_key()}", connect(default_pg_timeout))


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False

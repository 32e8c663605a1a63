"""Device, backend and thread choices that work unchanged on a laptop CPU and a GPU node.

Two kinds of rank choose a device here:
  - an RPC-only rank (a parameter server, a pipeline shard): ``pick_device``. Its tensors
    cross RPC on the CPU, so two such ranks may share one GPU.
  - a member of a process group (DDP trainers, pipeline stages): ``group_placement``. NCCL
    wants a GPU of its own per member (two ranks on one GPU fail or hang inside NCCL), and
    every member of a group must use the same backend. ``agree_on_backend`` checks that
    across machines before ``init_process_group``, through the job's rendezvous store.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from .rendezvous import job_store, restart_key

DEVICE_CHOICES = ("auto", "cpu", "cuda")

log = logging.getLogger("distkit")


class DeviceError(RuntimeError):
    """A device this machine (or this job) cannot provide. Its message is one line for the user."""


@dataclass(frozen=True)
class Placement:
    """Where one rank computes, and the process-group backend it joins (None: it joins none)."""

    device: torch.device
    backend: str | None = None


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_preference(preference: str) -> None:
    if preference not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {preference!r}")


def pick_device(preference: str, index: int = 0, min_gpus: int = 1) -> torch.device:
    """The device of an RPC-only rank holding slot ``index`` on its machine.

    ``auto`` uses CUDA only where at least ``min_gpus`` GPUs are visible, else the CPU.
    ``cuda`` insists on a GPU. With fewer GPUs than slots, slots share them (``index % n``):
    right for ranks that only exchange CPU tensors over RPC, never for a process group.
    """
    _check_preference(preference)
    n = gpu_count()
    if preference == "cpu" or (preference == "auto" and n < max(1, min_gpus)):
        return torch.device("cpu")
    if n == 0:
        raise DeviceError("--device cuda was asked for, but no CUDA device is visible on this machine")
    return torch.device("cuda", index % n)


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors, gloo moves CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def group_placement(preference: str, local_index: int, local_members: int) -> Placement:
    """Device and backend of a process-group member, ``local_index`` of ``local_members`` here.

    A GPU of its own (``cuda:local_index``) and NCCL where this machine has a GPU for every
    member it runs, else the CPU and gloo (``auto``) or a refusal (``cuda``). Never two
    members on one GPU.
    """
    _check_preference(preference)
    if not 0 <= local_index < local_members:
        raise ValueError(f"local index {local_index} is not within 0..{local_members - 1}")
    n = gpu_count()
    if preference != "cpu" and n >= local_members:
        device = torch.device("cuda", local_index)
        return Placement(device, backend_for(device))
    if preference == "cuda":
        if n == 0:
            raise DeviceError("--device cuda was asked for, but no CUDA device is visible on this machine")
        raise DeviceError(f"--device cuda: NCCL needs a GPU per process, and this machine runs "
                          f"{local_members} processes of the group with {n} GPU(s) visible "
                          f"(use --device auto or cpu, or fewer processes per machine)")
    if n and local_index == 0:
        log.info(f"{n} GPU(s) for {local_members} processes of the group on this machine: NCCL "
                 f"needs one each, so the group runs on the CPU with gloo")
    return Placement(torch.device("cpu"), "gloo")


def agree_on_backend(group: str, group_rank: int, group_size: int, placement: Placement,
                     timeout: timedelta = timedelta(seconds=120)) -> None:
    """Raise ``DeviceError`` unless every member of ``group`` chose ``placement.backend``.

    Every member writes what its machine sees into the job's rendezvous store and reads
    what the others wrote: a job whose machines decided differently (``auto`` found GPUs
    on one, none on another) stops here with one line naming each machine, instead of
    hanging or crashing inside ``init_process_group``. Call it on every member, before
    ``init_process_group``.
    """
    # a torchrun restart may reuse the store: each attempt its own keys
    store = job_store(f"distkit/placement/{group}/{restart_key()}")
    mine = "|".join([socket.gethostname(), str(gpu_count()), str(placement.device), str(placement.backend)])
    store.set(str(group_rank), mine)
    keys = [str(r) for r in range(group_size)]
    store.wait(keys, timeout)
    seen = [store.get(k).decode().split("|") for k in keys]
    problem = backend_disagreement(seen)
    if problem:
        raise DeviceError(problem)


def take_placement(group: str, group_rank: int, group_size: int, placement: Placement) -> Placement:
    """Before ``init_process_group``, on every member of ``group``: check that all chose the
    same backend (``agree_on_backend``), and make this rank's GPU, if it has one, the current
    device. ``placement`` is the example's own choice, the one checked before launch."""
    agree_on_backend(group, group_rank, group_size, placement)
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    return placement


def backend_disagreement(seen: Sequence[Sequence[str]]) -> str | None:
    """The one-line error for members' ``(host, gpus, device, backend)``, or None if they agree."""
    if len({backend for *_, backend in seen}) <= 1:
        return None
    machines: dict[tuple[str, str, str], list[int]] = {}
    for rank, (host, gpus, _, backend) in enumerate(seen):
        machines.setdefault((host, gpus, backend), []).append(rank)
    what = "; ".join(f"{host} sees {gpus} GPU(s) -> {backend} (rank{'s' * (len(ranks) > 1)} "
                     f"{','.join(map(str, ranks))})" for (host, gpus, backend), ranks in machines.items())
    return (f"the machines of this job chose different backends for one process group: {what}; "
            f"every member needs the same one: pass the same --device on every machine "
            f"(--device cpu works everywhere)")


def threads_per_process(local_world_size: int) -> int:
    """Split this machine's cores between the processes running on it.

    Without this every process starts one intra-op thread per core, and N processes on a
    2-core laptop spend their time preempting each other.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))

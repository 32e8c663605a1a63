"""Device, backend and thread choices that work unchanged on a laptop CPU and a GPU node: ``pick_device``
for an RPC-only rank, ``group_placement`` and ``agreed_backend`` for a process group's members."""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .rendezvous import STORE_TIMEOUT, job_store, restart_key

DEVICE_CHOICES = ("auto", "cpu", "cuda")
NO_GPU = "--device cuda was asked for, but no CUDA device is visible on this machine"


class DeviceError(RuntimeError):
    """A device this machine (or this job) cannot provide. Its message is one line for the user."""


@dataclass(frozen=True)
class Placement:
    """Where one rank computes, and the process-group backend it joins (None: it joins none)."""

    device: torch.device
    backend: str | None = None

    @property
    def device_id(self) -> torch.device | None:
        """For ``init_process_group(device_id=...)``: the GPU that binds the group to it, None on the CPU."""
        return None if self.device.type == "cpu" else self.device


def gpu_count() -> int:
    """The CUDA GPUs visible here (``torch.accelerator``'s devices where it is CUDA), or 0: a Mac's GPU
    (mps) stays out of ``auto``, which keeps a laptop's processes on the CPU with gloo."""
    accelerator = torch.accelerator.current_accelerator()
    return torch.accelerator.device_count() if accelerator is not None and accelerator.type == "cuda" else 0


backend_for = dist.get_default_backend_for_device  # NCCL moves CUDA tensors, gloo CPU ones


def pick_device(preference: str, index: int = 0, min_gpus: int = 1) -> torch.device:
    """An RPC-only rank's device (``auto``: CUDA where ``min_gpus`` are visible). Slots share GPUs
    (``index % n``): right for ranks that exchange CPU tensors over RPC, never for a process group."""
    n = gpu_count()
    if preference == "cpu" or (preference == "auto" and n < max(1, min_gpus)):
        return torch.device("cpu")
    if n == 0:
        raise DeviceError(NO_GPU)
    return torch.device("cuda", index % n)


def group_placement(preference: str, local_index: int, local_members: int) -> Placement:
    """A process-group member's: ``cuda:local_index`` and NCCL where there is a GPU per member here,
    else the CPU and gloo (``auto``) or a refusal (``cuda``): two members on one GPU hang in NCCL."""
    if not 0 <= local_index < local_members:
        raise ValueError(f"local index {local_index} is not within 0..{local_members - 1}")
    n = gpu_count()
    if preference != "cpu" and n >= local_members:
        return Placement(torch.device("cuda", local_index), backend_for(torch.device("cuda", local_index)))
    if preference == "cuda":
        raise DeviceError(NO_GPU if n == 0 else f"--device cuda: NCCL needs a GPU per process, and this "
                          f"machine runs {local_members} processes of the group with {n} GPU(s) visible "
                          f"(use --device auto or cpu, or fewer processes per machine)")
    if n and local_index == 0:
        logging.getLogger("distkit").info(
            f"{n} GPU(s) for {local_members} processes of the group on this machine: NCCL needs one each, "
            f"so the group runs on the CPU with gloo")
    return Placement(torch.device("cpu"), "gloo")


def agreed_backend(group: str, rank: int, world_size: int, placement: Placement) -> str | None:
    """``placement``'s backend, for ``dist.init_process_group(backend=...)``, once every member of ``group``
    has chosen the same: a ``DeviceError`` naming each machine where ``auto`` found GPUs on one only, not a
    hang inside ``init_process_group``. On a GPU, it also makes this rank's GPU the current one."""
    seen = job_store(f"distkit/placement/{group}/{restart_key()}")  # a torchrun restart's own keys
    seen.set(str(rank), f"{socket.gethostname()}|{gpu_count()}|{placement.device}|{placement.backend}")
    keys = [str(r) for r in range(world_size)]
    seen.wait(keys, STORE_TIMEOUT)
    if problem := backend_disagreement([seen.get(k).decode().split("|") for k in keys]):
        raise DeviceError(problem)
    if placement.device_id is not None:
        torch.accelerator.set_device_index(placement.device_id)
    return placement.backend


def backend_disagreement(seen: Sequence[Sequence[str]]) -> str | None:
    """The one-line error for members' ``(host, gpus, device, backend)``, or None if they agree."""
    if len({backend for *_, backend in seen}) <= 1:
        return None
    machines: dict[tuple[str, ...], list[str]] = {}
    for rank, (host, gpus, _, backend) in enumerate(seen):
        machines.setdefault((host, gpus, backend), []).append(str(rank))
    what = "; ".join(f"{host} sees {gpus} GPU(s) -> {backend} (rank{'s' * (len(ranks) > 1)} {','.join(ranks)})"
                     for (host, gpus, backend), ranks in machines.items())
    return (f"the machines of this job chose different backends for one process group: {what}; every "
            f"member needs the same one: pass the same --device on every machine (--device cpu works everywhere)")


def threads_per_process(local_world_size: int) -> int:
    """This machine's cores split between its processes (else N processes on 2 cores preempt each other)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))

"""Device, backend and thread choices that work unchanged on a laptop CPU and a GPU node: ``pick_device``
for an RPC-only rank, ``group_placement`` for a process group's members."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def threads_per_process(local_world_size: int) -> int:
    """This machine's cores split between its processes (else N processes on 2 cores preempt each other)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))

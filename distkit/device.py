"""Device, backend and thread choices that work unchanged on a laptop CPU and a GPU node."""
from __future__ import annotations

import os

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_device(preference: str, index: int = 0, min_gpus: int = 1) -> torch.device:
    """The device for the process holding slot ``index`` on its machine.

    ``auto`` uses CUDA only where at least ``min_gpus`` GPUs are visible (an example that
    needs one GPU per trainer asks for 2), else the CPU. ``cuda`` insists on a GPU.
    """
    if preference not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {preference!r}")
    n = gpu_count()
    if preference == "cpu" or (preference == "auto" and n < max(1, min_gpus)):
        return torch.device("cpu")
    if n == 0:
        raise RuntimeError("--device cuda was asked for, but no CUDA device is visible")
    return torch.device("cuda", index % n)


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors, gloo moves CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


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

"""The little every example needs: launching, rendezvous, devices, logging and cleanup.

The distributed logic of each tutorial stays in its own package; this one only gets the
processes started, talking to each other, and reliably stopped.
"""
from .device import backend_for, gpu_count, pick_device, threads_per_process
from .launch import (
    ArgumentParser,
    Worker,
    add_launch_args,
    check_finite,
    check_launch_args,
    cleanup,
    job_store,
    launch,
    parse_ranks,
    process_group_store,
    require_positive,
    under_torchrun,
)

__all__ = [
    "ArgumentParser", "Worker", "add_launch_args", "backend_for", "check_finite", "check_launch_args",
    "cleanup", "gpu_count", "job_store", "launch", "parse_ranks", "pick_device", "process_group_store",
    "require_positive",
    "threads_per_process", "under_torchrun",
]

"""The little every example needs: launching, rendezvous, devices, logging and cleanup.

The distributed logic of each tutorial stays in its own package; this one only gets the
processes started, talking to each other, and reliably stopped.
"""
from .device import (
    DeviceError,
    Placement,
    agree_on_backend,
    backend_for,
    gpu_count,
    group_placement,
    pick_device,
    threads_per_process,
)
from .launch import (
    ArgumentParser,
    Worker,
    add_launch_args,
    check_finite,
    check_launch_args,
    check_placements,
    cleanup,
    exit_process,
    job_store,
    launch,
    local_workers,
    parse_ranks,
    process_group_store,
    require_positive,
    silence_torchscript_optimizer_warning,
    under_torchrun,
)

__all__ = [
    "ArgumentParser", "DeviceError", "Placement", "Worker", "add_launch_args", "agree_on_backend",
    "backend_for", "check_finite", "check_launch_args", "check_placements", "cleanup",
    "exit_process", "gpu_count", "group_placement", "job_store", "launch", "local_workers",
    "parse_ranks", "pick_device", "process_group_store", "require_positive",
    "silence_torchscript_optimizer_warning", "threads_per_process", "under_torchrun",
]

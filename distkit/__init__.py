"""The little every example needs: launching, rendezvous, devices, logging and cleanup.

Modules, each importing only those listed before it: rendezvous (the job's store), device
(device and backend per rank), watchdog (--hang_timeout), worker (what runs inside every rank),
profiling (--trace), launch (``Job``, beside ``mp.spawn``), args (the shared flags and their
checks), schedules (the pipelining schedules, for both pipeline examples; imported on its own).
The distributed logic of each tutorial stays in its own package."""
from .args import ArgumentParser, add_launch_args, check_finite, check_launch_args, check_placements
from .device import (Placement, agreed_backend, backend_for, gpu_count, group_placement, pick_device,
                     threads_per_process)
from .launch import Job, launch, local_workers, parse_ranks
from .profiling import profiled
from .rendezvous import job_store, process_group_store
from .worker import Worker, exit_now, exit_process, quiet_distributed_optimizer

__all__ = [
    "ArgumentParser", "Job", "Placement", "Worker", "add_launch_args", "agreed_backend", "backend_for",
    "check_finite", "check_launch_args", "check_placements", "exit_now", "exit_process", "gpu_count",
    "group_placement", "job_store", "launch", "local_workers", "parse_ranks", "pick_device",
    "process_group_store", "profiled", "quiet_distributed_optimizer", "threads_per_process",
]

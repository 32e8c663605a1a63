"""Only what PyTorch does not give the examples: their shared flags and one-line refusals (args), the
device of each rank (device), what each rank sets up for itself and how it ends (rank), what the
launcher prepares around the tutorial's ``mp.spawn`` and the tests' in-process launcher (launch),
``--trace`` (profiling), and the pipelining schedules' checks (schedules, imported on its own).
Modules import only those listed before them: device, profiling, rank, launch, args.
The distributed logic of each tutorial stays in its own package."""
from .args import ArgumentParser, add_launch_args, check_finite, check_launch_args, check_placements, srun_problem
from .device import Placement, gpu_count, group_placement, pick_device, threads_per_process
from .launch import launch, prepare_spawn, results, save_result
from .profiling import profiled
from .rank import (exit_now, local_rank, local_world_size, ping, progress, quiet_distributed_optimizer, start_rank,
                   under_torchrun, wait_on)

__all__ = [
    "ArgumentParser", "Placement", "add_launch_args", "check_finite", "check_launch_args", "check_placements",
    "exit_now", "gpu_count", "group_placement", "launch", "local_rank", "local_world_size", "pick_device",
    "ping", "prepare_spawn", "profiled", "progress", "quiet_distributed_optimizer", "results", "save_result",
    "srun_problem", "start_rank", "threads_per_process", "under_torchrun", "wait_on",
]

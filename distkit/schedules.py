"""The pipelining schedules PyTorch exports, where each puts its stages, and whether one can run a
micro-batch count: both pipeline examples check it before launch (imported on its own)."""
from __future__ import annotations

import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

# Every schedule this PyTorch exports, by its short name ("GPipe", "Interleaved1F1B", ...)
SCHEDULES: dict[str, type] = {
    name.removeprefix("Schedule"): getattr(pipelining, name)
    for name in pipelining.__all__ if name.startswith("Schedule")
}
# a "V" (rank r: stages r and 2W-1-r, the last beside the first); other multi-stage ones loop: r, r+W
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}
STAGES_PER_RANK_MULTI = 2


def is_multi_stage(schedule: str) -> bool:
    return issubclass(SCHEDULES[schedule], PipelineScheduleMulti)


def num_stages_for(schedule: str, world_size: int) -> int:
    return world_size * (STAGES_PER_RANK_MULTI if is_multi_stage(schedule) else 1)


def stage_indices_for(schedule: str, rank: int, world_size: int) -> list[int]:
    """The stages ``rank`` owns, in the order the schedule expects them."""
    if not is_multi_stage(schedule):
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * world_size - 1 - rank]
    return [rank + k * world_size for k in range(STAGES_PER_RANK_MULTI)]


class _StubStage:
    """Just enough of a stage for a schedule's constructor to lay out its whole timetable."""

    def __init__(self, stage_index: int, num_stages: int, rank: int, world_size: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = rank, world_size
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_problem(schedule: str, world_size: int, n_microbatches: int) -> str | None:
    """Why ``schedule`` cannot run ``n_microbatches`` on ``world_size`` ranks, or None, from PyTorch:
    each schedule's constructor checks every rank's timetable, here around stand-in stages."""
    n_stages, cls = num_stages_for(schedule, world_size), SCHEDULES[schedule]
    for rank in range(world_size):
        stubs = [_StubStage(i, n_stages, rank, world_size)
                 for i in stage_indices_for(schedule, rank, world_size)]
        try:
            cls(stubs if is_multi_stage(schedule) else stubs[0], n_microbatches=n_microbatches,
                loss_fn=F.mse_loss)  # any loss: only the timetable is built
        except (ValueError, AssertionError, RuntimeError) as e:
            return str(e).strip().splitlines()[0].replace("  ", " ")
        except Exception:  # a PyTorch whose constructor wants more than the stand-in has
            return None
    return None

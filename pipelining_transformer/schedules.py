"""The schedule catalogue: every schedule this PyTorch offers, and where each puts the stages.

Beyond the tutorial, which runs ``ScheduleGPipe`` with one stage per rank: ``--schedule``
picks any schedule PyTorch exports (``build``, which ``main.build_schedule`` calls for any
but GPipe); multi-stage ones (Interleaved1F1B, LoopedBFS, the zero-bubble ones) give each
rank two stages, looped or V-shaped. ``stage_bounds`` divides the layers among the stages
(``--stage_layers``, in halves if asked: balance.py; layout.py holds the result), and
``schedule_problem`` asks PyTorch itself, before any process starts, whether a schedule
can run a micro-batch count.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from pipelining_transformer.model import tokenwise_loss_fn

# Every schedule this PyTorch exports, by its short name ("GPipe", "Interleaved1F1B", ...)
SCHEDULES: dict[str, type] = {
    name.removeprefix("Schedule"): getattr(pipelining, name)
    for name in pipelining.__all__ if name.startswith("Schedule")
}
# These schedules place a rank's two stages as a "V" (rank r: stages r and 2W-1-r, so the
# last stage sits beside the first); the other multi-stage ones loop (rank r: r, r+W, ...).
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


def build(name: str, stages: Sequence, n_microbatches: int, loss_fn: Callable):
    """Schedule ``name`` built as the tutorial builds ``ScheduleGPipe``: a multi-stage
    schedule drives all of this rank's stages, the others its one stage."""
    schedule_class = SCHEDULES[name]
    return schedule_class(stages if is_multi_stage(name) else stages[0],
                          n_microbatches=n_microbatches, loss_fn=loss_fn)


def stage_bounds(n_layers: int, num_stages: int, sizes: Sequence[float] | None = None
                 ) -> list[tuple[float, float]]:
    """Where each stage starts and ends, in layers: ``sizes[s]`` layers for stage s, or (no
    ``sizes``) as even as can be, earlier stages taking the remainder.

    A size may end in .5: the cut then falls inside a layer, between its attention and its
    feed-forward block (balance.py). Every stage gets at least half a layer, but the last
    may get none (it still computes the norm, the output projection and the loss).
    """
    if sizes is None:
        if not 1 <= num_stages <= n_layers:
            raise ValueError(f"cannot give {num_stages} stages at least one of {n_layers} layers each")
        per, extra = divmod(n_layers, num_stages)
        sizes = [per + (s < extra) for s in range(num_stages)]
    elif (len(sizes) != num_stages or sum(sizes) != n_layers or any(2 * n % 1 for n in sizes)
          or min(sizes[:-1], default=1) < 0.5 or sizes[-1] < 0):
        raise ValueError(f"{num_stages} stages need {num_stages} layer counts (halves allowed, "
                         f"at least 0.5, the last at least 0) that add up to {n_layers}, "
                         f"got {' '.join(f'{n:g}' for n in sizes)}")
    bounds = [0.0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return list(zip(bounds, bounds[1:]))


class _StubStage:
    """Just enough of a stage for a schedule's constructor to lay out its whole timetable."""

    def __init__(self, stage_index: int, num_stages: int, rank: int, world_size: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = rank, world_size
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_problem(schedule: str, world_size: int, n_microbatches: int) -> str | None:
    """Why ``schedule`` cannot run ``n_microbatches`` on ``world_size`` ranks, or None.

    Each schedule computes and checks the timetable of every rank in its constructor, so
    building it around stand-in stages asks PyTorch itself, before any process starts.
    """
    n_stages = num_stages_for(schedule, world_size)
    cls = SCHEDULES[schedule]
    for rank in range(world_size):
        stubs = [_StubStage(i, n_stages, rank, world_size)
                 for i in stage_indices_for(schedule, rank, world_size)]
        try:
            cls(stubs if is_multi_stage(schedule) else stubs[0], n_microbatches=n_microbatches,
                loss_fn=tokenwise_loss_fn)
        except (ValueError, AssertionError, RuntimeError) as e:
            return str(e).strip().splitlines()[0].replace("  ", " ")
        except Exception:  # a PyTorch whose constructor wants more than the stand-in has
            return None
    return None

"""Any schedule, and where the layers go.

Beyond the tutorial, which runs ``ScheduleGPipe`` with one stage per rank: ``--schedule``
picks any schedule PyTorch exports (``build``, which ``main.build_schedule`` calls for any
but GPipe); multi-stage ones (Interleaved1F1B, LoopedBFS, the zero-bubble ones) give each
rank two stages, looped or V-shaped. ``stage_bounds`` divides the layers among the stages
(``--stage_layers``, in halves if asked: balance.py; layout.py holds the result). The
catalogue itself, where each schedule puts its stages and ``schedule_problem`` (PyTorch
asked, before any process starts, whether a schedule can run a micro-batch count) are in
``distkit.schedules``, shared with rpc_pipeline_resnet/pipelining.py.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from distkit.schedules import SCHEDULES, is_multi_stage


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

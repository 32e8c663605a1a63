"""The stage layout: which layers (or halves) each stage owns, which stages this rank runs. The tutorial's
``stage_index = rank``, ``num_stages = world_size`` and cuts (``"layers.4"``) for any number of stages:
even, ``--stage_layers 4.5 3.5`` or ``auto`` (balance.py), two per rank in the multi-stage schedules.
"""
from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from distkit.schedules import num_stages_for, stage_indices_for
from pipelining_transformer import balance
from pipelining_transformer.dp import DistEnv
from pipelining_transformer.model import Transformer


def stage_bounds(n_layers: int, num_stages: int, sizes: Sequence[float] | None = None
                 ) -> list[tuple[float, float]]:
    """Where each stage starts and ends, in layers: ``sizes[s]`` layers for stage s (halves allowed, at
    least 0.5, the last at least 0), or as even as can be, earlier stages taking the remainder."""
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
    bounds = list(accumulate(sizes, initial=0.0))
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class StageLayout:
    """Which layers (or halves of layers) each stage owns, and which stages this rank holds."""

    n_layers: int
    # each stage's (start, end) in layers; a .5 falls between a layer's attention and feed-forward
    bounds: tuple[tuple[float, float], ...]
    stage_indices: tuple[int, ...]  # this rank's stages, in the order its schedule expects
    rows: int  # of one micro-batch: the tracer's example input, what auto measured with
    # the counts --stage_layers gave or auto chose; None: even (checkpoints' layout then names none)
    chosen: tuple[float, ...] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def stage_layers(self) -> tuple[float, ...]:
        """Layers per stage, in stage order (4.5 3.5): what --stage_layers takes."""
        return tuple(end - start for start, end in self.bounds)

    def layers(self, stage_index: int) -> range:
        """The layers a stage holds, whole or half: what ``manual_model_split`` keeps."""
        start, end = self.bounds[stage_index]
        return range(math.floor(start), math.ceil(end))

    @property
    def split_points(self) -> list[str]:
        """Where the tracer cuts: before the first layer of every stage but the first, or its feed-forward
        block's first call (linear1) for a half, or "norm" before a last stage of the head alone."""
        return ["norm" if start == self.n_layers else f"layers.{int(start)}{'.linear1' if start % 1 else ''}"
                for start, _ in self.bounds[1:]]

    def stage_models(self, model: Transformer) -> list[tuple[Transformer, int]]:
        """This rank's stages for the manual split: (the model to cut, the stage index); a copy for
        all but the last, a layer the stage owns only half of replaced by that half (HalfLayer)."""
        models = [copy.deepcopy(model) for _ in self.stage_indices[1:]] + [model]
        for m, i in zip(models, self.stage_indices):
            # a stage starting in the middle of a layer owns its feed-forward, one ending there its attention
            for bound, part in zip(self.bounds[i], (balance.FEED_FORWARD, balance.ATTENTION)):
                if bound % 1:
                    m.layers[str(int(bound))] = balance.HalfLayer(m.layers[str(int(bound))], part)
        return list(zip(models, self.stage_indices))


def stage_layout(args: argparse.Namespace, env: DistEnv, model: Transformer) -> StageLayout:
    """The layout of this run on this rank. With --stage_layers auto it measures ``model``'s
    pieces on the ranks first (a collective: every rank calls this, and all get one answer)."""
    num_stages = num_stages_for(args.schedule, env.pp_size)
    rows = args.batch_size // (env.dp_size * args.n_microbatches)  # one micro-batch's
    sizes = args.stage_layers
    if sizes == "auto":
        sizes = balance.auto_split(model, rows, args.seq_len, num_stages, env.device).stage_layers
    return StageLayout(args.n_layers, tuple(stage_bounds(args.n_layers, num_stages, sizes)),
                       tuple(stage_indices_for(args.schedule, env.pp_rank, env.pp_size)), rows,
                       tuple(sizes) if sizes else None)

"""The stage layout: one value saying which layers each stage owns and which stages this rank runs.

In the tutorial it is two globals, ``stage_index = rank`` and ``num_stages = world_size``,
and two hard-coded cuts (``range(4, 8)`` for the manual split, ``"layers.4"`` for the
tracer). Here the layers are divided among any number of stages, in halves if asked
(``--stage_layers 4.5 3.5``, balance.py), or where the measured costs say
(``--stage_layers auto``); the multi-stage schedules give each rank two stages
(schedules.py). ``stage_layout`` works all of that out once per run, the measurement of
``auto`` included, and ``main.build_rank`` hands the value down: to the manual split (each
stage's layer range, its halves), to the tracer (where it cuts), and, through the rank, to
what records the layout (checkpoints). Nothing recomputes it.
"""
from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from distkit.schedules import num_stages_for, stage_indices_for
from pipelining_transformer import balance
from pipelining_transformer.model import Transformer
from pipelining_transformer.schedules import stage_bounds


class Place(Protocol):
    """Where a rank sits: ``main.DistEnv`` (a protocol, so that this module needs no main)."""

    @property
    def pp_rank(self) -> int: ...

    @property
    def pp_size(self) -> int: ...

    dp_size: int
    device: torch.device


@dataclass(frozen=True)
class StageLayout:
    """Which layers (or halves of layers) each stage owns, and which stages this rank holds."""

    n_layers: int
    # stage s owns the layers from bounds[s][0] to bounds[s][1]; a bound ending in .5 falls
    # between a layer's attention and its feed-forward block
    bounds: tuple[tuple[float, float], ...]
    stage_indices: tuple[int, ...]  # this rank's stages, in the order its schedule expects
    rows: int  # of one micro-batch: the tracer's example input, what auto measured with
    # the counts --stage_layers gave or auto chose; None: as even as can be (then the
    # checkpoints' layout does not name them, as before there was a choice)
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
        """Where the tracer cuts: before the first layer (or half) of every stage but the first."""
        return [balance.split_point(start, self.n_layers) for start, _ in self.bounds[1:]]

    def stage_models(self, model: Transformer) -> list[tuple[Transformer, int]]:
        """This rank's stages for the manual split: (the model to cut, the stage index).

        Every stage but the last gets a copy, the last the model itself; a layer the stage
        owns only half of is already replaced by that half (balance.HalfLayer).
        """
        models = [copy.deepcopy(model) for _ in self.stage_indices[1:]] + [model]
        for m, i in zip(models, self.stage_indices):
            balance.halve(m, self.bounds[i])
        return list(zip(models, self.stage_indices))


def stage_layout(args: argparse.Namespace, place: Place, model: Transformer) -> StageLayout:
    """The layout of this run on this rank. With --stage_layers auto it measures ``model``'s
    pieces on the ranks first (a collective: every rank calls this, and all get one answer)."""
    num_stages = num_stages_for(args.schedule, place.pp_size)
    rows = args.batch_size // (place.dp_size * args.n_microbatches)  # one micro-batch's
    sizes = args.stage_layers
    if sizes == "auto":
        sizes = balance.auto_split(model, rows, args.seq_len, num_stages, place.device).stage_layers
    bounds = stage_bounds(args.n_layers, num_stages, sizes)
    return StageLayout(args.n_layers, tuple(bounds),
                       tuple(stage_indices_for(args.schedule, place.pp_rank, place.pp_size)), rows,
                       tuple(sizes) if sizes else None)

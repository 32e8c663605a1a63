"""Measurement around pipelining.py's loop: what measure.Meter measures around main.py's.

``StageMeter`` is what ``pipelining.run_worker`` hands ``run_pipeline`` as ``on_batch``. Every
rank enters it around every batch; it brackets the batch with barriers and reads both
processes' CPU seconds, page faults and peak memory, and (``--trace``) records the stages'
spans with ``distkit.stagetrace``. ``result`` returns the same dict as ``Meter.result``, so
``measure.print_report`` and ``trace.write_trace`` serve both engines unchanged.
"""
from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from distkit import stagetrace
from distkit.timeline import Recorder, clock, spans_to_dicts
from rpc_pipeline_resnet.measure import BatchLog, process_stats, state_digest


def _gather(value: object) -> list:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


class StageMeter:
    """``run_pipeline``'s ``on_batch`` on every rank: clocks, CPU time, faults, spans.

    The wall clock of a batch runs on every rank from before a barrier that both pass
    before reading their CPU clocks to after a barrier both reach after reading them
    again, so every CPU second counted falls inside it (CPU / cores <= wall holds, as in
    ``measure.Meter``). Batches before ``--warmup`` run but are not counted. ``states``:
    CPU copies of each stage's weights before the first batch and after the last (tests).
    """

    def __init__(self, args: argparse.Namespace, trace: bool = False, states: bool = False) -> None:
        self.recorder = Recorder(dist.get_rank()) if trace else None
        self.states = states
        self.stage: PipelineStage | None = None
        self.first: dict = {}
        self.log = BatchLog(args.warmup)

    @contextlib.contextmanager
    def __call__(self, stage: PipelineStage, i: int) -> Iterator[None]:
        if self.stage is None:
            self.stage = stage
            self.first = {"devices": _gather(str(stage.device)),
                          "init_digests": _gather(state_digest(stage.submod))}
            if self.states:
                self.first["before"] = _gather(_cpu_state(stage.submod))
            stagetrace.record_into(self.recorder)
        dist.barrier()  # the other rank has finished the previous batch's bookkeeping
        tik = clock()
        dist.barrier()
        before = process_stats()
        yield
        after = process_stats()
        dist.barrier()
        tok = clock()
        stagetrace.end_step()
        stats = _gather((before, after))  # outside the window
        self.log.add(i, tik, tok, [b for b, _ in stats], [a for _, a in stats])  # rank 0, rank 1

    def result(self, num_split: int, losses: list[float]) -> dict:
        """One run, on every rank: the last stage's losses beside everything measured."""
        stagetrace.record_into(None)
        losses = next((x for x in _gather(losses) if x), [])  # the last stage computed them
        spans = _gather(spans_to_dicts(self.recorder.spans) if self.recorder else [])
        result = (self.log.result(num_split, losses)
                  | {"spans": [s for rank in spans for s in rank]} | self.first)
        if self.states:
            result["after"] = _gather(_cpu_state(self.stage.submod))
        return result

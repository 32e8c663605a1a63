"""Spans of torch.distributed.pipelining's stages, for every schedule, without copying one.

``record_into`` wraps the stages' F, B, W (loss in the last F) and the P2P waits, once per
process; ``end_step()`` after each ``schedule.step``. Not torch.profiler: Schedule1F1B (torch
2.14) records no span, and no schedule its P2P waits.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

# Private in torch 2.14.1 (pinned: re-check on upgrade): every schedule's compute and waits
# happen here, so wrapping them observes all of it without copying a schedule's loop.
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

COMPUTE = ("F", "B", "W")  # forward, backward (input gradients, or all of it), weight gradients
clock = time.time  # the wall clock, which every process of one machine shares: spans of several ranks compare


@dataclass(frozen=True)
class Span:
    """One measured (or planned) interval of one rank's work."""

    rank: int
    kind: str                 # one of COMPUTE, or "send", "recv", "wait"
    start: float              # seconds on clock()
    end: float
    stage: int | None = None
    microbatch: int | None = None


@dataclass(eq=False)  # record_into tells recorders apart by identity, not by their spans
class Recorder:
    """Collects one rank's spans. Cheap enough to leave on for a whole run."""

    rank: int
    spans: list[Span] = field(default_factory=list)

# Everything _install wraps: private names of torch 2.14.1 (and 2.10). This module is the one
# place any private torch attribute is assigned. test_stagetrace_wraps_only_names_this_torch_has
# fails on a rename.
PATCHED = ((_PipelineStageBase, ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                                 "get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops",
                                 "get_bwd_send_ops")),
           (_schedules._PipelineSchedule, ("_maybe_compute_loss",)),
           (_schedules, ("_batch_p2p", "_wait_batch_p2p")))

_recorders: list[Recorder] = []  # those tracing this process, if any


@functools.cache  # once per process
def _install() -> None:
    """Wrap the stage compute and the schedules' P2P waits."""
    def timed(cls, name: str, kind: str):
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def wrapper(stage, chunk, *args, **kwargs):
            with _span(kind, stage.stage_index, chunk):
                return fn(stage, chunk, *args, **kwargs)
        setattr(cls, name, wrapper)

    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                       ("backward_weight_one_chunk", "W")):
        timed(_PipelineStageBase, name, kind)

    loss_fn = _schedules._PipelineSchedule._maybe_compute_loss

    @functools.wraps(loss_fn)
    def loss_in_forward(self, stage, output, target_mbs, mb_index, *args, **kwargs):
        result = loss_fn(self, stage, output, target_mbs, mb_index, *args, **kwargs)
        for spans in (r.spans for r in _recorders):
            if stage.is_last and spans and (spans[-1].kind, spans[-1].stage,
                                            spans[-1].microbatch) == ("F", stage.stage_index, mb_index):
                last = spans[-1]  # the loss is the last stage's forward's tail: one F span
                spans[-1] = Span(last.rank, "F", last.start, clock(), last.stage, mb_index)
        return result
    _schedules._PipelineSchedule._maybe_compute_loss = loss_in_forward

    # Which P2P ops (and so which works) carry which stage's micro-batch, and which way
    for name, direction in (("get_fwd_recv_ops", "recv"), ("get_bwd_recv_ops", "recv"),
                            ("get_fwd_send_ops", "send"), ("get_bwd_send_ops", "send")):
        def tagging(fn, direction=direction):
            @functools.wraps(fn)
            def wrapper(stage, chunk, *args, **kwargs):
                ops = fn(stage, chunk, *args, **kwargs)
                for op in ops:
                    op._trace = (direction, stage.stage_index, chunk)
                return ops
            return wrapper
        setattr(_PipelineStageBase, name, tagging(getattr(_PipelineStageBase, name)))

    batch_p2p, wait_batch_p2p = _schedules._batch_p2p, _schedules._wait_batch_p2p

    @functools.wraps(batch_p2p)
    def tagged_batch_p2p(p2p_ops, *args, **kwargs):
        works = batch_p2p(p2p_ops, *args, **kwargs)
        if _recorders:
            tags = [getattr(op, "_trace", None) for op in p2p_ops]
            for w in works:  # a work kept here until the step ends: its id stays its own
                _works[id(w)] = (w, tags)
        return works

    @functools.wraps(wait_batch_p2p)
    def timed_wait(work):
        if not _recorders or not work:
            return wait_batch_p2p(work)
        tags = [t for w in work for t in _works.get(id(w), (None, [None]))[1] if t]
        recvs = [t for t in tags if t[0] == "recv"]
        kind = ("recv" if len(recvs) == len(tags) else "send" if not recvs else "wait") if tags else "wait"
        _, stage, mb = (recvs or tags or [(None, None, None)])[0]
        with _span(kind, stage, mb):
            return wait_batch_p2p(work)

    _schedules._batch_p2p, _schedules._wait_batch_p2p = tagged_batch_p2p, timed_wait


_works: dict[int, tuple[object, list]] = {}  # id(work) -> (work, its ops' tags), this step


@contextlib.contextmanager
def _span(kind: str, stage: int | None, microbatch: int | None) -> Iterator[None]:
    """One span in every recorder (one clock reading for all), or nothing when none records."""
    if not _recorders:
        yield
        return
    start = clock()
    try:
        yield
    finally:
        end = clock()
        for recorder in _recorders:
            recorder.spans.append(Span(recorder.rank, kind, start, end, stage, microbatch))


def record_into(recorder: Recorder) -> None:
    """Record every stage's spans in this process into ``recorder`` too."""
    _install()
    if recorder not in _recorders:
        _recorders.append(recorder)
    _works.clear()


def end_step() -> None:
    """Forget the P2P works of the step that ended (their ids may be reused)."""
    _works.clear()

"""Spans of torch.distributed.pipelining's stages, for every schedule, without copying one.

``record_into(recorder)`` wraps (once per process) the stages' compute,
``forward_one_chunk`` (F), ``backward_one_chunk`` (B) and ``backward_weight_one_chunk`` (W),
the loss the schedule computes after the last stage's forward (counted in that F), and the
schedules' waits on their P2P work objects (``send``, ``recv``, ``wait``), and records them
into ``recorder`` until ``record_into(None)``. ``end_step()`` after each ``schedule.step``.
Both pipelining examples' ``--trace`` use it (pipelining_transformer/timeline.py,
rpc_pipeline_resnet/pipelining.py).
"""
from __future__ import annotations

import functools

# Private in torch 2.14.1 (pinned: re-check on upgrade). _PipelineStageBase and the two P2P
# helpers are where every schedule's compute and waits happen, so wrapping them observes
# all of it without copying a schedule's loop.
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

from .timeline import Recorder, Span, clock

_recorder: Recorder | None = None  # the one tracing this process, if any
_installed = False


def _install() -> None:
    """Wrap the stage compute and the schedules' P2P waits (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True

    def timed(cls, name: str, kind_of):
        fn = getattr(cls, name)

        @functools.wraps(fn)
        def wrapper(stage, chunk, *args, **kwargs):
            if _recorder is None:
                return fn(stage, chunk, *args, **kwargs)
            with _recorder.span(kind_of(kwargs), stage.stage_index, chunk):
                return fn(stage, chunk, *args, **kwargs)
        setattr(cls, name, wrapper)

    timed(_PipelineStageBase, "forward_one_chunk", lambda kw: "F")
    timed(_PipelineStageBase, "backward_one_chunk", lambda kw: "B")
    timed(_PipelineStageBase, "backward_weight_one_chunk", lambda kw: "W")

    loss_fn = _schedules._PipelineSchedule._maybe_compute_loss

    @functools.wraps(loss_fn)
    def loss_in_forward(self, stage, output, target_mbs, mb_index, *args, **kwargs):
        result = loss_fn(self, stage, output, target_mbs, mb_index, *args, **kwargs)
        spans = _recorder.spans if _recorder is not None else []
        if stage.is_last and spans and (spans[-1].kind, spans[-1].stage,
                                        spans[-1].microbatch) == ("F", stage.stage_index, mb_index):
            last = spans[-1]  # the loss is the last stage's forward's tail: one F span
            _recorder.spans[-1] = Span(last.rank, "F", last.start, clock(), last.stage, mb_index)
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
        if _recorder is not None:
            tags = [getattr(op, "_trace", None) for op in p2p_ops]
            for w in works:  # a work kept here until the step ends: its id stays its own
                _works[id(w)] = (w, tags)
        return works

    @functools.wraps(wait_batch_p2p)
    def timed_wait(work):
        if _recorder is None or not work:
            return wait_batch_p2p(work)
        tags = [t for w in work for t in _works.get(id(w), (None, [None]))[1] if t]
        recvs = [t for t in tags if t[0] == "recv"]
        kind = ("recv" if len(recvs) == len(tags) else "send" if not recvs else "wait") if tags else "wait"
        _, stage, mb = (recvs or tags or [(None, None, None)])[0]
        with _recorder.span(kind, stage, mb):
            return wait_batch_p2p(work)

    _schedules._batch_p2p, _schedules._wait_batch_p2p = tagged_batch_p2p, timed_wait


_works: dict[int, tuple[object, list]] = {}  # id(work) -> (work, its ops' tags), this step


def record_into(recorder: Recorder | None) -> None:
    """Record every stage's spans in this process into ``recorder`` (None: stop)."""
    global _recorder
    _install()
    _recorder = recorder
    _works.clear()


def end_step() -> None:
    """Forget the P2P works of the step that ended (their ids may be reused)."""
    _works.clear()

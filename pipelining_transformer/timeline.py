"""What the ranks measure: ``--trace`` timelines, drawn beside the schedule's plan (planned.py).

``PipelineTracer`` wraps the stages' compute (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``, plus the loss the schedule computes
after the last stage's forward, which is counted in that F) and the schedule's waits on
its P2P work objects (``_wait_batch_p2p``), as ``distkit.timeline`` spans. Every rank
writes ``DIR/rank<r>.json``; rank 0 gathers all spans and writes ``DIR/trace.json`` (all
ranks, all steps: open it in https://ui.perfetto.dev), ``DIR/planned.json`` (the plan,
1 unit = 1 s) and ``DIR/timeline.png`` (the last step measured, the plan beside it).
``extras.Trace`` attaches it to a run when --trace asks for it.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
# Private in torch 2.14.1 (pinned: re-check on upgrade). _PipelineStageBase and the two P2P
# helpers are where every schedule's compute and waits happen, so wrapping them observes
# all of it without copying a schedule's loop.
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

from distkit.timeline import (COMPUTE, Recorder, Span, clock, plot_timelines, read_chrome_trace,
                              spans_from_dicts, spans_to_dicts, write_chrome_trace)
from pipelining_transformer.planned import Plan, plan

log = logging.getLogger(__name__)


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


class PipelineTracer:
    """One rank's recorder for ``--trace``: spans of every step, then files and a drawing."""

    def __init__(self, rank: int) -> None:
        global _recorder
        _install()
        self.recorder = _recorder = Recorder(rank)

    @contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Time one schedule step (``forward_backward``) as a "step" span."""
        with self.recorder.span("step", None, index):
            yield
        _works.clear()

    def stop(self) -> None:
        """Record no more (the spans so far stay in ``self.recorder``)."""
        global _recorder
        _recorder = None
        _works.clear()

    def finish(self, folder: str | Path, schedule: str, n_microbatches: int) -> Path | None:
        """Write this rank's file; gather every rank's spans on rank 0, which writes and draws.

        A collective: every rank of the default group calls it. Returns the PNG on rank 0.
        """
        global _recorder
        _recorder = None
        folder = Path(folder)
        rank = self.recorder.rank
        spans = self.recorder.spans
        write_chrome_trace(folder / f"rank{rank}.json", spans)
        gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(spans_to_dicts(spans), gathered, dst=0)
        if rank != 0:
            return None
        every = [s for rows in gathered for s in spans_from_dicts(rows)]
        write_chrome_trace(folder / "trace.json", every)
        p = plan(schedule, dist.get_world_size(), n_microbatches)
        write_chrome_trace(folder / "planned.json", p.spans, origin=0.0)
        png = draw(folder / "timeline.png", every, p)
        log.info(f"trace written to {folder}/trace.json (open in https://ui.perfetto.dev), "
                 f"drawn in {png}")
        return png


def last_step(spans: list[Span]) -> tuple[list[Span], float, float]:
    """The compute and wait spans of the last step every rank ran, and that step's window."""
    index = max(s.microbatch for s in spans if s.kind == "step")
    steps = [s for s in spans if s.kind == "step" and s.microbatch == index]
    start, end = min(s.start for s in steps), max(s.end for s in steps)
    inside = [s for s in spans if s.kind != "step" and start <= s.start and s.end <= end]
    return inside, start, end


def measured_bubbles(spans: list[Span]) -> dict[int, float]:
    """Per rank, in its last step: 1 - compute / the time its ``forward_backward`` took."""
    index = max(s.microbatch for s in spans if s.kind == "step")
    out = {}
    for step in (s for s in spans if s.kind == "step" and s.microbatch == index):
        busy = sum(s.end - s.start for s in spans if s.rank == step.rank and s.kind in COMPUTE
                   and step.start <= s.start and s.end <= step.end)
        out[step.rank] = 1 - busy / (step.end - step.start)
    return dict(sorted(out.items()))


def draw(path: str | Path, spans: list[Span], p: Plan) -> Path:
    """The last step measured, above the plan scaled so that its busy time matches."""
    inside, start, end = last_step(spans)
    bubbles = measured_bubbles(spans)
    busy = sum(s.end - s.start for s in inside if s.kind in COMPUTE) / p.world_size
    unit = busy / (sum(p.busy(r) for r in range(p.world_size)) / p.world_size)
    planned = [Span(s.rank, s.kind, s.start * unit, s.end * unit, s.stage, s.microbatch)
               for s in p.spans]
    measured_text = ", ".join(f"rank {r} {b:.2f}" for r, b in bubbles.items())
    # a zero-length marker of the step's start, so the measured panel starts with the step
    marker = [Span(min(bubbles), "step", start, start)]
    return plot_timelines(path, [
        (f"measured, last step ({1e3 * (end - start):.0f} ms): bubble {measured_text}", marker + inside),
        (f"planned: PyTorch's {p.schedule} table, F=1 B=2 I=1 W=1, free messages, unit = "
         f"{1e3 * unit:.1f} ms ({1e3 * p.makespan * unit:.0f} ms): ideal bubble "
         + ", ".join(f"rank {r} {b:.2f}" for r, b in enumerate(p.idle)), planned)],
        title=f"{p.schedule}, {p.world_size} ranks, {p.n_microbatches} micro-batches",
        unit="s" if end - start > 10 else "ms")


def read_trace(folder: str | Path) -> list[Span]:
    return read_chrome_trace(Path(folder) / "trace.json")

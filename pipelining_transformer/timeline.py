"""What the ranks measure: ``--trace`` timelines, drawn beside the schedule's plan (planned.py).

``PipelineTracer`` records the stages' compute (F, B, W; the loss the schedule computes
after the last stage's forward is counted in that F) and the schedule's waits on its P2P
work objects, as ``distkit.timeline`` spans (``distkit.stagetrace`` wraps them). Every rank
writes ``DIR/rank<r>.json``; rank 0 gathers all spans and writes ``DIR/trace.json`` (all
ranks, all steps: open it in https://ui.perfetto.dev), ``DIR/planned.json`` (the plan,
1 unit = 1 s) and ``DIR/timeline.png`` (the last step measured, the plan beside it).
``callbacks.Trace`` attaches it to a run when --trace asks for it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from distkit import stagetrace
from distkit.timeline import (COMPUTE, Recorder, Span, plot_timelines, read_chrome_trace,
                              spans_from_dicts, spans_to_dicts, write_chrome_trace)
from pipelining_transformer.planned import Plan, plan

log = logging.getLogger(__name__)


class PipelineTracer:
    """One rank's recorder for ``--trace``: spans of every step, then files and a drawing."""

    def __init__(self, rank: int) -> None:
        self.recorder = Recorder(rank)
        stagetrace.record_into(self.recorder)

    @contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Time one schedule step (``forward_backward``) as a "step" span."""
        with self.recorder.span("step", None, index):
            yield
        stagetrace.end_step()

    def stop(self) -> None:
        """Record no more (the spans so far stay in ``self.recorder``)."""
        stagetrace.stop_recording(self.recorder)

    def finish(self, folder: str | Path, schedule: str, n_microbatches: int) -> Path | None:
        """Write this rank's file; gather every rank's spans on rank 0, which writes and draws.

        A collective: every rank of the default group calls it. Returns the PNG on rank 0.
        """
        stagetrace.stop_recording(self.recorder)
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

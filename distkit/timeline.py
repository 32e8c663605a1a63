"""Measured per-rank timelines: record spans, write Chrome trace-event JSON, draw one PNG.

Both pipeline examples use this for ``--trace DIR``. Each rank records what it computed
(``F``orward, ``B``ackward, ``W``eight-gradient) and what it waited for (``send``,
``recv``, ``wait``), per stage and micro-batch, with ``clock()``; the spans are then
written as Chrome trace events (``chrome://tracing`` and https://ui.perfetto.dev open
them: one process row per rank, one thread row per stage) and drawn on one time axis.

``clock()`` is the wall clock, which every process of one machine shares; across machines
the rows line up as well as the machines' clocks agree (NTP: usually within a millisecond).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

COMPUTE = ("F", "B", "W")  # forward, backward (input gradients, or all of it), weight gradients
COMMS = ("send", "recv", "wait")


def clock() -> float:
    """Seconds on the clock every rank of a trace uses."""
    return time.time()


@dataclass(frozen=True)
class Span:
    """One measured (or planned) interval of one rank's work."""

    rank: int
    kind: str                 # one of COMPUTE or COMMS, or a free word ("step", "loss")
    start: float              # seconds on clock()
    end: float
    stage: int | None = None
    microbatch: int | None = None

    @property
    def label(self) -> str:
        return f"{self.kind}{'' if self.microbatch is None else self.microbatch}"


class Recorder:
    """Collects one rank's spans. Cheap enough to leave on for a whole run."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.spans: list[Span] = []

    def add(self, kind: str, start: float, end: float, stage: int | None = None,
            microbatch: int | None = None) -> None:
        self.spans.append(Span(self.rank, kind, start, end, stage, microbatch))

    @contextmanager
    def span(self, kind: str, stage: int | None = None, microbatch: int | None = None
             ) -> Iterator[None]:
        start = clock()
        try:
            yield
        finally:
            self.add(kind, start, clock(), stage, microbatch)


def to_chrome_trace(spans: Sequence[Span], origin: float | None = None) -> dict:
    """Chrome trace-event JSON (``ph: X`` complete events, microseconds) for ``spans``.

    ``origin`` (default: the earliest start) becomes time 0, so that several ranks' spans
    written separately stay on one axis if they are given the same origin.
    """
    if origin is None:
        origin = min((s.start for s in spans), default=0.0)
    events: list[dict] = []
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
    for rank, stage in sorted({(s.rank, -1 if s.stage is None else s.stage) for s in spans}):
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": stage,
                       "args": {"name": "rank" if stage < 0 else f"stage {stage}"}})
    for s in spans:
        events.append({"ph": "X", "name": s.label, "cat": s.kind, "pid": s.rank,
                       "tid": -1 if s.stage is None else s.stage,
                       "ts": round((s.start - origin) * 1e6, 3),
                       "dur": round(max(0.0, s.end - s.start) * 1e6, 3),
                       "args": {"stage": s.stage, "microbatch": s.microbatch,
                                "start_s": s.start, "end_s": s.end}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_s": origin, "clock": "time.time() of each rank"}}


def write_chrome_trace(path: str | Path, spans: Sequence[Span], origin: float | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(spans, origin)))
    return path


def read_chrome_trace(path: str | Path) -> list[Span]:
    """The spans of a file written by ``write_chrome_trace`` (absolute clock times)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [Span(e["pid"], e["cat"], e["args"]["start_s"], e["args"]["end_s"],
                 e["args"]["stage"], e["args"]["microbatch"])
            for e in events if e.get("ph") == "X"]


def spans_to_dicts(spans: Sequence[Span]) -> list[dict]:
    """Plain dicts, to send spans between processes (RPC, the launcher's results)."""
    return [asdict(s) for s in spans]


def spans_from_dicts(rows: Sequence[dict]) -> list[Span]:
    return [Span(**r) for r in rows]


def _lanes(spans: Sequence[Span]) -> tuple[dict[int, int], dict[int, int]]:
    """Greedy interval partitioning of each rank's compute spans: (lane of span i, lanes per rank)."""
    lane: dict[int, int] = {}
    ends: dict[int, list[float]] = {}
    order = sorted((i for i, s in enumerate(spans) if s.kind in COMPUTE), key=lambda i: spans[i].start)
    for i in order:
        s, free = spans[i], ends.setdefault(spans[i].rank, [])
        k = next((k for k, end in enumerate(free) if end <= s.start), len(free))
        free[k:k + 1] = [s.end]
        lane[i] = k
    return lane, {rank: max(1, len(free)) for rank, free in ends.items()} | {
        s.rank: 1 for s in spans if s.rank not in ends}


def plot_timelines(path: str | Path, panels: Sequence[tuple[str, Sequence[Span]]],
                   title: str = "", unit: str = "ms") -> Path:
    """Draw each panel (a title and its spans) with one row per rank on one time axis.

    Compute spans are coloured by micro-batch and labelled ("F3", "B3", "W3"); a backward
    is hatched, a weight-gradient cross-hatched; waits are thin grey bars under the row.
    Blank space in a row is idle time. Compute spans of one rank that overlap in time (a
    rank working on two micro-batches at once) are stacked in thinner lanes of its row.
    A panel whose spans are in abstract units (a planned schedule) is drawn in those units when ``unit`` is ""; measured panels start
    at their earliest span.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "": 1.0}[unit]
    cmap = plt.get_cmap("tab10")
    ranks_per_panel = [sorted({s.rank for s in spans}) for _, spans in panels]
    heights = [max(1, len(r)) * 0.55 + 0.9 for r in ranks_per_panel]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    hatch = {"F": "", "B": "//", "W": "xx"}
    # one time axis for every panel: a planned panel scaled to real time compares by eye
    extent = max((max((s.end for s in spans), default=0.0) - min((s.start for s in spans), default=0.0)
                  for _, spans in panels), default=0.0) * scale
    for ax, (name, spans), ranks in zip(axes[:, 0], panels, ranks_per_panel):
        origin = min((s.start for s in spans), default=0.0)
        row = {r: i for i, r in enumerate(ranks)}
        # a rank with several stages: "2F3" is stage 2's forward of micro-batch 3 (PyTorch's notation)
        several = len({(s.rank, s.stage) for s in spans if s.kind in COMPUTE}) > len(ranks)
        lane, lanes = _lanes(spans)
        for i, s in enumerate(spans):
            y = row[s.rank]
            x0, w = (s.start - origin) * scale, max(0.0, s.end - s.start) * scale
            if s.kind in COMPUTE:
                color = cmap((s.microbatch or 0) % 10)
                height = 0.7 / lanes[s.rank]
                y = y - 0.35 + (lane[i] + 0.5) * height
                ax.broken_barh([(x0, w)], (y - height / 2, height), facecolors=color,
                               edgecolor="black", linewidth=0.4, hatch=hatch[s.kind])
                ax.text(x0 + w / 2, y, f"{s.stage}{s.label}" if several and s.stage is not None else s.label,
                        ha="center", va="center", fontsize=6, clip_on=True)
            else:
                ax.broken_barh([(x0, w)], (y + 0.38, 0.1), facecolors="0.6")
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.set_ylim(len(ranks) - 0.4, -0.6)
        ax.set_xlim(0, extent * 1.01 or None)
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_xlabel(f"time ({unit})" if unit else "time (unit costs)")
    legend = [Patch(facecolor="white", edgecolor="black", hatch=hatch[k], label=lbl)
              for k, lbl in (("F", "forward"), ("B", "backward"), ("W", "weight grad"))]
    legend.append(Patch(facecolor="0.6", label="send/recv wait"))
    axes[0, 0].legend(handles=legend, fontsize=7, ncol=4, loc="upper right",
                      bbox_to_anchor=(1.0, 1.35 if len(panels) > 1 else 1.2))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

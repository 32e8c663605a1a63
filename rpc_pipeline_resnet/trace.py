"""``--trace DIR``: measured per-rank timelines, attached to the tutorial's code from outside.

On each shard's worker a ``ShardTracer`` records, for every micro-batch, the spans
  recv  forward was called until ``x_rref.to_here()`` returned (shard 2: shard 1's output)
  wait  the shard's ``_lock`` was asked for until it was held (only when >= 1 ms)
  F     the layers, under the lock
  B     the gradient of the shard's output arrived until the shard's last gradient was made
and on the master a ``Tracer`` records ``recv`` (the model's forward), ``loss``, ``wait``
(``dist_autograd.backward``) and ``step`` around each batch. The shards' ``forward`` stays
the tutorial's: the tracer wraps it, swaps its lock for a timed one and hooks its first
layer and its tensors (autograd hooks). All spans use ``distkit.timeline``'s one clock.
"""
from __future__ import annotations

import contextlib
import functools
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import RRef

from distkit.timeline import (Recorder, clock, plot_timelines, spans_from_dicts, spans_to_dicts,
                              write_chrome_trace)

LOCK_WAIT_MIN = 1e-3  # seconds: shorter waits for a shard's lock are not worth a span
_RREF_ID = re.compile(r"GloballyUniqueId\(created_on=(\d+), local_id=(\d+)\)")


def rref_number(rref: RRef) -> int:
    """The RRef's id on its creator: the master numbers the RRefs it creates in order.

    An RRef has no public id; its repr names it (first id: the RRef's, then its fork's).
    Every x_rref and y_rref is created by the master, micro-batch after micro-batch, so
    sorting these numbers puts a shard's micro-batches in the order of the master's loop
    (``Tracer.spans`` turns them into 0 .. num_split - 1).
    """
    return int(_RREF_ID.search(repr(rref)).group(2))


class TimedLock:
    """Stands in for a shard's ``_lock``: notes (per thread) when forward asked for it, got it
    and let it go. Those three instants end ``recv``, end ``wait`` and bracket ``F``."""

    def __init__(self, lock: threading.Lock, times: threading.local) -> None:
        self.lock, self.times = lock, times

    def __enter__(self) -> None:
        self.times.asked = clock()
        self.lock.acquire()
        self.times.held = clock()

    def __exit__(self, *exc: Any) -> None:
        self.times.released = clock()
        self.lock.release()


class ShardTracer:
    """Lives on a shard's worker: records recv, wait, F and B of every micro-batch it runs."""

    def __init__(self, shard: nn.Module, stage: int) -> None:
        self.recorder = Recorder(rpc.get_worker_info().id)
        self.stage = stage
        self.call = threading.local()  # one forward call = one RPC thread
        self.backward_start: dict[int, float] = {}
        shard._lock = TimedLock(shard._lock, self.call)
        shard.seq[0].register_forward_hook(self._first_layer)
        # The RRef proxies call shard.forward itself, not shard(...): the shard's own forward
        # hooks would never run. So the forward is wrapped, on this instance only.
        forward = shard.forward

        @functools.wraps(forward)
        def traced_forward(x_rref: RRef) -> torch.Tensor:
            start = clock()
            out = forward(x_rref)
            self._record(start, rref_number(x_rref), out)
            return out

        shard.forward = traced_forward

    def _first_layer(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.call.x, self.call.first = args[0], output  # the shard's input, its first layer's output

    def _record(self, start: float, microbatch: int, out: torch.Tensor) -> None:
        rec, stage, t = self.recorder, self.stage, self.call
        rec.add("recv", start, t.asked, stage, microbatch)
        if t.held - t.asked >= LOCK_WAIT_MIN:
            rec.add("wait", t.asked, t.held, stage, microbatch)
        rec.add("F", t.held, t.released, stage, microbatch)
        if out.requires_grad:
            self._time_backward(t.x, t.first, out, microbatch)

    def _time_backward(self, x: torch.Tensor, first: torch.Tensor, out: torch.Tensor,
                       microbatch: int) -> None:
        """Record this micro-batch's backward through the shard as one span ``B``.

        It starts when the gradient of the shard's output arrives (a hook on ``out`` runs
        before anything of the shard's backward does) and ends when the last gradient of
        the shard is computed: the gradient of its input when the input needs one (shard
        2: it is then sent back to shard 1), else the first layer's backward node (shard
        1's conv1: every other node of the shard feeds it). Parameters' gradients are
        produced by the same nodes, so nothing of the shard runs outside the span but the
        accumulation into the distributed autograd context.
        """
        def started(grad: torch.Tensor) -> None:
            self.backward_start[microbatch] = clock()

        def ended(*_: Any) -> None:
            end = clock()
            self.recorder.add("B", self.backward_start.pop(microbatch, end), end, self.stage,
                              microbatch)

        out.register_hook(started)
        if x.requires_grad:
            x.register_hook(ended)
        else:
            first.grad_fn.register_hook(ended)  # a node's post-hook: after it ran

    def take(self) -> list[dict]:
        spans, self.recorder.spans = self.recorder.spans, []
        return spans_to_dicts(spans)


def _attach(shard_rref: RRef, stage: int) -> None:
    """Runs on the shard's owner."""
    shard = shard_rref.local_value()
    shard.tracer = ShardTracer(shard, stage)


def _take(shard_rref: RRef) -> list[dict]:
    """Runs on the shard's owner: its spans so far (as dicts, to travel over RPC)."""
    return shard_rref.local_value().tracer.take()


class Tracer:
    """Lives on the master: its own spans around each batch, and the shards' tracers.

    ``batch(model)`` wraps one batch (``measure.Meter`` enters it inside its clocks). The
    model's forward is timed by module hooks; ``dist_autograd.backward`` is a C function
    with no hook of its own, so its call and return are caught with ``sys.setprofile``
    (this thread only, only inside the batch).
    """

    def __init__(self) -> None:
        self.recorder = Recorder(0)
        self.model: nn.Module | None = None
        self.times: dict[str, float] = {}

    def _attach(self, model: nn.Module) -> None:
        self.model = model
        shards = (model.p1_rref, model.p2_rref)
        torch.futures.wait_all([rpc.rpc_async(r.owner(), _attach, args=(r, stage))
                                for stage, r in enumerate(shards)])
        model.register_forward_pre_hook(lambda *_: self.times.__setitem__("forward", clock()))
        model.register_forward_hook(lambda *_: self.times.__setitem__("logits", clock()))

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if arg is dist_autograd.backward:
            if event == "c_call":
                self.times["backward"] = clock()
            elif event == "c_return":
                self.times["stepping"] = clock()

    @contextlib.contextmanager
    def batch(self, model: nn.Module) -> Iterator[None]:
        if self.model is None:
            self._attach(model)
        self.times = {}
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(previous)
        t = self.times | {"end": clock()}
        # the master waits for the logits, computes the loss, waits for the backward, steps
        for kind, start, end in (("recv", "forward", "logits"), ("loss", "logits", "backward"),
                                 ("wait", "backward", "stepping"), ("step", "stepping", "end")):
            self.recorder.add(kind, t[start], t[end])

    def spans(self, num_split: int) -> list[dict]:
        """Every rank's spans so far; the shards' micro-batches numbered 0 .. num_split - 1."""
        shards = (self.model.p1_rref, self.model.p2_rref)
        futures = [rpc.rpc_async(r.owner(), _take, args=(r,)) for r in shards]
        spans = spans_to_dicts(self.recorder.spans)
        for fut in futures:
            shard_spans = fut.wait()
            # every batch has num_split micro-batches, numbered in the master's loop order
            order = {n: i % num_split for i, n in
                     enumerate(sorted({s["microbatch"] for s in shard_spans}))}
            spans += [s | {"microbatch": order[s["microbatch"]]} for s in shard_spans]
        self.recorder.spans = []
        return spans


def write_trace(directory: str, runs: list[dict],
                roles: str = "rank 0 master, rank 1 shard 1, rank 2 shard 2") -> list[Path]:
    """splits_N.json per split value (all ranks, one clock) and timeline.png (last timed batch)."""
    paths, panels = [], []
    for run in runs:
        spans = spans_from_dicts(run["spans"])
        m = run["num_split"]
        paths.append(write_chrome_trace(Path(directory) / f"splits_{m}.json", spans))
        start, end = run["windows"][-1]
        last = [s for s in spans if start <= s.start <= end]
        panels.append((f"{m} split{'s' * (m > 1)}: last timed batch, {end - start:.2f} s "
                       f"({roles})", last))
    paths.append(plot_timelines(Path(directory) / "timeline.png", panels,
                                title="rpc_pipeline_resnet: measured timeline per rank"))
    return paths

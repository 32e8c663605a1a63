"""The step callbacks of the extras: each one is on only if its flag asks for it.

``extras.Hooks`` starts them after the rank is built (``on_train_begin``), calls them after
every step of ``main.train`` (``on_step_end``) and once at the end (``on_train_end``):

  ``LossLog``      --loss_log PATH: one JSON line per step, the loss at full precision
  ``Checkpoints``  --checkpoint_dir DIR: a torch.distributed.checkpoint every K steps
  ``Trace``        --trace DIR: every forward/backward/wait per rank (``timeline.py``)
  ``StageCosts``   --stage_layers auto: each stage's predicted cost beside the measured one
  ``Summary``      always: steps, seconds, peak memory and the first and last loss
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from distkit.timeline import COMPUTE
from pipelining_transformer import checkpoint
from pipelining_transformer.cli import data_settings_from, layout_from
from pipelining_transformer.timeline import PipelineTracer

log = logging.getLogger(__name__)


class StepCallback:
    """What ``extras.Hooks`` calls: once before the first step (``first_step``: 0, or the
    step a resume goes on from), after every step (``step`` the 0-based batch index,
    ``loss`` the batch's loss on the rank that reports it, None on every other rank), and
    once after the last."""

    def on_train_begin(self, first_step: int) -> None:
        pass

    def on_step_end(self, step: int, loss: float | None) -> None:
        pass

    def on_train_end(self) -> None:
        pass


def parts_of(pp) -> list:
    """Each stage's module with its optimizer: what a checkpoint holds."""
    return [(s.submod, opt) for s, opt in zip(pp.stages, pp.optimizers)]


class LossLog(StepCallback):
    """--loss_log: appended to, so that a resumed run goes on with the file of the run it resumes."""

    def __init__(self, path: str) -> None:
        self.path = path
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as cli.check_args allowed
        self.file = open(path, "a")

    def on_step_end(self, step: int, loss: float | None) -> None:
        if loss is not None:
            try:  # one write of a whole line, flushed: a killed run leaves only whole lines
                self.file.write(json.dumps({"step": step + 1, "loss": loss}) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk: say where and when, not only errno
                raise OSError(e.errno, f"--loss_log {self.path}: cannot write step {step + 1}: "
                                       f"{e.strerror}") from e

    def on_train_end(self) -> None:
        self.file.close()


class Checkpoints(StepCallback):
    """--checkpoint_dir: save every --checkpoint_every steps and after the last (a collective)."""

    def __init__(self, args: argparse.Namespace, pp) -> None:
        self.args, self.parts = args, parts_of(pp)
        self.layout = layout_from(args, pp.layout, pp.device)

    def on_step_end(self, step: int, loss: float | None) -> None:
        done, every = step + 1, self.args.checkpoint_every
        if done == self.args.steps or every and done % every == 0:
            try:
                path = checkpoint.save(self.args.checkpoint_dir, done, self.parts,
                                       data_settings_from(self.args), self.layout)
            # a full disk, a directory taken away: where, when, what is left (DCP's
            # CheckpointException is a BaseException, the others' errors gathered on each rank)
            except (Exception, CheckpointException) as e:
                previous = checkpoint.latest_complete(self.args.checkpoint_dir)
                raise RuntimeError(f"--checkpoint_dir {self.args.checkpoint_dir}: cannot save step "
                                   f"{done} ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); the newest complete checkpoint "
                                   f"is {previous or 'none'} (--resume goes on from it)") from e
            log.info(f"checkpoint {path} complete")


class Trace(StepCallback):
    """--trace: each ``forward_backward`` becomes a "step" span, the stages' compute and
    waits spans inside it; at the end the files and the drawing (``timeline.py``). Also on,
    without files, for ``StageCosts``."""

    def __init__(self, args: argparse.Namespace, pp) -> None:
        self.args, self.step = args, 0
        self.tracer = PipelineTracer(dist.get_rank())
        inner = pp.forward_backward

        def traced(*a, **kw):
            with self.tracer.step(self.step):
                return inner(*a, **kw)

        pp.forward_backward = traced  # this rank object only; the class is untouched

    def on_train_begin(self, first_step: int) -> None:
        self.step = first_step

    def on_step_end(self, step: int, loss: float | None) -> None:
        self.step = step + 1  # the index of the next "step" span

    def on_train_end(self) -> None:
        if self.args.trace:
            self.tracer.finish(self.args.trace, self.args.schedule, self.args.n_microbatches)
        else:
            self.tracer.stop()


class StageCosts(StepCallback):
    """--stage_layers auto: each stage's cost per micro-batch as balance.py predicted it
    and as the run measured it (forward + backward spans of the steps after the first),
    logged once at the end, beside each other."""

    def __init__(self, pp, trace: Trace, n_microbatches: int) -> None:
        self.predicted = dict(enumerate(pp.layout.predicted_ms))  # by stage index
        self.trace, self.m = trace, n_microbatches
        self.steps = self.first_step_end = 0  # spans before it belong to the first step (warm-up)

    def on_step_end(self, step: int, loss: float | None) -> None:
        self.steps += 1
        if self.steps == 1:
            self.first_step_end = len(self.trace.tracer.recorder.spans)

    def on_train_end(self) -> None:
        spans = self.trace.tracer.recorder.spans
        steps = self.steps - 1  # the steps after the first
        if steps < 1:  # one step only: measure it
            self.first_step_end, steps = 0, 1
        measured: dict[int, float] = {}
        for s in spans[self.first_step_end:]:
            if s.kind in COMPUTE:
                measured[s.stage] = measured.get(s.stage, 0.0) + 1e3 * (s.end - s.start) / (steps * self.m)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measured)  # each stage's replicas: their mean
        per_stage: dict[int, list[float]] = {}
        for rank_costs in everyone:
            for stage, ms in rank_costs.items():
                per_stage.setdefault(stage, []).append(ms)
        if dist.get_rank() == 0:
            log.info("stage costs per micro-batch, forward + backward: " + "; ".join(
                f"stage {k} predicted {self.predicted[k]:.1f} ms, measured "
                f"{sum(v) / len(v):.1f} ms" for k, v in sorted(per_stage.items())))


class Summary(StepCallback):
    """Always on: the run's losses, time and peak memory, logged at the end and returned."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.losses: list[float] = []
        self.seconds = self.peak_mb = 0.0

    def on_train_begin(self, first_step: int) -> None:
        self.steps, self.first = self.args.steps - first_step, first_step
        self.start = time.perf_counter()

    def on_step_end(self, step: int, loss: float | None) -> None:
        if loss is not None:
            self.losses.append(loss)

    def on_train_end(self) -> None:
        self.seconds = time.perf_counter() - self.start
        # peak resident memory of this process (Linux reports KiB)
        self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        text = f"{self.steps} steps in {self.seconds:.1f} s, peak memory {self.peak_mb:.0f} MB"
        if self.losses:
            text += f"; loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}"
        log.info(text)

    def result(self) -> dict:
        """What ``main.run_worker`` returns to the launcher (``extras.exit_status`` reads it)."""
        return {"losses": self.losses or None, "seconds": self.seconds, "peak_mb": self.peak_mb,
                "first_step": self.first}


def callbacks_for(args: argparse.Namespace, pp) -> list[StepCallback]:
    """The callbacks the flags ask for (``Summary`` is added by ``extras.Hooks`` itself)."""
    callbacks: list[StepCallback] = []
    if args.loss_log and pp.reports:
        callbacks.append(LossLog(args.loss_log))
    if args.checkpoint_dir:
        callbacks.append(Checkpoints(args, pp))
    auto = pp.layout.predicted_ms is not None  # --stage_layers auto
    if args.trace or auto:
        callbacks.append(Trace(args, pp))
    if auto:
        callbacks.append(StageCosts(pp, callbacks[-1], args.n_microbatches))
    return callbacks

"""What is layered on the tutorial's code: one hook per phase, each holding every extra of it.

  build  ``on_build(stages, args, env)``, in ``main.build_rank``: the stages worked around
         for gloo (workarounds.py) and, with --dp_size, sharded over the replicas (dp.py)
  start  ``Hooks(args, pp, callbacks_for)``, in ``main.train``: logs where the stages are,
         resumes (--resume: ``first_step``), starts torch.profiler (--trace) and the step
         callbacks the flags ask for: ``LossLog`` (--loss_log), ``Checkpoints``
         (--checkpoint_dir) and, always, ``Summary`` (steps, seconds, peak memory, losses)
  step   ``Hooks.on_step_end(step, loss)``: after each step
  end    ``Hooks.on_train_end()``: the run's summary, which ``main.run_worker`` returns to
         the launcher and ``exit_status`` judges
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

import distkit
from pipelining_transformer import checkpoint, dp, workarounds
from pipelining_transformer.cli import data_settings_from, layout_from

log = logging.getLogger(__name__)


class Replica(Protocol):
    """``main.DistEnv`` as this module sees it (main imports this module)."""

    dp_size: int
    mesh: DeviceMesh | None

    @property
    def dp_rank(self) -> int: ...


def on_build(stages: list[PipelineStage], args: argparse.Namespace, env: Replica) -> list[PipelineStage]:
    """The build phase's extras, on the stages the tutorial's split built."""
    for stage in stages:
        workarounds.apply(stage)  # torch's pipelining on gloo (workarounds.py)
        if env.dp_size > 1:
            dp.shard_over_dp(stage, env.mesh["dp"])  # before main.build_rank makes the optimizers
    if env.dp_rank:
        # the replicas' own dropout masks (replica 0 keeps those of a run without --dp_size);
        # after the split, which draws no random numbers: the weights are every rank's same
        torch.manual_seed(args.seed + 1_000_003 * env.dp_rank)
    return stages


class Hooks:
    """The start, step and end hooks of ``main.train`` (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, pp,
                 callbacks_for: Callable[[argparse.Namespace, object], list[StepCallback]]
                 ) -> None:
        self.args, self.pp = args, pp
        replica = f", replica {pp.dp_rank} of {pp.dp_size}" if pp.dp_size > 1 else ""
        log.info(f"stages {[s.stage_index for s in pp.stages]} of {pp.num_stages} "
                 f"({args.schedule}, {args.split} split{replica}) on {pp.device}")
        self.first_step = resume(args, pp)  # 0 unless --resume finds a checkpoint
        # --trace: the steps under torch.profiler, with the schedule's own spans ("Forward 0",
        # "PP:0F1"), written to DIR/rank<r>.json when the training ends
        self.profiler = contextlib.ExitStack()
        self.profiler.enter_context(distkit.profiled(args.trace, f"rank{dist.get_rank()}"))
        self.summary = Summary(args)
        self.callbacks = [self.summary, *callbacks_for(args, pp)]
        for callback in self.callbacks:
            callback.on_train_begin(self.first_step)

    def on_step_end(self, step: int, loss: float | None) -> None:
        for callback in self.callbacks:
            callback.on_step_end(step, loss)

    def on_train_end(self) -> dict:
        self.profiler.close()
        for callback in self.callbacks:
            callback.on_train_end()
        # the split the run used (with --stage_layers auto, the one it chose)
        return {**self.summary.result(), "stage_layers": list(self.pp.layout.stage_layers)}


def resume(args: argparse.Namespace, pp) -> int:
    """--resume: load the checkpoint check_args chose, and return its step (0: a fresh start).

    The step saved is also the data position: batch ``step`` is the next one to read.
    """
    # each rank (each restarted torchrun worker too) chose for itself: the same one?
    if not checkpoint.same_on_every_rank(args.resume_path):
        return 0
    first = checkpoint.load(args.resume_path, parts_of(pp), layout_from(args, pp.layout, pp.device))
    log.info(f"resumed from {args.resume_path} after step {first}")
    return first


def exit_status(results: dict) -> int:
    """0, or 1 if the loss of a run from step 0 did not fall.

    Judged on runs from step 0 only: what is left after a resume (a torchrun restart late
    in the run) may be too few steps to fall, and a non-zero exit would make torchrun restart.
    """
    losses = [r["losses"] for r in results.values() if r and r["losses"] and r["first_step"] == 0]
    if losses and len(losses[0]) > 1 and not losses[0][-1] < losses[0][0]:
        print(f"The loss did not fall: {losses[0][0]:.4f} -> {losses[0][-1]:.4f}", file=sys.stderr)
        return 1
    return 0


class StepCallback:
    """What ``Hooks`` calls: before the first step (``first_step``: 0, or where a resume goes
    on), after every step (``step`` 0-based, ``loss`` on the rank that reports it, else
    None), and after the last."""

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
                                   f"{done} ({checkpoint.why(e)}); the newest complete checkpoint "
                                   f"is {previous or 'none'} (--resume goes on from it)") from e
            log.info(f"checkpoint {path} complete")


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
        """What ``main.run_worker`` returns to the launcher (``exit_status`` reads it)."""
        return {"losses": self.losses or None, "seconds": self.seconds, "peak_mb": self.peak_mb,
                "first_step": self.first}


def callbacks_for(args: argparse.Namespace, pp) -> list[StepCallback]:
    """The callbacks the flags ask for (``Hooks`` adds ``Summary`` itself)."""
    callbacks: list[StepCallback] = []
    if args.loss_log and pp.reports:
        callbacks.append(LossLog(args.loss_log))
    if args.checkpoint_dir:
        callbacks.append(Checkpoints(args, pp))
    return callbacks

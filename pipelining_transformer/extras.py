"""What is layered on the tutorial's code: one hook per phase, each holding every extra of it.

  build  ``on_build(stages, args, env)``: ``main.build_rank`` hands it the stages the
         tutorial's split built, and goes on with what it returns: the stages worked
         around for gloo (workarounds.py) and, with --dp_size, sharded over the replicas
         (dp.py), each replica drawing dropout masks of its own
  start  ``Hooks(args, pp, callbacks_for)``: ``main.train`` makes it once the rank is
         built: it says where the stages are, resumes (--resume: ``first_step``), starts
         torch.profiler (--trace) and the step callbacks the flags ask for (callbacks.py)
  step   ``Hooks.on_step_end(step, loss)``: after each step of ``main.train``
  end    ``Hooks.on_train_end()``: the callbacks' last word; the run's summary, which
         ``main.run_worker`` returns to the launcher and ``exit_status`` judges

Without a flag, each hook does only what every run needs: the gloo workarounds, the summary.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

import distkit
from pipelining_transformer import checkpoint, dp, workarounds
from pipelining_transformer.callbacks import StepCallback, Summary, callbacks_for, parts_of
from pipelining_transformer.cli import layout_from

log = logging.getLogger(__name__)


class Replica(Protocol):
    """A rank's place among the pipeline replicas: ``main.DistEnv`` (a protocol, so that this
    module needs no main, which imports it)."""

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
                 callbacks_for: Callable[[argparse.Namespace, object], list[StepCallback]] = callbacks_for
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

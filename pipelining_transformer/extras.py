"""What is layered on the tutorial's code, each by a call that says what it does: ``on_build``
(main.py's gloo fix, --dp_size); ``resume`` (--resume); ``RunLog`` (the stages, each step's loss and the run's
summary, and the flags' step callbacks: ``LossLog``, ``Checkpoints``). --trace is ``distkit.start_rank``'s.
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.pipelining import PipelineStage

import distkit
from pipelining_transformer import checkpoint, dp
from pipelining_transformer import main as tutorial
from pipelining_transformer.cli import data_settings_from, layout_from

log = logging.getLogger(__name__)


def on_build(stages: list[PipelineStage], args: argparse.Namespace, env: dp.DistEnv) -> list[PipelineStage]:
    """The build phase's extras, on the stages the tutorial's split built."""
    for stage in stages:
        tutorial.send_contiguous_input_grads(stage)  # main.py's gloo fix; the zero-bubble schedules too
        if env.dp_size > 1:
            dp.shard_over_dp(stage, env.mesh["dp"])  # before train.build_rank makes the optimizers
    if env.dp_rank:
        # each replica's own dropout masks (replica 0's: a run's without --dp_size), after the split
        torch.manual_seed(args.seed + 1_000_003 * env.dp_rank)
    return stages


def resume(args: argparse.Namespace, pp) -> int:
    """--resume: the step to go on from (0 for a fresh start), after loading the checkpoint check_args
    chose, once every rank is seen to have chosen the same (each picks the newest itself; a marker seen
    by one machine first would split the steps, silently)."""
    if args.resume is None:
        return 0
    chosen: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, args.resume_path)
    if len(set(chosen)) > 1:
        raise RuntimeError("the ranks chose different checkpoints to resume from: " +
                           ", ".join(f"rank {r}: {p}" for r, p in enumerate(chosen)))
    if not args.resume_path:
        return 0
    first_step = checkpoint.load(args.resume_path, parts_of(pp), layout_from(args, pp.layout, pp.env.device))
    log.info(f"resumed from {args.resume_path} after step {first_step}")
    return first_step


class RunLog:
    """The run as ``train.train`` reports it: the stages at the start, each step's loss (and the step
    callbacks), the time, peak memory and losses at the end: what ``run_worker`` saves."""

    def __init__(self, args: argparse.Namespace, pp, callbacks: list[StepCallback]) -> None:
        self.args, self.pp, self.callbacks = args, pp, callbacks
        env = pp.env
        replica = f", replica {env.dp_rank} of {env.dp_size}" if env.dp_size > 1 else ""
        log.info(f"stages {[s.stage_index for s in pp.stages]} of {pp.layout.num_stages} "
                 f"({args.schedule}, {args.split} split{replica}) on {env.device}")
        self.losses: list[float] = []
        self.start = time.perf_counter()

    def on_step_end(self, step: int, loss: float | None) -> None:
        if loss is not None:
            self.losses.append(loss)
        for callback in self.callbacks:
            callback.on_step_end(step, loss)

    def on_train_end(self, first_step: int) -> dict:
        seconds = time.perf_counter() - self.start
        for callback in self.callbacks:
            callback.on_train_end()
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak resident; Linux: KiB
        losses = f"; loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}" if self.losses else ""
        log.info(f"{self.args.steps - first_step} steps in {seconds:.1f} s, peak memory {peak_mb:.0f} MB{losses}")
        # what train.run_worker saves for main(), with the split the run used (auto's choice)
        return {"losses": self.losses or None, "seconds": seconds, "peak_mb": peak_mb,
                "first_step": first_step, "stage_layers": list(self.pp.layout.stage_layers)}


def exit_status(results: dict) -> int:
    """0, or 1 if the loss of a run from step 0 did not fall (after a resume, a torchrun restart late
    in the run, too few steps may be left to fall, and a non-zero exit would make torchrun restart)."""
    losses = [r["losses"] for r in results.values() if r and r["losses"] and r["first_step"] == 0]
    if losses and len(losses[0]) > 1 and not losses[0][-1] < losses[0][0]:
        print(f"The loss did not fall: {losses[0][0]:.4f} -> {losses[0][-1]:.4f}", file=sys.stderr)
        return 1
    return 0


class StepCallback:
    """What ``RunLog`` calls after each step (``loss``: on the reporting rank, else None) and at the end."""

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
    """--checkpoint_dir: save every --checkpoint_every steps, after the last, and after the step in which a
    SIGTERM came (a collective): SLURM's preemption, requeue and time limit send one before SIGKILL."""

    def __init__(self, args: argparse.Namespace, pp) -> None:
        self.args, self.parts, self.layout = args, parts_of(pp), layout_from(args, pp.layout, pp.env.device)
        self.device, self.terminated = pp.env.device, False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.terminated = True  # the step goes on: a rank stopped inside it would stall the others

    def on_step_end(self, step: int, loss: float | None) -> None:
        done, every = step + 1, self.args.checkpoint_every
        # the ranks may get the signal in different steps: all stop after the first one that saw it
        flag = torch.tensor([float(self.terminated)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop or done == self.args.steps or every and done % every == 0:
            distkit.progress()  # the save has --hang_timeout of its own, not what is left after the step
            try:
                path = checkpoint.save(self.args.checkpoint_dir, done, self.parts,
                                       data_settings_from(self.args), self.layout)
            # a full disk, a directory gone: where, when, what is left (DCP's error is a BaseException)
            except (Exception, CheckpointException) as e:
                previous = checkpoint.latest_complete(self.args.checkpoint_dir)
                raise RuntimeError(f"--checkpoint_dir {self.args.checkpoint_dir}: cannot save step "
                                   f"{done} ({checkpoint.why(e)}); the newest complete checkpoint "
                                   f"is {previous or 'none'} (--resume goes on from it)") from e
            distkit.progress()  # and the next step a whole --hang_timeout after it
            log.info(f"checkpoint {path} complete")
        if stop:
            log.info(f"stopped by SIGTERM after step {done}; --resume goes on from {path}")
            distkit.exit_now(128 + signal.SIGTERM)  # as SIGTERM's default would have, saved first


def callbacks_for(args: argparse.Namespace, pp) -> list[StepCallback]:
    """The step callbacks the flags ask for."""
    callbacks: list[StepCallback] = []
    if args.loss_log and pp.reports:
        callbacks.append(LossLog(args.loss_log))
    if args.checkpoint_dir:
        callbacks.append(Checkpoints(args, pp))
    return callbacks

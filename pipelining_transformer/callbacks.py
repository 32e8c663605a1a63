"""The step callbacks of the extras: each one is on only if its flag asks for it.

``extras.Hooks`` starts them after the rank is built (``on_train_begin``), calls them after
every step of ``main.train`` (``on_step_end``) and once at the end (``on_train_end``):

  ``LossLog``      --loss_log PATH: one JSON line per step, the loss at full precision
  ``Checkpoints``  --checkpoint_dir DIR: a torch.distributed.checkpoint every K steps
  ``Summary``      always: steps, seconds, peak memory and the first and last loss
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import time
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from pipelining_transformer import checkpoint
from pipelining_transformer.cli import data_settings_from, layout_from

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
    return callbacks

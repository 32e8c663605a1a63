"""One run of pipelining_transformer's ``train``, recorded: what the pipelining tests
(test_pipelining_transformer.py, test_pipelining_dp.py) compare with one process."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable

import torch

from pipelining_transformer import extras
from pipelining_transformer.train import train


class Recorder(extras.StepCallback):
    """What a step of ``train.train`` left on this rank: the micro-batch losses the schedule
    returned, the batch loss computed from them, the loss handed to the callbacks (the one
    the run reports, None elsewhere), and each parameter's gradient and value after the step.

    It is one more step callback, plus a wrap of this rank object's ``schedule.step`` (to see the
    micro-batch losses it fills in) and ``batch_loss``: the step itself is the one a user's run executes.
    """

    def __init__(self, pp, whole: Callable[[torch.Tensor | None], torch.Tensor | None]) -> None:
        self.pp, self.whole = pp, whole
        self.out: dict = {"losses": None, "batch_loss": None}
        schedule_step, batch_loss = pp.schedule.step, pp.batch_loss

        def recording_schedule_step(*args, losses=None, **kwargs):
            out = schedule_step(*args, losses=losses, **kwargs)
            if pp.has_last:
                self.out["losses"] = torch.stack(losses).detach().cpu()
            return out

        def recording_batch_loss(losses, step):
            self.out["batch_loss"] = batch_loss(losses, step)  # None where no last stage is
            return self.out["batch_loss"]

        pp.schedule.step, pp.batch_loss = recording_schedule_step, recording_batch_loss

    def on_step_end(self, step: int, loss: float | None) -> None:
        # every rank of a dp group walks the same parameters in the same order: the
        # gathers of ``whole`` (a collective for dp-sharded ones) line up
        self.out["reported"] = loss
        self.out["grads"] = {n: self.whole(p.grad) for n, p in self.pp.named_parameters()}
        self.out["params"] = {n: self.whole(p) for n, p in self.pp.named_parameters()}


class LogLines(logging.Handler):
    """The messages the example's loop logs on this rank (what the user reads, "[rank r]" aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu().clone()


def train_recorded(args: argparse.Namespace, env, whole=_copy) -> dict:
    """One run of the example's ``train`` with --loss_log on: what it recorded, printed, logged."""
    said = LogLines()
    logger = logging.getLogger("pipelining_transformer")  # main's, and balance's
    logger.addHandler(said)
    recorders = []

    def with_recorder(a: argparse.Namespace, pp) -> list[extras.StepCallback]:
        recorders.append(Recorder(pp, whole))
        return [*extras.callbacks_for(a, pp), recorders[-1]]

    loss_log = os.path.join(tempfile.mkdtemp(), "losses.jsonl")
    try:
        train(argparse.Namespace(**{**vars(args), "loss_log": loss_log}), env, callbacks_for=with_recorder)
    finally:
        logger.removeHandler(said)
    logged = None
    if os.path.exists(loss_log):  # only the reporting rank writes it
        with open(loss_log) as f:
            logged = [json.loads(line) for line in f]
    printed = [line for line in said.lines if re.fullmatch(r"step \d+/\d+  loss \S+", line)]
    return {**recorders[0].out, "printed": printed, "loss_log": logged, "logged": said.lines}

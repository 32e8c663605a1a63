"""Beyond the tutorial: what ``run_trainer`` records besides training, one call per phase.

The tutorial's loop only trains and prints "Training epoch N". This run also reports each
epoch's mean loss and seconds on that line, stops on a non-finite loss, and returns every
parameter before and after training, which ``tests/test_rpc_rnn.py`` compares with one
process training the same model. ``run_trainer`` calls a ``TrainingRecord`` once per phase:
``start`` (the model is built), ``step`` (after each batch), ``end_epoch`` (the text of the
epoch's line) and ``result`` (what ``run_trainer`` returns).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

import distkit
from rpc_rnn.rnn import Decoder, EmbeddingTable, RNNModel, _remote_method


def _parameter_copies(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter of ``module`` (runs on the owner)."""
    return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}


def parameter_copies(model: RNNModel) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter, remote or local, named as in a one-process model."""
    copies: dict[str, torch.Tensor] = _remote_method(_parameter_copies, model.emb_table_rref)  # encoder.weight
    copies |= {f"rnn.{k}": v for k, v in _parameter_copies(model.rnn).items()}
    return copies | _remote_method(_parameter_copies, model.decoder_rref)  # decoder.*


class TrainingRecord:
    """The losses, the seconds and the parameters of one ``run_trainer`` call."""

    def __init__(self) -> None:
        self.losses: list[float] = []  # the mean loss of every finished epoch
        self.initial: dict[str, torch.Tensor] = {}
        self._epoch: list[float] = []  # the current epoch's batch losses
        self._clock = 0.0

    @classmethod
    def start(cls, model: RNNModel) -> TrainingRecord:
        """Build phase: the parameters before training; the first epoch's clock starts."""
        record = cls()
        record.initial = parameter_copies(model)
        record._clock = time.perf_counter()
        return record

    def step(self, loss: torch.Tensor) -> None:
        """Step phase: one batch's loss (a nan would poison every weight at the next step)."""
        self._epoch.append(distkit.check_finite(loss.item(), f"epoch {len(self.losses)}"))

    def end_epoch(self) -> str:
        """End of an epoch: its mean loss and seconds, as printed after "Training epoch N"."""
        now = time.perf_counter()
        self.losses.append(sum(self._epoch) / len(self._epoch))
        seconds, self._clock, self._epoch = now - self._clock, now, []
        return f"loss {self.losses[-1]:.4f}\t({seconds:.2f} s)"

    def result(self, model: RNNModel) -> dict:
        """End phase: every epoch's mean loss, the parameters before and after training."""
        return {"losses": self.losses, "initial": self.initial, "final": parameter_copies(model)}

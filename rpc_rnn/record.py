"""Beyond the tutorial: what ``run_trainer`` records besides training, one call per phase.

The tutorial's loop only trains and prints "Training epoch N". This run also reports each
epoch's mean loss and seconds on that line, stops on a non-finite loss, and returns the
losses. ``run_trainer`` calls a ``TrainingRecord`` once per phase: ``start``, ``step``
(after each batch), ``end_epoch`` (the text of the epoch's line) and ``result``.
"""
from __future__ import annotations

import time

import torch

import distkit


class TrainingRecord:
    """The losses and the seconds of one ``run_trainer`` call."""

    def __init__(self) -> None:
        self.losses: list[float] = []  # the mean loss of every finished epoch
        self._epoch: list[float] = []  # the current epoch's batch losses
        self._clock = time.perf_counter()

    @classmethod
    def start(cls) -> TrainingRecord:
        """Build phase: the first epoch's clock starts."""
        return cls()

    def step(self, loss: torch.Tensor) -> None:
        """Step phase: one batch's loss (a nan would poison every weight at the next step)."""
        self._epoch.append(distkit.check_finite(loss.item(), f"epoch {len(self.losses)}"))

    def end_epoch(self) -> str:
        """End of an epoch: its mean loss and seconds, as printed after "Training epoch N"."""
        now = time.perf_counter()
        self.losses.append(sum(self._epoch) / len(self._epoch))
        seconds, self._clock, self._epoch = now - self._clock, now, []
        return f"loss {self.losses[-1]:.4f}\t({seconds:.2f} s)"

    def result(self) -> dict:
        """End phase: every epoch's mean loss."""
        return {"losses": self.losses}

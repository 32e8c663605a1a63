"""Beyond the tutorial, what ``run_trainer`` records: every batch's loss (stopping on a non-finite one),
each epoch's mean loss and seconds for its "Training epoch N" line, and the losses it returns."""
from __future__ import annotations

import time

import torch

import distkit


class TrainingRecord:
    """The losses and the seconds of one ``run_trainer`` call; made as the first epoch starts."""

    def __init__(self) -> None:
        self.losses: list[float] = []  # the mean loss of every finished epoch
        self._epoch: list[float] = []  # the current epoch's batch losses
        self._clock = time.perf_counter()

    def step(self, loss: torch.Tensor) -> None:
        """One batch's loss (a nan would poison every weight at the next step)."""
        self._epoch.append(distkit.check_finite(loss.item(), f"epoch {len(self.losses)}"))

    def end_epoch(self) -> str:
        """End of an epoch: its mean loss and seconds, as printed after "Training epoch N"."""
        now = time.perf_counter()
        self.losses.append(sum(self._epoch) / len(self._epoch))
        seconds, self._clock, self._epoch = now - self._clock, now, []
        return f"loss {self.losses[-1]:.4f}\t({seconds:.2f} s)"

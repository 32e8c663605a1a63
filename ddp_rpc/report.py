"""Beyond the tutorial: the trainers' reports (``TrainerReport``: the loop records each loss), the master's
(``MasterReport``), its fail-fast wait and the summary ``main`` prints at the end."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed.rpc as rpc
from torch.distributed.nn import RemoteModule
from torch.distributed.rpc import RRef

import distkit

log = logging.getLogger(__name__)

# HybridModel typed as a Module: trainer.py imports this module, an import back is a circle (test_distkit.py)


def _fc_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The DDP-wrapped ``fc`` of a trainer's HybridModel, copied to the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.fc.module.state_dict().items()}


@dataclass
class TrainerReport:
    """What a trainer sends back to the master: losses and its ``fc`` before/after (CPU)."""

    rank: int
    device: str
    losses: list[list[float]] = field(default_factory=list)  # [epoch][batch]
    fc_before: dict[str, torch.Tensor] = field(default_factory=dict)
    fc_after: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def start(cls, rank: int, model: torch.nn.Module) -> TrainerReport:
        """Start reporting on trainer ``rank``: its ``fc`` now."""
        return cls(rank, str(model.device), fc_before=_fc_state(model))

    def record(self, epoch: int, loss: torch.Tensor) -> None:
        """Keep ``loss``, a float, under ``epoch``; a nan loss would poison every parameter at the step."""
        if len(self.losses) == epoch:
            self.losses.append([])
        self.losses[epoch].append(distkit.check_finite(loss.item(), f"trainer{self.rank}, epoch {epoch}"))

    def epoch_loss(self, epoch: int) -> float:
        return sum(self.losses[epoch]) / len(self.losses[epoch])

    def finish(self, model: torch.nn.Module) -> TrainerReport:
        """The report to send, with ``fc`` as training left it."""
        self.fc_after = _fc_state(model)
        return self


def _embedding_weight(module_rref: RRef) -> torch.Tensor:
    """Runs on the parameter server (the owner of ``module_rref``): a copy of the table."""
    return module_rref.local_value().weight.detach().cpu().clone()


class MasterReport:
    """The master's view of a run: the table before and after training, the time, the reports."""

    def __init__(self, remote_emb_module: RemoteModule, config: object, trainers: int) -> None:
        log.info(f"Training on {trainers} trainers: {config}")
        self.table = remote_emb_module.get_module_rref()
        self.config = config
        self.emb_before = rpc.rpc_sync(self.table.owner(), _embedding_weight, args=(self.table,))
        self.start = time.perf_counter()

    def finish(self, reports: list[TrainerReport]) -> dict:
        seconds = time.perf_counter() - self.start
        emb_after = rpc.rpc_sync(self.table.owner(), _embedding_weight, args=(self.table,))
        return {"trainers": reports, "emb_before": self.emb_before, "emb_after": emb_after,
                "seconds": seconds, "config": self.config}


def wait_for_trainers(futs: list[torch.futures.Future], names: list[str], timeout: float) -> list:
    """What every trainer's ``_run_trainer`` returned; raise as soon as one fails, or hangs (hung, not
    dead, it would leave a ``timeout=0`` RPC waiting forever): each trainer still training must answer
    a no-op RPC every second, which fails after ``timeout`` seconds. Each answer is the master's
    progress (``distkit.ping``): it only waits, and --hang_timeout measures the trainers' answers."""
    changed = threading.Event()
    for fut in futs:
        fut.add_done_callback(lambda _: changed.set())
    while not all(fut.done() for fut in futs):
        changed.wait(timeout=1.0)
        changed.clear()
        for name, fut in zip(names, futs):
            if fut.done():
                fut.wait()  # raises that trainer's error, if it had one
            else:
                distkit.ping(name, timeout)
    return [fut.wait() for fut in futs]


def print_summary(summary: dict) -> bool:
    """Print the master's summary of a run; whether DDP kept ``fc`` identical on all trainers."""
    config, reports = summary["config"], summary["trainers"]
    in_sync = all(torch.equal(reports[0].fc_after[k], r.fc_after[k]) for r in reports for k in r.fc_after)
    print(f"Trained {config.epochs} epochs x {config.batches_per_epoch} batches on "
          f"{len(reports)} trainers ({reports[0].device}) in {summary['seconds']:.1f} s")
    for r in reports:
        print(f"  trainer{r.rank}: loss {r.epoch_loss(0):.4f} (epoch 0) -> "
              f"{r.epoch_loss(-1):.4f} (epoch {config.epochs - 1})")
    print(f"  fc identical on all trainers: {in_sync}")
    return in_sync

"""The tutorial's ``HybridModel``, ``_run_trainer`` and ``get_next_batch``.

Everything here is called over RPC (the master runs ``_run_trainer`` on each trainer), so it
lives in an importable module rather than in ``main.py``, which runs as ``__main__``.

Who owns what:
  - the parameter server owns the ``nn.EmbeddingBag`` (created there by the master through a
    ``RemoteModule``); every trainer holds the same ``RemoteModule`` handle to it;
  - each trainer owns its replica of ``fc`` (an ``nn.Linear`` wrapped in DDP);
  - each trainer owns its own ``DistributedOptimizer``, whose local optimizers sit on the
    trainer (for ``fc``) and on the parameter server (for the embedding table).

What goes beyond the tutorial (loss records, the nan check, fc before/after) attaches from
``ddp_rpc/report.py``, through a forward hook on the loss function.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed.autograd as dist_autograd
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_rpc.report import TrainerReport

log = logging.getLogger(__name__)

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8
MAX_BAG_SIZE = 10  # the tutorial's offsets advance by 1..10 indices per bag

# The device this trainer process chose when it started (see main.run_worker). The master
# calls _run_trainer later, in one of RPC's threads, and cannot know the trainers' GPUs.
_device = torch.device("cpu")


def set_device(device: torch.device) -> None:
    global _device
    _device = device


@dataclass(frozen=True)
class TrainConfig:
    """What the master tells every trainer (it crosses in the ``_run_trainer`` RPC)."""

    epochs: int = 10
    batches_per_epoch: int = 10
    batch_size: int = 16
    lr: float = 0.05
    seed: int = 0


class HybridModel(torch.nn.Module):
    """The trainer's model: a sparse part on the parameter server, a dense part here.

    1) The dense part, ``fc``, is an ``nn.Linear`` replicated across all trainers by DDP.
    2) The sparse part, ``remote_emb_module``, is a ``RemoteModule`` holding an
       ``nn.EmbeddingBag`` on the parameter server; this model never holds the table.
    """

    def __init__(self, remote_emb_module: RemoteModule, device: torch.device) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        # DDP broadcasts rank 0's initial fc to the other trainers here, and from now on
        # averages fc's gradients across trainers during every backward pass.
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # the lookup runs on the parameter server; inputs and result cross as CPU tensors
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


def get_next_batch(rank: int, config: TrainConfig,
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One epoch of ``(indices, offsets, target)`` batches for trainer ``rank``, on the CPU.

    Seeded per trainer, and the same in every epoch: a fixed little dataset per trainer, so
    the loss can fall. (The tutorial drew unseeded fresh random batches every epoch, whose
    random targets no model can learn.)
    """
    gen = torch.Generator().manual_seed(config.seed * 1000 + rank)
    for _ in range(config.batches_per_epoch):
        bag_sizes = torch.randint(1, MAX_BAG_SIZE + 1, (config.batch_size,), generator=gen)
        offsets = torch.cumsum(bag_sizes, 0) - bag_sizes  # where each bag starts
        indices = torch.randint(0, NUM_EMBEDDINGS, (int(bag_sizes.sum()),), generator=gen)
        target = torch.randint(0, NUM_CLASSES, (config.batch_size,), generator=gen)
        yield indices, offsets, target


class SerializedSGD(optim.SGD):
    """Plain SGD, under a name ``DistributedOptimizer`` has no functional version of.

    Every trainer's ``DistributedOptimizer`` steps the same embedding table on the parameter
    server, each from its own RPC thread. For ``optim.SGD`` itself ``DistributedOptimizer``
    uses a functional optimizer whose step holds no lock (torch 2.14.1), so two in-place
    updates of the table can interleave and one of them is lost. For any other class it
    falls back to a local optimizer that serialises the steps on each worker, as its
    documentation promises ("concurrent calls to step ... will be serialized on each
    worker"). Same maths, no lost update; tests/test_ddp_rpc.py catches one.
    """


class _NoFunctionalWarning(logging.Filter):
    """Hide DistributedOptimizer's advice to use a functional optimizer: that is the racy one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "without a functional optimizer" not in record.getMessage()


logging.getLogger("torch.distributed.optim.optimizer").addFilter(_NoFunctionalWarning())


def _run_trainer(remote_emb_module: RemoteModule, rank: int, config: TrainConfig) -> TrainerReport:
    """Train on trainer ``rank``; called by the master with ``rpc_async``.

    Each trainer runs a forward pass which involves an embedding lookup on the parameter
    server and running nn.Linear locally. During the backward pass, DDP averages the
    gradients of the dense part (nn.Linear) across trainers and distributed autograd sends
    the embedding table's gradients to the parameter server.
    """
    # Setup the model.
    model = HybridModel(remote_emb_module, _device)

    # Retrieve all model parameters as RRefs for DistributedOptimizer.

    # Retrieve parameters for embedding table (RRefs owned by the parameter server).
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()

    # model.fc.parameters() only includes local parameters: an RRef (owned by this trainer)
    # for each. NOTE: not model.parameters(): it would recurse into
    # remote_emb_module.parameters(), which RemoteModule does not support (only
    # remote_parameters()).
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    # Setup distributed optimizer. SerializedSGD, not the tutorial's optim.SGD: the same SGD,
    # but every trainer steps the one table on the parameter server, and with optim.SGD those
    # concurrent steps run unlocked and can lose an update (see SerializedSGD). SGD is
    # stateless, so each trainer's step there adds -lr * (its own gradient) to the table.
    opt = DistributedOptimizer(SerializedSGD, model_parameter_rrefs, lr=config.lr)
    criterion = torch.nn.CrossEntropyLoss()
    # beyond the tutorial: a hook on criterion records every loss (and stops on nan), and
    # fc before/after training is kept for the master (report.py)
    report = TrainerReport.watch(rank, model, criterion, config.batches_per_epoch)

    for epoch in range(config.epochs):
        for indices, offsets, target in get_next_batch(rank, config):
            # create distributed autograd context
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target.to(_device))

                # Run distributed backward pass (DDP's allreduce of fc's gradients included)
                dist_autograd.backward(context_id, [loss])

                # Run distributed optimizer: fc here, the embedding table on the server
                opt.step(context_id)

                # Not necessary to zero grads as each iteration creates a different
                # distributed autograd context which hosts different grads
        log.info(f"Training done for epoch {epoch}: loss {report.epoch_loss(epoch):.4f}")
    return report.finish(model)

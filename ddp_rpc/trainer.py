"""The tutorial's ``HybridModel``, ``_run_trainer`` and ``get_next_batch``: the master calls ``_run_trainer``
over RPC, so not in ``main.py`` (``__main__``). Each loss recorded, nan check, fc before/after: report.py."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
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

@dataclass(frozen=True)
class TrainConfig:
    """What the master tells every trainer (it crosses in the ``_run_trainer`` RPC)."""

    epochs: int = 10
    batches_per_epoch: int = 10
    batch_size: int = 16
    lr: float = 0.05
    seed: int = 0


class HybridModel(torch.nn.Module):
    """A sparse part on the parameter server, a dense part here. 1) The dense part, ``fc``, is an
    ``nn.Linear`` replicated across all trainers by DDP. 2) The sparse part, ``remote_emb_module``,
    is a ``RemoteModule`` holding an ``nn.EmbeddingBag`` on the parameter server."""

    def __init__(self, remote_emb_module: RemoteModule, device: torch.device) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        # DDP broadcasts rank 0's fc to the other trainers here, then averages fc's gradients in every backward
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # the lookup runs on the parameter server; inputs and result cross as CPU tensors
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


def get_next_batch(rank: int, config: TrainConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One epoch of ``(indices, offsets, target)`` CPU batches for trainer ``rank``, seeded per trainer and
    the same every epoch, so the loss can fall (the tutorial's fresh unseeded targets cannot be learnt)."""
    gen = torch.Generator().manual_seed(config.seed * 1000 + rank)
    for _ in range(config.batches_per_epoch):
        bag_sizes = torch.randint(1, MAX_BAG_SIZE + 1, (config.batch_size,), generator=gen)
        offsets = torch.cumsum(bag_sizes, 0) - bag_sizes  # where each bag starts
        indices = torch.randint(0, NUM_EMBEDDINGS, (int(bag_sizes.sum()),), generator=gen)
        target = torch.randint(0, NUM_CLASSES, (config.batch_size,), generator=gen)
        yield indices, offsets, target


class SerializedSGD(optim.SGD):
    """Plain SGD, under a name ``DistributedOptimizer`` has no functional version of. Every trainer steps
    the one table on the parameter server from its own RPC thread; for ``optim.SGD`` the functional
    step holds no lock (torch 2.14.1) and an update can be lost. Any other class gets a local optimizer
    whose steps are serialised on each worker, as documented. Same maths (tests/test_ddp_rpc.py)."""




def _run_trainer(remote_emb_module: RemoteModule, rank: int, config: TrainConfig) -> TrainerReport:
    """Called by the master with ``rpc_async``. A forward pass looks up the embedding on the parameter
    server and runs nn.Linear locally; in the backward pass DDP averages the dense part's gradients
    across trainers and distributed autograd sends the table's gradients to the parameter server."""
    # This trainer's device, the one main.run_worker bound its process group to: its GPU under NCCL (the
    # tutorial's cuda:rank), else the CPU. The master, which calls this over RPC, cannot know it
    device = dist.group.WORLD.bound_device_id or torch.device("cpu")
    # Setup the model.
    model = HybridModel(remote_emb_module, device)

    # Retrieve all model parameters as RRefs for DistributedOptimizer.

    # Retrieve parameters for embedding table (RRefs owned by the parameter server).
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()

    # model.fc.parameters() only includes local parameters. NOTE: not model.parameters(): it would
    # call remote_emb_module.parameters(), which RemoteModule does not support (only remote_parameters())
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    # Setup distributed optimizer. SerializedSGD, not optim.SGD, whose concurrent steps on the table
    # can lose an update; stateless, so each trainer's step adds -lr * (its own gradient) to the table
    opt = DistributedOptimizer(SerializedSGD, model_parameter_rrefs, lr=config.lr)
    criterion = torch.nn.CrossEntropyLoss()
    report = TrainerReport.start(rank, model)  # beyond the tutorial: the losses, fc before and after


    for epoch in range(config.epochs):
        for indices, offsets, target in get_next_batch(rank, config):
            # create distributed autograd context
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target.to(device))
                report.record(epoch, loss)  # a nan loss stops here, before the step would spread it

                # Run distributed backward pass (DDP's allreduce of fc's gradients included)
                dist_autograd.backward(context_id, [loss])

                # Run distributed optimizer: fc here, the embedding table on the server
                opt.step(context_id)

                # Not necessary to zero grads as each iteration creates a different
                # distributed autograd context which hosts different grads
        log.info(f"Training done for epoch {epoch}: loss {report.epoch_loss(epoch):.4f}")
    return report.finish(model)

"""The tutorial's ``HybridModel``, ``_run_trainer`` and ``get_next_batch``.

Everything here is called over RPC (the master runs ``_run_trainer`` on each trainer), so it
lives in an importable module rather than in ``main.py``, which runs as ``__main__``.

Who owns what:
  - the parameter server owns the ``nn.EmbeddingBag`` (created there by the master through a
    ``RemoteModule``); every trainer holds the same ``RemoteModule`` handle to it;
  - each trainer owns its replica of ``fc`` (an ``nn.Linear`` wrapped in DDP);
  - each trainer owns its own ``DistributedOptimizer``, whose local optimizers sit on the
    trainer (for ``fc``) and on the parameter server (for the embedding table).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed.autograd as dist_autograd
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

import distkit

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


@dataclass
class TrainerReport:
    """What a trainer sends back to the master: losses and its ``fc`` before/after (CPU)."""

    rank: int
    device: str
    losses: list[list[float]] = field(default_factory=list)  # [epoch][batch]
    fc_before: dict[str, torch.Tensor] = field(default_factory=dict)
    fc_after: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0


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


def distributed_sgd(parameter_rrefs: list[RRef], lr: float) -> DistributedOptimizer:
    """The trainers' optimizer: SGD on every parameter, where it lives, steps never overlapping."""
    return DistributedOptimizer(SerializedSGD, parameter_rrefs, lr=lr)


def _fc_state(model: HybridModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.fc.module.state_dict().items()}


def _run_trainer(remote_emb_module: RemoteModule, rank: int, config: TrainConfig) -> TrainerReport:
    """Train on trainer ``rank``; called by the master with ``rpc_async``.

    Each trainer runs a forward pass which involves an embedding lookup on the parameter
    server and running nn.Linear locally. During the backward pass, DDP averages the
    gradients of the dense part (nn.Linear) across trainers and distributed autograd sends
    the embedding table's gradients to the parameter server.
    """
    start = time.perf_counter()
    model = HybridModel(remote_emb_module, _device)
    report = TrainerReport(rank, str(_device), fc_before=_fc_state(model))

    # Retrieve all model parameters as RRefs for DistributedOptimizer: the embedding
    # table's from the parameter server ...
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    # ... and an RRef (owned by this trainer) for each local fc parameter. NOTE: not
    # model.parameters(): it would recurse into remote_emb_module.parameters(), which
    # RemoteModule does not support (only remote_parameters()).
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    # SGD is stateless, so this trainer's step on the parameter server simply adds
    # -lr * (this trainer's gradient) to the table; the other trainer's step adds its own
    # (one after the other: see SerializedSGD).
    opt = distributed_sgd(model_parameter_rrefs, config.lr)
    criterion = torch.nn.CrossEntropyLoss()

    for epoch in range(config.epochs):
        epoch_losses = []
        for indices, offsets, target in get_next_batch(rank, config):
            # every iteration has its own distributed autograd context: gradients live in
            # the context, not in .grad, so there is nothing to zero between iterations
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target.to(_device))
                # Run distributed backward pass (DDP's allreduce of fc's gradients included)
                dist_autograd.backward(context_id, [loss])
                # Run distributed optimizer: fc here, the embedding table on the server
                opt.step(context_id)
            epoch_losses.append(distkit.check_finite(loss.item(), f"trainer{rank}, epoch {epoch}"))
        report.losses.append(epoch_losses)
        log.info(f"Training done for epoch {epoch}: loss {sum(epoch_losses) / len(epoch_losses):.4f}")
    report.fc_after = _fc_state(model)
    report.seconds = time.perf_counter() - start
    return report


def _embedding_weight(module_rref: RRef) -> torch.Tensor:
    """Runs on the parameter server (the owner of ``module_rref``): a copy of the table."""
    return module_rref.local_value().weight.detach().cpu().clone()


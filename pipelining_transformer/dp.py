"""``--dp_size``: pipeline x data parallelism, layered on the tutorial's one pipeline.

``init_distributed`` lays the ranks out on a ("dp", "pp") device mesh (``device_mesh``):
``dp_size`` pipeline replicas of ``world_size / dp_size`` ranks each (rank = dp_rank *
pp_size + pp_rank). The rest is what only a run with replicas needs: each replica reads its
share of every batch (``replica_rows``, in ``main.train``), its stages' gradients are
averaged with the same stages of the other replicas (``shard_over_dp``, FSDP2, in
``extras.on_build``), and the batch's loss is the mean over the replicas
(``mean_over_replicas``, in ``PipelineRank.batch_loss``). With ``dp_size`` 1 none of it runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage


def shard_over_dp(stage: PipelineStage, dp_mesh: DeviceMesh) -> None:
    """Average the stage's gradients over its replicas: FSDP2 (``fully_shard``) on the stage.

    FSDP2, not DDP, because PyTorch's schedules drive it for every schedule: they turn off
    its gradient sync for all but the last micro-batch and call its reduce-scatter once per
    step (``REDUCE_GRAD``). DDP's all-reduce fires from autograd hooks on the gradient
    accumulators, which the zero-bubble schedules' split backward (``autograd.grad`` for the
    weights, added into ``.grad`` by hand) never reaches: with DDP, ZBVZeroBubble's gradients
    were silently not averaged (see docs/pipelining_transformer.md). ``reshard_after_forward=False``:
    a stage's weights are gathered once per step, not once per micro-batch forward and again
    per backward. The parameters become DTensors, each rank storing 1/dp of every one (and
    of its optimizer state), under the same names as before. Call it before the optimizers
    are built: they must hold the sharded parameters.
    """
    fully_shard(stage.submod, mesh=dp_mesh, reshard_after_forward=False)


def device_mesh(device: torch.device, world_size: int, dp_size: int) -> DeviceMesh:
    """The ("dp", "pp") mesh of ``dp_size`` pipelines of ``world_size / dp_size`` ranks each.

    Row-major (rank = dp_rank * pp_size + pp_rank): each pipeline is a block of consecutive
    ranks, and each "dp" group takes one rank from every pipeline. With ``dp_size`` 1 its
    "pp" group is every rank: the tutorial's one pipeline.
    """
    if world_size % dp_size:
        raise ValueError(f"world size {world_size} is not divisible by dp_size {dp_size}")
    return init_device_mesh(device.type, (dp_size, world_size // dp_size), mesh_dim_names=("dp", "pp"))


def replica_rows(batch: tuple[torch.Tensor, ...], dp_rank: int, dp_size: int) -> tuple[torch.Tensor, ...]:
    """Replica ``dp_rank``'s share of a batch (the tokens and the targets): of each tensor,
    the ``dp_rank``-th of ``dp_size`` contiguous slices.

    Contiguous, so that the replicas' micro-batches, in replica order, are the whole
    batch's micro-batches as one pipeline with dp_size times as many would cut them.
    """
    return tuple(t.chunk(dp_size)[dp_rank] for t in batch) if dp_size > 1 else batch


def mean_over_replicas(loss: torch.Tensor, dp_size: int, dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The mean of ``loss`` over the replicas: a collective over the dp group (every rank
    holding the last stage calls it); same-sized micro-batches make it the batch's mean."""
    if dp_size > 1:
        dist.all_reduce(loss, group=dp_group)  # SUM: gloo has no AVG
        loss /= dp_size
    return loss

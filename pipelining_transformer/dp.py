"""``--dp_size``: pipeline x data parallelism on a ("dp", "pp") mesh of ``dp_size`` pipelines; each
replica reads its share of every batch (``replica_rows``), its stages' gradients are averaged over
the replicas (``shard_over_dp``, FSDP2) and the loss is their mean (``mean_over_replicas``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage


@dataclass
class DistEnv:
    """The tutorial's globals (rank, device, pp_group, stage_index) as one value: where this rank sits,
    read from the ("dp", "pp") mesh; one pipeline unless --dp_size."""

    device: torch.device
    mesh: DeviceMesh
    pp_group: dist.ProcessGroup = field(init=False)  # this pipeline's ranks: the stages' send/recv
    pp_rank: int = field(init=False)  # the tutorial's stage_index, with one stage per rank
    pp_size: int = field(init=False)
    dp_group: dist.ProcessGroup = field(init=False)  # this rank's stages in the other replicas
    dp_rank: int = field(init=False)
    dp_size: int = field(init=False)

    def __post_init__(self) -> None:
        pp, dp = self.mesh["pp"], self.mesh["dp"]
        self.pp_group, self.pp_rank, self.pp_size = pp.get_group(), pp.get_local_rank(), pp.size()
        self.dp_group, self.dp_rank, self.dp_size = dp.get_group(), dp.get_local_rank(), dp.size()


def shard_over_dp(stage: PipelineStage, dp_mesh: DeviceMesh) -> None:
    """Average the stage's gradients over its replicas with FSDP2, which every schedule drives (DDP's hooks
    miss the zero-bubble split backward: docs); weights gathered once a step; before the optimizers."""
    fully_shard(stage.submod, mesh=dp_mesh, reshard_after_forward=False)


def device_mesh(device: torch.device, world_size: int, dp_size: int) -> DeviceMesh:
    """The mesh of ``dp_size`` pipelines, each a block of consecutive ranks (dp_rank * pp_size + pp_rank)."""
    return init_device_mesh(device.type, (dp_size, world_size // dp_size), mesh_dim_names=("dp", "pp"))


def replica_rows(batch: tuple[torch.Tensor, ...], dp_rank: int, dp_size: int) -> tuple[torch.Tensor, ...]:
    """Replica ``dp_rank``'s contiguous slice of each tensor: the micro-batches, in replica order, that
    one pipeline with ``dp_size`` times as many would cut."""
    return tuple(t.chunk(dp_size)[dp_rank] for t in batch) if dp_size > 1 else batch


def mean_over_replicas(loss: torch.Tensor, dp_size: int, dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The mean of ``loss`` over the replicas (a collective of the last stage's ranks): the batch's."""
    if dp_size > 1:
        dist.all_reduce(loss, group=dp_group)  # SUM: gloo has no AVG
        loss /= dp_size
    return loss

"""The tutorial's pipelining steps, for any number of ranks and any installed schedule.

``init_distributed`` (torchrun's environment -> process group and a ("dp", "pp") device
mesh), ``manual_model_split`` and ``tracer_model_split`` (the two ways to cut the model into
``PipelineStage``s), the schedule catalogue, and ``PipelineRank``: what one rank holds and how
it trains (with ``--dp_size`` > 1, its stages sharded over their data-parallel group with FSDP2).
"""
from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

import distkit
from pipelining_transformer.model import ModelArgs, Transformer, tokenwise_loss_fn

# Every schedule this PyTorch exports, by its short name ("GPipe", "Interleaved1F1B", ...)
SCHEDULES: dict[str, type] = {
    name.removeprefix("Schedule"): getattr(pipelining, name)
    for name in pipelining.__all__ if name.startswith("Schedule")
}
# These schedules place a rank's two stages as a "V" (rank r: stages r and 2W-1-r, so the
# last stage sits beside the first); the other multi-stage ones loop (rank r: r, r+W, ...).
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}
STAGES_PER_RANK_MULTI = 2


def is_multi_stage(schedule: str) -> bool:
    return issubclass(SCHEDULES[schedule], PipelineScheduleMulti)


def num_stages_for(schedule: str, world_size: int) -> int:
    return world_size * (STAGES_PER_RANK_MULTI if is_multi_stage(schedule) else 1)


def stage_indices_for(schedule: str, rank: int, world_size: int) -> list[int]:
    """The stages ``rank`` owns, in the order the schedule expects them."""
    if not is_multi_stage(schedule):
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * world_size - 1 - rank]
    return [rank + k * world_size for k in range(STAGES_PER_RANK_MULTI)]


def layer_ranges(n_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Contiguous blocks of layers, one per stage: ``sizes[s]`` layers for stage s, or (no
    ``sizes``) as even as can be, earlier stages taking the remainder."""
    if sizes is None:
        if not 1 <= num_stages <= n_layers:
            raise ValueError(f"cannot give {num_stages} stages at least one of {n_layers} layers each")
        per, extra = divmod(n_layers, num_stages)
        sizes = [per + (s < extra) for s in range(num_stages)]
    elif len(sizes) != num_stages or sum(sizes) != n_layers or min(sizes) < 1:
        raise ValueError(f"{num_stages} stages need {num_stages} layer counts of at least 1 that "
                         f"add up to {n_layers}, got {' '.join(map(str, sizes))}")
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class _StubStage:
    """Just enough of a stage for a schedule's constructor to lay out its whole timetable."""

    def __init__(self, stage_index: int, num_stages: int, rank: int, world_size: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = rank, world_size
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_problem(schedule: str, world_size: int, n_microbatches: int) -> str | None:
    """Why ``schedule`` cannot run ``n_microbatches`` on ``world_size`` ranks, or None.

    Each schedule computes and checks the timetable of every rank in its constructor, so
    building it around stand-in stages asks PyTorch itself, before any process starts.
    """
    n_stages = num_stages_for(schedule, world_size)
    cls = SCHEDULES[schedule]
    for rank in range(world_size):
        stubs = [_StubStage(i, n_stages, rank, world_size)
                 for i in stage_indices_for(schedule, rank, world_size)]
        try:
            cls(stubs if is_multi_stage(schedule) else stubs[0], n_microbatches=n_microbatches,
                loss_fn=tokenwise_loss_fn)
        except (ValueError, AssertionError, RuntimeError) as e:
            return str(e).strip().splitlines()[0].replace("  ", " ")
        except Exception:  # a PyTorch whose constructor wants more than the stand-in has
            return None
    return None


@dataclass
class DistEnv:
    """The tutorial's globals (rank, device, pp_group), as one value, and this rank's place
    on the ("dp", "pp") mesh: pipeline replica ``dp_rank`` of ``dp_size``, pipeline rank
    ``pp_rank`` of ``pp_size`` within it (``rank = dp_rank * pp_size + pp_rank``)."""

    rank: int
    world_size: int
    device: torch.device
    pp_group: dist.ProcessGroup  # the ranks of this pipeline replica: the stages' send/recv
    mesh: DeviceMesh | None = None
    dp_size: int = 1

    @property
    def pp_size(self) -> int:
        return self.world_size // self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same stages as this one, in the other replicas."""
        return self.mesh["dp"].get_group() if self.mesh is not None else None


def init_distributed(device_preference: str = "auto", dp_size: int = 1) -> DistEnv:
    """Join the process group described by torchrun's (or distkit's) environment and lay
    its ranks out on a (dp_size, world_size / dp_size) mesh named ("dp", "pp")."""
    rank = int(os.environ["RANK"])  # the tutorial used LOCAL_RANK: wrong beyond one machine
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % dp_size:
        raise ValueError(f"world size {world_size} is not divisible by dp_size {dp_size}")
    # a GPU per process on this machine, or the CPU for all (never cuda:<rank> by fiat,
    # never two ranks on one GPU); the same backend on every machine, or a one-line error
    where = distkit.group_placement(device_preference, local_rank, local_world_size)
    distkit.agree_on_backend("pp", rank, world_size, where)
    device = where.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # under torchrun, a store of this restart's own: a restarted group would otherwise meet
    # the addresses its killed predecessor left in torchrun's store (see distkit)
    dist.init_process_group(backend=where.backend, store=distkit.process_group_store(),
                            rank=rank, world_size=world_size)
    # row-major: rank = dp_rank * pp_size + pp_rank, so each pipeline replica is a block of
    # consecutive ranks (one machine's, with torchrun --nproc_per_node pp_size) and its
    # send/recv stays there; each "dp" group takes one rank from every replica
    mesh = init_device_mesh(device.type, (dp_size, world_size // dp_size),
                            mesh_dim_names=("dp", "pp"))
    # the group that carries the stages' send/recv: a sub-group, now that PP is one of 2 dims
    return DistEnv(rank, world_size, device, mesh["pp"].get_group(), mesh, dp_size)


def manual_model_split(model: Transformer, stage_index: int, num_stages: int, layers: range,
                       device: torch.device, pp_group: dist.ProcessGroup | None = None
                       ) -> PipelineStage:
    """Stage ``stage_index``: ``model`` itself, without the parts other stages own."""
    for i in list(model.layers):
        if int(i) not in layers:
            del model.layers[i]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != num_stages - 1:
        model.norm = None
        model.output = None
    model.to(device)
    stage = PipelineStage(model, stage_index, num_stages, device, group=pp_group)
    _send_contiguous_input_grads(stage)
    _skip_warmup_with_itself(stage)
    return stage


def tracer_model_split(model: Transformer, example_input_microbatch: torch.Tensor,
                       split_layers: list[int], stage_indices: list[int], device: torch.device,
                       pp_group: dist.ProcessGroup | None = None) -> list[PipelineStage]:
    """Trace ``model``, cut it before each layer in ``split_layers``, build this rank's stages."""
    pipe = pipeline(
        module=model,
        mb_args=(example_input_microbatch,),
        split_spec={f"layers.{k}": SplitPoint.BEGINNING for k in split_layers},
    )
    stages = [pipe.build_stage(i, device, pp_group) for i in stage_indices]
    for stage in stages:
        _send_contiguous_input_grads(stage)
        _skip_warmup_with_itself(stage)
    return stages


def _send_contiguous_input_grads(stage: PipelineStage) -> None:
    """Make the gradient a stage sends back to the previous stage contiguous.

    With batch_first=True, attention transposes its inputs, so the gradient of a stage's
    input is a transposed view. A manual ``PipelineStage`` (any schedule) and the
    zero-bubble schedules' input-only backward (InterleavedZeroBubble, ZBV, DualPipeV, any
    split) send it as it is, and gloo refuses it ("input tensor has to be contiguous").
    """
    def hook(module: nn.Module, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                a.register_hook(torch.Tensor.contiguous)

    stage.submod.register_forward_pre_hook(hook)


def _skip_warmup_with_itself(stage: PipelineStage) -> None:
    """Drop the send/recv a traced stage's warm-up would make to its own rank.

    ``build_stage``'s stages greet both neighbours with a send and a receive before the
    first step, even a neighbour on the same rank (ZBV and DualPipeV put the middle two
    stages on one rank); gloo cannot send to itself ("Pair is not connected"). Stages on one
    rank hand activations over in memory, so nothing is lost. Older multi-stage schedules
    (torch 2.10) greet the neighbours of manual stages too, so those get it as well.
    """
    # private API (no public hook filters the warm-up); torch 2.15 no longer has it, and
    # then there is no such warm-up to patch
    neighbour_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if neighbour_ops is None:
        return

    def without_self() -> list[dist.P2POp]:
        return [op for op in neighbour_ops() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = without_self


def synthetic_batch(step: int, batch_size: int, seq_len: int, vocab_size: int,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens and targets; every rank draws the same ones.

    Tokens follow Zipf's law, as words do, and each token's target is its successor id.
    The tutorial's model has no position encoding, so this token-wise task is one it can
    learn; frequent tokens are learned first and the loss falls within a few steps.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float)
    x = torch.multinomial(zipf, batch_size * seq_len, replacement=True, generator=gen)
    x = x.view(batch_size, seq_len)
    return x, (x + 1) % vocab_size


def make_optimizer(name: str, params: Iterator[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}")


def shard_over_dp(stage: PipelineStage, dp_mesh: DeviceMesh) -> None:
    """Average the stage's gradients over its replicas: FSDP2 (``fully_shard``) on the stage.

    FSDP2, not DDP, because PyTorch's schedules drive it for every schedule: they turn off
    its gradient sync for all but the last micro-batch and call its reduce-scatter once per
    step (``REDUCE_GRAD``). DDP's all-reduce fires from autograd hooks on the gradient
    accumulators, which the zero-bubble schedules' split backward (``autograd.grad`` for the
    weights, added into ``.grad`` by hand) never reaches: with DDP, ZBVZeroBubble's gradients
    were silently not averaged (see the README). ``reshard_after_forward=False``: a stage's weights are gathered
    once per step, not once per micro-batch forward and again per backward.
    The parameters become DTensors, each rank storing 1/dp of every one (and of its
    optimizer state), under the same names as before.
    """
    fully_shard(stage.submod, mesh=dp_mesh, reshard_after_forward=False)


class PipelineRank:
    """What one rank runs: its stages, their schedule, and an optimizer per stage.

    With ``env.dp_size`` > 1 it is one rank of pipeline replica ``env.dp_rank``: it trains on
    that replica's rows of each batch, and its stages' gradients are averaged with the same
    stages of the other replicas (``shard_over_dp``).
    """

    def __init__(self, model: Transformer, model_args: ModelArgs, env: DistEnv, schedule: str,
                 split: str, n_microbatches: int, microbatch_shape: tuple[int, int],
                 lr: float, optimizer: str = "adamw", stage_layers: Sequence[int] | None = None) -> None:
        self.num_stages = num_stages_for(schedule, env.pp_size)
        indices = stage_indices_for(schedule, env.pp_rank, env.pp_size)
        ranges = layer_ranges(model_args.n_layers, self.num_stages, stage_layers)
        if split == "manual":
            # every stage but the last cuts its own copy; the last cuts the model itself
            models = [copy.deepcopy(model) for _ in indices[1:]] + [model]
            self.stages = [manual_model_split(m, i, self.num_stages, ranges[i], env.device,
                                              env.pp_group) for m, i in zip(models, indices)]
        elif split == "tracer":
            example = torch.zeros(microbatch_shape, dtype=torch.long)
            self.stages = tracer_model_split(model, example, [r.start for r in ranges[1:]],
                                             indices, env.device, env.pp_group)
        else:
            raise ValueError(f"unknown split {split!r}")
        self.dp_rank, self.dp_size, self.dp_group = env.dp_rank, env.dp_size, env.dp_group
        if env.dp_size > 1:  # before the optimizers: they must hold the sharded parameters
            for stage in self.stages:
                shard_over_dp(stage, env.mesh["dp"])
        cls = SCHEDULES[schedule]
        self.schedule = cls(self.stages if is_multi_stage(schedule) else self.stages[0],
                            n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)
        self.optimizers = [make_optimizer(optimizer, s.submod.parameters(), lr) for s in self.stages]
        self.device = env.device
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)

    def replica_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This replica's share of a batch: the ``dp_rank``-th of ``dp_size`` contiguous slices.

        Contiguous, so that the replicas' micro-batches, in replica order, are the whole
        batch's micro-batches as one pipeline with dp_size times as many would cut them.
        """
        return batch.chunk(self.dp_size)[self.dp_rank] if self.dp_size > 1 else batch

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
        """One pipelined pass over this replica's rows of the whole batch ``x``, ``y``; the
        replica's micro-batch losses where the last stage is."""
        x, y = self.replica_rows(x), self.replica_rows(y)
        for opt in self.optimizers:
            # the schedule adds every micro-batch's gradient into .grad
            opt.zero_grad(set_to_none=True)
        # only the first stage reads the tokens and only the last the targets
        args = (x.to(self.device),) if self.has_first else ()
        target = y.to(self.device) if self.has_last else None
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses)
        return losses

    def batch_loss(self, mb_losses: list[torch.Tensor]) -> float:
        """The whole batch's mean loss from the replicas' micro-batch losses.

        A collective over the dp group: every rank holding the last stage calls it (the
        same-sized micro-batches of every replica make it the mean of their means).
        """
        loss = torch.stack(mb_losses).detach().mean()
        if self.dp_size > 1:
            dist.all_reduce(loss, group=self.dp_group)  # SUM: gloo has no AVG
            loss /= self.dp_size
        return loss.item()

    def optimizer_step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the full model's names ("layers.3.linear1.weight")."""
        for stage in self.stages:
            yield from stage.submod.named_parameters()

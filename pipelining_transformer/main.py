"""Pipeline-parallel training of a GPT-style transformer with torch.distributed.pipelining.

The tutorial "Introduction to Distributed Pipeline Parallelism", top to bottom:
``init_distributed``, the model cut into stages (``manual_model_split`` or
``tracer_model_split``), ``ScheduleGPipe(stage, n_microbatches=..., loss_fn=tokenwise_loss_fn)``
and the rank-dependent ``schedule.step`` (in ``PipelineRank.forward_backward``), trained for
--steps steps. The model is in model.py. Roles:
  the rank holding stage 0      feeds the tokens: ``schedule.step(x)``
  the rank holding the last     feeds the targets, gets each micro-batch's loss and prints
                                the batch's: ``schedule.step(target=y, losses=losses)``
  any rank in between           relays activations and gradients: ``schedule.step()``
  every rank                    steps one optimizer per stage

Run on one machine (spawns the processes, CPU + gloo unless a GPU per process is visible):
    python pipelining_transformer/main.py --world_size 2
    python pipelining_transformer/main.py --world_size 4 --schedule Interleaved1F1B --split tracer
One rank per process under torchrun, as the tutorial launches it:
    torchrun --nproc_per_node 2 pipelining_transformer/main.py
The model is the tutorial's (dim 512, 8 layers, 8 heads, vocabulary 10000); the batch is
CPU-sized (8 x 16 tokens, not the tutorial's 32 x 500). Exit status 0 if the loss fell.

Beyond the tutorial, each behind its flag and outside the tutorial's functions (extras.py,
dp.py, checkpoint.py, timeline.py; docs/pipelining_transformer.md): --loss_log, --trace DIR,
--checkpoint_dir/--checkpoint_every/--resume (and torchrun --max-restarts), --dp_size D
(FSDP2 over a ("dp", "pp") mesh), --stage_layers, every schedule PyTorch offers.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline

import distkit
from pipelining_transformer import balance, dp, extras, workarounds
from pipelining_transformer.cli import add_extra_args, check_args, model_args_from, schedule_name
from pipelining_transformer.cli import placement  # noqa: F401  (where each rank runs: distkit's contract)
from pipelining_transformer.model import (ModelArgs, Transformer, make_optimizer, synthetic_batch,
                                          tokenwise_loss_fn)
from pipelining_transformer.schedules import (SCHEDULES, is_multi_stage, layer_ranges,
                                              num_stages_for, stage_bounds, stage_indices_for)

log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    """The tutorial's globals (rank, device, pp_group) as one value, and this rank's place on
    the ("dp", "pp") mesh: replica ``dp_rank`` of ``dp_size`` (1 unless --dp_size)."""

    rank: int
    world_size: int
    device: torch.device
    pp_group: dist.ProcessGroup  # the ranks of this pipeline: the stages' send/recv
    mesh: DeviceMesh | None = None
    dp_size: int = 1

    @property
    def pp_size(self) -> int:
        return self.world_size // self.dp_size

    @property
    def pp_rank(self) -> int:  # the tutorial's stage_index, with one stage per rank
        return self.rank % self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same stages as this one, in the other replicas."""
        return self.mesh["dp"].get_group() if self.mesh is not None else None


def init_distributed(device_preference: str = "auto", dp_size: int = 1) -> DistEnv:
    """Join the process group torchrun (or distkit) describes; ``pp_group`` for send/recv."""
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
    # "This group can be a sub-group in the N-D parallel case": it is, on a (dp, pp) mesh,
    # row-major (rank = dp_rank * pp_size + pp_rank), so each pipeline is a block of
    # consecutive ranks and each "dp" group takes one rank from every pipeline (dp.py)
    mesh = init_device_mesh(device.type, (dp_size, world_size // dp_size),
                            mesh_dim_names=("dp", "pp"))
    return DistEnv(rank, world_size, device, mesh["pp"].get_group(), mesh, dp_size)


def manual_model_split(model: Transformer, stage_index: int, num_stages: int, layers: range,
                       device: torch.device, pp_group: dist.ProcessGroup | None = None
                       ) -> PipelineStage:
    """Option 1: stage ``stage_index`` is ``model`` itself, without the parts other stages own."""
    for i in list(model.layers):
        if int(i) not in layers:
            del model.layers[i]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != num_stages - 1:
        model.norm = None
        model.output = None
    model.to(device)
    stage = PipelineStage(
        model,
        stage_index,
        num_stages,
        device,
        group=pp_group,
    )
    return stage


def tracer_model_split(model: Transformer, example_input_microbatch: torch.Tensor,
                       split_points: list[str], stage_indices: list[int], device: torch.device,
                       pp_group: dist.ProcessGroup | None = None) -> list[PipelineStage]:
    """Option 2: trace ``model``, cut it before each submodule in ``split_points`` (like
    "layers.4"), build this rank's stages (one, or two for a multi-stage schedule)."""
    pipe = pipeline(
        module=model,
        mb_args=(example_input_microbatch,),
        split_spec={name: SplitPoint.BEGINNING for name in split_points},
    )
    stages = [pipe.build_stage(i, device, pp_group) for i in stage_indices]
    return stages


def build_schedule(stages: list[PipelineStage], name: str, n_microbatches: int):
    """The tutorial's ``ScheduleGPipe``, or the --schedule the user named, built the same way."""
    if name == "GPipe":
        return ScheduleGPipe(stages[0], n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)
    schedule_class = SCHEDULES[name]  # schedules.py: 1F1B, Interleaved1F1B, ZBVZeroBubble, ...
    # a multi-stage schedule drives all of this rank's stages, the others its one stage
    return schedule_class(stages if is_multi_stage(name) else stages[0],
                          n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)


class PipelineRank:
    """What one rank runs: its stages, the schedule that drives them, an optimizer per stage."""

    def __init__(self, stages: list[PipelineStage], schedule, optimizers: list[torch.optim.Optimizer],
                 env: DistEnv) -> None:
        self.stages, self.schedule, self.optimizers = stages, schedule, optimizers
        self.num_stages = stages[0].num_stages
        self.device = env.device
        self.dp_rank, self.dp_size, self.dp_group = env.dp_rank, env.dp_size, env.dp_group
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.reports = self.has_last and self.dp_rank == 0  # one rank prints the batch's loss
        self.auto_split: balance.Split | None = None  # --stage_layers auto: the prediction

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
        """The tutorial's step, by role; the micro-batch losses where the last stage is."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)  # the schedule adds each micro-batch's gradient
        x, y = x.to(self.device), y.to(self.device)
        losses: list[torch.Tensor] = []
        if self.has_first and self.has_last:
            # ZBVZeroBubble, DualPipeV: a "V" puts the first and the last stage on one rank
            self.schedule.step(x, target=y, losses=losses)
        elif self.has_first:
            self.schedule.step(x)
        elif self.has_last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        return losses if self.has_last else None

    def optimizer_step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def batch_loss(self, losses: list[torch.Tensor]) -> float:
        """The batch's mean loss: equal micro-batches make it the mean of their means (and,
        with --dp_size, of the replicas' means: a collective of the last-stage ranks)."""
        loss = torch.stack(losses).detach().mean()
        return dp.mean_over_replicas(loss, self.dp_size, self.dp_group).item()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the full model's names ("layers.3.linear1.weight")."""
        for stage in self.stages:
            yield from stage.submod.named_parameters()


def build_rank(args: argparse.Namespace, env: DistEnv) -> PipelineRank:
    """This rank's stages, cut from the same seeded full model that every rank builds."""
    model_args = model_args_from(args)
    torch.manual_seed(args.seed)
    model = Transformer(model_args)
    if env.dp_rank:
        # the replicas' own dropout masks (replica 0 keeps those of a run without --dp_size)
        torch.manual_seed(args.seed + 1_000_003 * env.dp_rank)
    num_stages = num_stages_for(args.schedule, env.pp_size)
    stage_indices = stage_indices_for(args.schedule, env.pp_rank, env.pp_size)
    rows = args.batch_size // (env.dp_size * args.n_microbatches)  # one micro-batch's
    auto = None
    if args.stage_layers == "auto":  # measured on the ranks, the same answer on each (balance.py)
        auto = balance.auto_split(model, rows, args.seq_len, num_stages, env.device)
        args.stage_layers = auto.stage_layers  # what checkpoints record as the layout
    bounds = stage_bounds(model_args.n_layers, num_stages, args.stage_layers)
    layers = layer_ranges(model_args.n_layers, num_stages, args.stage_layers)  # whole or half
    if args.split == "manual":  # Option 1: manual model splitting
        # every stage but the last cuts its own copy; the last cuts the model itself
        models = [copy.deepcopy(model) for _ in stage_indices[1:]] + [model]
        for m, i in zip(models, stage_indices):
            balance.halve(m, bounds[i])  # a layer cut in two (--stage_layers 4.5 3.5)
        stages = [manual_model_split(m, i, num_stages, layers[i], env.device, env.pp_group)
                  for m, i in zip(models, stage_indices)]
    else:  # Option 2: tracer model splitting
        example_input_microbatch = torch.zeros(rows, args.seq_len, dtype=torch.long)
        split_points = [balance.split_point(start, model_args.n_layers) for start, _ in bounds[1:]]
        stages = tracer_model_split(model, example_input_microbatch, split_points,
                                    stage_indices, env.device, env.pp_group)
    for stage in stages:
        workarounds.apply(stage)  # torch's pipelining on gloo (workarounds.py)
        if env.dp_size > 1:
            dp.shard_over_dp(stage, env.mesh["dp"])  # before the optimizers are built
    schedule = build_schedule(stages, args.schedule, args.n_microbatches)
    optimizers = [make_optimizer(args.optimizer, s.submod.parameters(), args.lr) for s in stages]
    pp = PipelineRank(stages, schedule, optimizers, env)
    pp.auto_split = auto
    return pp


def train(args: argparse.Namespace, env: DistEnv, callbacks_for=extras.callbacks_for) -> dict:
    """The training loop: the tutorial's step, --steps times, with the extras' callbacks."""
    pp = build_rank(args, env)
    replica = f", replica {env.dp_rank} of {env.dp_size}" if env.dp_size > 1 else ""
    log.info(f"stages {[s.stage_index for s in pp.stages]} of {pp.num_stages} "
             f"({args.schedule}, {args.split} split{replica}) on {pp.device}")
    first = extras.resume(args, pp)  # 0 unless --resume finds a checkpoint
    summary = extras.Summary(args, first)
    callbacks = [summary, *callbacks_for(args, pp)]
    for step in range(first, args.steps):
        x, y = synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size, args.seed)
        # --dp_size: this replica's rows of the batch (all of it otherwise)
        x, y = (dp.replica_rows(t, env.dp_rank, env.dp_size) for t in (x, y))
        for callback in callbacks:
            callback.on_step_begin(step)
        losses = pp.forward_backward(x, y)
        pp.optimizer_step()
        loss = None
        if losses is not None:
            loss = distkit.check_finite(pp.batch_loss(losses), f"step {step + 1}")
        if pp.reports:
            log.info(f"step {step + 1}/{args.steps}  loss {loss:.4f}")
        for callback in callbacks:
            callback.on_step_end(step, loss if pp.reports else None)
    for callback in callbacks:
        callback.on_train_end()
    return summary.result()


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> dict:
    """Every rank: join the group, train its stages, leave."""
    env = init_distributed(args.device, args.dp_size)
    result = train(args, env)
    dist.destroy_process_group()
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline parallelism with torch.distributed.pipelining")
    parser.add_argument("--schedule", type=schedule_name, default="GPipe", metavar="NAME",
                        help=f"pipeline schedule, one of: {', '.join(SCHEDULES)}")
    parser.add_argument("--split", choices=("manual", "tracer"), default="manual",
                        help="cut the model by deleting parts (manual) or by tracing it (tracer)")
    parser.add_argument("--n_microbatches", type=int, default=4, metavar="M",
                        help="micro-batches each batch is cut into")
    parser.add_argument("--batch_size", type=int, default=8, metavar="B",
                        help="sequences per batch (per optimizer step)")
    parser.add_argument("--seq_len", type=int, default=16, metavar="T", help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, metavar="N", help="optimizer steps")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="one per stage; sgd (momentum 0.9) makes a step a linear function "
                             "of the gradient, for bit-for-bit comparisons")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    model = parser.add_argument_group("model (defaults: the tutorial's ModelArgs)")
    defaults = ModelArgs()
    model.add_argument("--dim", type=int, default=defaults.dim)
    model.add_argument("--n_layers", type=int, default=defaults.n_layers)
    model.add_argument("--n_heads", type=int, default=defaults.n_heads)
    model.add_argument("--vocab_size", type=int, default=defaults.vocab_size)
    model.add_argument("--dropout", type=float, default=defaults.dropout)
    add_extra_args(parser)  # --stage_layers, --dp_size, --loss_log, --trace, checkpoints
    distkit.add_launch_args(parser, world_size=2, hang_timeout=300)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    results = distkit.launch(run_worker, args)
    return extras.exit_status(results)  # 1 if the loss of a run from step 0 did not fall


if __name__ == "__main__":
    distkit.exit_process(main())

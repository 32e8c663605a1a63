"""pipelining_transformer's main.py grown into a trainer, as torchtitan's train.py grows the tutorial: the
same functions (imported from main.py), and what the tutorial leaves out, each behind its flag:
- every schedule PyTorch exports (``--schedule Interleaved1F1B``, ``ZBVZeroBubble``, ...), two stages a
  rank for the multi-stage ones, any cut (``--stage_layers 4.5 3.5``, or ``auto``: measured, balance.py);
- pipeline x data parallelism (``--dp_size``, dp.py), checkpoints and resume (``--checkpoint_dir``,
  ``--resume``, checkpoint.py), torch.profiler traces (``--trace``), the loss log (``--loss_log``).
The build, each step's report and the run's end pass through extras.py (docs/pipelining_transformer_train.md).
    .venv/bin/python pipelining_transformer/train.py --schedule ZBVZeroBubble
    .venv/bin/torchrun --nproc_per_node 4 pipelining_transformer/train.py --dp_size 2
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

import distkit
from distkit.schedules import SCHEDULES, is_multi_stage
from pipelining_transformer import dp, extras
from pipelining_transformer import main as tutorial
from pipelining_transformer.cli import add_extra_args, check_args, model_args_from, schedule_name
from pipelining_transformer.dp import DistEnv
from pipelining_transformer.layout import StageLayout, stage_layout
from pipelining_transformer.model import Transformer, make_optimizer, synthetic_batch, tokenwise_loss_fn

log = logging.getLogger(__name__)


def init_distributed(rank: int, args: argparse.Namespace) -> DistEnv:
    """main.py's process group, in a store of this restart's own, and on it a ("dp", "pp") mesh of
    --dp_size pipelines: where this rank sits. The mesh makes the groups, so main.py's one more (the
    tutorial's ``pp_group``) is not made here."""
    where = tutorial.placement(rank, args)
    if where.device.type == "cuda":
        torch.accelerator.set_device_index(where.device)  # this rank's GPU, the current one: NCCL's default
    backend, device_id = where.backend, where.device_id  # NCCL bound to that GPU, or gloo on the CPU
    # torch 2.14.1 needs this (pytorch/pytorch#135712): torchrun keeps its agent's store, keys and all, for
    # every restart, and env:// puts no prefix on the group's keys, so a restarted rank can read what the dead
    # attempt wrote under the same key (the report: NCCL's unique id, then a failed connect). This
    # restart's keys take a prefix of their own, in the store the launcher hosts (torchrun's agent, or
    # distkit.prepare_spawn for mp.spawn). Over several machines, whose agents count restarts differently,
    # torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 hosts none: a new store each restart (env://).
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt_{restart}/", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
    dist.init_process_group(backend=backend, rank=rank, world_size=args.world_size, store=store,
                            device_id=device_id)
    return DistEnv(where.device, dp.device_mesh(where.device, args.world_size, args.dp_size))


def traced_stages(model: Transformer, example_input_microbatch: torch.Tensor, split_points: list[str],
                  stage_indices: Sequence[int], device: torch.device,
                  pp_group: dist.ProcessGroup | None = None) -> list[PipelineStage]:
    """main.py's ``tracer_model_split`` for this rank's stages, one or several."""
    if len(stage_indices) == 1:
        return [tutorial.tracer_model_split(model, example_input_microbatch, split_points, stage_indices[0],
                                            device, pp_group)]
    pipe = pipeline(module=model, mb_args=(example_input_microbatch,),
                    split_spec={name: SplitPoint.BEGINNING for name in split_points})
    # several a rank: build_stage's stage greets its neighbours before the first step, one on its own
    # rank too (a V's middle), which gloo cannot; a PipelineStage around the same module hands over in memory
    return [PipelineStage(pipe.get_stage_module(i).to(device), i, pipe.num_stages, device, group=pp_group)
            for i in stage_indices]


def build_schedule(stages: list[PipelineStage], name: str, n_microbatches: int):
    """``--schedule``, from the schedules torch.distributed.pipelining exports; a multi-stage one drives
    all of this rank's stages."""
    stage_arg = stages if is_multi_stage(name) else stages[0]
    return SCHEDULES[name](stage_arg, n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)


@dataclass
class PipelineRank:
    """What one rank holds: its stages, the schedule that drives them, an optimizer per stage."""

    stages: list[PipelineStage]
    schedule: Any
    optimizers: list[torch.optim.Optimizer]
    layout: StageLayout
    env: DistEnv

    def __post_init__(self) -> None:
        self.has_first, self.has_last = any(s.is_first for s in self.stages), any(s.is_last for s in self.stages)
        self.reports = self.has_last and self.env.dp_rank == 0  # one rank prints the batch's loss

    def batch_loss(self, losses: list[torch.Tensor], step: int) -> float | None:
        """The batch's mean loss where the last stage is (a collective over the replicas), else None."""
        if not self.has_last:
            return None
        loss = torch.stack(losses).detach().mean()
        loss = dp.mean_over_replicas(loss, self.env.dp_size, self.env.dp_group).item()
        return distkit.check_finite(loss, f"step {step + 1}")  # not finite: the run ends

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under the full model's names ("layers.3.linear1.weight")."""
        for stage in self.stages:
            yield from stage.submod.named_parameters()


def build_rank(args: argparse.Namespace, env: DistEnv) -> PipelineRank:
    """This rank's stages, cut from the same seeded full model that every rank builds."""
    torch.manual_seed(args.seed)
    model_args = model_args_from(args)
    model = Transformer(model_args)
    layout = stage_layout(args, env, model)  # the tutorial's stage_index, num_stages (layout.py)
    if args.split == "manual":  # Option 1: manual model splitting
        stages = [tutorial.manual_model_split(m, i, layout.num_stages, layout.layers(i), env.device, env.pp_group)
                  for m, i in layout.stage_models(model)]
    else:  # Option 2: tracer model splitting
        example_input_microbatch = torch.zeros(layout.rows, args.seq_len, dtype=torch.long)
        stages = traced_stages(model, example_input_microbatch, layout.split_points,
                               layout.stage_indices, env.device, env.pp_group)
    stages = extras.on_build(stages, args, env)  # the build phase's extras (extras.py)
    schedule = build_schedule(stages, args.schedule, args.n_microbatches)
    optimizers = [make_optimizer(args.optimizer, s.submod.parameters(), args.lr) for s in stages]
    return PipelineRank(stages, schedule, optimizers, layout, env)


def train(args: argparse.Namespace, env: DistEnv, callbacks_for=extras.callbacks_for) -> dict:
    """The training loop: the tutorial's step, --steps times; the extras enter by the calls named extras."""
    pp = build_rank(args, env)
    first_step = extras.resume(args, pp)  # --resume: the step after the checkpoint's, else 0
    run = extras.RunLog(args, pp, callbacks_for(args, pp))  # the losses; --trace, --loss_log, checkpoints
    for step in range(first_step, args.steps):
        # the tutorial's dummy data, made learnable; with --dp_size, this replica's rows of it
        x, y = dp.replica_rows(synthetic_batch(step, args.batch_size, args.seq_len, args.vocab_size,
                                               args.seed), env.dp_rank, env.dp_size)
        x, y = x.to(env.device), y.to(env.device)
        losses = tutorial.train_step(pp.schedule, pp.optimizers, x, y, pp.has_first, pp.has_last)
        loss = pp.batch_loss(losses, step)  # the batch's mean, where the last stage is
        if pp.reports:
            log.info(f"step {step + 1}/{args.steps}  loss {loss:.4f}")
        run.on_step_end(step, loss if pp.reports else None)
    return run.on_train_end(first_step)  # the callbacks' last word, and the run's summary


def run_worker(rank: int, args: argparse.Namespace) -> None:
    distkit.start_rank(rank, args)  # log prefix, threads, hang bound, --trace (distkit/rank.py)
    env = init_distributed(rank, args)
    result = train(args, env)
    distkit.save_result(rank, result)  # its run's summary, for main()'s exit status
    dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="main.py's pipeline, with every schedule, data parallelism, "
                                                "checkpoints and traces")
    parser.add_argument("--schedule", type=schedule_name, default="GPipe", metavar="NAME",
                        help=f"pipeline schedule, one of: {', '.join(SCHEDULES)}")
    tutorial.add_training_args(parser)
    add_extra_args(parser)  # --stage_layers, --dp_size, --loss_log, --trace, checkpoints
    distkit.add_launch_args(parser, world_size=2, hang_timeout=60)  # as main.py's
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if distkit.under_torchrun():  # torchrun started this process as one rank: run it
        record(run_worker)(int(os.environ["RANK"]), args)
    else:
        distkit.prepare_spawn()  # a free port, a folder for the ranks' summaries
        mp.spawn(run_worker, args=(args,), nprocs=args.world_size, join=True)
    return extras.exit_status(distkit.results())  # 1 if the loss of a run from step 0 did not fall


if __name__ == "__main__":
    sys.exit(main())

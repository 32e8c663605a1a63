"""Pipeline-parallel training of a GPT-style transformer with torch.distributed.pipelining.

The tutorial "Introduction to Distributed Pipeline Parallelism", top to bottom (its model in model.py):
``init_distributed``, the model cut into stages (``manual_model_split`` or ``tracer_model_split``),
``ScheduleGPipe`` and the step by role in ``train``, --steps times; exit status 0 if the loss fell.
Each extra is behind its flag and enters by a named call (extras.py, docs/pipelining_transformer.md).
Roles: the rank holding stage 0 feeds the tokens (``schedule.step(x)``); the one holding the last stage
feeds the targets and prints the batch's loss (``schedule.step(target=y, losses=losses)``); any rank in
between relays activations and gradients (``schedule.step()``); every rank steps an optimizer per stage.
    .venv/bin/python pipelining_transformer/main.py --world_size 2   # spawned here; gloo unless a GPU each
    .venv/bin/torchrun --nproc_per_node 2 pipelining_transformer/main.py   # as the tutorial launches it
"""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline

import distkit
from distkit.args import at_least, positive, probability
from distkit.schedules import SCHEDULES, is_multi_stage
from pipelining_transformer import dp, extras
from pipelining_transformer.cli import add_extra_args, check_args, model_args_from, placement, schedule_name
from pipelining_transformer.dp import DistEnv
from pipelining_transformer.layout import StageLayout, stage_layout
from pipelining_transformer.model import (ModelArgs, Transformer, make_optimizer, synthetic_batch,
                                          tokenwise_loss_fn)

log = logging.getLogger(__name__)


def init_distributed(where: distkit.Placement, dp_size: int = 1) -> DistEnv:
    """Join the process group torchrun (or distkit) describes, on ``placement``'s ``where``."""
    rank = int(os.environ["RANK"])  # the tutorial used LOCAL_RANK: wrong beyond one machine
    world_size = int(os.environ["WORLD_SIZE"])
    # distkit: one backend on every machine, this rank's GPU, and under torchrun a store of this
    # restart's own, not the one its killed predecessor left
    dist.init_process_group(**distkit.process_group_args("pp", rank, world_size, where))
    # pp_group, "a sub-group in the N-D parallel case": of a ("dp", "pp") mesh, one pipeline by default
    return DistEnv(where.device, dp.device_mesh(where.device, world_size, dp_size))


def manual_model_split(model: Transformer, stage_index: int, num_stages: int, layers: range,
                       device: torch.device, pp_group: dist.ProcessGroup | None = None) -> PipelineStage:
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
                       split_points: list[str], stage_indices: Sequence[int], device: torch.device,
                       pp_group: dist.ProcessGroup | None = None) -> list[PipelineStage]:
    """Option 2: trace ``model``, cut before each of ``split_points`` ("layers.4"), build this rank's stages."""
    pipe = pipeline(
        module=model,
        mb_args=(example_input_microbatch,),
        split_spec={name: SplitPoint.BEGINNING for name in split_points},
    )
    if len(stage_indices) == 1:  # the tutorial's one stage per rank
        return [pipe.build_stage(stage_indices[0], device, pp_group)]
    # several a rank: build_stage's stage greets its neighbours before the first step, one on its own
    # rank too (a V's middle), which gloo cannot; a PipelineStage around the same module hands over in memory
    return [PipelineStage(pipe.get_stage_module(i).to(device), i, pipe.num_stages, device, group=pp_group)
            for i in stage_indices]


def build_schedule(stages: list[PipelineStage], name: str, n_microbatches: int):
    """The tutorial's ``ScheduleGPipe``, or the --schedule the user named, built the same way."""
    if name != "GPipe":  # 1F1B, Interleaved1F1B, ZBVZeroBubble, ...: a multi-stage one drives
        stage_arg = stages if is_multi_stage(name) else stages[0]  # all of this rank's stages
        return SCHEDULES[name](stage_arg, n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)
    return ScheduleGPipe(stages[0], n_microbatches=n_microbatches, loss_fn=tokenwise_loss_fn)


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
        stages = [manual_model_split(m, i, layout.num_stages, layout.layers(i), env.device, env.pp_group)
                  for m, i in layout.stage_models(model)]
    else:  # Option 2: tracer model splitting
        example_input_microbatch = torch.zeros(layout.rows, args.seq_len, dtype=torch.long)
        stages = tracer_model_split(model, example_input_microbatch, layout.split_points,
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
        for opt in pp.optimizers:
            opt.zero_grad(set_to_none=True)  # step() sums micro-batch grads, divides by their count
        losses: list[torch.Tensor] = []
        if pp.has_first and pp.has_last:  # ZBVZeroBubble, DualPipeV: a "V" puts both on one rank
            pp.schedule.step(x, target=y, losses=losses, return_outputs=False)
        elif pp.has_first:
            pp.schedule.step(x)
        elif pp.has_last:  # the outputs (every micro-batch's logits) are not read: not kept, not merged
            pp.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            pp.schedule.step()
        for opt in pp.optimizers:
            opt.step()
        loss = pp.batch_loss(losses, step)  # the batch's mean, where the last stage is
        if pp.reports:
            log.info(f"step {step + 1}/{args.steps}  loss {loss:.4f}")
        run.on_step_end(step, loss if pp.reports else None)
    return run.on_train_end(first_step)  # the callbacks' last word, and the run's summary


def run_worker(worker: distkit.Worker, args: argparse.Namespace) -> dict:
    env = init_distributed(placement(worker, args), args.dp_size)
    result = train(args, env)
    dist.destroy_process_group()
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = distkit.ArgumentParser(description="Pipeline parallelism with torch.distributed.pipelining")
    parser.add_argument("--schedule", type=schedule_name, default="GPipe", metavar="NAME",
                        help=f"pipeline schedule, one of: {', '.join(SCHEDULES)}")
    parser.add_argument("--split", choices=("manual", "tracer"), default="manual",
                        help="cut the model by deleting parts (manual) or by tracing it (tracer)")
    parser.add_argument("--n_microbatches", type=at_least(1), default=4, metavar="M",
                        help="micro-batches each batch is cut into")
    parser.add_argument("--batch_size", type=at_least(1), default=8, metavar="B",
                        help="sequences per batch (per optimizer step)")
    parser.add_argument("--seq_len", type=at_least(1), default=16, metavar="T", help="tokens per sequence")
    parser.add_argument("--steps", type=at_least(1), default=10, metavar="N", help="optimizer steps")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="one per stage; sgd (momentum 0.9) makes a step a linear function "
                             "of the gradient, for bit-for-bit comparisons")
    parser.add_argument("--lr", type=positive, default=1e-3, help="learning rate")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seeds the weights and the data")
    model = parser.add_argument_group("model (defaults: the tutorial's ModelArgs)")
    defaults = ModelArgs()
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "dropout"):
        model.add_argument(f"--{name}", type=probability if name == "dropout" else at_least(1),
                           default=getattr(defaults, name))
    add_extra_args(parser)  # --stage_layers, --dp_size, --loss_log, --trace, checkpoints
    # --hang_timeout 60: the longest time without progress in the README's runs was 1.5 s on a loaded 2-core machine,
    # and a stalled quick start should end with every rank's stack within a minute (issue 45)
    distkit.add_launch_args(parser, world_size=2, hang_timeout=60)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # torchrun starts one process per rank, as in the tutorial; else mp.spawn does (see distkit.Job)
    with distkit.Job(args) as job:
        if job.torchrun:
            job.run(run_worker, args)
        else:
            job.join(mp.spawn(job.wrap(run_worker), args=(args,), nprocs=job.nprocs, join=False))
    if args.trace is not None and job.results:
        print(f"torch.profiler traces written to {args.trace}/rank<N>.json")
    return extras.exit_status(job.results)  # 1 if the loss of a run from step 0 did not fall


if __name__ == "__main__":
    distkit.exit_process(main())

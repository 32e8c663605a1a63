"""Workarounds for torch.distributed.pipelining on gloo, applied by ``extras.on_build`` to
every built stage, so the tutorial's functions stay as it writes them; harmless on NCCL."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage


def apply(stage: PipelineStage) -> None:
    """Every workaround below, on one built stage (manual or traced)."""
    _send_contiguous_input_grads(stage)
    _skip_warmup_with_itself(stage)


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


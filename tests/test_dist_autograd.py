"""Why the RPC examples step with ``DistributedOptimizer``: distributed autograd keeps its
gradients in its context, not in ``.grad``.

pytorch/examples' ``distributed/rpc/pipeline`` replaced ``DistributedOptimizer`` with a local
SGD on each worker, stepped after ``dist_autograd.backward`` (its PR #1385). This test runs that
pattern and the tutorials' one on the same remote ``nn.Linear``, against one process's
``backward()`` and ``SGD.step()``: the local step leaves the weights as they were, the
distributed optimizer takes the step one process takes.
"""
from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

import distkit
from conftest import FLOAT32, checked_args

pytestmark = pytest.mark.fast
LR = 0.1
_owned: dict[str, object] = {}  # the owner's module and its local optimizer, as upstream keeps them


def _build(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _make_owned(seed: int) -> rpc.RRef:
    _owned["model"] = model = _build(seed)
    _owned["sgd"] = optim.SGD(model.parameters(), lr=LR)
    return [rpc.RRef(p) for p in model.parameters()]


def _forward(x: torch.Tensor) -> torch.Tensor:
    return _owned["model"](x)


def _local_step() -> list[bool]:
    """What upstream's workers do after ``dist_autograd.backward``: their own optimizer's step."""
    _owned["sgd"].step()
    return [p.grad is None for p in _owned["model"].parameters()]


def _weights() -> list[torch.Tensor]:
    return [p.detach().clone() for p in _owned["model"].parameters()]


def _worker(rank: int, args: argparse.Namespace) -> dict | None:
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.rpc_timeout)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=args.world_size, rpc_backend_options=options)
    result = None
    if rank == 0:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
        param_rrefs = rpc.rpc_sync("w1", _make_owned, args=(7,))
        before = rpc.rpc_sync("w1", _weights)

        with dist_autograd.context() as context_id:  # upstream's pattern: a local step after it
            loss = rpc.rpc_sync("w1", _forward, args=(x,)).pow(2).sum()
            dist_autograd.backward(context_id, [loss])
            grads_are_none = rpc.rpc_sync("w1", _local_step)
        after_local = rpc.rpc_sync("w1", _weights)

        with dist_autograd.context() as context_id:  # the tutorials' pattern
            loss = rpc.rpc_sync("w1", _forward, args=(x,)).pow(2).sum()
            dist_autograd.backward(context_id, [loss])
            DistributedOptimizer(optim.SGD, param_rrefs, lr=LR).step(context_id)
        result = {"x": x, "before": before, "grads_are_none": grads_are_none, "after_local": after_local,
                  "after_distributed": rpc.rpc_sync("w1", _weights)}
    rpc.shutdown()
    return result


def test_a_local_step_after_a_distributed_backward_changes_nothing():
    distkit.quiet_distributed_optimizer()
    out = distkit.launch(_worker, checked_args("rpc_rnn.main", "--world_size", "2"))[0]
    assert out["grads_are_none"] == [True, True]  # the gradients are in the context, not in .grad
    for before, after in zip(out["before"], out["after_local"]):
        assert torch.equal(before, after), "a local SGD step after dist_autograd.backward moved a weight"

    reference = _build(7)  # one process: backward() fills .grad, SGD steps on it
    for p, before in zip(reference.parameters(), out["before"]):
        assert torch.equal(p.detach(), before)
    expected = copy.deepcopy(reference)
    expected(out["x"]).pow(2).sum().backward()
    optim.SGD(expected.parameters(), lr=LR).step()
    for p, got, before in zip(expected.parameters(), out["after_distributed"], out["before"]):
        assert not torch.equal(got, before)
        torch.testing.assert_close(got, p.detach(), **FLOAT32)

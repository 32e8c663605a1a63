"""rpc_rnn: distributed forward/backward/step equal a single process's; the model learns."""
from __future__ import annotations

import argparse
import copy
import re

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

import distkit
from conftest import run_cli, run_torchrun
from rpc_rnn.main import build_parser, check_args, get_next_batch, make_stream, run_worker
from rpc_rnn.rnn import PS_NAME, TRAINER_NAME, RNNModel, _remote_method

SIZES = dict(ntoken=7, ninp=4, nhid=5, nlayers=2, seq_len=3, batch_size=4)
LR = 0.05  # the tutorial's learning rate


def make_args(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    check_args(parser, args)
    return args


def test_batches_are_consecutive_next_token_pairs():
    stream = make_stream(ntoken=5, pattern_len=6, batch_size=3, length=2 * 4 + 1, seed=0)
    assert stream.shape == (9, 3)
    assert torch.equal(stream, make_stream(5, 6, 3, 9, seed=0))
    assert not torch.equal(stream, make_stream(5, 6, 3, 9, seed=1))
    assert torch.equal(stream[6:], stream[:3])  # every column repeats the same 6-token pattern
    batches = list(get_next_batch(stream, seq_len=4))
    assert len(batches) == 2
    for i, (data, target) in enumerate(batches):
        assert torch.equal(data, stream[4 * i:4 * i + 4])
        assert torch.equal(target, stream[4 * i + 1:4 * i + 5])  # the next token of each


# ---- helpers that run on the parameter server, reached with _remote_method ----

def _state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _gradients_of(module: nn.Module, context_id: int) -> dict[str, torch.Tensor]:
    """The gradients this worker accumulated in ``context_id`` for ``module``'s parameters."""
    grads = dist_autograd.get_gradients(context_id)
    return {name: grads[p].cpu() for name, p in module.named_parameters()}


def _model_state(model: RNNModel) -> dict[str, torch.Tensor]:
    """Every parameter, named as in the single-process reference below."""
    state = _remote_method(_state_of, model.emb_table_rref)  # encoder.weight
    state |= {f"rnn.{k}": v.detach().clone() for k, v in model.rnn.state_dict().items()}
    return state | _remote_method(_state_of, model.decoder_rref)  # decoder.weight, .bias


def _parity_worker(worker: distkit.Worker, args: argparse.Namespace) -> dict | None:
    """Two training iterations exactly as run_trainer does them, recording everything."""
    if worker.rank == 0:
        return run_worker(worker, args)  # the example's own parameter server
    rpc.init_rpc(TRAINER_NAME, rank=1, world_size=2)
    torch.manual_seed(0)
    model = RNNModel(PS_NAME, args.ntoken, args.ninp, args.nhid, args.nlayers, dropout=0.0)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    stream = make_stream(args.ntoken, args.pattern_len, args.batch_size, 2 * args.seq_len + 1, seed=0)
    gen = torch.Generator().manual_seed(0)
    shape = (args.nlayers, args.batch_size, args.nhid)
    hidden = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    out = {"initial": _model_state(model), "hidden": hidden, "stream": stream, "steps": []}
    for data, target in get_next_batch(stream, args.seq_len):
        with dist_autograd.context() as context_id:
            hidden = tuple(h.detach() for h in hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output.reshape(-1, args.ntoken), target.reshape(-1))
            dist_autograd.backward(context_id, [loss])
            local = dist_autograd.get_gradients(context_id)  # the trainer's: the LSTM's
            grads = {f"rnn.{n}": local[p] for n, p in model.rnn.named_parameters()}
            # the ps's: read there, in the same context, before it is released
            grads |= _remote_method(_gradients_of, model.emb_table_rref, context_id)
            grads |= _remote_method(_gradients_of, model.decoder_rref, context_id)
            opt.step(context_id)
        out["steps"].append({"loss": loss.detach(), "output": output.detach(), "grads": grads,
                             "after": _model_state(model)})
    rpc.shutdown()
    return out


class LocalRNNModel(nn.Module):
    """The same network in one process: what RNNModel computes, without RPC."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output), hidden


@pytest.mark.fast  # also on the oldest supported torch (.ci/run)
def test_distributed_step_matches_single_process():
    argv = [x for k, v in SIZES.items() for x in (f"--{k}", str(v))]
    args = make_args(*argv, "--pattern_len", "5")
    out = distkit.launch(_parity_worker, args)[1]

    ref = LocalRNNModel(args.ntoken, args.ninp, args.nhid, args.nlayers)
    ref.load_state_dict(out["initial"])
    before = copy.deepcopy(ref.state_dict())
    opt = optim.SGD(ref.parameters(), lr=LR)
    criterion = nn.CrossEntropyLoss()
    hidden = out["hidden"]
    batches = list(get_next_batch(out["stream"], args.seq_len))
    assert len(batches) == len(out["steps"]) == 2
    for i, ((data, target), step) in enumerate(zip(batches, out["steps"])):
        hidden = tuple(h.detach() for h in hidden)
        output, hidden = ref(data, hidden)
        loss = criterion(output.reshape(-1, args.ntoken), target.reshape(-1))
        opt.zero_grad()  # the distributed side has no zero_grad: a fresh context per step
        loss.backward()
        torch.testing.assert_close(step["output"], output.detach())
        torch.testing.assert_close(step["loss"], loss.detach())
        assert sorted(step["grads"]) == sorted(n for n, _ in ref.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(step["grads"][name], p.grad,
                                       msg=lambda m: f"step {i} gradient of {name}: {m}")
        opt.step()
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(step["after"][name], p,
                                       msg=lambda m: f"step {i} {name} after SGD: {m}")
    changed = [n for n, p in ref.state_dict().items() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), "every parameter should have moved"


def test_default_cli_run_learns():
    """The loss decreases over a short run: the default one, 10 epochs of 40 batches."""
    proc = run_cli("rpc_rnn/main.py", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"\[rank 1\] Training epoch \d+\tloss ([\d.]+)", proc.stdout)]
    assert len(losses) == 10, proc.stdout
    assert losses[0] > 1.5, proc.stdout  # about ln(10): nothing learned yet in epoch 0
    assert losses[-1] < 0.5 * losses[0], proc.stdout
    assert f"loss {losses[0]:.4f} in epoch 0 -> {losses[-1]:.4f} in epoch 9" in proc.stdout


def test_torchrun_launch():
    proc = run_torchrun(2, "rpc_rnn/main.py", "--epochs", "2", "--batches", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Training epoch 1\tloss" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--world_size", "3"], "--world_size must be at most 2"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--ntoken", "1"], "--ntoken must be at least 2"),
    (["--dropout", "1"], "--dropout must be in [0, 1)"),
    (["--seq_len", "five"], "invalid int value"),
])
def test_bad_input_is_one_line_exit_2(argv, message):
    proc = run_cli("rpc_rnn/main.py", *argv, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert "[rank" not in proc.stdout  # nothing was spawned
